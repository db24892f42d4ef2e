"""The jointly trained system: retriever (f, g), FiD reader and corrector h in one module.

One `nn.Module` so that accelerate/DDP sees a single model whose forward is the whole training step (gradient
synchronisation in DDP requires the forward to go through the wrapper).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlm.reader.fid import FiDReader
from rlm.reader.formatting import FiDCollator
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.encoder import DualEncoder
from rlm.training.step_inputs import StepInputs
from rlm.training.steps import Batch, StepOutput, algorithm1_step, algorithm2_step
from rlm.training.throughput import NO_TIMER


class QueryEmbeddingCache:
    """f(x) for selection at the steps that do not train the retriever, each question embedded once.

    At such a step (Algorithm 2's reader-only phases, a frozen retriever) q only picks S_x; no gradient flows
    through it. It is computed as at prediction time, the query tower in eval mode (no dropout), so the reader
    trains on the selection it will be evaluated on, and kept per question while f does not move: the
    training step calls `clear` whenever it trains the retriever. `max_entries` bounds the memory (the cache
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


class RetrievalAugmentedModel(nn.Module):
    def __init__(
        self,
        retriever: DualEncoder,
        reader: FiDReader | None,
        corrector: CorrectorNetwork | None,
        collator: FiDCollator | None,
        cfg,
    ):
        super().__init__()
        self.retriever = retriever
        self.reader = reader
        self.corrector = corrector
        self.collator = collator  # not a module: tokenisation only
        self.cfg = cfg
        self.timer = NO_TIMER  # a PhaseTimer while the step is measured (rlm.training.throughput)
        self.query_cache = QueryEmbeddingCache()  # f(x) at the steps that leave the retriever as it is
        self.inputs = StepInputs()  # the thread that reads and tokenizes each micro-batch's S_x ahead

    def forward(
        self, batch: Batch, strategy, corpus, reader_only: bool = False, later: tuple[Batch, ...] = ()
    ) -> StepOutput:
        """One micro-step of the algorithm; `later`: the micro-batches after `batch` in its accumulation window
        (Algorithm 2 selects S_x for them with `batch`'s)."""
        if self.cfg.algorithm == 1:
            return algorithm1_step(self, batch, strategy, corpus, self.cfg)
        return algorithm2_step(self, batch, strategy, corpus, self.cfg, reader_only=reader_only, later=later)

    def parameter_groups(self, strategy, optim_cfg) -> list[dict]:
        """One group per component with its own learning rate; components the strategy does not train are frozen."""
        # (name, module, trained or None when the strategy has no say: the reader keeps any weights its recipe
        # froze, e.g. a warm start's embeddings, learning rate)
        components = [
            ("reader", self.reader, None, optim_cfg.lr_reader),
            ("retriever", self.retriever, strategy.trains_retriever, optim_cfg.lr_retriever),
            ("corrector", self.corrector, strategy.uses_corrector, optim_cfg.lr_corrector),
        ]
        groups = []
        for name, module, trained, lr in components:
            if module is None:
                continue
            if trained is not None:
                module.requires_grad_(trained)
            if trained is not False:
                groups.append({"name": name, "params": list(module.parameters()), "lr": lr})
        return groups

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Each component in its own library's folder convention: a user can load any one without our code."""
        out_dir = Path(out_dir)
        self.retriever.save_pretrained(out_dir / "retriever")
        if self.reader is not None:
            self.reader.save_pretrained(out_dir / "reader")
        if self.corrector is not None:
            self.corrector.save_pretrained(out_dir / "corrector")


def embed_rows(passage_tower, texts, rows, batch_size: int = 64) -> torch.Tensor:
    """Re-embed corpus rows with the current passage tower (eval mode, no gradient) for refreshing strategies."""
    return passage_tower.encode([texts[r] for r in rows], batch_size=batch_size).float()
