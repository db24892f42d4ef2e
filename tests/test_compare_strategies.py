"""scripts/bench/compare_strategies.py end to end on a tiny toy world: table, JSON, plots, and reuse of finished runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def script_args(tmp_path: Path, seeds: str, *extra: str) -> list[str]:
    args = ["--algorithm", "1", "--start", "random_gtr", "--strategies", "start,stale,corrector"]
    args += ["--seeds", seeds, "--steps", "2"]
    args += ["--num-passages", "150", "--batch-size", "4", "--k", "4", "--num-random", "4"]
    args += ["--set", "data.max_dev_examples=16", "--work", str(tmp_path / "work")]
    return [*args, "--out", str(tmp_path / "out" / "table"), *extra]


def run_script(tmp_path: Path, seeds: str, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        str(ROOT / "scripts" / "bench" / "compare_strategies.py"),
        *script_args(tmp_path, seeds, *extra),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_compare_writes_table_json_plots_and_reuses_finished_runs(tmp_path, capsys, fresh_accelerator_state):
    # The first call in this process (a process start is ~8 CPU-s), the second as users run the script.
    script = load_script("compare_strategies")
    script.main(script_args(tmp_path, "0"))
    report = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [r["strategy"] for r in report["runs"]] == ["start", "stale", "corrector"]
    assert all(0 <= r["dev_gold_recall@1"] <= r["dev_gold_recall@100"] <= 1 for r in report["runs"])
    start, stale, corrector = report["runs"]
    assert start["reembedded"] == 0 and start["seed"] is None and "drift" not in start
    assert corrector["kl_fresh_corrected"] is not None and stale["reembedded"] == 0
    assert 0 < report["dropout_floor"] < 2
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| corrector |" in table and "Dropout floor" in table
    for png in ("table.png", "table_drift.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5_000
    assert [len(r.get("drift_log", [])) > 0 for r in report["runs"]] == [False, True, True]

    # The table and plots come from the JSON alone: re-rendered without training, the markdown is the same.
    for name in ("table.md", "table.png", "table_drift.png"):
        (tmp_path / "out" / name).unlink()
    capsys.readouterr()
    script.main(["--render", str(tmp_path / "out" / "table.json")])
    assert (tmp_path / "out" / "table.md").read_text() == table and table.strip() in capsys.readouterr().out
    for png in ("table.png", "table_drift.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5_000

    # Adding a seed trains only the new runs (here two at once, --jobs 2); the finished ones are read back
    # unchanged, and the table keeps the strategies' order whichever run finishes first.
    second = run_script(tmp_path, "0,1", "--jobs", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [(r["strategy"], r["seed"]) for r in again["runs"]] == [
        ("start", None),  # the untrained retriever is evaluated once, whatever the seeds
        ("stale", 0),
        ("stale", 1),
        ("corrector", 0),
        ("corrector", 1),
    ]
    # Equal records, wall time included: read back, not retrained.
    assert again["runs"][1] == report["runs"][1] and again["runs"][3] == report["runs"][2]
    recall_keys = [k for k in start if k.startswith("dev_")]
    assert {k: again["runs"][0][k] for k in recall_keys} == {k: start[k] for k in recall_keys}
    table = (tmp_path / "out" / "table.md").read_text()
    assert "±" in table  # mean ± spread over the two seeds
    assert "| start |" in table


def test_multihop200_without_the_shared_data_names_the_option(tmp_path):
    args = [
        sys.executable,
        str(ROOT / "scripts" / "bench" / "compare_strategies.py"),
        "--data",
        "multihop200",
    ]
    args += ["--data-dir", str(tmp_path / "nowhere"), "--work", str(tmp_path / "work")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--data-dir" in done.stderr and "nowhere" in done.stderr
    assert not (tmp_path / "work").exists()
