"""The index study (scripts/bench/bench_index.py) runs its quick mode end to end through its main and reports figures
that make sense: exact search agrees with itself, every compressed index is smaller than Flat, `tune` reaches
its target or says why not, and each factory is projected to 21M passages."""

from __future__ import annotations

import json
import sys

import pytest
from script_loader import load_script

pytest.importorskip("faiss")


def test_quick_index_study_reports_each_factory_with_sane_figures(tmp_path, monkeypatch):
    out = tmp_path / "bench_index"
    scratch = tmp_path / "not" / "made yet"  # the script makes the folder it is given for its indexes
    monkeypatch.setattr(
        sys, "argv", ["bench_index.py", "--quick", "--out", str(out), "--scratch", str(scratch)]
    )
    script = load_script("bench_index")
    assert script.main() == 0

    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["factory"]: row for row in report["rows"]}
    assert list(rows) == ["Flat", "IVF16,SQ8", "IVF16,PQ32x4np", "IVF16,PQ32x4np+rescore5", "HNSW32,SQ8"]
    flat = rows.pop("Flat")
    assert flat["recall_at_1"] == flat["recall_at_20"] == flat["recall_at_100"] == 1.0
    assert flat["gold_recall_at_20"] == report["settings"]["flat_gold_recall_at_20"] > 0.5
    assert 3072 <= flat["bytes_per_passage"] < 3072 * 1.01  # 768 float32 per passage and a header
    for name, row in rows.items():
        assert row["bytes_per_passage"] < flat["bytes_per_passage"], name
        assert 0.0 <= row["recall_at_1"] <= 1.0 and 0.0 <= row["recall_at_100"] <= 1.0, name
        assert row["p50_ms"] > 0 and row["p95_ms"] >= row["p50_ms"], name
        assert row["projection"]["ram_gb"] > 0, name
    # The same codes re-scored exactly from the float16 rows: the index is no larger, its rows are counted on
    # disk, and it finds most of what the codes alone miss.
    rescored, bare = rows["IVF16,PQ32x4np+rescore5"], rows["IVF16,PQ32x4np"]
    assert rescored["bytes_per_passage"] == bare["bytes_per_passage"] and rescored["rescore_k_factor"] == 5
    assert rescored["projection"]["rows_on_disk_gb"] == 21_000_000 * 768 * 2 / 1e9
    assert rescored["recall_at_20"] > bare["recall_at_20"] + 0.3
    # Tuned at the default target on indexed rows made question-like: reached by SQ8 codes; 4-bit PQ codes cap
    # recall far below it, so tune stops where probing more lists gains nothing (not at every list) and the
    # held-out sweep finds no setting within a point of Flat.
    for name in ("IVF16,SQ8", "HNSW32,SQ8"):
        assert rows[name]["tuned"]["recall"] >= rows[name]["tuned"]["target_recall"] == 0.995
        # ... which is the goal's recall where the codes allow it: at the setting chosen, the held-out
        # questions' gold recall@20 is within a point of Flat's (tuned for 95% of exact search's top 100
        # instead, SQ8 stopped at nprobe 2 and lost 4.0 points, HNSW-SQ8 at efSearch 1024 and lost 1.5).
        assert flat["gold_recall_at_20"] - rows[name]["gold_recall_at_20"] <= 0.01, name
    capped = rows["IVF16,PQ32x4np"]
    assert capped["tuned"]["recall"] < 0.995 and capped["tuned"]["value"] < capped["nlist"] == 16
    assert capped["sweep"]["goal"] is None and capped["projection"]["meets_recall"] is False
    met = rows["IVF16,SQ8"]["sweep"]["goal"]
    assert met is not None and flat["gold_recall_at_20"] - met["gold_recall_at_20"] <= 0.01
    assert rows["IVF16,SQ8"]["projection"]["factory"] == "IVF16384,SQ8"

    markdown = out.with_suffix(".md").read_text()
    assert "## Projected to 21M passages" in markdown and "| IVF16384,SQ8 |" in markdown
    out.with_suffix(".md").unlink()
    assert (
        script.main(["--render", str(out.with_suffix(".json"))]) == 0
    )  # the report again, measuring nothing
    assert out.with_suffix(".md").read_text() == markdown
