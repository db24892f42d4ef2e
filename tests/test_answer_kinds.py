"""Answers that fit the question (rlm.inference.answer_kinds): the kind a question asks for, the kind an answer
is, and the answer policy abstaining on a mismatch. Wordings and relations here are ones the toy world never
uses, and NQ-open's real questions hold the rules to real answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlm.inference.answer_kinds import AnswerKinds, answer_form, asked_kind
from rlm.inference.answer_policy import AnswerSignals, fit_answer_policy


@pytest.mark.parametrize(
    "question, kind",
    [
        ("In what year was Ada Lovelace born?", "year"),
        ("Which year did the bridge open?", "year"),
        ("When did she marry?", "date"),
        ("On what date was the treaty signed?", "date"),
        ("How many moons does Jupiter have?", "number"),
        ("How old was he when he died?", "number"),
        ("What is the population of Lyon?", "number"),
        ("Who painted the ceiling?", "person"),
        ("Whom did the committee appoint?", "person"),
        ("Which actor played the lead?", "person"),
        ("Which company makes the engine?", "organisation"),
        ("Where did the river flood?", "place"),
        ("In which country is the lake?", "place"),
        ("What is the birthplace of Marie Curie?", "place"),
        ("What does she do for a living?", None),
        ("What is the favourite colour of Tom?", None),
        # The question phrase that comes first decides, not a wh-word inside a title.
        ("who sang how long has this been going on", "person"),
        ("where was when we first met filmed", "place"),
    ],
)
def test_the_kind_a_question_asks_for_comes_from_its_question_phrase(question, kind):
    assert asked_kind(question) == kind


@pytest.mark.parametrize(
    "answer, form",
    [
        ("1987", "date"),
        ("March 3, 1990", "date"),
        ("the 1960s", "date"),
        ("the 19th century", "date"),
        ("spring", "date"),
        ("42", "number"),
        ("three", "number"),
        ("third season", "number"),
        ("June Gable", "words"),  # a month that is a name
        ("Ant & Dec", "words"),
        ("Kelora", "words"),
        ("carpenter", "words"),
    ],
)
def test_numbers_and_dates_show_in_the_answers_form_and_names_do_not(answer, form):
    assert answer_form(answer) == form


CITIES = ["Kelora", "Brimsvale", "Tarnow Reach", "Ostvik", "Lunefeld", "Carradine Bay", "Vossheim", "Peldra"]
JOBS = ["carpenter", "dentist", "pilot", "baker", "architect", "nurse", "sculptor", "librarian"]


def fitted_kinds() -> AnswerKinds:
    """Fitted as a toy world's dev questions would fit it: birthplaces and headquarters are places, jobs are
    asked with wordings that say no kind."""
    asked, answers = [], []
    for city, job in zip(CITIES, JOBS):
        asked += [asked_kind("Where was Mira Tolvaxen born?"), asked_kind("What is the occupation of Mira?")]
        answers += [[city], [job]]
    return AnswerKinds.fit(asked, answers)


def test_a_place_given_for_a_year_a_number_or_a_person_is_a_mismatch_and_said_so():
    kinds = fitted_kinds()
    assert set(kinds.classes) == {"place", "other"}
    for question in ("In what year was Ilsa Marrow born?", "How many children does Ilsa Marrow have?"):
        why = kinds.mismatch(asked_kind(question), "Kelora")
        assert why is not None and "'Kelora'" in why
    assert "a place" in kinds.mismatch("person", "Brimsvale")  # who is her spouse? a city
    assert "a place" in kinds.mismatch("date", "Ostvik")  # when did she marry? a city
    # The right kind, or a kind the model cannot tell, passes.
    assert kinds.mismatch("year", "1987") is None and kinds.mismatch("number", "three") is None
    assert kinds.mismatch("place", "Lunefeld") is None and kinds.mismatch(None, "Kelora") is None
    assert kinds.mismatch("person", "dentist") is None  # not a name the model knows as another kind
    assert kinds.mismatch("person", "1987") is not None  # a year for "who"
    # A world without fitted kinds knows numbers and dates only.
    assert AnswerKinds().mismatch("person", "Kelora") is None and AnswerKinds().match("year", "Kelora") == 0.0


def test_saved_kinds_give_the_same_probabilities():
    kinds = fitted_kinds()
    again = AnswerKinds(**json.loads(json.dumps(kinds.__dict__)))
    for answer in ("Kelora", "Vossheim", "sculptor", "Amsterdam"):
        assert again.probabilities(answer) == pytest.approx(kinds.probabilities(answer), abs=1e-4)


def signals_of(question: str, answer: str, probability: float, support_passage: str) -> AnswerSignals:
    return AnswerSignals.of(answer, probability, [0.8, 0.6], [support_passage, "Other text."], question)


@pytest.mark.learning
def test_the_policy_abstains_on_an_answer_of_the_wrong_kind_and_keeps_the_right_ones():
    """A reader that answers 'In what year was X born?' with X's birthplace, confidently and from X's own
    passage: nothing but the kind says it is wrong."""
    rng = np.random.default_rng(0)
    signals, correct, answerable, gold = [], [], [], []
    people = [f"Person{i} Surname{i}" for i in range(60)]
    for i, name in enumerate(people):
        city, job = CITIES[i % len(CITIES)], JOBS[i % len(JOBS)]
        passage = f"{name} was born in {city} and works as a {job}."
        right = rng.random() < 0.9
        said = city if right else CITIES[(i + 1) % len(CITIES)]
        signals.append(signals_of(f"Where was {name} born?", said, 0.6 + 0.3 * rng.random(), passage))
        correct.append(bool(right))
        answerable.append(True)
        gold.append([city])
        signals.append(signals_of(f"What is the occupation of {name}?", job, 0.9, passage))
        correct.append(True)
        answerable.append(True)
        gold.append([job])
    for i, name in enumerate(people[:30]):  # generated unanswerable questions of the new shape
        passage = f"{name} was born in {CITIES[i % len(CITIES)]}."
        signals.append(signals_of(f"How many brothers does {name} have?", CITIES[i % 8], 0.85, passage))
        correct.append(False)
        answerable.append(False)
        gold.append([])
    policy = fit_answer_policy(signals, correct, answerable, gold_answers=gold)
    assert policy.features[-1] == "kind_match" and policy.answer_kinds.classes
    # Wordings the fit never saw: a year, a date and a spouse, each answered with the person's birthplace.
    name, city = "Ilsa Marrow", "Kelora"
    passage = f"{name} was born in {city} and works as a baker."
    for question in (
        f"In what year was {name} born?",
        f"When did {name} move?",
        f"Who is the spouse of {name}?",
    ):
        decision = policy.decide(signals_of(question, city, 0.95, passage))
        assert decision.abstained and "the question asks for" in decision.reason, (question, decision)
    for question, answer in (
        (f"Where was {name} born?", city),
        (f"What is the occupation of {name}?", "baker"),
    ):
        assert not policy.decide(signals_of(question, answer, 0.95, passage)).abstained, question
    assert policy.fitted_on["kept_correct"] >= 0.95


@pytest.mark.learning
def test_the_rules_pass_nq_opens_gold_answers(shared_data):
    """Real questions and their gold answers: the kind rules alone (no fitted names) call fewer than 1% of
    NQ-open's dev answers the wrong kind, and with names fitted on half the questions, fewer than 3% of the
    other half's (measured: 0.3% and 1.7%)."""
    rows = [json.loads(line) for line in (shared_data / "nq_open" / "NQ-open.dev.jsonl").open()]
    asked = [asked_kind(r["question"]) for r in rows]
    assert sum(k is not None for k in asked) > 0.7 * len(rows)

    def wrong_kind(kinds, part):
        flagged = [i for i in part if all(kinds.mismatch(asked[i], a) for a in rows[i]["answer"])]
        return len(flagged) / len(part)

    assert wrong_kind(AnswerKinds(), range(len(rows))) < 0.01
    half = len(rows) // 2
    kinds = AnswerKinds.fit(asked[:half], [r["answer"] for r in rows[:half]])
    assert {"person", "place"} <= set(kinds.classes)
    assert wrong_kind(kinds, range(half, len(rows))) < 0.03
