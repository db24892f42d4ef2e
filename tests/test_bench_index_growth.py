"""The index growth study (scripts/bench_index_growth.py) runs its quick mode through its main: each size's
tuned setting is recorded as a share of its lists, the runs of two invocations add up in one report, and the
21M projection is made from the fitted trend, with the figures it was fitted on."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("faiss")


def test_growth_study_records_each_sizes_share_and_projects_from_the_trend(tmp_path):
    script = load_script("bench_index_growth")
    out = tmp_path / "growth"
    factories = "IVF{nlist},SQ8"
    assert script.main(["--quick", "--sizes", "4000", "--factories", factories, "--out", str(out)]) == 0
    assert script.main(["--quick", "--sizes", "16000", "--factories", factories, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert [(r["n"], r["nlist"]) for r in rows] == [(4000, 4), (16000, 16)]
    for row in rows:
        assert row["parameter"] == "nprobe" and row["share"] == row["value"] / row["nlist"]
        assert 0 < row["share"] <= 1 and row["codes_per_query"] > 0 and row["p50_ms_1_core"] > 0
        assert row["tune_recall"] >= 0.995  # SQ8 does not cap it: the target is reached
    [projection] = report["projections"]
    assert projection["sizes"] == [4000, 16000] and projection["shares"] == [r["share"] for r in rows]
    assert projection["lists_at_target"] == 16384
    assert 1 <= projection["nprobe_at_target"] <= 16384
    assert projection["codes_at_target"] == pytest.approx(projection["nprobe_at_target"] / 16384 * 21_000_000)
    assert len(report["commands"]) == 2 and out.with_suffix(".png").is_file()
    markdown = out.with_suffix(".md").read_text()
    assert "Assumption: the share of lists" in markdown and "IVF16,SQ8" in markdown
    # Measuring the same size again replaces its row instead of adding a second one.
    assert script.main(["--quick", "--sizes", "4000", "--factories", factories, "--out", str(out)]) == 0
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 2
