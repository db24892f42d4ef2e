"""What the benchmark scripts (`rlm bench ...`, `scripts/bench_*.py`) share: best-of timing, peak RSS, top-k
overlap, a corrector that moves vectors by a stated amount, and synthetic buffers (in memory, or written the way
`rlm embed` writes them).

The scripts import these from the installed package instead of from each other: a script folder put on
`sys.path` would shadow installed packages by its file names (`scripts/evaluate.py` hides the `evaluate`
library from every later import in that process).
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def timings(reps: int, fn: Callable[[], Any]) -> tuple[list[float], Any]:
    """Wall seconds of each of `reps` calls of `fn`, and the last result."""
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def best_of(reps: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Fewest wall seconds of `reps` calls of `fn` (the least disturbed by other jobs) and the last result."""
    times, out = timings(reps, fn)
    return min(times), out


def median_of(reps: int, fn: Callable[[], Any], warmup: bool = True) -> tuple[float, Any]:
    """Median wall seconds of `reps` calls of `fn`, after one untimed call with `warmup` (allocator and
    autocast caches), and the last result."""
    if warmup:
        fn()
    times, out = timings(reps, fn)
    return statistics.median(times), out


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
