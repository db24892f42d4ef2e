"""Two-stage selection at scale (`rlm bench two-stage`): Appendix B.2's search against the exact corrected
top-k over millions of memory-mapped rows, and what it makes of the 21M x 768 projection.

For each N (default 1M and 4M rows x 768) a buffer of clustered unit vectors (N / --cluster centres, noise
--noise: real passage embeddings have neighbourhoods, and a top-32 over pure noise measures nothing) is written
as `rlm embed` writes one and opened memory-mapped; the G queries are drawn the same way. Then, as
`strategy.search: two_stage` runs it: a faiss index over the stale buffer (`PassageIndex.from_buffer`, default
`IVF2048,SQfp16`), built once; for each correction size (`--moves`: ||h(b) - b||, ~0.2 for a trained corrector,
1.0 rewrites the vector) the exact corrected top-k (`corrected_topk`, h = CorrectorNetwork(768, --hidden)), the
stale top-k, and `two_stage_corrected_topk` for every (first stage, nprobe, candidates): seconds (min of
--reps), speed-up over exact, top-k overlap with exact.

The projection takes bench_scale's (its JSON: model step, all-reduce, accumulation) and replaces the exact
corrected pass with the two-stage cost from its FLOPs and bytes, plus a stated fixed cost per faiss call.

    python scripts/bench_two_stage.py                  # N = 1M, 4M (~15 min on 2 cores)
    python scripts/bench_two_stage.py --quick          # N = 100k (about a minute)
    python scripts/bench_two_stage.py --render docs/results/bench_two_stage/bench_two_stage.json
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from pathlib import Path

import torch

from rlm.experiments import reporting
from rlm.experiments.benchmarking import (
    PROJECTION_DEFAULTS,
    autocast,
    best_of,
    clustered,
    corrector_moving,
    fmt_n,
    gpu_rates,
    overlap,
    run_or_render,
    scale_arguments,
    synthetic_buffers,
)

D, K, CHUNK = 768, 32, 65_536


def bench_size(args, folder: Path, n: int, queries: torch.Tensor) -> dict:
    from retriever.buffer import PassageBuffer
    from retriever.index import PassageIndex
    from retriever.search import corrected_topk, two_stage_corrected_topk

    buffer = PassageBuffer.load(folder)
    cast = autocast(args.dtype)
    nlist = args.nlist or max(16, int(4 * n**0.5))
    factory = args.factory.format(nlist=nlist) if "index" in args.first_stage else None
    start, index = time.perf_counter(), None
    if factory is not None:
        index = PassageIndex.from_buffer(buffer, factory, train_sample=min(n, args.train_per_list * nlist))
    out = {"n": n, "factory": factory, "nlist": nlist, "index_build_s": time.perf_counter() - start}
    with cast:
        out["stale_s"], stale = best_of(1, lambda: corrected_topk(queries, buffer, None, K, chunk_size=CHUNK))
    out["moves"] = []
    for move in args.moves:
        net = corrector_moving(D, args.hidden, move)
        with cast, torch.no_grad():
            exact_s, exact = best_of(1, lambda h=net: corrected_topk(queries, buffer, h, K, chunk_size=CHUNK))
            row = {"move": move, "exact_s": exact_s, "stale_overlap": overlap(stale.indices, exact.indices)}
            # (first stage, nprobe): the index's lists probed, or the stale scan over every row (no index).
            stages = [("index", p) for p in (args.nprobe if index else [])]
            stages += [("scan", None)] if "scan" in args.first_stage else []
            row["two_stage"] = []
            for first, nprobe in stages:
                search_s = None
                if first == "index":  # the faiss search alone, at the largest candidate count
                    search_s = best_of(
                        args.reps,
                        lambda p=nprobe: index.search_rows(queries.numpy(), max(args.candidates), p),
                    )[0]
                for candidates in args.candidates:
                    seconds, top = best_of(
                        args.reps,
                        lambda f=first, p=nprobe, c=candidates, h=net: two_stage_corrected_topk(
                            queries,
                            buffer,
                            h,
                            K,
                            index if f == "index" else None,
                            c,
                            nprobe=p,
                            chunk_size=CHUNK,
                        ),
                    )
                    overlap_ = overlap(top.indices, exact.indices)
                    row["two_stage"].append(
                        {"first_stage": first, "nprobe": nprobe, "candidates": candidates, "seconds": seconds}
                        | {"faiss_search_s": search_s, "speedup": exact_s / seconds, "overlap": overlap_}
                    )
        print(
            f"N={n:,} move {move}: exact {exact_s:.1f} s, stale overlap {row['stale_overlap']:.2f}",
            file=sys.stderr,
        )
        out["moves"].append(row)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return out


def projection(args, scale: dict | None) -> dict | None:
    """Two-stage selection per optimizer step at 21M x 768 on 8 GPUs, next to bench_scale's exact one."""
    if scale is None or "projection" not in scale:
        return None
    base = scale["projection"]
    p = {**PROJECTION_DEFAULTS, **base["params"]}
    rows, g, a = base["rows_per_process"], base["gathered_queries"], base["selections_per_step"]
    gemm, hbm = gpu_rates(p)
    nlist, nprobe, cands = max(16, int(4 * rows**0.5)), args.proj_nprobe, args.proj_candidates
    out = {"nlist": nlist, "nprobe": nprobe, "candidates": cands, "accumulation": a, "gathered_queries": g}
    out |= {"rows_per_process": rows, "by_hidden": []}
    scanned = g * nprobe * rows / nlist  # rows the queries' inverted lists hold
    for exact in base["by_hidden"]:
        hidden = exact["hidden"]
        h_cost = g * cands * (4 * D * hidden) / gemm + g * cands * (2 * D + 4 * hidden + 8 * D) / hbm
        parts = {
            "coarse quantiser": g * nlist * 2 * D / gemm,
            "inverted lists (fp16 rows)": scanned * 2 * D / hbm + scanned * 2 * D / gemm,
            "h on the candidates": h_cost,
            "faiss call (fixed)": args.proj_faiss_call_ms / 1e3,
        }
        # first_stage: scan: every row of the shard read once and scored against the G queries, a top-K' of
        # the G x r scores, then h on the candidates; no index.
        scan_s = rows * 2 * D / hbm + g * rows * 2 * D / gemm + g * rows * 8 / hbm + h_cost
        rest = exact["step_s"] - exact["per_step"]["corrected selection"]
        select_s = sum(parts.values())
        step_s, scan_step_s = rest + a * select_s, rest + a * scan_s
        out["by_hidden"].append(
            {
                "hidden": hidden,
                "parts_s": parts,
                "selection_s": select_s,
                "exact_selection_s": exact["selection_s"],
            }
            | {"step_s": step_s, "exact_step_s": exact["step_s"], "selection_fraction": a * select_s / step_s}
            | {"exact_selection_fraction": exact["selection_fraction"], "index_gpu_bytes": rows * D * 2}
            | {"days": (p["steps"] * step_s + base["startup_s"]) / 86400, "scan_selection_s": scan_s}
            | {"scan_step_s": scan_step_s, "scan_selection_fraction": a * scan_s / scan_step_s}
            | {"scan_days": (p["steps"] * scan_step_s + base["startup_s"]) / 86400}
        )
    # Building the index at start-up: k-means (25 iterations over 64 points per list) + assigning every row.
    build_flops = 25 * 64 * nlist * nlist * 2 * D + rows * nlist * 2 * D
    out["index_build_s"] = build_flops / (gemm * args.proj_kmeans_efficiency)
    out["startup_s"] = base["startup_s"] + out["index_build_s"]
    return out


def where(r: dict) -> str:
    return "stale scan" if r["first_stage"] == "scan" else f"index nprobe {r['nprobe']}"


def goals(results: dict) -> list[str]:
    out = []
    for size in results["sizes"]:
        for m in size["moves"]:
            ok = [r for r in m["two_stage"] if r["overlap"] >= 0.95]
            best = (
                max(ok, key=lambda r: r["speedup"]) if ok else max(m["two_stage"], key=lambda r: r["overlap"])
            )
            out.append(
                f"- N = {fmt_n(size['n'])}, move {m['move']} (stale overlap {m['stale_overlap']:.2f}): "
                f"{'fastest with overlap >= 0.95' if ok else 'no setting reaches overlap 0.95; best'}: {where(best)}, "
                f"{best['candidates']} candidates, {best['speedup']:.0f}x faster, overlap {best['overlap']:.3f} "
                f"({'met' if ok and best['speedup'] >= 10 else 'NOT met'})"
            )
    return out


def markdown(results: dict) -> str:
    a = results["args"]
    rows = [
        {"n": fmt_n(s["n"]), "factory": s["factory"], "build": s["index_build_s"], **m, **r}
        for s in results["sizes"]
        for m in s["moves"]
        for r in m["two_stage"]
    ]
    scan = lambda key: lambda r: None if r["first_stage"] == "scan" else r[key]  # noqa: E731
    columns = [
        ("N", "n", ""),
        ("first stage", lambda r: "stale scan" if r["first_stage"] == "scan" else r["factory"], ""),
    ]
    columns += [
        ("build s", scan("build"), ".0f"),
        ("move", "move", "g"),
        ("stale overlap", "stale_overlap", ".2f"),
    ]
    columns += [("exact s", "exact_s", ".1f"), ("nprobe", "nprobe", "d"), ("candidates", "candidates", "d")]
    columns += [("faiss s", scan("faiss_search_s"), ".3f"), ("two-stage s", "seconds", ".3f")]
    columns += [("speed-up", lambda r: f"{r['speedup']:.0f}x", ""), ("overlap", "overlap", ".3f")]
    lines = [
        "# Two-stage selection at scale: candidates from the stale buffer, re-scored with h",
        "",
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; compute {a['dtype']}; load average "
        f"after {results['load_after']}; total wall time {results['wall_s'] / 60:.1f} min.",
        "",
        f"Buffer: memory-mapped fp16 shards, {D} columns, clustered unit vectors (~{a['cluster']} rows per centre, "
        f"noise {a['noise']}); {a['queries']} queries drawn the same way, k = {K}. h = CorrectorNetwork({D}, "
        f"{a['hidden']}) scaled to move a unit vector by `move`. Exact: `corrected_topk`; two-stage: "
        "`two_stage_corrected_topk`, candidates from a faiss index (`first_stage: index`) or a scan of <q, B> over "
        f"every row (`first_stage: scan`); min of {a['reps']} repetitions. Overlap: the share of the exact top-32 "
        "it holds; stale overlap: the same for the stale top-32.",
        "",
        reporting.table(rows, columns),
        "",
        "Peak RSS: " + ", ".join(f"{fmt_n(s['n'])} {s['peak_rss_gb']:.1f} GB" for s in results["sizes"]),
        "",
        "## Goal: >= 10x faster than exact at 4M rows with top-32 overlap >= 0.95",
        "",
        *goals(results),
    ]
    proj = results.get("projection")
    if proj:
        steps = f"days for {PROJECTION_DEFAULTS['steps']:,} steps"
        columns = [
            ("corrector h", "hidden", "d"),
            ("two-stage selection ms", lambda h: 1e3 * h["selection_s"], ".1f"),
        ]
        columns += [("exact selection ms", lambda h: 1e3 * h["exact_selection_s"], ".1f")]
        columns += [("step s (two-stage)", "step_s", ".3f"), ("step s (exact)", "exact_step_s", ".3f")]
        columns += [("selection share two-stage", "selection_fraction", ".1%")]
        columns += [("selection share exact", "exact_selection_fraction", ".1%")]
        columns += [("index on GPU GB", lambda h: h["index_gpu_bytes"] / 1e9, ".1f"), (steps, "days", ".2f")]
        scan_columns = [
            ("corrector h", "hidden", "d"),
            ("scan selection ms", lambda h: 1e3 * h["scan_selection_s"], ".1f"),
        ]
        scan_columns += [
            ("step s", "scan_step_s", ".3f"),
            ("selection share", "scan_selection_fraction", ".1%"),
        ]
        scan_columns += [(steps, "scan_days", ".2f")]
        last = proj["by_hidden"][-1]
        lines += [
            "",
            f"## Projection: 21M x 768 on 8 GPUs (nlist {proj['nlist']} = 4 sqrt(rows per process), nprobe "
            f"{proj['nprobe']}, {proj['candidates']} candidates)",
            "",
            f"From bench_scale's JSON (configs/nq.yaml: {proj['accumulation']} selections per optimizer step of "
            f"{proj['gathered_queries']} queries against {proj['rows_per_process']:,} rows per process), the exact "
            "pass replaced by, per selection:",
            "",
            "```",
            "t_sel2 = G*nlist*2D / gemm + G*nprobe*(r/nlist) * (2D / HBM + 2D / gemm)   (quantiser, inverted lists)",
            "       + G*K' * 4*D*H / gemm + G*K' * (2D + 4H + 8D) / HBM + faiss call   (h on the candidates)",
            "t_scan = r * 2D / HBM + G*r*2D / gemm + G*r*8 / HBM + the same h on the candidates   (no index)",
            "```",
            "",
            reporting.table(proj["by_hidden"], columns),
            "",
            "With `first_stage: scan` (the stale top-K' of every row of the shard, no index):",
            "",
            # A run saved before the scan first stage existed has no scan projection.
            reporting.table(proj["by_hidden"], scan_columns) if "scan_days" in last else "(not in this run)",
            "",
            f"One two-stage selection (h{last['hidden']}): "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in last["parts_s"].items())
            + f". Index build at start-up {proj['index_build_s']:.1f} s; start-up with it {proj['startup_s']:.0f} s.",
        ]
    return "\n".join(lines)


def plot(results: dict):
    fig, ax = reporting.figure(1, (6.5, 4))
    for size in results["sizes"]:
        for m in size["moves"]:
            for first, marker in (("index", "o-"), ("scan", "s--")):
                rows = [r for r in m["two_stage"] if r["first_stage"] == first]
                if rows:
                    label = f"N={fmt_n(size['n'])}, move {m['move']}, {first}"
                    ax.plot([r["speedup"] for r in rows], [r["overlap"] for r in rows], marker, label=label)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.axvline(10, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="speed-up over the exact corrected top-k", ylabel="top-32 overlap with exact")
    ax.set_title("two-stage selection (index: nprobe x candidates; scan: candidates)")
    ax.legend(fontsize=7)
    return fig


def benchmark(args, argv) -> dict:
    wall = time.perf_counter()
    results = {
        "command": reporting.command("bench_two_stage.py", argv),
        "machine": reporting.machine(),
        "sizes": [],
    }
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    made = {n: clustered(n, D, args.cluster, args.noise) for n in args.sizes}
    source = f"clustered{args.cluster}:noise{args.noise}"
    for n, folder, written in synthetic_buffers(
        args, D, "clustered", lambda n: (made[n][0], f"synthetic:{n}x{D}:{source}")
    ):
        results["sizes"].append({**bench_size(args, folder, n, made[n][1](args.queries)), "write": written})
    results["load_after"] = reporting.machine()["load_average"]
    scale = reporting.load_results(args.scale_json) if args.scale_json.is_file() else None
    results["projection"] = projection(args, scale)
    results["wall_s"] = time.perf_counter() - wall
    return results


def main(argv: list[str] | None = None) -> int:
    parser = scale_arguments(__doc__, "bench_two_stage", "1M,4M; --quick 100k", hidden=3072, reps=3)
    add = parser.add_argument
    add("--moves", type=lambda t: [float(x) for x in t.split(",")], default=[0.2, 0.5, 1.0])
    add("--queries", type=int, default=32)
    add("--cluster", type=int, default=200, help="rows per centre")
    add("--noise", type=float, default=1.0)
    add("--factory", default="IVF{nlist},SQfp16", help="faiss factory ({nlist} is filled in)")
    add("--nlist", type=int, default=2048, help="0: 4 sqrt(N) (what index_factory=auto uses)")
    add("--train-per-list", type=int, default=64, help="k-means training rows per list")
    add("--nprobe", type=reporting.int_list, default=[16, 64])
    add(
        "--first-stage",
        type=lambda t: [x for x in t.split(",") if x],
        default=["index", "scan"],
        help="where candidates come from: index (faiss), scan (stale top-k over every row), or both",
    )
    add("--candidates", type=reporting.int_list, default=[256, 1024])
    add("--scale-json", type=Path, default=reporting.results_path("bench_scale").with_suffix(".json"))
    add("--proj-nprobe", type=int, default=64)
    add("--proj-candidates", type=int, default=1024)
    add("--proj-faiss-call-ms", type=float, default=2.0, help="fixed cost of a GPU faiss search")
    add("--proj-kmeans-efficiency", type=float, default=0.1, help="of the GEMM rate")
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([100_000] if args.quick else [1_000_000, 4_000_000])
    if args.quick:
        args.moves, args.reps, args.nlist = args.moves[:2], 2, min(args.nlist, 256)
    if args.threads and args.render is None:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(ImportError):
            import faiss

            faiss.omp_set_num_threads(args.threads)
    if args.dtype is None and args.render is None:
        from rlm.precision import cpu_bf16_support

        args.dtype = "bf16" if cpu_bf16_support(probe=False).native else "fp32"
    return run_or_render(args, argv, benchmark, markdown, plot)


if __name__ == "__main__":
    sys.exit(main())
