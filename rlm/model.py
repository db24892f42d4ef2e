"""The jointly trained system: retriever (f, g), FiD reader and corrector h in one module.

One `nn.Module` so that accelerate/DDP sees a single model whose forward is the whole training step (gradient
synchronisation in DDP requires the forward to go through the wrapper).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from reader.fid import FiDReader
from reader.formatting import FiDCollator
from retriever.corrector import CorrectorNetwork
from retriever.encoder import DualEncoder
from rlm.steps import Batch, StepOutput, algorithm1_step, algorithm2_step


def null_timer(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


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
        self.timer = null_timer  # replaced by a PhaseTimer when profiling (scripts/bench_training.py)

    def forward(self, batch: Batch, strategy, corpus, reader_only: bool = False) -> StepOutput:
        if self.cfg.algorithm == 1:
            return algorithm1_step(self, batch, strategy, corpus, self.cfg)
        return algorithm2_step(self, batch, strategy, corpus, self.cfg, reader_only=reader_only)

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
