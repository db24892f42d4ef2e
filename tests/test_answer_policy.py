"""Calibrated confidence and abstention (rlm.inference.answer_policy) and every surface that applies it: QAService, the
demo's page and API, and `rlm evaluate`."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from local_port import free_port

from rlm.errors import UserError
from rlm.inference.answer_policy import (
    POLICY_FILE,
    AnswerPolicy,
    AnswerSignals,
    QuestionWords,
    auroc,
    expected_calibration_error,
    fit_answer_policy,
    reliability_bins,
)

pytestmark = pytest.mark.learning  # trains or fits, then asserts what it learned (make test-kernels)

OUT_OF_CORPUS = "What is the capital of France?"


def synthetic_reader(n: int, seed: int) -> tuple[list[AnswerSignals], np.ndarray]:
    """Answers of a reader whose true accuracy is known: log-odds of being right = 1.5 x the log-odds of its
    probability p - 1.5 + 10 x (best retrieval score - 0.55), so it is overconfident, as small readers are."""
    rng = np.random.default_rng(seed)
    prob = rng.uniform(0.02, 0.995, n)
    top = rng.normal(0.55, 0.08, n)
    truth = 1 / (1 + np.exp(-(1.5 * np.log(prob / (1 - prob)) - 1.5 + 10 * (top - 0.55))))
    correct = rng.random(n) < truth
    second = top - rng.uniform(0.0, 0.1, n)
    signals = [
        AnswerSignals(float(p), [float(t), float(s)], bool(rng.random() < 0.5))
        for p, t, s in zip(prob, top, second)
    ]
    return signals, correct


def test_confidence_of_a_reader_with_known_accuracy_comes_out_calibrated():
    train, train_correct = synthetic_reader(4000, seed=0)
    held_out, correct = synthetic_reader(4000, seed=1)
    policy = fit_answer_policy(train, train_correct, [True] * len(train))
    calibrated = np.array([policy.confidence(s) for s in held_out])
    raw = np.array([s.reader_probability for s in held_out])
    # The reader's own probability overstates its accuracy; the fitted confidence means what it says.
    assert expected_calibration_error(raw, correct) > 0.1
    assert expected_calibration_error(calibrated, correct) < 0.03
    assert auroc(calibrated, correct) > 0.75
    bins = reliability_bins(calibrated, correct)
    assert sum(b["count"] for b in bins) == len(held_out)
    for b in bins:
        if b["count"] >= 200:
            assert abs(b["accuracy"] - b["confidence"]) < 0.06


def test_threshold_keeps_the_asked_share_of_correct_answers_and_abstains_below_it():
    signals, correct = synthetic_reader(2000, seed=2)
    policy = fit_answer_policy(signals, correct, [True] * len(signals), keep=0.9)
    kept = [not policy.decide(s).abstained for s, c in zip(signals, correct) if c]
    assert 0.9 <= np.mean(kept) <= 0.91  # the cut at 1% of best scores drops some; the threshold makes up
    assert policy.fitted_on["kept_correct"] == pytest.approx(np.mean(kept))
    unsure = min(signals, key=policy.confidence)
    decision = policy.decide(unsure)
    assert decision.abstained and "do not support an answer" in decision.reason
    assert decision.confidence < policy.threshold


def test_a_question_scoring_far_below_the_answerable_ones_is_out_of_corpus():
    signals, correct = synthetic_reader(500, seed=3)
    policy = fit_answer_policy(signals, correct, [True] * len(signals))
    # Four standard deviations under the median of N(0.55, 0.08) scores: about 0.23, below all 500 of them.
    assert policy.min_top_score == pytest.approx(0.55 - 4 * 0.08, abs=0.04)
    assert policy.min_top_score < min(s.scores[0] for s in signals)
    far = AnswerSignals(0.99, [policy.min_top_score - 0.2, policy.min_top_score - 0.3], True)
    decision = policy.decide(far)
    assert decision.abstained and decision.reason.startswith("the corpus has nothing on this question")


def person_questions(n: int, seed: int):
    """Questions of one template about n invented people, each answered (reader probability 0.95, the answer
    in the best passage, the same retrieval scores) from a passage that names the person asked (right) or from
    another person's passage of the same relation (wrong): only question support tells them apart, as for the
    hard unanswerable case."""
    rng = np.random.default_rng(seed)
    signals, correct = [], []
    for i in range(n):
        name, other = f"Pel{i}a Dor{seed}x{i}", f"Qua{i}o Vem{seed}y{i}"
        right = bool(rng.random() < 0.5)
        passage = f"{name if right else other} works as a chemist."
        question = f"What is the occupation of {name}?"
        signals.append(
            AnswerSignals.of("chemist", 0.95, [0.7, 0.6], [passage, "Fofield is a city."], question)
        )
        correct.append(right)
    return signals, np.array(correct)


def test_question_support_weights_the_words_that_name_who_is_asked():
    asked = [
        AnswerSignals.of("x", 0.5, [0.5], [], f"What is the occupation of Ann{i} Lee{i}?") for i in range(9)
    ]
    weights = QuestionWords.fit([s.question for s in asked])
    q = asked[0].question
    # The template's words are in every fit question and weigh little; the name is rare and weighs most.
    assert weights.weight("occupation") < 0.1 < weights.weight("ann0") == weights.weight("never_seen")
    about_her = weights.support(
        q, AnswerSignals.of("chemist", 0.9, [0.5], ["Ann0 Lee0 works as a chemist."], "").answer_passages[0]
    )
    about_other = weights.support(
        q, frozenset({"bob", "ray", "works", "as", "a", "chemist", "the", "occupation"})
    )
    assert about_her > 0.9 and about_other < 0.1
    # The answer's passage is the one the support is measured on, not the best-ranked one.
    read = ["Fofield is a city.", "Ann0 Lee0 is a chemist."]
    signals = AnswerSignals.of("chemist", 0.9, [0.7, 0.6], read, "What is the occupation of Ann0 Lee0?")
    assert not signals.answer_in_top
    assert signals.answer_passages == (frozenset({"ann0", "lee0", "is", "a", "chemist"}),)
    assert signals.vector(weights)[-1] > 0.9


def test_the_policy_tells_an_answer_about_the_person_asked_from_one_about_another():
    signals, correct = person_questions(300, seed=0)
    policy = fit_answer_policy(signals, correct, [True] * len(signals))
    held_out, truth = person_questions(300, seed=1)  # other people: their names were never fitted
    confidence = np.array([policy.confidence(s) for s in held_out])
    assert auroc(confidence, truth) == 1.0
    answered = np.array([not policy.decide(s).abstained for s in held_out])
    assert answered[truth].mean() >= 0.95 and not answered[~truth].any()


def test_policy_round_trips_through_the_checkpoint_and_bad_files_are_refused(tmp_path):
    signals, correct = synthetic_reader(300, seed=4)
    policy = fit_answer_policy(signals, correct, [True] * len(signals), fitted_on={"source": "synthetic"})
    assert AnswerPolicy.load(tmp_path) is None
    policy.save(tmp_path)
    loaded = AnswerPolicy.load(tmp_path)
    assert loaded == policy and loaded.fitted_on["source"] == "synthetic"
    assert all(math.isclose(loaded.confidence(s), policy.confidence(s)) for s in signals[:20])
    (tmp_path / POLICY_FILE).write_text("{not json")
    with pytest.raises(UserError, match=f"{POLICY_FILE}:1: not valid JSON"):
        AnswerPolicy.load(tmp_path)
    (tmp_path / POLICY_FILE).write_text(json.dumps({"format_version": 1, "features": ["other"]}))
    with pytest.raises(UserError, match="other answer signals"):
        AnswerPolicy.load(tmp_path)


def test_fitting_needs_right_and_wrong_answers():
    signals, _ = synthetic_reader(50, seed=5)
    with pytest.raises(UserError, match="both right and wrong answers"):
        fit_answer_policy(signals, [False] * 50, [True] * 50)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tiny_quickstart):
    """(checkpoint folder, toy world folder): a copy of the tiny quickstart's checkpoint with an answer policy
    fitted on its real answer signals (dev questions and dev_unanswerable). The tiny reader answers no dev
    question right, so the labels are stand-ins (every other answerable question counts as right): what these
    tests check is that each surface applies the saved policy, not how good the tiny reader is."""
    from rlm.app.service import QAService
    from rlm.commands.calibrate import fit_questions

    run = tiny_quickstart
    final = tmp_path_factory.mktemp("calibrated") / "final"
    shutil.copytree(run / "final", final)
    examples, extra, _ = fit_questions(final, "toy", "dev", str(run / "toy_world"), "auto", 40)
    service = QAService.from_checkpoint(final)
    assert service.policy is None  # the quickstart fitted none: no dev answer was right
    signals = [sig for _, sig in service.answer_with_signals([q.question for q in [*examples, *extra]])]
    stand_in = [i < len(examples) and i % 2 == 0 for i in range(len(signals))]
    answerable = [i < len(examples) for i in range(len(signals))]
    fit_answer_policy(signals, stand_in, answerable, fitted_on={"source": "stand-in labels"}).save(final)
    return final, run / "toy_world"


def test_service_loads_the_policy_and_abstains_on_an_out_of_corpus_question(calibrated):
    from rlm.app.demo import respond
    from rlm.app.service import QAService

    final, _ = calibrated
    service = QAService.from_checkpoint(final)
    assert service.policy == AnswerPolicy.load(final)
    result = service.answer(OUT_OF_CORPUS, best_guess=True)
    assert result["abstained"] is True and result["calibrated"] is True
    assert result["answer"] == "" and "best_guess" in result  # the guess is there for a caller who asks
    assert result["reason"].startswith("the corpus has nothing on this question")
    assert not any(p["has_answer"] for p in result["passages"])
    # The page shows an abstention as such: no answer, the reason where the confidence would be.
    answer, status, _, shown = respond(service, OUT_OF_CORPUS, 3)
    assert answer == "" and status.startswith("🚫 No answer: the corpus has nothing") and shown["abstained"]
    # A question the corpus answers still gets an answer (the tiny policy keeps most dev questions).
    kept = [service.answer(q) for q in service.examples]
    assert any(not r["abstained"] for r in kept)


def test_rlm_evaluate_records_confidence_and_abstention_per_prediction(calibrated, tmp_path):
    from rlm.cli import main

    final, world = calibrated
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question": OUT_OF_CORPUS, "answers": ["Paris"]})
        + "\n"
        + json.dumps({"question": "How many legs does a spider have?", "answers": ["eight"]})
        + "\n"
    )
    out = tmp_path / "eval"
    argv = ["evaluate", "--checkpoint", str(final), "--dataset", "jsonl", "--data-path", str(questions)]
    assert main([*argv, "--corpus", str(world / "corpus.jsonl"), "--k", "4", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert all(r["abstained"] and r["reason"] and 0 <= r["confidence"] <= 1 for r in records)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["coverage"] == 0.0 and "answered_exact_match" not in metrics
    # On dev the policy answers, and EM at full coverage is reported beside EM on the answered questions.
    dev_out = tmp_path / "dev"
    argv = ["evaluate", "--checkpoint", str(final), "--dataset", "toy", "--data-path", str(world)]
    assert main([*argv, "--split", "dev", "--max-examples", "20", "--k", "4", "--out", str(dev_out)]) == 0
    dev = json.loads((dev_out / "metrics.json").read_text())
    assert 0 < dev["coverage"] <= 1 and "answered_exact_match" in dev and "exact_match" in dev
    # --no-policy answers everything with the reader's own probability.
    raw = tmp_path / "raw"
    assert main([*argv, "--split", "dev", "--max-examples", "5", "--no-policy", "--out", str(raw)]) == 0
    rows = [json.loads(line) for line in (raw / "predictions.jsonl").read_text().splitlines()]
    assert all(not r["abstained"] and r["confidence"] == r["reader_probability"] for r in rows)


def test_unanswerable_toy_questions_are_deterministic_and_ask_nothing_the_corpus_states(calibrated):
    from rlm.data.qa import load_qa_dataset, read_qa_jsonl
    from rlm.data.unanswerable import unanswerable_path, write_unanswerable_questions

    _, world = calibrated
    dev = load_qa_dataset("toy", "dev_unanswerable", str(world))
    test = load_qa_dataset("toy", "test_unanswerable", str(world))
    assert {q.meta["type"] for q in dev} == {"unstated_fact", "unknown_entity"}
    assert all(q.answers == [] and q.meta["answerable"] is False for q in dev + test)
    # dev and test ask unstated facts with disjoint wordings; unknown entities carry names no passage has.
    stem = lambda q: q.question.split(q.meta["subject"])[0]  # noqa: E731
    unstated = lambda qs: {stem(q) for q in qs if q.meta["type"] == "unstated_fact"}  # noqa: E731
    assert unstated(dev) and not unstated(dev) & unstated(test)
    titles = {json.loads(line)["title"] for line in (world / "corpus.jsonl").read_text().splitlines()}
    assert not {q.meta["subject"] for q in dev + test if q.meta["type"] == "unknown_entity"} & titles
    before = unanswerable_path(world, "dev").read_bytes()
    write_unanswerable_questions(world, "dev", read_qa_jsonl(f"{world}/dev.jsonl"), overwrite=True)
    assert unanswerable_path(world, "dev").read_bytes() == before


@pytest.mark.slow
def test_demo_api_outputs_have_names_and_an_out_of_corpus_question_abstains(calibrated):
    from gradio_client import Client

    from rlm.app.demo import serve
    from rlm.app.service import QAService

    final, _ = calibrated
    port = free_port()
    demo, url = serve(QAService.from_checkpoint(final), port=port, blocked=[final])
    try:
        client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
        info = client.view_api(return_format="dict", print_info=False)
        returns = info["named_endpoints"]["/answer"]["returns"]
        assert [r["label"] for r in returns] == ["Answer", "status", "passages", "result"]
        answer, status, _, result = client.predict(OUT_OF_CORPUS, 3, api_name="/answer")
        assert answer == "" and status.startswith("🚫 No answer")
        assert result["abstained"] is True and result["reason"] and "best_guess" in result
        assert set(result) >= {"answer", "confidence", "abstained", "reason", "passages"}
    finally:
        demo.close()
