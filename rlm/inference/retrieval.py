"""Retrieval for a trained checkpoint: questions embedded by the query tower, the top-k searched in a
`rlm.retriever.index.PassageIndex` (built by `rlm.inference.indexing`), the result as `Retrieved`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Retrieved:
    """Top-k per question: passage ids (best first) and their inner-product scores."""

    ids: list[list[str]]
    scores: list[list[float]]


def retrieve(
    query_tower,
    index,
    questions: Sequence[str],
    k: int = 100,
    batch_size: int = 64,
    show_progress: bool = False,
) -> Retrieved:
    """Top-k passages per question by inner product of the query tower's embeddings with the index."""
    if not questions:
        return Retrieved([], [])
    return search_index(index, encode_questions(query_tower, questions, batch_size, show_progress), k)


def encode_questions(
    query_tower, questions: Sequence[str], batch_size: int = 64, show_progress: bool = False
):
    """The questions' embeddings [Q, D] as host float32, whatever the tower's device and autocast: what faiss
    takes."""
    return query_tower.encode(list(questions), batch_size=batch_size, show_progress=show_progress).numpy()


def search_index(index, queries, k: int) -> Retrieved:
    """Top-k passages per query embedding ([Q, D] float32) from a `rlm.retriever.index.PassageIndex`."""
    scores, ids = index.search(queries, k)
    return Retrieved(ids=ids, scores=[row[: len(i)].tolist() for row, i in zip(scores, ids)])
