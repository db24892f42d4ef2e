"""How each training step picks S_x, the passages the retriever and reader see: the paper's methods and baselines.

Every strategy answers one question (`select`: which k rows of the corpus for these queries) and counts how many
passages it had to re-embed with the live passage tower to do so: the paper's cost axis. The corrector strategy
never re-embeds; exhaustive re-embeds the whole corpus every R steps; SNM re-embeds a random subset of M
passages every R steps; two-round re-embeds the corpus once, half way.

| strategy | S_x | re-embedded |
| --- | --- | --- |
| corrector | top-k <q, h(B)> | 0 |
| stale | top-k <q, B> (passage tower still trained) | 0 |
| exhaustive | top-k <q, B_t>, B_t re-embedded every R steps | N * steps / R |
| snm | top-k over a random subset of M, resampled and re-embedded every R | M * steps / R |
| regression | top-k <q, R(B)>, R a kernel regression B -> B_t refitted every R on s' re-embedded passages | s' * steps / R |
| two_round | stale, B re-embedded once at max_steps / 2 | N |
| frozen | top-k <q, B>, retriever not trained | 0 |
| closed_book | none | 0 |
| in_batch (Algorithm 1) | the batch's gold passages | 0 |
"""

from __future__ import annotations

import torch

from rlm.errors import UserError
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.search import TopK, full_precision
from rlm.training.strategies.base import EmbedRows, SelectionStrategy
from rlm.training.strategies.refreshing import (
    ExhaustiveStrategy,
    RegressionStrategy,
    SNMStrategy,
    TwoRoundStrategy,
)

__all__ = ["STRATEGY_CLASSES", "EmbedRows", "SelectionStrategy", "make_strategy", "strategy_class"]


class StaleStrategy(SelectionStrategy):
    """Top-k over the fixed stale buffer B as it is; no passage is re-embedded."""

    name = "stale"


class FrozenStrategy(SelectionStrategy):
    """The retriever is not trained; passages come from the fixed buffer B."""

    name = "frozen"


class CorrectorStrategy(SelectionStrategy):
    """Top-k over h(B): the fixed stale buffer B corrected by the corrector network h; no passage is
    re-embedded during training."""

    name = "corrector"


class InBatchStrategy(SelectionStrategy):
    """Algorithm 1's cheapest baseline: no buffer search; each question scores the batch's gold passages."""

    name = "in_batch"

    def select(self, queries, corrector=None, include=None, num_random=0, k=None):
        if include is None:  # no batch to score (validation): rank against the stale buffer, as stale does
            return super().select(queries, corrector, k=k)
        include = include.to(queries.device)
        rows = self.buffer.rows(include).to(device=queries.device, dtype=torch.float32)
        with full_precision(queries.device):
            return TopK(torch.einsum("bd,bmd->bm", queries.float(), rows), include)


class ClosedBookStrategy(SelectionStrategy):
    """No passages: the reader answers from the question alone."""

    name = "closed_book"

    def select(self, queries, corrector=None, include=None, num_random=0, k=None):
        raise RuntimeError("closed_book selects no passages")


STRATEGY_CLASSES: dict[str, type[SelectionStrategy]] = {
    cls.name: cls
    for cls in (
        InBatchStrategy,
        CorrectorStrategy,
        StaleStrategy,
        ExhaustiveStrategy,
        RegressionStrategy,
        SNMStrategy,
        TwoRoundStrategy,
        FrozenStrategy,
        ClosedBookStrategy,
    )
}


def strategy_class(name: str) -> type[SelectionStrategy]:
    """The strategy registered under `name`; an unknown name is an error listing the known ones."""
    if name not in STRATEGY_CLASSES:
        raise UserError(f"strategy.name must be one of {', '.join(STRATEGY_CLASSES)}; got {name!r}")
    return STRATEGY_CLASSES[name]


def make_strategy(
    cfg,
    buffer: PassageBuffer,
    max_steps: int,
    seed: int = 0,
    chunk_size: int = 65536,
    start_step: int = 0,
    stop_step: int | None = None,
) -> SelectionStrategy:
    """The strategy named by `cfg.name`; `start_step` is the first step that updates the retriever and
    `stop_step` the step after its last update (None: it trains until `max_steps`)."""
    return strategy_class(cfg.name)(
        cfg, buffer, max_steps, seed=seed, chunk_size=chunk_size, start_step=start_step, stop_step=stop_step
    )
