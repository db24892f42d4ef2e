"""What kind of answer a question asks for, and whether an answer is of that kind.

A reader trained on a few relations answers an unfamiliar question with the kind of answer it knows: asked in
what year a person was born, the quickstart's reader gives the person's birthplace, and at high confidence (its
passage names the person, so nothing else looks wrong). Question answering systems have typed answers since
the TREC QA track (Li and Roth, *Learning Question Classifiers*, COLING 2002); this module does it in two parts:

* `asked_kind(question)`: the kind the wording asks for, from its question phrase: a `year`, a `date` (when),
  a `number` (how many, how old, the population of), a `person` (who), an `organisation` (which company), a
  `place` (where, which city), or None where the wording does not say (what does X do?).
* `AnswerKinds`: whether an answer is of that kind. Numbers, years and dates show in the answer's form (digits,
  month names, number words). A name does not: a person, a place and an organisation are all capitalised words,
  so which one a name is is fitted on the fit questions' gold answers, each labelled with the kind its question
  asks for (character n-grams of the answer, hashed, in a naive Bayes model: the same invented city names come
  back as answers, and real ones share their endings).

`AnswerKinds.match(asked, answer)` is the probability that the answer is of a kind the question accepts, a
signal of the answer policy (`rlm.inference.answer_policy`) fitted like the others, and `mismatch` says in
words when it is surely not (the policy abstains then).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

NUMERIC_KINDS = ("year", "date", "number")
NAMED_KINDS = ("person", "organisation", "place")
OTHER = "other"  # the label of a fit answer whose question does not say what it asks for
# The named kinds a question asking for each one accepts: "who" is answered by people and organisations alike
# (Who employs her? A company); "when" by none.
ACCEPTED = {
    "person": ("person", "organisation"),
    "organisation": ("organisation", "person"),
    "place": ("place",),
    "date": (),
}
# A named answer is surely of another kind when the fitted model gives the kinds the question accepts less
# than this probability together.
MISMATCH_BELOW = 0.05
HASHED_FEATURES = 2**11

_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
_NUMBER_WORDS = (
    "zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|"
    "seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand|"
    "million|billion|trillion|dozen|half|once|twice|several|none|first|second|third|fourth|fifth|sixth|seventh|"
    "eighth|ninth|tenth"
)
_TIME_NAMES = (
    "spring|summer|autumn|fall|winter|christmas|easter|today|yesterday|tomorrow|"
    "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
)
_NUMBER = re.compile(rf"\d|\b({_NUMBER_WORDS})\b", re.I)
# A date: a year, a month next to a number, a century or decade, or an answer that is only a month, a season
# or a day (a name like June Gable or Ant & Dec is not one).
_DATE = re.compile(
    rf"\b(1\d{{3}}|20\d{{2}})s?\b|\b({_MONTHS})\.? \d|\d(st|nd|rd|th)? ({_MONTHS})\b|\b(century|centuries|decade|"
    rf"bce?|a\.?d\.?)\b|^(early |late |mid-?)?({_MONTHS}|{_TIME_NAMES})$",
    re.I,
)
# (kind, pattern): the question phrase that starts earliest in the lower-cased question decides, the first
# listed on a tie (In which city was she born? asks for a place; who sang "How Long" asks for a person).
_ASKED = (
    ("year", r"\b(what|which|in what|in which) year\b|\byear (was|did|were|does|is|of)\b"),
    ("number", r"\bhow (many|much|old|long|far|tall|high|big|large|deep|often|fast|heavy)\b"),
    ("number", r"\b(what|which) (number|percentage|percent|age|amount|population|size|score)\b"),
    ("number", r"\bwhat is the (number|population|revenue|age|height|size|length|amount|price|cost) of\b"),
    ("date", r"\b(what|which|on what|on which) (date|day|month|century|decade|time)\b"),
    (
        "organisation",
        r"\b(which|what) (company|companies|organi[sz]ation|firm|employer|business|corporation|team|club|"
        r"university|school|college|band|party|newspaper|airline|bank|brand)\b",
    ),
    (
        "place",
        r"\b(which|what) (city|country|town|state|place|continent|region|village|county|province|island|"
        r"river|mountain|capital|street|neighbourhood|neighborhood)\b|\bbirthplace\b",
    ),
    (
        "person",
        r"\b(which|what) (person|man|woman|actor|actress|singer|player|author|writer|president|king|queen|"
        r"artist|character|scientist|inventor|founder)\b",
    ),
    ("date", r"\bwhen\b"),
    ("person", r"\b(who|whom|whose)\b"),
    ("place", r"\bwhere\b"),
)
_ASKED_PATTERNS = tuple((kind, re.compile(pattern)) for kind, pattern in _ASKED)


def asked_kind(question: str) -> str | None:
    """The kind of answer the question's wording asks for (`NUMERIC_KINDS` or `NAMED_KINDS`), or None."""
    text = " ".join(question.lower().split())
    found = [(m.start(), i, kind) for i, (kind, p) in enumerate(_ASKED_PATTERNS) if (m := p.search(text))]
    return min(found)[2] if found else None


def answer_form(answer: str) -> str:
    """`date` (a year, a day of a month, a century, a season...), `number` (digits or number words) or
    `words`."""
    answer = answer.strip()
    if _DATE.search(answer):
        return "date"
    if _NUMBER.search(answer):
        return "number"
    return "words"


@dataclass
class AnswerKinds:
    """Which named kind an answer is, fitted on gold answers labelled by their questions' asked kinds: a
    multinomial naive Bayes over hashed character n-grams (the hashing is fixed, so the saved model is the
    class priors and n-gram probabilities alone)."""

    classes: list[str] = field(default_factory=list)
    class_log_prior: list[float] = field(default_factory=list)
    feature_log_prob: list[list[float]] = field(default_factory=list)

    @classmethod
    def fit(cls, asked: Sequence[str | None], answers: Sequence[Sequence[str]]) -> AnswerKinds:
        """From the kinds questions ask for (`asked_kind`) and their gold answers (empty for a question the
        corpus does not answer). Only names are fitted (the form tells numbers and dates); a model that knows
        nothing (every name accepted) comes back unless a named kind and one other kind occur among them."""
        from sklearn.naive_bayes import MultinomialNB

        texts, labels = [], []
        for kind, golds in zip(asked, answers):
            if kind in NUMERIC_KINDS:
                continue
            for gold in golds:
                if gold.strip() and answer_form(gold) == "words":
                    texts.append(gold)
                    labels.append(kind or OTHER)
        if len(set(labels)) < 2 or not set(labels) & set(NAMED_KINDS):
            return cls()
        model = MultinomialNB(alpha=0.1).fit(_ngrams(texts), labels)
        return cls(
            [str(c) for c in model.classes_],
            [round(float(x), 5) for x in model.class_log_prior_],
            [[round(float(x), 5) for x in row] for row in model.feature_log_prob_],
        )

    def probabilities(self, answer: str) -> dict[str, float]:
        """P(kind | answer) over the fitted kinds (empty when nothing was fitted)."""
        if not self.classes:
            return {}
        counts = _ngrams([answer]).toarray()[0]
        joint = np.asarray(self.class_log_prior) + np.asarray(self.feature_log_prob) @ counts
        p = np.exp(joint - joint.max())
        return dict(zip(self.classes, (p / p.sum()).tolist()))

    def match(self, asked: str | None, answer: str) -> float:
        """The probability that `answer` is of a kind a question asking for `asked` accepts (1.0 when the
        question does not say, or the model does not know the kinds)."""
        if asked is None or not answer.strip():
            return 1.0
        form = answer_form(answer)
        if asked in ("year", "number"):
            return 0.0 if form == "words" else 1.0
        if asked == "date":
            # "When" is answered by words too (an episode, "never"), but not by a name of a person or a place.
            return 1.0 if form != "words" else 1.0 - self.named_share(answer, ())
        if form == "date" or (form == "number" and not re.search(r"[^\W\d_]{3,}", answer)):
            return 0.0  # a year or a bare number for who / where / which company
        return 1.0 - self.named_share(answer, ACCEPTED[asked])

    def named_share(self, answer: str, accepted: tuple[str, ...]) -> float:
        """The probability the model gives the named kinds outside `accepted` (kinds it never saw count as
        accepted: a model fitted without people cannot say a name is not one)."""
        p = self.probabilities(answer)
        return sum(p[c] for c in p if c in NAMED_KINDS and c not in accepted)

    def mismatch(self, asked: str | None, answer: str) -> str | None:
        """Why `answer` surely is not what a question asking for `asked` wants, in words; None when it may be."""
        if self.match(asked, answer) >= MISMATCH_BELOW:
            return None
        form = answer_form(answer)
        if form != "words":
            given = "a date" if form == "date" else "a number"
        elif asked in ("year", "number"):
            given = "words, not a number or a date"
        else:
            p = self.probabilities(answer)
            given = f"a {max((c for c in p if c in NAMED_KINDS), key=p.get)}"
        wanted = "an organisation" if asked == "organisation" else f"a {asked}"
        return f"the question asks for {wanted} and the answer {answer!r} is {given}"


def _ngrams(texts: list[str]):
    from sklearn.feature_extraction.text import HashingVectorizer

    vectorizer = HashingVectorizer(
        analyzer="char_wb",
        ngram_range=(2, 4),
        lowercase=False,
        n_features=HASHED_FEATURES,
        alternate_sign=False,
        norm=None,
    )
    return vectorizer.transform(texts)
