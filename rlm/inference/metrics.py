"""Answer metrics of open-domain QA: SQuAD/NQ normalisation, exact match, token F1, DPR-style has_answer
and recall@k over retrieved passages.

The normalisation is the one of the SQuAD v1.1 script that NQ-open, TriviaQA and HotpotQA papers all report
with (lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace). `has_answer` follows
DPR's `has_answer(..., match_type="string")`: the answer's token sequence occurs in the passage's token
sequence, both normalised the same way, so "Paris" matches "... in Paris, France" but not "Parisian".
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, remove punctuation and the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(answers: str | Iterable[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else list(answers)


def exact_match(prediction: str, answers: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0 (max over golds)."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in _as_list(answers)))


def _f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    # Answers that normalise to nothing (NQ has "---" and ")") match only an equally empty prediction, as in
    # the SQuAD v2 script; v1.1 would score them 0 even against themselves.
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: str | Iterable[str]) -> float:
    """Token-level F1 between the normalised prediction and the best-matching gold answer."""
    pred_tokens = normalize_answer(prediction).split()
    golds = _as_list(answers)
    if not golds:
        return 0.0
    return max(_f1(pred_tokens, normalize_answer(a).split()) for a in golds)


def _tokens(text: str) -> list[str]:
    # Unicode NFD first, as DPR does, so "Zürich" in a passage and "Zurich" typed by an annotator can meet
    # after normalisation strips the combining marks along with punctuation.
    text = unicodedata.normalize("NFD", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    return normalize_answer(text).split()


def has_answer(passage_text: str, answers: str | Iterable[str]) -> bool:
    """True when any answer's normalised token sequence occurs contiguously in the passage's tokens."""
    tokens = _tokens(passage_text)
    for answer in _as_list(answers):
        ans = _tokens(answer)
        if not ans:
            continue
        n = len(ans)
        for start in range(len(tokens) - n + 1):
            if tokens[start : start + n] == ans:
                return True
    return False


def recall_at_k(
    retrieved_texts: Sequence[Sequence[str]],
    answers: Sequence[Sequence[str]],
    ks: Iterable[int] = (1, 5, 20, 100),
) -> dict[str, float]:
    """Fraction of questions with an answer-bearing passage among their top k, for each k.

    `retrieved_texts[i]` are question i's passages, best first; a question with fewer than k passages counts
    with the ones it has. Returns {"recall@k": value}.
    """
    if len(retrieved_texts) != len(answers):
        raise ValueError(
            f"recall_at_k: {len(retrieved_texts)} retrieval lists but {len(answers)} answer lists"
        )
    hits = [first_answer_hit(texts, golds) for texts, golds in zip(retrieved_texts, answers)]
    return recall_from_first_hits(hits, ks)


def gold_recall_at_k(
    retrieved_ids: Sequence[Sequence[str]],
    gold_ids: Sequence[Sequence[str]],
    ks: Iterable[int] = (1, 5, 20, 100),
) -> dict[str, float]:
    """Fraction of questions with any gold passage id among their top k (questions without gold ids skipped).

    Returns {"gold_recall@k": value}; an empty dict when no question has gold ids.
    """
    if len(retrieved_ids) != len(gold_ids):
        raise ValueError(
            f"gold_recall_at_k: {len(retrieved_ids)} retrieval lists but {len(gold_ids)} gold lists"
        )
    hits = [first_gold_hit(ids, golds) for ids, golds in zip(retrieved_ids, gold_ids) if golds]
    if not hits:
        return {}
    return {f"gold_{key}": value for key, value in recall_from_first_hits(hits, ks).items()}


def first_answer_hit(texts: Sequence[str], answers: Sequence[str]) -> int | None:
    """The rank of the first passage text (best first) that `has_answer`, or None."""
    return next((rank for rank, text in enumerate(texts) if has_answer(text, answers)), None)


def first_gold_hit(ids: Sequence[str], gold_ids: Sequence[str]) -> int | None:
    """The rank of the first passage id (best first) among `gold_ids`, or None."""
    gold_set = set(gold_ids)
    return next((rank for rank, pid in enumerate(ids) if pid in gold_set), None)


def recall_from_first_hits(hits: Sequence[int | None], ks: Iterable[int]) -> dict[str, float]:
    """{"recall@k": the share of `hits` (each question's first-hit rank, None: none) below k} for each k."""
    n = max(len(hits), 1)
    return {f"recall@{k}": sum(1 for h in hits if h is not None and h < k) / n for k in ks}


def qa_scores(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean exact match and F1 (in [0, 1]) of predictions against their gold answer lists."""
    if len(predictions) != len(answers):
        raise ValueError(f"qa_scores: {len(predictions)} predictions but {len(answers)} answer lists")
    n = max(len(predictions), 1)
    return {
        "exact_match": sum(exact_match(p, a) for p, a in zip(predictions, answers)) / n,
        "f1": sum(f1_score(p, a) for p, a in zip(predictions, answers)) / n,
    }


def evaluate_module_path() -> str:
    """Folder of the local `evaluate` metric module: `evaluate.load(evaluate_module_path())` works offline."""
    return str(Path(__file__).resolve().parent / "metrics_module")
