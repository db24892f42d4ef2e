"""What the benchmark scripts (`rlm bench ...`, `scripts/bench_*.py`) share: where a timing was taken, best-of
timing, peak RSS, top-k overlap, a corrector that moves vectors by a stated amount, synthetic buffers written
the way `rlm embed` writes them, and what the two selection-at-scale benchmarks (`bench_scale.py`,
`bench_two_stage.py`) share: their options, their buffers' life, the paper-scale projection constants.

The scripts import these from the installed package instead of from each other: a script folder put on
`sys.path` would shadow installed packages by its file names (`scripts/evaluate.py` hides the `evaluate`
library from every later import in that process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlm.experiments import reporting

# Projection defaults: the paper's RLM setting as configs/nq.yaml states it, and H100 SXM constants.
PROJECTION_DEFAULTS = {
    "n": 21_000_000,  # DPR psgs_w100 (21,015,324 passages), 768-d GTR-base vectors
    "gpus": 8,
    "questions_per_step": 128,
    "micro_batch": 4,  # questions per GPU per micro-step (configs/nq.yaml): accumulation 4 on 8 GPUs
    "passages": 32,
    "passage_tokens": 256,
    "query_tokens": 64,
    "answer_tokens": 32,
    "steps": 20_000,
    "refresh_every": 500,  # the exhaustive baseline (for the refresh column only; the corrector never refreshes)
    "peak_tflops": 989.0,  # H100 SXM bf16 dense
    "gemm_efficiency": 0.7,  # large bf16 GEMMs (65536 x 768 x H): ~700 TFLOP/s achieved
    "train_mfu": 0.4,  # model FLOPs utilisation of the T5-base FiD training step (HF T5, checkpointing)
    "embed_mfu": 0.5,  # the passage tower in inference (refresh)
    "hbm_tbps": 3.0,
    "pcie_gbps": 25.0,  # host -> device
    "disk_gbps": 2.0,  # one NVMe read by all 8 processes of the node (a cold start; warm page cache: faster)
    "nvlink_gbps": 300.0,  # all-reduce bus bandwidth per GPU
    "launch_s": 30.0,  # launcher + python + torch/CUDA/NCCL init per process
}


def best_of(reps: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Fewest wall seconds of `reps` calls of `fn` (the least disturbed by other jobs) and the last result."""
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def overlap(found, reference) -> float:
    """Mean over queries of the fraction of `reference`'s indices (per row) that `found` also holds."""
    return float(
        np.mean(
            [len(set(x.tolist()) & set(y.tolist())) / len(y) for x, y in zip(found, reference, strict=True)]
        )
    )


def corrector_moving(dim: int, hidden: int, move: float = 0.2, seed: int = 1, num_hidden_layers: int = 1):
    """CorrectorNetwork(dim, hidden) in eval mode whose residual branch moves unit vectors by `move` on average.

    A fresh corrector's output layer is zero (h = identity), which would time a corrector that changes nothing
    and select exactly what the stale buffer selects; a trained one moves vectors by ~0.2 here
    (docs/results/bench_retrieval/bench_retrieval.md), and 1.0 is a corrector that rewrites them.
    """
    import torch
    import torch.nn.functional as F

    from retriever.corrector import CorrectorNetwork

    torch.manual_seed(seed)
    net = CorrectorNetwork(dim, hidden, num_hidden_layers=num_hidden_layers).eval()
    with torch.no_grad():
        net.output.weight.normal_()
        probe = F.normalize(torch.randn(512, dim), dim=-1)
        net.output.weight.mul_(move / (net(probe) - probe).norm(dim=-1).mean())
    return net


class PeakRSS:
    """Samples this process's RSS every few ms in a thread; `.extra_mb` = peak minus the RSS at entry."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra_mb = (self.peak - self.start) / 2**20


def write_buffer(
    folder: Path, n: int, dim: int, shard: Callable[[int, int], np.ndarray], source: str
) -> dict:
    """A fixed buffer of `n` synthetic rows, written by `retriever.buffer`'s own writer as `rlm embed` writes
    one (shards of 100k rows with their receipts, then `finalize_buffer`: verified, ids.txt, meta.json), so
    that `PassageBuffer.load` opens it memory-mapped as training does. Shard s holds `shard(s, rows)`, an
    fp16 [rows, dim] array; `source` names the data: a folder already holding the same buffer is reused."""
    from retriever import buffer as layout

    rows = 100_000
    settings = {
        "format_version": layout.FORMAT_VERSION,
        "encoder_fingerprint": "synthetic",
        "corpus_fingerprint": source,
        "count": n,
        "dim": dim,
        "dtype": "float16",
        "shard_size": rows,
        "num_shards": -(-n // rows),
        "max_length": 0,
        "precision": "float32",
    }
    meta = folder / layout.META_NAME
    if meta.is_file() and all(json.loads(meta.read_text()).get(k) == v for k, v in settings.items()):
        return {"seconds": 0.0, "reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    for s in range(settings["num_shards"]):
        # retriever.buffer's own writer: a shard and its receipt, atomically (the format is written in one place).
        layout.write_shard(folder, s, shard(s, min(rows, n - s * rows)))
    layout.finalize_buffer(folder, range(n), settings)
    return {"seconds": time.perf_counter() - start, "reused": False}


def clustered(n: int, dim: int, cluster: int = 200, noise: float = 1.0, seed: int = 0):
    """Synthetic passage embeddings with neighbourhoods (a top-k over pure noise measures nothing): unit vectors
    around n // cluster random centres plus noise * N(0, I/dim). Returns (shard, queries): `shard(s, rows)`, an
    fp16 [rows, dim] array from its own generator (the same rows whatever writes them, in any order), and
    `queries(count)`, unit queries drawn the same way."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(max(1, n // cluster), dim, generator=g), dim=-1)

    def draw(count: int, g: torch.Generator):
        picked = torch.randint(0, len(centres), (count,), generator=g)
        return F.normalize(
            centres[picked] + torch.randn(count, dim, generator=g) * (noise / dim**0.5), dim=-1
        )

    def shard(s: int, rows: int) -> np.ndarray:
        return draw(rows, torch.Generator().manual_seed(seed * 1_000_003 + s + 1)).half().numpy()

    return shard, lambda count: draw(count, torch.Generator().manual_seed(seed + 7919))


def clustered_buffer(n: int, dim: int, queries: int, cluster: int = 200, noise: float = 1.0, seed: int = 0):
    """(an in-memory fp16 [n, dim] buffer of `clustered` rows, `queries` unit queries drawn the same way)."""
    import torch

    shard, draw = clustered(n, dim, cluster, noise, seed)
    buffer = torch.empty(n, dim, dtype=torch.float16)  # filled in place: no second copy of it all
    for s, lo in enumerate(range(0, n, 100_000)):
        buffer[lo : lo + 100_000] = torch.from_numpy(shard(s, min(100_000, n - lo)))
    return buffer, draw(queries)


def fmt_n(n: int) -> str:
    """1,000,000 -> '1M', 4,000 -> '4k'."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def autocast(dtype: str):
    """bf16 autocast on the CPU for 'bf16'; nothing for 'fp32'."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def gpu_rates(p: dict) -> tuple[float, float]:
    """(achieved GEMM FLOP/s, HBM bytes/s) of a projection's constants."""
    return p["peak_tflops"] * 1e12 * p["gemm_efficiency"], p["hbm_tbps"] * 1e12


def scale_arguments(doc: str, study: str, sizes: str, **defaults) -> argparse.ArgumentParser:
    """The options both selection-at-scale benchmarks take; `defaults` sets hidden, reps, threads, dtype."""
    parser = reporting.arguments(doc)
    add = parser.add_argument
    add("--sizes", type=reporting.int_list, help=f"comma-separated N (default {sizes})")
    add("--quick", action="store_true", help="small N, fewer repetitions (about a minute)")
    add("--hidden", type=int, default=defaults["hidden"], help="corrector width measured over all rows")
    add("--reps", type=int, default=defaults.get("reps"), help="repetitions (min)")
    add("--threads", type=int, default=defaults.get("threads"), help="torch threads (per process)")
    add("--dtype", choices=("bf16", "fp32"), default=defaults.get("dtype"), help="compute (autocast) dtype")
    add("--workdir", type=Path, help="where the buffers go (default: a temp dir)")
    add("--keep", action="store_true", help="keep the buffers (a later --workdir run reuses them)")
    add("--out", type=Path, default=reporting.results_path(study), help="output stem")
    add("--no-plot", action="store_true")
    add("--render", type=Path, help="re-render the .md and .png of a saved JSON (no benchmark)")
    return parser


def synthetic_buffers(args, dim: int, name: str, make: Callable[[int], tuple[Callable, str]]):
    """Yield (n, folder, write figures) for each N of `args.sizes`: `make(n)` gives (shard, source) for
    `write_buffer` into `args.workdir` (default a temp folder) / `<name>_<n>`; without `args.keep` each buffer
    is deleted once measured, and the folder too when this run created it."""
    made = args.workdir is None or not args.workdir.exists()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for n in args.sizes:
            folder = workdir / f"{name}_{n}"
            written = write_buffer(folder, n, dim, *make(n))
            print(f"N={n:,}: buffer written in {written['seconds']:.1f} s", file=sys.stderr)
            yield n, folder, written
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if args.keep:
            print(f"buffers kept in {workdir}", file=sys.stderr)
        elif made:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            for n in args.sizes:
                shutil.rmtree(workdir / f"{name}_{n}", ignore_errors=True)


def run_or_render(
    args, argv, benchmark: Callable, markdown: Callable, plot: Callable, load=lambda r: r
) -> int:
    """`--render JSON`: the report and plot of a saved run; otherwise run `benchmark(args, argv)` and write all."""
    if args.render is not None:
        results, out, saved = load(reporting.load_results(args.render)), args.render.with_suffix(""), None
    else:
        results = saved = benchmark(args, argv)
        out = args.out
    plots = {} if args.no_plot else {".png": lambda: plot(results)}
    reporting.write_report(out, markdown(results), saved, plots)
    return 0
