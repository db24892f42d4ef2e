"""scripts/bench/bench_rescoring.py (re-scoring from disk, issue 39) in its quick mode, through its main as a user runs
it: every way to search is measured at every k, over a buffer written as `rlm embed` writes one, and the rows
are really evicted between searches (the eviction itself is checked against the page cache)."""

from __future__ import annotations

import json
import sys

import pytest
from script_loader import load_script

pytest.importorskip("faiss")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="evicting pages needs Linux")


def test_quick_run_measures_each_way_to_search_at_each_k(tmp_path):
    script = load_script("bench_rescoring")
    out = tmp_path / "rescoring"
    assert script.main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    ways = [
        "codes only",
        "re-scored, rows cached",
        "re-scored, rows on disk, read one by one",
        "re-scored, rows on disk, prefetched",
        "re-scored, rows cached, 20 at once",
        "re-scored, rows on disk, prefetched, 20 at once",
    ]
    assert [(r["k"], r["search"]) for r in results["rows"]] == [(k, w) for k in (4, 20) for w in ways]
    assert all(r["rows_read"] == 5 * r["k"] and r["p95_ms"] >= r["p50_ms"] > 0 for r in results["rows"])
    markdown = out.with_suffix(".md").read_text()
    assert results["settings"]["disk"] and "| re-scored, rows on disk, prefetched |" in markdown
    out.with_suffix(".md").unlink()
    assert (
        script.main(["--render", str(out.with_suffix(".json"))]) == 0
    )  # the report again, measuring nothing
    assert out.with_suffix(".md").read_text() == markdown


def test_eviction_leaves_no_page_of_the_rows_in_the_page_cache(tmp_path):
    """What 'rows on disk' means: after `Eviction`, mincore(2) finds none of the shard's pages in memory."""
    import ctypes
    import mmap

    import torch
    from lab.benchmarking import clustered, write_buffer

    from rlm.retriever.buffer import PassageBuffer

    script = load_script("bench_rescoring")
    shard, _ = clustered(4096, 64)
    write_buffer(tmp_path / "rows", 4096, 64, shard, "test")
    buffer = PassageBuffer.load(tmp_path / "rows")
    evict = script.Eviction(buffer)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

    def resident_pages() -> int:
        start, length = evict.spans[0]
        vector = ctypes.create_string_buffer(-(-length // mmap.PAGESIZE))
        assert libc.mincore(ctypes.c_void_p(start), length, vector) == 0, ctypes.get_errno()
        return sum(byte & 1 for byte in vector.raw)

    float(buffer.rows(torch.arange(4096)).float().sum())  # every row read: its pages are in memory
    assert resident_pages() > 0
    evict()
    assert resident_pages() == 0
