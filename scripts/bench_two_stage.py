"""Two-stage selection at scale (`rlm bench two-stage`): Appendix B.2's search against the exact corrected
top-k over millions of memory-mapped rows, and what it makes of the 21M x 768 projection.

For each N (default 1M and 4M rows x 768) a buffer folder is written in `rlm embed`'s layout (fp16 shards of
100k rows) and opened with `PassageBuffer.load` (memory-mapped), as a training run opens its buffer. The
vectors are clustered (unit vectors around N / --cluster random centres, noise --noise: real passage
embeddings have neighbourhoods, and a top-32 over pure noise measures nothing) and the G queries are drawn the
same way. Then, as `strategy.search: two_stage` runs it (`rlm.training.strategies`):

- the faiss index over the stale buffer is built once (`PassageIndex.from_buffer`, default `IVF2048,SQfp16`:
  the buffer is fp16, so fp16 storage loses nothing and halves the index next to Flat); build seconds;
- for each correction size (`--moves`: how far h moves a unit vector, ||h(b) - b||; a trained corrector
  moves ~0.2 here, see bench_retrieval.md; 1.0 is a corrector that rewrites the vector): the exact
  corrected top-k (`corrected_topk`, every row through h = CorrectorNetwork(768, --hidden)), the stale
  top-k (its overlap with the exact one says how much the corrector changes the selection), and the
  two-stage top-k (`two_stage_corrected_topk`) for every (nprobe, candidates): seconds (min of --reps),
  speed-up over exact, top-k overlap with exact; its faiss search is timed apart from the re-scoring.

The projection to 21M x 768 on 8 GPUs takes bench_scale's (docs/results/bench_scale.json: model step,
all-reduce, accumulation) and replaces the exhaustive corrected pass with the two-stage cost from its FLOPs and
bytes: coarse quantiser, the nprobe inverted lists each query reads (fp16 rows at HBM bandwidth), h on G x K'
candidates at the GEMM rate, plus a fixed cost per faiss call (a stated constant).

    python scripts/bench_two_stage.py                  # N = 1M, 4M (~15 min on 2 cores)
    python scripts/bench_two_stage.py --quick          # N = 100k (about a minute)
    python scripts/bench_two_stage.py --render docs/results/bench_two_stage.json   # .md/.png of a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from atomicio import atomic_file, atomic_write_json, atomic_write_text  # noqa: E402
from retriever.buffer import shard_name  # noqa: E402
from rlm.experiments.benchmarking import (  # noqa: E402
    PROJECTION_DEFAULTS,
    best_of,
    corrector_moving,
    cpu_name,
    load_average,
    overlap,
)

D, K, CHUNK, SHARD_ROWS = 768, 32, 65_536, 100_000


# ----------------------------------------------------------------------------------------------- data


def centres(n: int, cluster: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(max(1, n // cluster), D, generator=g), dim=-1)


def write_clustered_buffer(folder: Path, n: int, cluster: int, noise: float, seed: int = 0) -> dict:
    """A buffer folder in `rlm embed`'s layout: row i = normalize(centre[c_i] + noise * N(0, I/D)), c_i uniform,
    shard s from its own generator (deterministic); reused when the folder already holds the same buffer."""
    meta_file = folder / "meta.json"
    expected = {"count": n, "dim": D, "dtype": "float16", "shard_size": SHARD_ROWS}
    data = {"cluster": cluster, "noise": noise, "seed": seed}
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        if all(meta.get(k) == v for k, v in expected.items()) and meta.get("data") == data:
            return {"seconds": 0.0, "reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    c = centres(n, cluster, seed)
    shards = []
    for s, lo in enumerate(range(0, n, SHARD_ROWS)):
        rows = min(SHARD_ROWS, n - lo)
        g = torch.Generator().manual_seed(seed * 1_000_003 + s + 1)
        picked = torch.randint(0, len(c), (rows,), generator=g)
        vectors = F.normalize(c[picked] + torch.randn(rows, D, generator=g) * (noise / D**0.5), dim=-1)
        np.save(folder / shard_name(s), vectors.half().numpy())
        shards.append(shard_name(s))
    (folder / "ids.txt").write_bytes("".join(f"{i}\n" for i in range(n)).encode())
    meta = {
        "format_version": 1,
        "encoder_fingerprint": "synthetic:bench_two_stage",
        "corpus_fingerprint": f"synthetic:{n}x{D}:clustered{cluster}:noise{noise}:seed{seed}",
        "max_length": 0,
        "num_shards": len(shards),
        "shards": shards,
        "ids_file": "ids.txt",
        "data": data,
        **expected,
    }
    meta_file.write_text(json.dumps(meta, indent=2))
    return {"seconds": time.perf_counter() - start, "reused": False}


def make_queries(n: int, cluster: int, noise: float, count: int, seed: int = 0) -> torch.Tensor:
    c = centres(n, cluster, seed)
    g = torch.Generator().manual_seed(seed + 7919)
    picked = torch.randint(0, len(c), (count,), generator=g)
    return F.normalize(c[picked] + torch.randn(count, D, generator=g) * (noise / D**0.5), dim=-1)


# ----------------------------------------------------------------------------------------------- one N


def bench_size(args, folder: Path, n: int) -> dict:
    from retriever.buffer import PassageBuffer
    from retriever.index import PassageIndex
    from retriever.search import corrected_topk, two_stage_corrected_topk

    buffer = PassageBuffer.load(folder)
    queries = make_queries(n, args.cluster, args.noise, args.queries)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    nlist = args.nlist or max(16, int(4 * n**0.5))
    factory = args.factory.format(nlist=nlist) if "index" in args.first_stage else None
    start = time.perf_counter()
    index = None
    if factory is not None:
        index = PassageIndex.from_buffer(buffer, factory, train_sample=min(n, args.train_per_list * nlist))
    build_s = time.perf_counter() - start if factory is not None else None
    with cast:
        stale_s, stale = best_of(1, lambda: corrected_topk(queries, buffer, None, K, chunk_size=CHUNK))
    out = {
        "n": n,
        "factory": factory,
        "nlist": nlist,
        "index_build_s": build_s,
        "index_bytes": n * D * 2 if factory and "SQfp16" in factory else None,
        "stale_s": stale_s,
        "moves": [],
    }
    if factory is not None:
        print(f"N={n:,}: index {factory} built in {build_s:.1f} s", file=sys.stderr)
    print(f"N={n:,}: stale top-k {stale_s:.2f} s", file=sys.stderr)
    for move in args.moves:
        net = corrector_moving(D, args.hidden, move)
        with cast, torch.no_grad():
            exact_s, exact = best_of(1, lambda h=net: corrected_topk(queries, buffer, h, K, chunk_size=CHUNK))
        row = {
            "move": move,
            "exact_s": exact_s,
            "stale_overlap": overlap(stale.indices, exact.indices),
            "two_stage": [],
        }
        for nprobe in args.nprobe if index is not None else []:
            search_s, _ = best_of(
                args.reps,
                lambda p=nprobe, ix=index: ix.search_rows(queries.numpy(), max(args.candidates), nprobe=p),
            )
            for candidates in args.candidates:
                with cast, torch.no_grad():
                    seconds, top = best_of(
                        args.reps,
                        lambda p=nprobe, c=candidates, h=net, ix=index: two_stage_corrected_topk(
                            queries, buffer, h, K, ix, num_candidates=c, nprobe=p
                        ),
                    )
                row["two_stage"].append(
                    {
                        "first_stage": "index",
                        "nprobe": nprobe,
                        "candidates": candidates,
                        "seconds": seconds,
                        "faiss_search_s": search_s,  # at the largest candidate count
                        "speedup": exact_s / seconds,
                        "overlap": overlap(top.indices, exact.indices),
                    }
                )
        for candidates in args.candidates if "scan" in args.first_stage else []:
            # The stale scan over every row gives the exact stale candidates (no index); h re-scores them.
            with cast, torch.no_grad():
                seconds, top = best_of(
                    args.reps,
                    lambda c=candidates, h=net: two_stage_corrected_topk(
                        queries, buffer, h, K, None, num_candidates=c, chunk_size=CHUNK
                    ),
                )
            row["two_stage"].append(
                {
                    "first_stage": "scan",
                    "nprobe": None,
                    "candidates": candidates,
                    "seconds": seconds,
                    "faiss_search_s": None,
                    "speedup": exact_s / seconds,
                    "overlap": overlap(top.indices, exact.indices),
                }
            )
        best = max(row["two_stage"], key=lambda r: (r["overlap"], r["speedup"]))
        print(
            f"N={n:,} move {move}: exact {exact_s:.1f} s, stale overlap {row['stale_overlap']:.2f}; "
            f"best two-stage ({where(best)}) {best['seconds']:.3f} s ({best['speedup']:.0f}x), "
            f"overlap {best['overlap']:.3f}",
            file=sys.stderr,
        )
        out["moves"].append(row)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    del index
    return out


# ----------------------------------------------------------------------------------------------- projection


def projection(args, scale: dict | None) -> dict | None:
    """Two-stage selection per optimizer step at p['n'] x 768 on p['gpus'] GPUs, next to bench_scale's exact one."""
    if scale is None or "projection" not in scale:
        return None
    base = scale["projection"]
    p = {**PROJECTION_DEFAULTS, **base["params"]}
    rows = base["rows_per_process"]
    gathered = base["gathered_queries"]
    accumulation = base["selections_per_step"]
    gemm = p["peak_tflops"] * 1e12 * p["gemm_efficiency"]
    hbm = p["hbm_tbps"] * 1e12
    nlist = max(16, int(4 * rows**0.5))
    nprobe, candidates = args.proj_nprobe, args.proj_candidates
    out = {
        "nlist": nlist,
        "nprobe": nprobe,
        "candidates": candidates,
        "faiss_call_s": args.proj_faiss_call_ms / 1e3,
    }
    out["by_hidden"] = []
    for exact in base["by_hidden"]:
        hidden = exact["hidden"]
        scanned = gathered * nprobe * rows / nlist  # rows the queries' inverted lists hold
        parts = {
            "coarse quantiser": gathered * nlist * 2 * D / gemm,
            "inverted lists (fp16 rows)": scanned * 2 * D / hbm + scanned * 2 * D / gemm,
            "h on the candidates": gathered * candidates * (4 * D * hidden) / gemm
            + gathered * candidates * (2 * D + 4 * hidden + 8 * D) / hbm,
            "faiss call (fixed)": args.proj_faiss_call_ms / 1e3,
        }
        select_s = sum(parts.values())
        per_step = dict(exact["per_step"])
        per_step["corrected selection"] = accumulation * select_s
        step_s = sum(per_step.values())
        # first_stage: scan: every row of the process's (device-resident) shard read once and scored against
        # the G queries, a top-K' over the G x r scores, then h on the candidates as above; no index.
        scan_parts = {
            "stale scan (fp16 rows)": rows * 2 * D / hbm + gathered * rows * 2 * D / gemm,
            "top-k of the scores": gathered * rows * 8 / hbm,
            "h on the candidates": parts["h on the candidates"],
        }
        scan_s = sum(scan_parts.values())
        scan_step_s = step_s - accumulation * select_s + accumulation * scan_s
        out["by_hidden"].append(
            {
                "hidden": hidden,
                "parts_s": parts,
                "selection_s": select_s,
                "exact_selection_s": exact["selection_s"],
                "step_s": step_s,
                "exact_step_s": exact["step_s"],
                "selection_fraction": accumulation * select_s / step_s,
                "exact_selection_fraction": exact["selection_fraction"],
                "index_gpu_bytes": rows * D * 2,
                "days": (p["steps"] * step_s + base["startup_s"]) / 86400,
                "scan_parts_s": scan_parts,
                "scan_selection_s": scan_s,
                "scan_step_s": scan_step_s,
                "scan_selection_fraction": accumulation * scan_s / scan_step_s,
                "scan_days": (p["steps"] * scan_step_s + base["startup_s"]) / 86400,
            }
        )
    out["accumulation"] = accumulation
    out["gathered_queries"] = gathered
    out["rows_per_process"] = rows
    # Building the index at start-up: k-means (25 iterations over 64 points per list) + assigning every row.
    build_flops = 25 * 64 * nlist * nlist * 2 * D + rows * nlist * 2 * D
    out["index_build_s"] = build_flops / (gemm * args.proj_kmeans_efficiency)
    out["startup_s"] = base["startup_s"] + out["index_build_s"]
    return out


# ----------------------------------------------------------------------------------------------- report


def where(r: dict) -> str:
    """Where a two-stage row's candidates came from."""
    return "stale scan" if r.get("first_stage") == "scan" else f"index nprobe {r['nprobe']}"


def fmt_n(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


def markdown(results: dict) -> str:
    a = results["args"]
    lines = [
        "# Two-stage selection at scale: candidates from the stale buffer, re-scored with h",
        "",
        f"Command: `{results['command']}`  ",
        f"Date: {results['date']}  ",
        f"CPU: {results['cpu']} ({results['cores']} cores); torch {results['torch']}, {a['threads']} thread(s); "
        f"compute {a['dtype']}; load average {results['load_before']} before, {results['load_after']} after; "
        f"total wall time {results['wall_s'] / 60:.1f} min.",
        "",
        f"Buffer: memory-mapped fp16 shards in `rlm embed`'s layout, {D} columns, clustered unit vectors "
        f"(~{a['cluster']} rows per centre, noise {a['noise']}); {a['queries']} queries drawn the same way (the "
        f"all-gathered queries of one micro-step on 8 GPUs x 4 questions), k = {K}. Corrector h = "
        f"CorrectorNetwork({D}, {a['hidden']}) with its residual branch scaled so that it moves a unit vector by "
        "`move` on average. Exact: `corrected_topk` (every row through h, one pass). Two-stage: "
        "`two_stage_corrected_topk` (what `strategy.search: two_stage` runs), its candidates either from a faiss "
        "index built by `PassageIndex.from_buffer` (`first_stage: index`) or from a streamed scan of <q, B> over "
        "every row (`first_stage: scan`: the exact stale candidates, no index); seconds are the minimum of "
        f"{a['reps']} repetitions, `faiss` the index search alone (at the largest candidate count). "
        "Overlap: the share of the exact top-32 the two-stage top-32 holds. Stale overlap: the same for the "
        "stale top-32 (how much h changes the selection: 1.0 would make the test trivial).",
        "",
        "| N | first stage | build s | move | stale overlap | exact s | nprobe | candidates | faiss s "
        "| two-stage s | speed-up | overlap |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in results["sizes"]:
        for m in size["moves"]:
            for r in m["two_stage"]:
                scan = r.get("first_stage") == "scan"
                lines.append(
                    f"| {fmt_n(size['n'])} | {'stale scan' if scan else size['factory']} | "
                    f"{'-' if scan else format(size['index_build_s'], '.0f')} | {m['move']} | "
                    f"{m['stale_overlap']:.2f} | {m['exact_s']:.1f} | {'-' if scan else r['nprobe']} | "
                    f"{r['candidates']} | {'-' if scan else format(r['faiss_search_s'], '.3f')} | "
                    f"{r['seconds']:.3f} | {r['speedup']:.0f}x | {r['overlap']:.3f} |"
                )
    lines += [
        "",
        "Peak RSS: " + ", ".join(f"{fmt_n(s['n'])} {s['peak_rss_gb']:.1f} GB" for s in results["sizes"]),
    ]
    lines += ["", "## Goal: >= 10x faster than exact at 4M rows with top-32 overlap >= 0.95", ""]
    lines += goals(results)
    proj = results.get("projection")
    if proj:
        lines += [
            "",
            f"## Projection: 21M x 768 on 8 GPUs with two-stage selection (nlist {proj['nlist']} = 4 sqrt(rows per "
            f"process), nprobe {proj['nprobe']}, {proj['candidates']} candidates)",
            "",
            "From docs/results/bench_scale.json (the model step, all-reduce and accumulation of "
            f"configs/nq.yaml: {proj['accumulation']} selections per optimizer step of "
            f"{proj['gathered_queries']} all-gathered queries against {proj['rows_per_process']:,} rows per "
            "process), with the exhaustive corrected pass replaced by the two-stage cost, per selection:",
            "",
            "```",
            "t_sel2 = G*nlist*2D / gemm                         (coarse quantiser)",
            "       + G*nprobe*(r/nlist) * (2D / HBM + 2D / gemm)  (inverted lists: fp16 rows)",
            "       + G*K' * 4*D*H / gemm + G*K' * (2D + 4H + 8D) / HBM   (h on the candidates)",
            "       + faiss call (fixed, stated)",
            "t_scan = r * 2D / HBM + G*r*2D / gemm + G*r*8 / HBM   (first_stage: scan: read + score every row, top-K')",
            "       + the same h on the candidates                 (no index, no faiss call)",
            "```",
            "",
            "| corrector h | two-stage selection ms | exact selection ms | step s (two-stage) | step s (exact) "
            "| selection share two-stage | selection share exact | index on GPU GB | days for 20,000 steps |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        scan_rows = []
        for h in proj["by_hidden"]:
            if "scan_selection_s" not in h:
                continue
            scan_rows.append(
                f"| {h['hidden']} | {h['scan_selection_s'] * 1e3:.1f} | {h['scan_step_s']:.3f} | "
                f"{100 * h['scan_selection_fraction']:.1f}% | {h['scan_days']:.2f} |"
            )
        for h in proj["by_hidden"]:
            lines.append(
                f"| {h['hidden']} | {h['selection_s'] * 1e3:.1f} | {h['exact_selection_s'] * 1e3:.1f} | "
                f"{h['step_s']:.3f} | {h['exact_step_s']:.3f} | {100 * h['selection_fraction']:.1f}% | "
                f"{100 * h['exact_selection_fraction']:.1f}% | {h['index_gpu_bytes'] / 1e9:.1f} | {h['days']:.2f} |"
            )
        if scan_rows:
            lines += [
                "",
                "With `first_stage: scan` (the stale top-K' of every row of the process's shard, no index):",
                "",
                "| corrector h | scan selection ms | step s | selection share | days for 20,000 steps |",
                "| ---: | ---: | ---: | ---: | ---: |",
                *scan_rows,
            ]
        parts = proj["by_hidden"][-1]["parts_s"]
        lines += [
            "",
            f"Split of one two-stage selection (h{proj['by_hidden'][-1]['hidden']}): "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items())
            + f". Index build at start-up (k-means + assignment at {100 * results['args']['proj_kmeans_efficiency']:.0f}% "
            f"of the GEMM rate): {proj['index_build_s']:.1f} s; start-up with it {proj['startup_s']:.0f} s.",
        ]
    return "\n".join(lines) + "\n"


def goals(results: dict) -> list[str]:
    out = []
    for size in results["sizes"]:
        for m in size["moves"]:
            ok = [r for r in m["two_stage"] if r["overlap"] >= 0.95]
            best = (
                max(ok, key=lambda r: r["speedup"]) if ok else max(m["two_stage"], key=lambda r: r["overlap"])
            )
            met = ok and best["speedup"] >= 10
            out.append(
                f"- N = {fmt_n(size['n'])}, move {m['move']} (stale overlap {m['stale_overlap']:.2f}): "
                f"{'fastest with overlap >= 0.95' if ok else 'no setting reaches overlap 0.95; best'}: "
                f"{where(best)}, {best['candidates']} candidates, {best['speedup']:.0f}x faster, overlap "
                f"{best['overlap']:.3f} ({'met' if met else 'NOT met'})"
            )
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for size in results["sizes"]:
        for m in size["moves"]:
            for first, marker in (("index", "o-"), ("scan", "s--")):
                rows = [r for r in m["two_stage"] if r.get("first_stage", "index") == first]
                if rows:
                    xs = [r["speedup"] for r in rows]
                    ys = [r["overlap"] for r in rows]
                    ax.plot(xs, ys, marker, label=f"N={fmt_n(size['n'])}, move {m['move']}, {first}")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.axvline(10, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("speed-up over the exact corrected top-k")
    ax.set_ylabel("top-32 overlap with exact")
    ax.set_title("two-stage selection (index: nprobe x candidates; scan: candidates)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write_outputs(results: dict, out: Path, json_too: bool = True) -> None:
    """`out`.json (the run: everything the table and plot are made from), .md and .png; the markdown is printed
    too. `json_too=False` re-renders a saved run."""
    text = markdown(results)
    if json_too:
        atomic_write_json(out.with_suffix(".json"), results)
    atomic_write_text(out.with_suffix(".md"), text)
    with atomic_file(out.with_suffix(".png")) as tmp:
        plot(results, tmp)
    print(text)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=ints, default=None, help="comma-separated N (default 1M,4M; --quick 100k)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=3072, help="corrector width (default 3072 = 4D)")
    parser.add_argument("--moves", type=floats, default=[0.2, 0.5, 1.0], help="||h(b) - b|| sizes")
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--cluster", type=int, default=200, help="rows per centre")
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--factory", default="IVF{nlist},SQfp16", help="faiss factory ({nlist} is filled in)")
    parser.add_argument("--nlist", type=int, default=2048, help="0: 4 sqrt(N) (what index_factory=auto uses)")
    parser.add_argument("--train-per-list", type=int, default=64, help="k-means training rows per list")
    parser.add_argument("--nprobe", type=ints, default=[16, 64])
    parser.add_argument(
        "--first-stage",
        type=lambda t: [x for x in t.split(",") if x],
        default=["index", "scan"],
        help="where candidates come from: index (faiss), scan (stale top-k over every row), or both",
    )
    parser.add_argument("--candidates", type=ints, default=[256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch/faiss threads (default: all cores)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 where native")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--keep", action="store_true", help="keep the buffers (a later --workdir run reuses them)"
    )
    parser.add_argument("--scale-json", type=Path, default=ROOT / "docs" / "results" / "bench_scale.json")
    parser.add_argument("--proj-nprobe", type=int, default=64)
    parser.add_argument("--proj-candidates", type=int, default=1024)
    parser.add_argument(
        "--proj-faiss-call-ms", type=float, default=2.0, help="fixed cost of a GPU faiss search"
    )
    parser.add_argument("--proj-kmeans-efficiency", type=float, default=0.1, help="of the GEMM rate")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_two_stage"))
    parser.add_argument(
        "--render", type=Path, default=None, help="re-render the .md and .png of a saved JSON (no benchmark)"
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        if not args.render.is_file():
            raise SystemExit(f"error: --render {args.render}: no such file (a JSON this script wrote)")
        write_outputs(json.loads(args.render.read_text()), args.render.with_suffix(""), json_too=False)
        return 0
    if args.sizes is None:
        args.sizes = [100_000] if args.quick else [1_000_000, 4_000_000]
    if args.quick:
        args.moves, args.reps = args.moves[:2], 2
        args.nlist = min(args.nlist, 256)
    if args.threads:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(ImportError):
            import faiss

            faiss.omp_set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    if args.dtype is None:
        from rlm.precision import cpu_bf16_support

        args.dtype = "bf16" if cpu_bf16_support(probe=False).native else "fp32"

    wall = time.perf_counter()
    results = {
        "command": " ".join(["python scripts/bench_two_stage.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_before": load_average(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sizes": [],
    }
    made = args.workdir is None or not args.workdir.exists()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_two_stage_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for n in args.sizes:
            folder = workdir / f"clustered_{n}"
            written = write_clustered_buffer(folder, n, args.cluster, args.noise)
            print(f"N={n:,}: buffer written in {written['seconds']:.1f} s", file=sys.stderr)
            size = bench_size(args, folder, n)
            size["write"] = written
            results["sizes"].append(size)
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not args.keep and made:
            shutil.rmtree(workdir, ignore_errors=True)
    results["load_after"] = load_average()
    scale = json.loads(args.scale_json.read_text()) if args.scale_json.is_file() else None
    results["projection"] = projection(args, scale)
    results["wall_s"] = time.perf_counter() - wall
    write_outputs(results, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
