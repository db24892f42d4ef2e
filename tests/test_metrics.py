import json

import pytest

from rlm.inference.metrics import (
    evaluate_module_path,
    exact_match,
    f1_score,
    gold_recall_at_k,
    has_answer,
    normalize_answer,
    qa_scores,
    recall_at_k,
)


def test_normalize_answer_follows_squad():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words


def test_exact_match_is_max_over_golds():
    assert exact_match("Paris", ["London", "paris."]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("the Beatles", "Beatles") == 1.0


def test_f1_partial_overlap():
    assert f1_score("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert f1_score("Berlin", ["Paris", "Berlin Germany"]) == pytest.approx(2 / 3)
    assert f1_score("", ["Paris"]) == 0.0


def test_has_answer_matches_whole_tokens_only():
    assert has_answer("He was born in Paris, France in 1900.", ["paris"])
    assert not has_answer("A Parisian cafe.", ["Paris"])
    assert has_answer("The city of Zürich.", ["Zurich"])
    assert has_answer("born on 14 December 1972 UTC", ["December 1972"])
    assert not has_answer("anything", [""])


def test_recall_at_k_counts_first_answer_bearing_rank():
    texts = [["no", "Paris here", "x"], ["Berlin", "y", "z"], ["a", "b", "c"]]
    answers = [["Paris"], ["Berlin"], ["Rome"]]
    assert recall_at_k(texts, answers, ks=(1, 2, 3)) == {
        "recall@1": pytest.approx(1 / 3),
        "recall@2": pytest.approx(2 / 3),
        "recall@3": pytest.approx(2 / 3),
    }
    with pytest.raises(ValueError, match="2 retrieval lists but 3"):
        recall_at_k(texts[:2], answers)


def test_gold_recall_skips_questions_without_gold():
    out = gold_recall_at_k([["a", "b"], ["c", "d"], ["e"]], [["b"], [], ["x"]], ks=(1, 2))
    assert out == {"gold_recall@1": 0.0, "gold_recall@2": 0.5}
    assert gold_recall_at_k([["a"]], [[]]) == {}


def test_exact_match_on_real_nq_open_answers(shared_data):
    rows = [
        json.loads(line) for line in (shared_data / "nq_open" / "NQ-open.dev.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3610
    # A gold answer with different case, an article and punctuation is still an exact match ...
    assert all(exact_match(f"The {r['answer'][0].upper()}.", r["answer"]) == 1.0 for r in rows)
    # ... and a neighbour question's answer almost never is.
    wrong = [exact_match(rows[i - 1]["answer"][0], rows[i]["answer"]) for i in range(1, len(rows))]
    assert sum(wrong) / len(wrong) < 0.02
    scores = qa_scores([r["answer"][-1] for r in rows], [r["answer"] for r in rows])
    assert scores == {"exact_match": 1.0, "f1": 1.0}


def test_local_evaluate_module_loads_offline():
    import evaluate

    metric = evaluate.load(evaluate_module_path())
    out = metric.compute(predictions=["Paris", "the cat"], references=[["paris", "Paris, France"], ["a dog"]])
    assert out["exact_match"] == pytest.approx(0.5)
    assert out["f1"] == pytest.approx(0.5)
