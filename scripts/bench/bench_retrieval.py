"""Retriever benchmark (`make bench`): the streamed corrected top-k against bare matmuls.

Corrected top-k over N in {10k, 100k, 1M} x D=384, corrector hidden 4D, 64 queries, k=32: passages/s and GFLOP/s
of `corrected_topk` next to plain torch matmuls of exactly the same shapes (+ topk) in the same process, and the
peak extra RSS during the call (sampled), which should not grow with N. Each N runs in a fresh process so that
memory figures do not leak between sizes. The data are clustered unit vectors (queries near a cluster, ~50
passages per cluster) so that top-32 is meaningful; the corrector moves vectors by ~0.2, as a trained one does.
Two-stage search at scale: `bench_two_stage.py`.

    python scripts/bench/bench_retrieval.py            # N = 10k, 100k, 1M (a few minutes)
    python scripts/bench/bench_retrieval.py --quick    # N = 10k, 50k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from lab import reporting
from lab.benchmarking import PeakRSS, best_of, clustered_buffer, corrector_moving, overlap, peak_rss_mb

D, HIDDEN, BATCH, K, CHUNK, CLUSTER = 384, 4 * 384, 64, 32, 65_536, 50


def plain_matmuls(n: int, net, queries: torch.Tensor, dtype: torch.dtype) -> float:
    """Seconds for the bare torch ops of the same shapes: per chunk h's two matmuls, scores, topk."""
    chunk = torch.randn(min(CHUNK, n), D).to(dtype)
    w1, b1 = net.hidden[0].weight.to(dtype), net.hidden[0].bias.to(dtype)
    w2, b2 = net.output.weight.to(dtype), net.output.bias.to(dtype)
    start = time.perf_counter()
    with torch.no_grad():
        for size in (min(CHUNK, n - s) for s in range(0, n, CHUNK)):
            x = chunk[:size]
            (queries.to(dtype) @ (x + F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)).T).float().topk(K, dim=1)
    return time.perf_counter() - start


def worker(n: int, reps: int) -> dict:
    from rlm.retriever.search import corrected_topk

    # Queries near a cluster, ~50 passages per cluster: top-32 is meaningful.
    buffer, queries = clustered_buffer(n, D, BATCH, cluster=CLUSTER, noise=0.5)
    net = corrector_moving(D, HIDDEN)
    corrected_topk(queries, buffer[:CHUNK], net, K)  # warm-up (allocator, autocast caches)
    flops = n * (2 * D * HIDDEN * 2) + 2 * BATCH * n * D
    rows, tops = [], {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # Interleaved reps: a burst of load from other jobs on the shared cores hits both sides alike.
        ours, plains = [], []
        for _ in range(reps):
            with PeakRSS() as mem:
                start = time.perf_counter()
                top = corrected_topk(queries, buffer, net, K, compute_dtype=dtype)
                ours.append(time.perf_counter() - start)
            plains.append(plain_matmuls(n, net, queries, dtype))
        seconds, plain = min(ours), min(plains)
        tops[name] = top
        rows.append(
            {"n": n, "compute": name, "seconds": seconds, "passages_per_s": n / seconds}
            | {
                "gflops": flops / seconds / 1e9,
                "plain_gflops": flops / plain / 1e9,
                "ratio_to_plain": plain / seconds,
            }
            | {"peak_extra_rss_mb": mem.extra_mb, "buffer_mb": buffer.numel() * 2 / 2**20}
        )
    stale_s, stale = best_of(reps, lambda: corrected_topk(queries, buffer, None, K))
    for row in rows:
        row["process_peak_rss_mb"] = peak_rss_mb()
        row["stale_seconds"] = stale_s
        row["stale_vs_corrected_overlap"] = overlap(stale.indices, tops["fp32"].indices)
    return {"rows": rows}


COLUMNS = [
    ("N", "n", ","),
    ("compute", "compute", ""),
    ("seconds", "seconds", ".3f"),
    ("passages/s", "passages_per_s", ",.0f"),
    ("GFLOP/s", "gflops", ".1f"),
    ("plain matmul GFLOP/s", "plain_gflops", ".1f"),
    ("ratio to plain", "ratio_to_plain", ".2f"),
    ("peak extra RSS MB", "peak_extra_rss_mb", ".0f"),
    ("buffer MB", "buffer_mb", ".0f"),
    ("process peak RSS MB", "process_peak_rss_mb", ".0f"),
    ("stale top-k s", "stale_seconds", ".3f"),
]


def markdown(results: dict) -> str:
    return (
        f"# Retriever benchmark\n\nCommand: `{results['command']}`; {reporting.machine_line(results['machine'])}.\n\n"
        f"## Corrected top-k (D={D}, corrector {D}->{HIDDEN}->{D}, {BATCH} queries, k={K}, chunk {CHUNK}, fp16 "
        f"buffer)\n\n{reporting.table(results['topk'], COLUMNS)}"
    )


def main() -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 10k, 50k")
    parser.add_argument("--sizes", default=None, help="comma-separated N (overrides the default sizes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--out", default=reporting.results_path("bench_retrieval"), help="output stem")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, 3 if args.worker <= 100_000 else 1)))
        return 0
    default = [10_000, 50_000] if args.quick else [10_000, 100_000, 1_000_000]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default
    results = {"command": reporting.command("bench_retrieval.py"), "machine": reporting.machine(), "topk": []}
    for n in sizes:
        cmd = [sys.executable, __file__, "--worker", str(n), "--threads", str(threads)]
        results["topk"] += reporting.run_json(cmd, what=f"benchmark worker for N={n}")["rows"]
        print(f"N={n:,}: fp32 {results['topk'][-2]['seconds']:.2f} s", file=sys.stderr)
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
