"""Two-stage selection at scale (`python scripts/bench/bench_two_stage.py`): Appendix B.2's search against the exact corrected
top-k over millions of memory-mapped rows.

For each N (default 1M and 4M rows x 768) a buffer of clustered unit vectors (N / --cluster centres, noise
--noise: real passage embeddings have neighbourhoods, and a top-32 over pure noise measures nothing) is written
as `rlm embed` writes one and opened memory-mapped; the G queries are drawn the same way. Then, as
`strategy.search: two_stage` runs it: a faiss index over the stale buffer (`PassageIndex.from_buffer`, default
`IVF2048,SQfp16`), built once; for each correction size (`--moves`: ||h(b) - b||, ~0.2 for a trained corrector,
1.0 rewrites the vector) the exact corrected top-k (`corrected_topk`, h = CorrectorNetwork(768, --hidden)), the
stale top-k, and `two_stage_corrected_topk` for every (first stage, nprobe, candidates): seconds (min of
--reps), speed-up over exact, top-k overlap with exact.

Until issue 30 this script also projected the cost at 21M x 768 on 8 GPUs from bench_scale.py's JSON (both
removed; see git history); `bash scripts/bench/gpu_smoke.sh` now measures that selection on a GPU
(scripts/bench/reports/gpu_smoke/gpu_smoke.md).

    python scripts/bench/bench_two_stage.py                  # N = 1M, 4M (~15 min on 2 cores)
    python scripts/bench/bench_two_stage.py --quick          # N = 100k (about a minute)
    python scripts/bench/bench_two_stage.py --render scripts/bench/reports/bench_two_stage/bench_two_stage.json
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from lab import reporting
from lab.benchmarking import best_of, clustered, corrector_moving, overlap, peak_rss_mb, write_buffer

D, K, CHUNK = 768, 32, 65_536


def fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def bench_size(args, folder: Path, n: int, queries: torch.Tensor) -> dict:
    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.search import corrected_topk, two_stage_corrected_topk

    buffer = PassageBuffer.load(folder)
    nlist = args.nlist or max(16, int(4 * n**0.5))
    factory = args.factory.format(nlist=nlist) if "index" in args.first_stage else None
    start, index = time.perf_counter(), None
    if factory is not None:
        index = PassageIndex.from_buffer(buffer, factory, train_sample=min(n, args.train_per_list * nlist))
    out = {"n": n, "factory": factory, "nlist": nlist, "index_build_s": time.perf_counter() - start}
    # (first stage, nprobe): the index's lists probed, or the stale scan over every row (no index).
    stages = [("index", p) for p in (args.nprobe if index else [])]
    stages += [("scan", None)] if "scan" in args.first_stage else []
    topk = partial(corrected_topk, queries, buffer, k=K, chunk_size=CHUNK)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    out["moves"] = []
    with cast, torch.no_grad():
        out["stale_s"], stale = best_of(1, partial(topk, corrector=None))
        for move in args.moves:
            h = corrector_moving(D, args.hidden, move)
            exact_s, exact = best_of(1, partial(topk, corrector=h))
            row = {"move": move, "exact_s": exact_s, "stale_overlap": overlap(stale.indices, exact.indices)}
            row["two_stage"] = []
            for first, nprobe in stages:
                searched = index if first == "index" else None
                search_s = None
                if searched is not None:  # the faiss search alone, at the largest candidate count
                    search = partial(searched.search_rows, queries.numpy(), max(args.candidates), nprobe)
                    search_s = best_of(args.reps, search)[0]
                for c in args.candidates:
                    select = partial(two_stage_corrected_topk, queries, buffer, h, K, searched, c)
                    seconds, top = best_of(args.reps, partial(select, nprobe=nprobe, chunk_size=CHUNK))
                    row["two_stage"].append(
                        {"first_stage": first, "nprobe": nprobe, "candidates": c, "seconds": seconds}
                        | {"faiss_search_s": search_s, "speedup": exact_s / seconds}
                        | {"overlap": overlap(top.indices, exact.indices)}
                    )
            print(
                f"N={n:,} move {move}: exact {exact_s:.1f} s, stale overlap {row['stale_overlap']:.2f}",
                file=sys.stderr,
            )
            out["moves"].append(row)
    out["peak_rss_gb"] = peak_rss_mb() * 2**20 / 1e9
    return out


def goals(results: dict) -> list[str]:
    out = []
    for size in results["sizes"]:
        for m in size["moves"]:
            ok = [r for r in m["two_stage"] if r["overlap"] >= 0.95]
            best = (
                max(ok, key=lambda r: r["speedup"]) if ok else max(m["two_stage"], key=lambda r: r["overlap"])
            )
            where = "stale scan" if best["first_stage"] == "scan" else f"index nprobe {best['nprobe']}"
            out.append(
                f"- N = {fmt_n(size['n'])}, move {m['move']} (stale overlap {m['stale_overlap']:.2f}): "
                f"{'fastest with overlap >= 0.95' if ok else 'no setting reaches overlap 0.95; best'}: {where}, "
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
        ("build s", scan("build"), ".0f"),
        ("move", "move", "g"),
        ("stale overlap", "stale_overlap", ".2f"),
        ("exact s", "exact_s", ".1f"),
        ("nprobe", "nprobe", "d"),
        ("candidates", "candidates", "d"),
        ("faiss s", scan("faiss_search_s"), ".3f"),
        ("two-stage s", "seconds", ".3f"),
        ("speed-up", lambda r: f"{r['speedup']:.0f}x", ""),
        ("overlap", "overlap", ".3f"),
    ]
    lines = [
        "# Two-stage selection at scale: candidates from the stale buffer, re-scored with h",
        "",
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; compute {a['dtype']}; "
        f"load average after {results['load_after']}; total wall time {results['wall_s'] / 60:.1f} min.",
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
    results = {"command": reporting.command("bench_two_stage.py", argv), "machine": reporting.machine()}
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["sizes"] = []
    created = args.workdir is None or not args.workdir.exists()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_two_stage_"))
    source = f"clustered{args.cluster}:noise{args.noise}"
    try:
        for n in args.sizes:
            # A 4M buffer is 6 GB: each goes once measured, unless --keep keeps it for a later run to reuse.
            folder = workdir / f"clustered_{n}"
            try:
                shard, draw = clustered(n, D, args.cluster, args.noise)
                written = write_buffer(folder, n, D, shard, f"synthetic:{n}x{D}:{source}")
                print(f"N={n:,}: buffer written in {written['seconds']:.1f} s", file=sys.stderr)
                results["sizes"].append({**bench_size(args, folder, n, draw(args.queries)), "write": written})
            finally:
                if not args.keep:
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        if args.keep:
            print(f"buffers kept in {workdir}", file=sys.stderr)
        elif created:
            shutil.rmtree(workdir, ignore_errors=True)
    results["load_after"] = reporting.machine()["load_average"]
    results["wall_s"] = time.perf_counter() - wall
    return results


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    add = parser.add_argument
    add("--sizes", type=reporting.int_list, help="comma-separated N (default 1M,4M; --quick 100k)")
    add("--quick", action="store_true", help="N = 100k, fewer moves and repetitions (about a minute)")
    add("--hidden", type=int, default=3072, help="corrector width")
    add("--reps", type=int, default=3, help="repetitions (min)")
    add("--threads", type=int, help="torch and faiss threads")
    add(
        "--dtype",
        choices=("bf16", "fp32"),
        help="autocast dtype (default: bf16 where the CPU has it natively)",
    )
    add("--workdir", type=Path, help="where the buffers go (default: a temp dir)")
    add("--keep", action="store_true", help="keep the buffers (a later --workdir run reuses them)")
    add("--out", type=Path, default=reporting.results_path("bench_two_stage"), help="output stem")
    add("--no-plot", action="store_true")
    add("--render", type=Path, help="re-render the .md and .png of a saved JSON (no benchmark)")
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
    args = parser.parse_args(argv)
    if args.render is not None:
        results, out, saved = reporting.load_results(args.render), args.render.with_suffix(""), None
    else:
        args.sizes = args.sizes or ([100_000] if args.quick else [1_000_000, 4_000_000])
        if args.quick:
            args.moves, args.reps, args.nlist = args.moves[:2], 2, min(args.nlist, 256)
        if args.threads:
            torch.set_num_threads(args.threads)
            with contextlib.suppress(ImportError):
                import faiss

                faiss.omp_set_num_threads(args.threads)
        if args.dtype is None:
            from rlm.precision import cpu_bf16_support

            args.dtype = "bf16" if cpu_bf16_support(probe=False).native else "fp32"
        results = saved = benchmark(args, argv)
        out = args.out
    reporting.write_report(
        out, markdown(results), saved, {} if args.no_plot else {".png": lambda: plot(results)}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
