"""Algorithm 2's step 2 for an accumulation window: S_x of every micro-batch, chosen where the loop forms the
window, before its first micro-step.

f and h change only when the optimizer steps, so one top-k over all the window's questions selects for every
micro-batch: one scan of h(B) per optimizer step, however many micro-batches accumulate. Selection runs without
gradient; each question is embedded for it from a random state that is kept (`Selection.query_rng`), and the
micro-batch's step 1 embeds it with gradient from that state again, so under the towers' dropout the q its loss
uses is the q that selected its S_x. As soon as the window is selected, a background thread reads and tokenizes
each micro-batch's passages for its steps 3-7 (`rlm.training.step_inputs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rlm.reader.fid import FiDReader
from rlm.reader.formatting import FiDCollator
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.encoder import DualEncoder
from rlm.training.batch import Batch
from rlm.training.step_inputs import PreparedPassages, StepInputs

if TYPE_CHECKING:
    from rlm.config import TrainConfig
    from rlm.data.corpus import Corpus
    from rlm.training.strategies.base import SelectionStrategy


class QueryEmbeddingCache:
    """f(x) for selection at the steps that do not train the retriever, each question embedded once.

    At such a step (Algorithm 2's reader-only phases, a frozen retriever) q only picks S_x; no gradient flows
    through it. It is computed as at prediction time, the query tower in eval mode (no dropout), so the reader
    trains on the selection it will be evaluated on, and kept per question while f does not move: the window's
    selection calls `clear` whenever its step trains the retriever. `max_entries` bounds the memory (the cache
    starts over when full).
    """

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self.vectors: dict[str, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self.vectors = {}

    @torch.no_grad()
    def encode(self, tower, questions: list[str]) -> torch.Tensor:
        """[B, D] embeddings of `questions` on the tower's device, the tower in eval mode for the new ones."""
        missing = list(dict.fromkeys(q for q in questions if q not in self.vectors))
        self.hits += len(questions) - len(missing)
        self.misses += len(missing)
        if missing:
            if len(self.vectors) + len(missing) > self.max_entries:
                self.clear()
            # `encode` runs the tower in eval mode and restores its mode; it returns CPU float32.
            self.vectors.update(zip(missing, tower.encode(missing).to(tower.device)))
        return torch.stack([self.vectors[q] for q in questions])


class StepModel(Protocol):
    """What the training steps and the window's selection use of the joint model
    (`rlm.training.model.RetrievalAugmentedModel`)."""

    retriever: DualEncoder
    reader: FiDReader | None
    corrector: CorrectorNetwork | None
    collator: FiDCollator | None
    query_cache: QueryEmbeddingCache
    inputs: StepInputs


@dataclass
class Selection:
    """One micro-batch's S_x, selected for its window, and what its steps 3-7 read of it."""

    rows: torch.Tensor  # [B, k] corpus rows, -1 padding
    passages: PreparedPassages  # read and tokenized on the background thread
    # The random state its questions were embedded from for the selection (None: from the query cache, eval
    # mode); step 1 embeds them from it again (`drawing_from`).
    query_rng: tuple | None


def select_window(
    model: StepModel,
    batches: Sequence[Batch],
    strategy: SelectionStrategy,
    corpus: Corpus,
    cfg: TrainConfig,
    reader_only: bool = False,
) -> list[Selection | None]:
    """Step 2 for the micro-batches of one accumulation window: `S_x = top-k_y <q, h(B_y)>` over every passage
    (h when the strategy selects through it), one top-k for all their questions, without gradient. None for a
    micro-batch that reads no selected passages (closed book, the gold-passage curriculum), and for Algorithm 1,
    whose step selects with the label included. `reader_only`: the step leaves the retriever as it is, so q
    comes from the query cache."""
    chosen = [b for b in batches if strategy.uses_passages and b.reader_passages is None]
    if cfg.algorithm != 2 or not chosen:
        return [None] * len(batches)
    trains_retriever = strategy.trains_retriever and not reader_only
    if trains_retriever:
        model.query_cache.clear()  # f moves at this step
    with torch.no_grad():
        embedded = [_embedded_for_selection(model, b, trains_retriever) for b in chosen]
        h = (
            model.corrector if strategy.uses_corrector else None
        )  # the strategy says whether S_x comes through h
        top = strategy.select(torch.cat([queries for queries, _ in embedded]), h)
    selections, start = {}, 0
    for batch, (_, rng) in zip(chosen, embedded):
        rows = top.indices[start : start + len(batch.questions)]
        start += len(batch.questions)
        passages = model.inputs.prepare_passages(
            *(model.retriever, model.reader, model.collator),
            *(corpus, strategy.buffer, batch, rows, cfg.reader.num_passages, trains_retriever),
        )
        selections[id(batch)] = Selection(rows, passages, rng)
    return [selections.get(id(b)) for b in batches]


def _embedded_for_selection(
    model: StepModel, batch: Batch, trains_retriever: bool
) -> tuple[torch.Tensor, tuple | None]:
    """f(x) for selection and the random state it was drawn from: while the retriever trains, in the tower's
    training mode (its dropout), else from the query cache (eval mode, no state to keep)."""
    if not trains_retriever:
        return model.query_cache.encode(model.retriever.query_tower, batch.questions), None
    state = _rng_state(model.retriever.query_tower.device)
    return model.retriever.encode_queries(batch.questions), state


def _rng_state(device: torch.device) -> tuple:
    """The random state dropout on `device` draws from: the CPU generator's, and the GPU's on a GPU."""
    gpu = device.type == "cuda" and torch.cuda.is_available()
    return torch.get_rng_state(), (device, torch.cuda.get_rng_state(device)) if gpu else None


@contextlib.contextmanager
def drawing_from(state: tuple) -> Iterator[None]:
    """A block that draws from `state` (a `Selection.query_rng`); the state from before the block is back after
    it."""
    cpu, gpu = state
    with torch.random.fork_rng(devices=[] if gpu is None else [gpu[0]]):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu[1], gpu[0])
        yield
