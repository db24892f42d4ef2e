"""Reading for a trained checkpoint: the FiD reader's answers from the retrieved passages (or the gold ones
swapped in, or none: closed book), and the answer policy's decision on each."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from rlm.data.qa import QAExample
from rlm.errors import UserError
from rlm.inference.retrieval import Retrieved


def with_gold_passages(
    examples: Sequence[QAExample], retrieved: Retrieved | None, num_passages: int
) -> list[list[str]]:
    """Oracle reading lists: each question's top `num_passages` with its gold passages guaranteed among them.

    A gold passage already in the top keeps its rank; a missing one replaces the lowest-ranked non-gold
    passage, so the reader does not see gold at a fixed position. Without retrieval: the gold passages alone.
    """
    out = []
    for i, ex in enumerate(examples):
        if not ex.gold_passage_ids:
            raise UserError(f"question {ex.id} has no gold passage ids; oracle reading needs them")
        gold = list(dict.fromkeys(ex.gold_passage_ids))
        if retrieved is None or num_passages <= len(gold):
            out.append(gold[:num_passages] if retrieved is not None else gold)
            continue
        top, gold_set = list(retrieved.ids[i][:num_passages]), set(gold)
        for pid in gold:
            if pid in top:
                continue
            if len(top) < num_passages:
                top.append(pid)
            else:
                last = max(j for j, other in enumerate(top) if other not in gold_set)
                top[last] = pid
        out.append(top)
    return out


def read(
    reader,
    examples: Sequence[QAExample],
    corpus=None,
    retrieved: Retrieved | None = None,
    num_passages: int = 10,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    num_beams: int = 1,
    passage_ids: Sequence[Sequence[str]] | None = None,
    with_confidence: bool = False,
    show_progress: bool = False,
) -> list[str] | list[tuple[str, float]]:
    """The reader's answers from the top `num_passages` retrieved passages; closed book when `retrieved` is None.

    `passage_ids` (e.g. from `with_gold_passages`) replaces the retrieved lists. `with_confidence`: (answer,
    the reader's probability of it) pairs instead of answers. The reader runs on its own device.
    """
    questions = [ex.question for ex in examples]
    if passage_ids is None:
        passage_ids = [] if retrieved is None else [ids[:num_passages] for ids in retrieved.ids]
    if not passage_ids:
        passages = [[] for _ in examples]
    else:
        passages = [
            [(p.title, p.text) for p in (corpus[corpus.index_of(pid)] for pid in ids)] for ids in passage_ids
        ]
    answer = reader.answer_with_confidence if with_confidence else reader.answer
    step = batch_size or max(len(questions), 1)
    answers = []
    # Batch by batch here rather than in the reader, for a progress bar over a dev set's hours of generation.
    with tqdm(total=len(questions), desc="read", unit="q", disable=not show_progress) as bar:
        for start in range(0, len(questions), step):
            stop = start + step
            answers.extend(
                answer(
                    questions[start:stop],
                    passages[start:stop],
                    max_new_tokens=max_new_tokens,
                    num_beams=num_beams,
                    batch_size=step,
                )
            )
            bar.update(len(questions[start:stop]))
    return answers


def decide_all(
    answered, questions, retrieved, corpus, num_passages: int, policy, retrieved_reading: bool
) -> list:
    """The answer policy's decision on each (answer, reader probability); without a policy, or when what was
    read is not the retrieved top (closed book, gold passages), every answer stands with the reader's own
    probability as its confidence."""
    from rlm.inference.answer_policy import AnswerSignals, Decision

    if policy is None or retrieved is None or not retrieved_reading:
        return [Decision(probability, False, None) for _, probability in answered]
    decisions = []
    for (answer, probability), question, ids, scores in zip(
        answered, questions, retrieved.ids, retrieved.scores
    ):
        read = [corpus[corpus.index_of(pid)] for pid in ids[:num_passages]]
        texts = [f"{p.title} {p.text}" for p in read]
        signals = AnswerSignals.of(answer, probability, scores[:num_passages], texts, question)
        decisions.append(policy.decide(signals))
    return decisions
