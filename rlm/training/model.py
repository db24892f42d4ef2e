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
from rlm.training.batch import Batch, StepOutput
from rlm.training.selection import QueryEmbeddingCache, Selection, select_window
from rlm.training.step_inputs import StepInputs
from rlm.training.steps import algorithm1_step, algorithm2_step, reader_alone_step


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
        self.query_cache = QueryEmbeddingCache()  # f(x) at the steps that leave the retriever as it is
        self.inputs = StepInputs()  # the thread that reads and tokenizes each micro-batch's S_x ahead

    def forward(
        self, batch: Batch, strategy, corpus, selection: Selection | None = None, reader_only: bool = False
    ) -> StepOutput:
        """One micro-step of the algorithm. `selection`: `batch`'s S_x, selected for its accumulation window
        (`rlm.training.selection.select_window`, as the loop does); without one, Algorithm 2 selects for
        `batch` alone, a window of one micro-batch."""
        if self.cfg.algorithm == 1:
            return algorithm1_step(self, batch, strategy, corpus, self.cfg)
        if not strategy.uses_passages or batch.reader_passages is not None:
            return reader_alone_step(self, batch, strategy)
        if selection is None:
            (selection,) = select_window(self, [batch], strategy, corpus, self.cfg, reader_only)
        return algorithm2_step(self, batch, selection, strategy, self.cfg, reader_only)

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
