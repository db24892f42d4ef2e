"""scripts/compare_predictions.py: flips between two evaluation runs, split by whether the reader's input changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

compare_predictions = load_script("compare_predictions")


def write(path: Path, rows: list[tuple[str, list[str], str, float]]) -> Path:
    with open(path, "w") as fh:
        for qid, ids, prediction, em in rows:
            row = {"id": qid, "question": f"q {qid}?", "answers": ["x"], "prediction": prediction}
            row["gold_passage_ids"] = ["p1", "p3"]
            fh.write(json.dumps({**row, "exact_match": em, "retrieved_ids": ids}) + "\n")
    return path


def test_counts_flips_and_order_invariance(tmp_path, capsys):
    a = write(
        tmp_path / "a.jsonl",
        [("1", ["p1", "p2", "p9"], "x", 1.0), ("2", ["p3", "p4"], "x", 1.0), ("3", ["p5", "p6"], "y", 0.0)],
    )
    b = write(
        tmp_path / "b.jsonl",
        [("1", ["p2", "p1", "p8"], "x", 1.0), ("2", ["p3", "p7"], "z", 0.0), ("3", ["p5", "p6"], "y", 0.0)],
    )
    report = compare_predictions.compare(compare_predictions.load(a), compare_predictions.load(b), k=2)
    assert report["questions"] == 3 and report["em_a"] == pytest.approx(2 / 3)
    assert report["same_topk_set"] == 2 and report["same_set_reordered"] == 1  # q1 (top-2 swapped), q3
    assert report["same_set_answer_changed"] == 0
    assert report["right_to_wrong"] == 1 and report["right_to_wrong_topk_changed"] == 1  # q2
    assert report["wrong_to_right"] == 0
    assert report["em_gold_first_a"] == (1.0, 2) and report["em_gold_first_b"] == (0.0, 1)  # B: q2 only
    assert compare_predictions.main([str(a), str(b), "--k", "2", "--examples", "1"]) == 0
    assert "q 2?" in capsys.readouterr().out


def test_malformed_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1"}\nnot json\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not valid JSON"):
        compare_predictions.load(bad)
