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
        groups = []
        if self.reader is not None:
            groups.append(
                {"name": "reader", "params": list(self.reader.parameters()), "lr": optim_cfg.lr_reader}
            )
        self.retriever.requires_grad_(strategy.trains_retriever)
        if strategy.trains_retriever:
            groups.append(
                {
                    "name": "retriever",
                    "params": list(self.retriever.parameters()),
                    "lr": optim_cfg.lr_retriever,
                }
            )
        if self.corrector is not None:
            self.corrector.requires_grad_(strategy.uses_corrector)
            if strategy.uses_corrector:
                groups.append(
                    {
                        "name": "corrector",
                        "params": list(self.corrector.parameters()),
                        "lr": optim_cfg.lr_corrector,
                    }
                )
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
