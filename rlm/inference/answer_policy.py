"""When to answer, and how sure to be: a calibrated confidence and an abstention rule kept with a checkpoint.

The reader's sequence probability is not the probability that its answer is right (on the quickstart it
separated right from wrong dev answers with an AUROC of 0.65), and a reader trained only on answerable
questions answers everything. So what the system knows when it answers, its `AnswerSignals`, is turned into
P(correct) by a small logistic regression fitted on questions the run owns (its dev split, plus generated
questions the corpus does not answer), never on the split it reports on:

* `reader_logit`: the log-odds of the reader's probability of the answer it generated (Platt scaling's input);
* `top_score` and `score_margin`: the best retrieval score and its lead over the second (a question about
  nothing in the corpus scores low against every passage);
* `answer_in_top`: whether the answer occurs in the best passage (a copied answer is not invented);
* `question_support`: how much of the question the passage holding the answer repeats, its words weighted by
  their rarity among the fit questions (a passage about the person asked names them; the hard unanswerable
  case, a fact the corpus never states about a person it knows, is answered from another person's passage of
  the same relation). On the quickstart's seed 2 it raised the test AUROC of correct vs wrong from 0.967 to
  0.996 (benchmark `scripts/bench/answer_quality.py`);
* `kind_match`: the probability that the answer is of the kind the question asks for (a year, a number, a
  person, a place: `rlm.inference.answer_kinds`). Asked in what year a person was born, a reader that only
  knows birthplaces answers one, from the person's own passage, and nothing above looks wrong.

The policy abstains when P(correct) is below a threshold chosen on the same questions (on out-of-fold
confidences: each from a fit that did not see the question) so that `keep` (98%) of their correct answers are
kept, when the best retrieval score is far below the answerable questions' (four robust standard
deviations under their median: the question matches nothing in the corpus), or when the answer is surely not
of the kind the question asks for (a place for "in what year"). It is saved as `answer_policy.json` in the
checkpoint folder, so `QAService` (and through it the demo and its API) and `rlm evaluate` all apply the same
rule; `rlm calibrate` fits it.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from rlm.base.atomicio import atomic_write_json
from rlm.errors import UserError, read_json_file
from rlm.inference.answer_kinds import AnswerKinds, asked_kind
from rlm.inference.metrics import has_answer

POLICY_FILE = "answer_policy.json"
FEATURES = ("reader_logit", "top_score", "score_margin", "answer_in_top", "question_support", "kind_match")
# The out-of-corpus cut: this many robust standard deviations (1.4826 x the median absolute deviation) below
# the answerable fit questions' median best retrieval score. A low quantile of a hundred or so scores is an
# estimate of their tail too noisy for a hard rule (at the 1% quantile, 3 of seed 2's 53 correct held-out
# answers fell below it); questions from outside the world score far lower (NQ-open's: 95% below 0.33 on the
# quickstart, answerable ones about 0.68), and the fitted confidence catches what the cut lets through.
SCORE_CUT_SPREADS = 4.0
# The share of the fit's correct answers the threshold keeps. Above the 95% a user wants kept: on new questions
# the share is lower (the quickstart's 55 held-out test questions kept 96.3-100% over three seeds at this
# setting, 81-91% at 0.95), and the unanswerable questions leave room (88-100% of them still abstained).
DEFAULT_KEEP = 0.98
# Words a question type repeats (what, the, occupation) say nothing about whom it asks: a word in fewer than this
# many fit questions is weighted as a rare one (names), and only the more common ones are kept in the file.
COMMON_WORD_MIN_QUESTIONS = 2
FORMAT_VERSION = 3


def words(text: str) -> frozenset[str]:
    """The lower-cased word set of a text (what question support compares)."""
    return frozenset(re.findall(r"\w+", text.lower()))


@dataclass
class QuestionWords:
    """Each word's weight in a question: log((n + 1) / (df + 1)), df the number of the n fit questions that
    contain it (a word in fewer than `COMMON_WORD_MIN_QUESTIONS` of them counts as in one)."""

    questions: int
    frequency: dict[str, int]

    @classmethod
    def fit(cls, questions: Sequence[frozenset[str]]) -> QuestionWords:
        counts = Counter(w for q in questions for w in q)
        common = {w: c for w, c in sorted(counts.items()) if c >= COMMON_WORD_MIN_QUESTIONS}
        return cls(len(questions), common)

    def weight(self, word: str) -> float:
        return math.log((self.questions + 1) / (self.frequency.get(word, 1) + 1))

    def support(self, question: frozenset[str], passage: frozenset[str]) -> float:
        """The weighted share of the question's words that the passage also has."""
        total = sum(self.weight(w) for w in question)
        return sum(self.weight(w) for w in question & passage) / total if total > 0 else 0.0


@dataclass
class AnswerSignals:
    """What is known about one answer when it is given."""

    reader_probability: float
    scores: Sequence[float]  # retrieval scores of the passages read, best first
    answer_in_top: bool
    question: frozenset[str] = frozenset()  # the question's words
    answer_passages: tuple[frozenset[str], ...] = ()  # the words of each passage read that holds the answer
    answer: str = ""
    asked: str | None = None  # the kind of answer the question asks for (`answer_kinds.asked_kind`)

    @classmethod
    def of(
        cls,
        answer: str,
        reader_probability: float,
        scores: Sequence[float],
        texts: Sequence[str],
        question: str = "",
    ):
        """The signals of `answer` to `question`, read with probability `reader_probability` from passages
        `texts` scored `scores` (both best first; empty: nothing was read)."""
        holding = [t for t in texts if answer.strip() and has_answer(t, answer)]
        found = bool(answer.strip()) and bool(texts) and has_answer(texts[0], answer)
        return cls(
            float(reader_probability),
            [float(s) for s in scores],
            found,
            words(question),
            tuple(words(t) for t in holding),
            answer,
            asked_kind(question),
        )

    def vector(self, question_words: QuestionWords, kinds: AnswerKinds | None = None) -> list[float]:
        """The features in `FEATURES` order (`kinds`: what tells a name's kind; none known without it)."""
        top = self.scores[0] if len(self.scores) else 0.0
        second = self.scores[1] if len(self.scores) > 1 else top
        p = min(max(self.reader_probability, 1e-6), 1 - 1e-6)
        support = max((question_words.support(self.question, w) for w in self.answer_passages), default=0.0)
        kind_match = (kinds or AnswerKinds()).match(self.asked, self.answer)
        return [math.log(p / (1 - p)), top, top - second, float(self.answer_in_top), support, kind_match]


@dataclass
class Decision:
    """The policy's verdict on one answer."""

    confidence: float  # P(the answer is correct)
    abstained: bool
    reason: str | None  # plain words, None when answered


@dataclass
class AnswerPolicy:
    """A logistic regression from `AnswerSignals` to P(correct), a threshold, and the out-of-corpus cut."""

    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float
    threshold: float
    min_top_score: float
    question_words: QuestionWords
    answer_kinds: AnswerKinds = field(default_factory=AnswerKinds)
    features: tuple[str, ...] = FEATURES
    fitted_on: dict = field(default_factory=dict)  # where and how it was fitted, and what it measured there

    def confidence(self, signals: AnswerSignals) -> float:
        """P(correct) of an answer with these signals."""
        vector = signals.vector(self.question_words, self.answer_kinds)
        x = (np.asarray(vector) - np.asarray(self.mean)) / np.asarray(self.scale)
        z = float(x @ np.asarray(self.coef) + self.intercept)
        return 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))

    def decide(self, signals: AnswerSignals) -> Decision:
        """Answer or abstain, with the confidence either way and a plain reason for an abstention."""
        confidence = self.confidence(signals)
        top = signals.scores[0] if len(signals.scores) else float("-inf")
        if top < self.min_top_score:
            reason = (
                f"the corpus has nothing on this question: its best passage scores {top:.2f}, below "
                f"{self.min_top_score:.2f}, far under what the questions the corpus answers score"
            )
            return Decision(confidence, True, reason)
        if mismatch := self.answer_kinds.mismatch(signals.asked, signals.answer):
            return Decision(confidence, True, f"{mismatch}, so it does not answer the question")
        if confidence < self.threshold:
            reason = (
                f"the passages read do not support an answer: its estimated chance of being right is "
                f"{100 * confidence:.0f}%, below the {100 * self.threshold:.0f}% this system answers from"
            )
            return Decision(confidence, True, reason)
        return Decision(confidence, False, None)

    def save(self, checkpoint: str | os.PathLike) -> Path:
        """Write `answer_policy.json` into the checkpoint folder (atomically); returns its path."""
        path = Path(checkpoint) / POLICY_FILE
        data = {"format_version": FORMAT_VERSION, **asdict(self), "features": list(self.features)}
        atomic_write_json(path, data, indent=2)
        return path

    @classmethod
    def load(cls, checkpoint: str | os.PathLike) -> AnswerPolicy | None:
        """The policy saved in the checkpoint folder; None when it has none (an uncalibrated checkpoint)."""
        path = Path(checkpoint) / POLICY_FILE
        if not path.is_file():
            return None
        data = read_json_file(path, "rerun `rlm calibrate`")
        if data.pop("format_version", None) != FORMAT_VERSION or tuple(data.get("features", ())) != FEATURES:
            raise UserError(
                f"{path} was written for other answer signals ({data.get('features')}); rerun `rlm calibrate`"
            )
        data["features"] = tuple(data["features"])
        try:
            data["question_words"] = QuestionWords(**data.get("question_words", {}))
            data["answer_kinds"] = AnswerKinds(**data.get("answer_kinds", {}))
            return cls(**data)
        except TypeError as err:
            raise UserError(f"{path}: {err}; rerun `rlm calibrate`") from None


def _standardization(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and spread; a constant feature keeps a spread of 1 (it is centred, not blown up)."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-8] = 1.0
    return mean, scale


def _keeping_threshold(conf: np.ndarray, y: np.ndarray, passes_cut: np.ndarray, keep: float) -> float:
    """The confidence threshold that answers `keep` of the correct answers (`y`), given the out-of-corpus
    cut (`passes_cut`: the questions it lets through)."""
    # The out-of-corpus cut already drops a few correct answers; of those that pass it, keep the most confident
    # ones, as many as make `keep` of all the correct answers (all that pass, when the cut alone drops more).
    passing = np.sort(conf[y & passes_cut])
    wanted = min(len(passing), math.ceil(keep * int(y.sum()) - 1e-9))
    return float(passing[len(passing) - wanted]) if wanted else 0.5


def _fit_report(
    policy: AnswerPolicy, signals, conf: np.ndarray, y: np.ndarray, able: np.ndarray, keep: float
) -> dict:
    """How the fitted `policy` does on its own fit questions (calibration on out-of-fold confidences)."""
    answered = np.asarray([not policy.decide(s).abstained for s in signals])
    return {
        "questions": int(len(y)),
        "answerable": int(able.sum()),
        "correct": int(y.sum()),
        "keep": keep,
        "kept_correct": float(answered[y].mean()),
        "abstained_unanswerable": float((~answered[~able]).mean()) if (~able).any() else None,
        "ece": expected_calibration_error(conf, y),  # both out of fold
        "auroc": auroc(conf, y),
    }


def fit_answer_policy(
    signals: Sequence[AnswerSignals],
    correct: Sequence[bool],
    answerable: Sequence[bool],
    keep: float = DEFAULT_KEEP,
    fitted_on: dict | None = None,
    gold_answers: Sequence[Sequence[str]] | None = None,
) -> AnswerPolicy:
    """Fit P(correct) on these answers and choose the threshold that keeps `keep` of the correct ones.

    `correct[i]`: the answer was right (always False for a question the corpus does not answer);
    `answerable[i]`: the corpus answers question i (the out-of-corpus cut is a low quantile of their best
    retrieval scores). Both classes must occur among `correct`. `gold_answers[i]`: question i's gold answers
    (empty for an unanswerable one), what tells the kinds of names apart (`AnswerKinds`); without them no
    name's kind is known.
    """
    from sklearn.linear_model import LogisticRegression

    if not 0.0 < keep <= 1.0:
        raise UserError(f"keep must be in (0, 1], got {keep}")
    question_words = QuestionWords.fit([s.question for s in signals])
    if gold_answers is not None and len(gold_answers) != len(signals):
        raise ValueError("gold_answers must have one entry per question")
    kinds = AnswerKinds.fit([s.asked for s in signals], gold_answers) if gold_answers else AnswerKinds()
    x = np.asarray([s.vector(question_words, kinds) for s in signals], dtype=np.float64)
    y = np.asarray(correct, dtype=bool)
    able = np.asarray(answerable, dtype=bool)
    if len(x) != len(y) or len(y) != len(able):
        raise ValueError("signals, correct and answerable must have one entry per question")
    if y.all() or not y.any():
        raise UserError(
            f"calibration needs both right and wrong answers; of {len(y)} questions {int(y.sum())} were "
            "answered correctly (use more or other questions)"
        )
    mean, scale = _standardization(x)
    model = LogisticRegression(C=1.0, max_iter=1000).fit((x - mean) / scale, y)
    # The threshold is chosen on confidences the model gave questions it was not fitted on: in-sample ones
    # are optimistic (a correct fit answer scores higher than a correct new one), so a threshold keeping 95%
    # of the fit's correct answers kept 83-93% of the held-out test's.
    conf = out_of_fold_confidence((x - mean) / scale, y)
    policy = AnswerPolicy(
        mean=mean.tolist(),
        scale=scale.tolist(),
        coef=model.coef_[0].tolist(),
        intercept=float(model.intercept_[0]),
        threshold=0.0,
        min_top_score=out_of_corpus_cut(x[able, 1]),
        question_words=question_words,
        answer_kinds=kinds,
    )
    policy.threshold = _keeping_threshold(conf, y, x[:, 1] >= policy.min_top_score, keep)
    policy.fitted_on = {**(fitted_on or {}), **_fit_report(policy, signals, conf, y, able, keep)}
    return policy


def out_of_corpus_cut(top_scores: np.ndarray) -> float:
    """The best-passage score below which a question is taken to be about nothing in the corpus, from the
    answerable fit questions' best scores (-inf without any)."""
    if not len(top_scores):
        return float("-inf")
    median = float(np.median(top_scores))
    spread = 1.4826 * float(np.median(np.abs(top_scores - median)))
    return median - SCORE_CUT_SPREADS * spread


def out_of_fold_confidence(x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Each question's P(correct) from a logistic regression fitted on the other folds (stratified k-fold;
    fewer folds when a class has fewer members, in-sample when a class has only one)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    model = LogisticRegression(C=1.0, max_iter=1000)
    folds = min(folds, int(y.sum()), int((~y).sum()))
    if folds < 2:
        return model.fit(x, y).predict_proba(x)[:, 1]
    split = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return cross_val_predict(model, x, y, cv=split, method="predict_proba")[:, 1]


def expected_calibration_error(confidence: Sequence[float], correct: Sequence[bool], bins: int = 10) -> float:
    """ECE: the mean |accuracy - confidence| over equal-width confidence bins, weighted by their counts."""
    conf = np.asarray(confidence, dtype=np.float64)
    hit = np.asarray(correct, dtype=np.float64)
    if not len(conf):
        return float("nan")
    which = np.minimum((conf * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.sum() * abs(hit[inside].mean() - conf[inside].mean())
    return float(total / len(conf))


def reliability_bins(confidence: Sequence[float], correct: Sequence[bool], bins: int = 10) -> list[dict]:
    """Per equal-width confidence bin: its range, count, mean confidence and accuracy (the diagram's data)."""
    conf = np.asarray(confidence, dtype=np.float64)
    hit = np.asarray(correct, dtype=np.float64)
    which = np.minimum((conf * bins).astype(int), bins - 1)
    out = []
    for b in range(bins):
        inside = which == b
        out.append(
            {
                "low": b / bins,
                "high": (b + 1) / bins,
                "count": int(inside.sum()),
                "confidence": float(conf[inside].mean()) if inside.any() else None,
                "accuracy": float(hit[inside].mean()) if inside.any() else None,
            }
        )
    return out


def auroc(confidence: Sequence[float], correct: Sequence[bool]) -> float | None:
    """Area under the ROC curve of confidence separating correct from wrong answers; None with one class."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(correct, dtype=bool)
    if y.all() or not y.any():
        return None
    return float(roc_auc_score(y, np.asarray(confidence, dtype=np.float64)))
