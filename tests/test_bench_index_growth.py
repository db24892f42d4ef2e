"""The index growth study (scripts/bench/bench_index_growth.py) runs its quick mode through its main: each size's
tuned setting is recorded as a share of its lists, the runs of two invocations add up in one report, and the
21M projection is made from the fitted trend, with the figures it was fitted on."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("faiss")


def test_growth_study_records_each_sizes_setting_and_projects_from_the_trend(tmp_path):
    script = load_script("bench_index_growth")
    out = tmp_path / "growth"
    factories = "IVF{nlist},SQ8;HNSW32,SQ8;IVF{nlist4},SQ8"
    assert script.main(["--quick", "--sizes", "4000", "--factories", factories, "--out", str(out)]) == 0
    assert script.main(["--quick", "--sizes", "16000", "--factories", factories, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["factory_template"], r["n"]): r for r in report["rows"]}
    assert [rows["IVF{nlist},SQ8", n]["nlist"] for n in (4000, 16000)] == [4, 16]
    assert [rows["IVF{nlist4},SQ8", n]["nlist"] for n in (4000, 16000)] == [16, 64]
    for (template, _), row in rows.items():
        assert row["codes_per_query"] > 0 and row["p50_ms_1_core"] > 0, template
        if template.startswith("IVF"):
            assert row["parameter"] == "nprobe" and row["share"] == row["value"] / row["nlist"]
            assert row["tune_recall"] >= 0.995  # SQ8 does not cap it: the target is reached
        else:
            assert row["parameter"] == "efSearch" and row["share"] is None
    projections = {p["factory"]: p for p in report["projections"]}
    ivf = projections["IVF{nlist},SQ8"]
    assert ivf["sizes"] == [4000, 16000]
    assert ivf["measured"] == [f"{rows['IVF{nlist},SQ8', n]['share']:.3f}" for n in (4000, 16000)]
    nprobe = int(ivf["setting_at_target"].split("=")[1].split(" of ")[0].replace(",", ""))
    assert ivf["setting_at_target"].endswith("of 16,384") and 1 <= nprobe <= 16384
    assert ivf["codes_at_target"] == pytest.approx(nprobe / 16384 * 21_000_000)
    assert projections["IVF{nlist4},SQ8"]["setting_at_target"].endswith("of 65,536")
    assert projections["HNSW32,SQ8"]["setting_at_target"].startswith("efSearch=")
    assert len(report["commands"]) == 2 and out.with_suffix(".png").is_file()
    markdown = out.with_suffix(".md").read_text()
    assert "Assumption: what the tuning keeps follows" in markdown and "IVF16,SQ8" in markdown
    # Measuring the same size again replaces its rows instead of adding more.
    assert script.main(["--quick", "--sizes", "4000", "--factories", factories, "--out", str(out)]) == 0
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 6
