"""The retrieval benchmark runs end to end (tiny sizes) and writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_retrieval_tiny(tmp_path):
    out = tmp_path / "bench"
    args = ["--sizes", "3000", "--build-passages", "8", "--threads", "1", "--out", str(out)]
    # A corpus that is not there (as ../shared/data is not, beside a bare clone): a generated world stands in.
    args += ["--build-corpus", str(tmp_path / "missing.jsonl")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_retrieval.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    (row,) = results["topk"]
    assert row["n"] == 3000 and row["fp32"]["seconds"] > 0 and row["bf16"]["ratio_to_plain"] > 0
    assert {r["index"] for r in row["two_stage"]} == {"Flat", "IVF208,Flat"}
    assert all(r["overlap_top32"] > 0.5 for r in row["two_stage"])
    assert results["build"]["passages"] == 8 and results["build"]["source"] == "toy-world"
    table = out.with_suffix(".md").read_text()
    assert "| 3,000 | fp32 |" in table and "Two-stage vs full" in table and "Buffer build" in table
