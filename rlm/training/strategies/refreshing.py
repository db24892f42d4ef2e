"""The strategies that re-embed passages on a schedule: exhaustive, regression (approximate re-encoding),
two-round and SNM. What each re-embeds counts on the paper's cost axis (`reembedded`).

With `refresh_dir` set (training runs), a refresh re-embeds this process's share of the rows (N/W when
sharded), writes it as fp16 under `refresh_dir/step_<s>/` (`rlm.retriever.distributed.RefreshedRows`), and
checkpoints reference that folder instead of pickling N x D floats. Without it (tests, scripts) the refreshed
rows stay in memory.
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor

from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.distributed import Processes, RefreshedRows, slice_rows
from rlm.retriever.reencode import NystromRegression, residual
from rlm.training.strategies.base import EmbedRows, SelectionStrategy


class _RefreshingStrategy(SelectionStrategy, abc.ABC):
    """Scores against a re-embedded copy of the buffer, refreshed on a schedule."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fresh: PassageBuffer | Tensor | None = None  # None until the first refresh
        self._unopened = False  # a loaded checkpoint's refreshed rows, not opened yet (`search_space`)
        self._refresh_now = False  # the refreshed rows lack rows a corpus update added: re-embed first

    @abc.abstractmethod
    def due(self, step: int) -> bool:
        """Whether the buffer is re-embedded before optimizer step `step`."""

    def refreshes_at(self, step: int) -> bool:
        # A resume over a corpus an update grew re-embeds at once: the refreshed rows lack the new passages,
        # and the buffer's g0 rows of those are not in the space of the others.
        return self._refresh_now or self.due(step)

    def prepare_refresh(self, step: int, embed_rows: EmbedRows) -> int:
        """Work a refresh does before its rows are computed; returns the passages it re-embedded (each once,
        however many processes shared the work). Exhaustive re-embeds them all in `refreshed_rows`."""
        return len(self.buffer)

    def refreshed_rows(self, start: int, stop: int, embed_rows: EmbedRows) -> Tensor:
        """Rows [start, stop) of the refreshed buffer: the corpus re-embedded by the current passage tower."""
        return embed_rows(range(start, stop))

    def refresh(self, step: int, embed_rows: EmbedRows) -> None:
        if not self.refreshes_at(step):
            return
        n = len(self.buffer)
        reembedded = self.prepare_refresh(step, embed_rows)
        if self.refresh_dir is None:
            # In memory (no run folder): every process computes and holds all rows.
            self.fresh = self.refreshed_rows(0, n, embed_rows).to(torch.float32)
            mine = None if self.sharded else self.fresh
        else:
            start, stop = self.procs.part(n) if self.sharded else (0, n)
            # fp16, as written: a run resumed from the files scans exactly what this one scans.
            mine = self.refreshed_rows(start, stop, embed_rows).to(torch.float16)
            folder = self.refresh_dir / f"step_{step:07d}"
            self.fresh = RefreshedRows.write(folder, self.procs, self.sharded, n, mine).whole
        self.search.set_rows(n, whole=self.fresh, mine=mine)
        self.refresh_step = step
        self.reembedded += reembedded
        self._unopened = self._refresh_now = False
        if self.procs.rank == 0:  # the earlier refreshed rows no kept checkpoint needs
            self.prune_refreshes(self.checkpoint_steps, step)

    def search_space(self) -> PassageBuffer | Tensor:
        if self._unopened:
            n = len(self.buffer)
            refreshed = RefreshedRows.open(self._refresh_folder(), self.procs, self.sharded, n)
            self.fresh = refreshed.whole
            self.search.set_rows(n, whole=self.fresh, mine=refreshed.mine)
            self._unopened = False
        return self.buffer if self.fresh is None else self.fresh

    def _refresh_folder(self):
        return self.refresh_dir / f"step_{self.refresh_step:07d}"

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "refresh_step": self.refresh_step}
        if self.refresh_dir is None:
            state["fresh"] = self.fresh  # in memory only (no run folder): pickled, as small runs afford
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.refresh_step = state.get("refresh_step")
        self.fresh = state.get("fresh")
        n = len(self.buffer)
        if self.fresh is None:
            self.search.set_rows(n, whole=self.buffer)
        else:
            self.search.set_rows(n, whole=self.fresh, mine=None if self.sharded else self.fresh)
        # The files are opened when first scanned: a checkpoint taken just before a refresh is resumed by
        # that refresh, which never reads them, and `prune_refreshes` has deleted them for that reason.
        self._unopened = "fresh" not in state and self.refresh_step is not None
        if self.corpus_grew and self.refresh_step is not None:  # rows of fewer passages than the corpus has
            self.fresh, self._unopened, self._refresh_now = None, False, True
            self.search.set_rows(n, whole=self.buffer)


class ExhaustiveStrategy(_RefreshingStrategy):
    """Re-embed every passage every R retriever updates (the buffer is fresh until the first update)."""

    name = "exhaustive"

    def due(self, step: int) -> bool:
        # Every R retriever updates, and once more when the retriever stops training (before a final
        # reader-only phase), so that phase reads the final tower's embeddings.
        trained = step - self.start_step
        if trained <= 0 or step > self.stop_step:
            return False
        return trained % self.cfg.refresh_every == 0 or step == self.stop_step < self.max_steps


class RegressionStrategy(ExhaustiveStrategy):
    """Dynnibal-style approximate re-encoding (`retriever/reencode.py`): on exhaustive's schedule, re-embed
    `regression.samples` random passages, fit a Nystrom kernel ridge regression from their rows of B to the
    fresh embeddings, and scan R(B), the whole buffer mapped by it. Only the samples count as re-embedded.

    Landmarks are random rows of B drawn at the first refit and kept for the run (as in the paper). With a
    sharded buffer every process re-embeds its share of the samples, the shares are gathered so that every
    process fits the same map, and each maps (and scans) its own share of B.
    """

    name = "regression"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landmark_rows: Tensor | None = None  # [d'] corpus rows, fixed at the first refit
        self.model: NystromRegression | None = None

    def prepare_refresh(self, step: int, embed_rows: EmbedRows) -> int:
        cfg, n = self.cfg.regression, len(self.buffer)
        if self.landmark_rows is None:
            self.landmark_rows = torch.randperm(n, generator=self.generator)[: cfg.landmarks].sort().values
        samples = torch.randperm(n, generator=self.generator)[: cfg.samples].sort().values
        fresh = self._embed_shared(samples, embed_rows).float().cpu()
        stale = self.buffer.rows(samples).float()
        landmarks = self.buffer.rows(self.landmark_rows).float()
        if cfg.ridge is None:  # chosen on a held-out fifth of the samples, the same on every process
            self.model, scores = NystromRegression.fit_validated(
                stale, fresh, landmarks, kernel=cfg.kernel, gamma=cfg.gamma, seed=step
            )
            if scores:
                ridge = min(scores, key=scores.get)
                self.metrics["regression_ridge"] = ridge
                # The share of the drift left on samples the chosen fit did not see: what the other rows get.
                self.metrics["regression_heldout_residual"] = scores[ridge]
        else:
            self.model = NystromRegression.fit(
                stale, fresh, landmarks, kernel=cfg.kernel, ridge=cfg.ridge, gamma=cfg.gamma
            )
        self.metrics["regression_residual"] = residual(self.model(stale), stale, fresh)  # on its own samples
        return len(samples)

    def _embed_shared(self, rows: Tensor, embed_rows: EmbedRows) -> Tensor:
        """`rows` re-embedded, every process getting all of them, each having embedded only its share."""
        if not self.sharded:
            return embed_rows(rows.tolist())
        procs, count = self.procs, len(rows)
        start, stop = procs.part(count)
        # An empty share is embedded too: every process's refresh meets the others as often (`embed_rows` agrees
        # on stop signals between its parts), whatever its share.
        mine = embed_rows(rows[start:stop].tolist())
        # The passage tower hands back host float32, and NCCL gathers device tensors only.
        device = procs.device or self.search.device or mine.device
        per = -(
            -count // procs.world
        )  # the gather needs one shape on every process: pad to the largest share
        padded = torch.zeros(per, self.buffer.dim, device=device)
        padded[: stop - start] = mine.to(device=device, dtype=torch.float32)
        gathered = procs.gather(padded)
        shares = [Processes(r, procs.world).part(count) for r in range(procs.world)]
        return torch.cat([gathered[r * per : r * per + (b - a)] for r, (a, b) in enumerate(shares)])

    def refreshed_rows(self, start: int, stop: int, embed_rows: EmbedRows) -> Tensor:
        blocks = (
            block for _, block in slice_rows(self.buffer, start, stop).iter_chunks(self.search.chunk_size)
        )
        return self.model.apply_chunks(blocks, device=self.search.device)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "landmark_rows": self.landmark_rows}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.landmark_rows = state.get("landmark_rows")


class TwoRoundStrategy(_RefreshingStrategy):
    """Stale for the first half, then one full re-embedding."""

    name = "two_round"

    def due(self, step: int) -> bool:
        half = self.start_step + (self.stop_step - self.start_step) // 2
        return step == half and step > self.start_step


class SNMStrategy(SelectionStrategy):
    """Stochastic negative mining: top-k over a random subset of M passages, re-embedded every R steps.

    Every process draws the same subset (the generators share a seed) and, when sharded, re-embeds and scans
    only its share of it. Algorithm 1's label and uniform negatives come from the whole corpus, scored against
    their stale rows.
    """

    name = "snm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: Tensor | None = None  # [M] corpus rows of the current subset
        self.subset: Tensor | None = None  # this process's share of their fresh embeddings
        self._unopened = False  # a loaded checkpoint's subset, not opened yet (`search_space`)

    def refreshes_at(self, step: int) -> bool:
        # A subset is needed from step 0; it is resampled every R retriever updates after that.
        trained = step - self.start_step
        return step == 0 or (trained > 0 and trained % self.cfg.refresh_every == 0 and step <= self.stop_step)

    def refresh(self, step: int, embed_rows: EmbedRows) -> None:
        if not self.refreshes_at(step):
            return
        m = min(self.cfg.snm_size, len(self.buffer))
        self.rows = torch.randperm(len(self.buffer), generator=self.generator)[:m].sort().values
        start, stop = self.procs.part(m) if self.sharded else (0, m)
        self.subset = embed_rows(self.rows[start:stop].tolist()).to(torch.float32)
        if self.refresh_dir is not None:
            # This process's share as an fp16 file that checkpoints reference (M x D is not pickled).
            self.subset = self.subset.to(torch.float16)
            folder = self.refresh_dir / f"step_{step:07d}"
            RefreshedRows.write(folder, self.procs, self.sharded, m, self.subset)
        self._scan_subset()
        self.refresh_step = step
        self.reembedded += m
        self._unopened = False
        if self.procs.rank == 0:  # the earlier subsets no kept checkpoint needs
            self.prune_refreshes(self.checkpoint_steps, step)

    def _scan_subset(self) -> None:
        # Sharded, this process holds only its share of the subset, and the search scans only that.
        if self.sharded:
            self.search.set_rows(len(self.rows), mine=self.subset, row_ids=self.rows)
        else:
            self.search.set_rows(len(self.rows), whole=self.subset, row_ids=self.rows)

    def search_space(self) -> PassageBuffer | Tensor:
        if self._unopened:
            m = len(self.rows)
            folder = self.refresh_dir / f"step_{self.refresh_step:07d}"
            self.subset = RefreshedRows.open(folder, self.procs, self.sharded, m).mine
            self._scan_subset()
            self._unopened = False
        if self.subset is None:
            raise RuntimeError("SNM subset not sampled yet: call before_step first")
        return self.subset

    def extra_rows_source(self):
        return self.buffer

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "rows": self.rows, "refresh_step": self.refresh_step}
        if self.refresh_dir is None:
            state["subset"] = self.subset
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rows, self.refresh_step = state["rows"], state.get("refresh_step")
        self.subset = state.get("subset")
        if self.subset is not None:
            self._scan_subset()
        # Opened when first scanned, as the refreshing strategies do: a resample first never reads it.
        self._unopened = "subset" not in state and self.rows is not None
