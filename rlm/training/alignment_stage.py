"""DAFT's alignment stage (stage 1): the query tower trains alone at the start of the retriever's training,
until it agrees with the passage tower, then both train. Also the collapse check that stops a run whose
query tower maps every question to nearly the same vector (what a light query tower does unaligned).

The loop calls the stage around each optimizer step (`before_step`, `after_step`); the step itself knows
nothing of it. While the stage runs, the passage tower and the corrector are frozen (requires_grad off: no
gradient, so neither AdamW nor clipping sees one; DDP finds them unused), and they train again once it ends.
The stage is measured by the kNN KL between the towers every `retriever.align.every` steps; it ends below
`retriever.align.kl`, after `retriever.align.patience` measurements without a new best, or after
`retriever.align.steps`. Every process measures the same questions, so they all decide alike.
"""

from __future__ import annotations

from rlm.retriever.alignment import alignment_metrics


class RepresentationCollapseError(RuntimeError):
    """The query tower maps every dev question to nearly the same vector (DAFT's collapse)."""


def check_collapse(retriever_cfg, metrics: dict, step: int) -> None:
    """Stop the run (every process sees the same figures) when the query tower has collapsed."""
    cosine, limit = metrics.get("dev_query_mean_cosine"), retriever_cfg.collapse_cosine
    if cosine is not None and limit is not None and cosine > limit:
        raise RepresentationCollapseError(
            f"step {step}: the query tower has collapsed: the dev questions' query embeddings have a mean "
            f"pairwise cosine of {cosine:.4f} > retriever.collapse_cosine={limit} (every question retrieves "
            "nearly the same passages). A light query tower needs aligning first (DAFT); otherwise lower "
            "optim.lr_retriever. Set retriever.collapse_cosine=null to train on anyway."
        )


class AlignmentStage:
    """Where the stage stands: it starts at `first_step` (the retriever's first update) and, while it runs,
    leaves the passage tower and the corrector out of every step. Saved with checkpoints."""

    def __init__(self, retriever_cfg, first_step: int, batch_size: int):
        self.cfg, self.first, self.batch_size = retriever_cfg, first_step, batch_size
        self.end: int | None = None  # the step it ended at (None while it runs, or when there is none)
        self.best = float("inf")  # the best kNN KL so far
        self.stalled = 0  # measurements since it last fell
        self.frozen: list = []  # the parameters it froze, trained again when it ends

    def active(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) is in the stage."""
        return self.end is None and self.first <= step < self.first + self.cfg.align.steps

    def before_step(self, step: int, model) -> bool:
        """At the top of optimizer step `step`: whether it is in the stage; while it is, only the query tower of
        `model` (the unwrapped joint model) moves: the passage tower and the corrector are frozen."""
        if not self.active(step):
            return False
        if not self.frozen:
            parts = [model.retriever.passage_tower, model.corrector]
            self.frozen = [
                p for part in parts if part is not None for p in part.parameters() if p.requires_grad
            ]
            for p in self.frozen:
                p.requires_grad_(False)
        return True

    def after_step(self, step: int, retriever, questions: list[str], record: dict) -> str | None:
        """After optimizer step `step` of the stage (`step` steps done): measure when due, add the figures to
        `record`; returns why the stage ended (the frozen towers train again from here), or None while it goes
        on."""
        rc = self.cfg
        record["aligning"] = 1
        last = step >= self.first + rc.align.steps
        if (step - self.first) % rc.align.every and not last:
            return None
        metrics = alignment_metrics(retriever, questions, self.batch_size)
        kl = metrics["query_passage_knn_kl"]
        record.update(
            {"align_knn_kl": round(kl, 4), "align_query_mean_cosine": round(metrics["query_mean_cosine"], 4)}
        )
        check_collapse(rc, {"dev_query_mean_cosine": metrics["query_mean_cosine"]}, step)
        if kl < self.best:
            self.best, self.stalled = kl, 0
        else:
            self.stalled += 1
        reason = None
        if rc.align.kl is not None and kl < rc.align.kl:
            reason = f"kNN KL {kl:.2f} < retriever.align.kl={rc.align.kl}"
        elif self.stalled >= rc.align.patience:
            reason = f"kNN KL has not fallen for {rc.align.patience} measurements (best {self.best:.2f})"
        elif last:
            reason = f"retriever.align.steps={rc.align.steps} reached (kNN KL {kl:.2f})"
        if reason is not None:
            self.end = record["align_end"] = step
            for p in self.frozen:
                p.requires_grad_(True)
            self.frozen = []
        return reason

    def state_dict(self) -> dict:
        return {"end": self.end, "best": self.best, "stalled": self.stalled}

    def load_state_dict(self, state: dict) -> None:
        self.end, self.best, self.stalled = state["end"], state["best"], state["stalled"]
