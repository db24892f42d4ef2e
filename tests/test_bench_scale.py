"""The scale benchmark runs end to end on tiny buffers with 1 and 2 processes (torch.distributed, gloo) and
writes its table, JSON and plot; `rlm bench scale` reaches it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_rlm_bench_registers_scale():
    from rlm.commands.bench import BENCHMARKS, script_path

    assert BENCHMARKS["scale"] == "bench_scale.py"
    assert script_path("scale").is_file()


@pytest.mark.slow
def test_bench_scale_quick_one_and_two_processes(tmp_path):
    out, work = tmp_path / "result" / "bench_scale", tmp_path / "work"
    args = [
        "--quick",
        "--sizes",
        "4000",  # one size: each (size, processes) pair costs ~40 s of process start-up on a 2-core CPU
        "--slice-hidden",
        "3072:2000,8192:1000",
        # float32: on a CPU without native bf16 the default bf16 autocast is emulated, 12x slower (80 s
        # against 6.5 s for one process here); what is asserted does not depend on the precision.
        "--dtype",
        "fp32",
    ]
    args += ["--out", str(out), "--workdir", str(work)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_scale.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert [s["n"] for s in results["sizes"]] == [4000]
    for size in results["sizes"]:
        assert [run["world"] for run in size["runs"]] == [1, 2]
        # The merged top-k of 2 processes (rank 0's queries) is the 1-process top-k, stale and corrected.
        assert size["sharded_equals_whole"] is True
        two = size["runs"][1]["processes"]
        assert [p["row_range"] for p in two] == [[0, size["n"] // 2], [size["n"] // 2, size["n"]]]
        assert all(p["world"] == 2 and p["threads"] == 1 for p in two)
    # Per process, every figure is there; the slices were measured once (smallest N) and scaled everywhere.
    assert len(results["summary"]) == 2
    for row in results["summary"]:
        assert row["rows"] == row["n"] // row["world"]
        assert row["buffer_bytes_scanned"] == row["rows"] * 768 * 2
        assert row["corrected_wall_s"] > 0 and row["corrected_cpu_s"] > 0 and row["stale_wall_s"] > 0
        assert row["peak_rss_selection_bytes"] > 0
        assert set(row["scaled"]) == {"3072", "8192"} and set(row["loss_ms"]) == {"768", "3072", "8192"}
    assert [r["n"] for r in results["ratios"]] == [4000]
    proj = results["projection"]
    assert proj["rows_per_process"] == 2_625_000 and proj["accumulation"] == 4
    assert [h["hidden"] for h in proj["by_hidden"]] == [3072, 8192]
    assert all(0 < h["selection_fraction"] < 1 and h["days"] > 0 for h in proj["by_hidden"])
    assert [v["accumulation"] for v in results["projection_variants"]] == [4, 1]
    assert len(results["goals"]) == 2 + 4 + 1
    table = out.with_suffix(".md").read_text()
    assert "| 4k | 1 | 4,000 |" in table and "| 4k | 2 | 2,000 |" in table
    assert "t_sel   = r * (4*D*H" in table and "## Goals" in table and "Timings are noisy" in table
    assert out.with_suffix(".png").stat().st_size > 0
    assert not any(work.glob("buffer_*")), "the buffers are deleted without --keep"
    # The table and plot come from the JSON alone: --render redoes them without benchmarking.
    out.with_suffix(".md").unlink()
    out.with_suffix(".png").unlink()
    assert load_script("bench_scale").main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text() == table and out.with_suffix(".png").stat().st_size > 5_000
