"""Re-scoring from disk (issue 39): what does `rlm index --rescore F` cost a search when the buffer's float16 rows
are not in the page cache, as at 21M passages on a host whose RAM holds the index but not the 32 GB of rows?

A buffer of N synthetic rows (`lab.benchmarking.clustered`, written as `rlm embed` writes one) and an
IVF-PQ index over it (`PassageIndex.from_buffer`, `--factory`, nprobe fixed by `--nprobe`), re-scored x F. One
query per search, k in `--k`; per search p50/p95 of:

- codes only: the index without re-scoring;
- re-scored, rows cached: the candidates' rows already in the page cache;
- re-scored, rows on disk, read one by one: before each search the rows are dropped from this process's mapping
  (`madvise(MADV_DONTNEED)`) and from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`), and
  `PassageBuffer.prefetch` is turned off: each row is a page fault that waits for its read;
- re-scored, rows on disk, prefetched: the same eviction, with `prefetch` (what `Rescoring.best` does);
- the two re-scored ways a server meets, with `--concurrent` (20) searches at once: rounds of 20 threads
  released together, each searching one query (the rows evicted before each round for "on disk"): 20 users'
  reads queued on one disk at once.

The eviction needs Linux (libc's `madvise`, `os.posix_fadvise`). What it measures is this machine's disk: a
local NVMe drive, a network volume and a virtual disk differ by orders of magnitude.

    python scripts/bench/bench_rescoring.py                  # N = 1M x 768 (1.5 GB of rows in --work), ~2 minutes
    python scripts/bench/bench_rescoring.py --quick          # N = 20k x 64, a few seconds
    python scripts/bench/bench_rescoring.py --render scripts/bench/reports/rescoring/rescoring.json
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from lab import reporting
from lab.benchmarking import clustered, latency_ms, write_buffer

MADV_DONTNEED = 4  # <sys/mman.h> on Linux


class Eviction:
    """Drops a memory-mapped buffer's rows from this process's mappings and from the page cache."""

    def __init__(self, buffer):
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.spans = []
        for shard in buffer._shards:  # the mapping starts at the file's first page, before the rows' pointer
            pointer = shard.data_ptr()
            start = pointer - pointer % mmap.PAGESIZE
            self.spans.append((start, pointer + shard.numel() * shard.element_size() - start))
        self.files = [path for path, _ in buffer._files]

    def __call__(self) -> None:
        for start, length in self.spans:
            if self.libc.madvise(ctypes.c_void_p(start), length, MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
        for path in self.files:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def timed(search, queries: np.ndarray, before=None) -> list[float]:
    """Seconds of `search(one query)` for each query, `before()` run untimed ahead of each."""
    seconds = []
    for query in queries:
        if before is not None:
            before()
        start = time.perf_counter()
        search(query[None])
        seconds.append(time.perf_counter() - start)
    return seconds


def timed_together(search, queries: np.ndarray, threads: int, before=None) -> list[float]:
    """Seconds of `search(one query)` for each query, in rounds of `threads` searches released at once (a
    barrier), `before()` run untimed ahead of each round; a last partial round is left out."""

    def one(query: np.ndarray, barrier: threading.Barrier) -> float:
        barrier.wait()
        began = time.perf_counter()
        search(query[None])
        return time.perf_counter() - began

    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(queries) - threads + 1, threads):
            if before is not None:
                before()
            barrier = threading.Barrier(threads)
            seconds += pool.map(one, queries[start : start + threads], [barrier] * threads)
    return seconds


def measure(index, buffer, queries: np.ndarray, k: int, concurrent: int) -> list[dict]:
    """The ways to search (the module's docstring) at this k."""
    evict, rescoring, prefetch = Eviction(buffer), index.rescoring, buffer.prefetch
    search = lambda q: index.search_rows(q, k)  # noqa: E731
    search(queries[:1])  # warm-up
    index.rescoring = None
    runs = {"codes only": timed(search, queries)}
    index.rescoring = rescoring
    runs["re-scored, rows cached"] = timed(search, queries)
    buffer.prefetch = lambda indices: None
    try:
        runs["re-scored, rows on disk, read one by one"] = timed(search, queries, evict)
    finally:
        buffer.prefetch = prefetch
    runs["re-scored, rows on disk, prefetched"] = timed(search, queries, evict)
    together = f"{concurrent} at once"
    runs[f"re-scored, rows cached, {together}"] = timed_together(search, queries, concurrent)
    runs[f"re-scored, rows on disk, prefetched, {together}"] = timed_together(
        search, queries, concurrent, evict
    )
    return [
        {
            "k": k,
            "rows_read": k * rescoring.k_factor,
            "search": name,
            **latency_ms(seconds),
            "searches": len(seconds),
        }
        for name, seconds in runs.items()
    ]


COLUMNS = [
    ("k", "k", ""),
    ("rows re-scored", "rows_read", ""),
    ("search", "search", ""),
    ("p50 ms", "p50_ms", ".2f"),
    ("p95 ms", "p95_ms", ".2f"),
    ("searches", "searches", ""),
]


def markdown(results: dict) -> str:
    s = results["settings"]
    return (
        "# Re-scoring from disk: a search's cost with the buffer's rows in the page cache or not\n\n"
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; disk: "
        f"{s['disk']}.\n\n"
        f"N = {s['n']:,} synthetic rows x {s['dim']} (float16, {s['rows_mb']:,.0f} MB in {s['shards']} shards), "
        f"`{s['factory']}` at nprobe={s['nprobe']}, re-scored x{s['k_factor']}; one query per search, "
        f"{s['queries']} queries. 'On disk': before each search the rows are dropped from the process's "
        "mapping and the page cache, so every candidate row is read from the disk. 'At once': rounds of "
        f"{s.get('concurrent', 20)} threads released together, one query each (rows evicted before each "
        "round), as a server's users share one disk and the cores.\n\n"
        f"{reporting.table(results['rows'], COLUMNS)}\n"
    )


def disk_of(path: Path) -> str:
    """The block device holding `path`, whether Linux calls it rotational and its read-ahead (a page fault on a
    mapped file reads up to that much around its page), best effort."""
    device = os.stat(path).st_dev
    name = f"{os.major(device)}:{os.minor(device)}"
    try:
        block = Path(f"/sys/dev/block/{name}").resolve()
        queue = block / "queue" if (block / "queue").is_dir() else block.parent / "queue"
        rotational = (queue / "rotational").read_text().strip() == "1"
        readahead = (queue / "read_ahead_kb").read_text().strip()
        return f"{block.name} ({'rotational' if rotational else 'not rotational'}, read-ahead {readahead} KB)"
    except OSError:
        return f"device {name}"


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 20,000 x 64, 60 queries")
    parser.add_argument("--n", type=int, default=None, help="rows (default 1,000,000)")
    parser.add_argument("--dim", type=int, default=None, help="row width (default 768)")
    parser.add_argument("--factory", default=None, help="faiss factory (default IVF1024,PQ256np)")
    parser.add_argument("--nprobe", type=int, default=16, help="IVF lists probed")
    parser.add_argument("--rescore", type=int, default=5, help="k factor of the re-scoring")
    parser.add_argument("--k", default="4,20", help="results per search, comma-separated")
    parser.add_argument("--queries", type=int, default=None, help="searches per way (default 300)")
    parser.add_argument("--concurrent", type=int, default=20, help="searches at once in the concurrent ways")
    parser.add_argument("--work", default="/tmp/rlm-bench-rescoring", help="folder for the buffer")
    parser.add_argument("--out", default=str(reporting.results_path("rescoring")), help="output stem")
    parser.add_argument("--render", default=None, help="redo the report from this JSON, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:
        results = reporting.load_results(args.render)
        reporting.write_report(Path(args.render).with_suffix(""), markdown(results), results)
        return 0
    if not sys.platform.startswith("linux"):
        raise SystemExit("error: evicting the rows from the page cache needs Linux (madvise, posix_fadvise)")
    import faiss
    import torch

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    n = args.n or (20_000 if args.quick else 1_000_000)
    dim = args.dim or (64 if args.quick else 768)
    factory = args.factory or ("IVF16,PQ16x4np" if args.quick else "IVF1024,PQ256np")
    count = args.queries or (60 if args.quick else 300)
    shard, queries = clustered(n, dim)
    folder = Path(args.work) / f"rows-{n}-{dim}"
    write_buffer(folder, n, dim, shard, f"clustered(n={n}, dim={dim}, seed=0)")
    buffer = PassageBuffer.load(folder)
    index = PassageIndex.from_buffer(buffer, factory)
    index.set_search_params({"nprobe": args.nprobe})
    index.rescore_from(buffer, args.rescore)
    asked = queries(count).numpy()
    rows = [
        row for k in reporting.int_list(args.k) for row in measure(index, buffer, asked, k, args.concurrent)
    ]
    settings = {
        "n": n,
        "dim": dim,
        "factory": factory,
        "nprobe": args.nprobe,
        "k_factor": args.rescore,
        "queries": count,
        "concurrent": args.concurrent,
        "shards": len(buffer._files),
        "rows_mb": n * dim * 2 / 2**20,
        "disk": disk_of(folder),
    }
    results = {"command": reporting.command("bench_rescoring.py", argv), "machine": reporting.machine()}
    results |= {"settings": settings, "rows": rows}
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
