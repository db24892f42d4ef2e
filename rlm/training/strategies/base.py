"""What every selection strategy is: which rows it scans, when they are re-embedded, whether it selects
through h and whether the retriever trains; `select` is the top-k over those rows.

The rows themselves (sharding, device placement, the two-stage index, the h(B) cache) are held by
`rlm.retriever.row_search.RowSearch`. `rlm.training.strategies` lists the strategies.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from rlm.config import StrategyFact
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.distributed import Processes, merge_topk, no_rows
from rlm.retriever.row_search import RowSearch
from rlm.retriever.search import TopK, complete_selection, corrected_topk, two_stage_corrected_topk

# Re-embeds the given corpus rows with the current passage tower (no gradient) -> [n, D] float32.
EmbedRows = Callable[[Sequence[int]], torch.Tensor]


class SelectionStrategy:
    """Base: stale top-k over the fixed buffer, nothing re-embedded. Subclasses change one thing each.

    Rows that are read one by one (Algorithm 1's label and uniform negatives, the corrector loss's B_y) come
    from the whole memory-mapped buffer, where only those rows are touched.
    """

    # What a strategy is, for everything outside this module (building components, validation, config checks):
    # its row of rlm.config.STRATEGY_FACTS, found by `name` (each attribute's meaning is written there).
    name = "stale"
    algorithms = StrategyFact()
    trains_retriever = StrategyFact()
    uses_passages = StrategyFact()
    uses_corrector = StrategyFact()
    scans_fixed_buffer = StrategyFact()
    shares_batch = StrategyFact()
    follows_refresh_every = StrategyFact()

    def __init__(
        self,
        cfg,
        buffer: PassageBuffer,
        max_steps: int,
        seed: int = 0,
        chunk_size: int = 65536,
        start_step: int = 0,
        stop_step: int | None = None,
    ):
        self.cfg = cfg  # rlm.config.StrategyConfig
        self.buffer = buffer  # the fixed stale buffer B; the corrector always reads this one
        self.max_steps = max_steps
        # The first step that updates the retriever (Algorithm 2's reader-only warm-up keeps it frozen
        # before): re-embedding schedules count from here, since re-embedding an unchanged tower buys nothing.
        self.start_step = start_step
        # The step after the retriever's last update (Algorithm 2's final reader-only phase comes after it):
        # a refresh later than this would re-embed a tower that has not moved since.
        self.stop_step = max_steps if stop_step is None else stop_step
        self.reembedded = 0  # passages re-embedded so far, each counted once over all processes
        self.generator = torch.Generator().manual_seed(seed)  # uniform negatives, SNM subsets
        self.procs, self.sharded = Processes(), False
        self.refresh_dir: Path | None = None  # where refreshed rows are written (None: kept in memory)
        self.refresh_step: int | None = None  # the step before which the scanned rows were last re-embedded
        # The steps of the run's kept checkpoints (told by the run when it saves or resumes): a refresh deletes
        # the earlier refreshed rows except theirs (`prune_refreshes`).
        self.checkpoint_steps: tuple[int, ...] = ()
        two_stage = cfg.two_stage if cfg.search == "two_stage" else None
        self.search = RowSearch(chunk_size, two_stage, cache_bytes=cfg.cache_corrected_mb * 2**20)
        self.search.set_rows(len(buffer), whole=buffer)
        if len(buffer.removed):  # rows of passages a corpus update replaced or deleted
            self.search.exclude(buffer.removed)
        self.metrics: dict[str, float] = {}  # logged with the step, then cleared (`pop_metrics`)
        self.corpus_grew = False  # the loaded checkpoint's corpus had fewer rows (`load_state_dict`)

    def distribute(
        self,
        procs: Processes,
        shard: bool,
        device: torch.device | None = None,
        refresh_dir: str | Path | None = None,
    ) -> None:
        """Shard the scanned rows across `procs` (`shard`), keep them on `device` (None: host memory, streamed),
        and write refreshed rows as fp16 files under `refresh_dir` (on a filesystem every process sees)."""
        self.procs, self.sharded = procs, shard and procs.world > 1
        self.search.place(procs, shard, device)
        self.refresh_dir = Path(refresh_dir) if refresh_dir is not None else None

    @property
    def k(self) -> int:
        return self.cfg.k

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        """Called first at optimizer step `step` (0-based): refreshing strategies re-embed here, and two-stage
        search measures itself against exact every `two_stage.overlap_every` steps."""
        if step % self.cfg.two_stage.overlap_every == 0:
            self.search.measure_overlap()
        self.refresh(step, embed_rows)

    def refresh(self, step: int, embed_rows: EmbedRows) -> None:
        """Re-embed what this strategy re-embeds before step `step`, if it is due."""

    def refreshes_at(self, step: int) -> bool:
        """Whether `before_step(step)` replaces the scanned rows before anything reads them."""
        return False

    def search_space(self) -> PassageBuffer | Tensor:
        """The rows scored at this step (row i = corpus row i; SNM: its subset)."""
        return self.buffer

    def extra_rows_source(self) -> PassageBuffer | Tensor:
        """Where Algorithm 1's forced and uniform rows are scored from (row i = corpus row i)."""
        return self.search_space()

    def pop_metrics(self) -> dict[str, float]:
        metrics = {**self.metrics, **self.search.metrics}
        self.metrics, self.search.metrics = {}, {}
        return metrics

    def select(
        self,
        queries: Tensor,
        corrector: torch.nn.Module | None = None,
        include: Tensor | None = None,
        num_random: int = 0,
        k: int | None = None,
    ) -> TopK:
        """S_x for each query: the corpus rows of the top `k` (default `strategy.k`) by <q, h(row)> over the
        rows this strategy scans (h = `corrector`, which a strategy that `uses_corrector` is given and no other
        is), and their scores; plus Algorithm 1's forced rows (`include`) and `num_random` uniform ones.
        Collective when sharded: every process calls it with as many queries."""
        if (corrector is not None) != self.uses_corrector:
            raise ValueError(
                f"the {self.name} strategy selects {'through' if self.uses_corrector else 'without'} h"
            )
        self.search_space()  # rows a loaded checkpoint references are opened before the search reads them
        k = self.k if k is None else k
        width = min(k + (0 if include is None else include.shape[1]), len(self.buffer))
        # Each process scores every process's queries against the rows it holds; the lists are merged.
        rows = self.search.scanned(corrector, queries.device)
        all_queries, n = rows.procs.gather(queries), min(width, len(rows.vectors))
        chunk, removed = self.search.chunk_size, rows.excluded  # removed: rows never returned
        if not n:
            local = no_rows(all_queries)
        elif rows.first_stage is None:
            local = corrected_topk(
                all_queries, rows.vectors, rows.corrector, n, chunk_size=chunk, excluded=removed
            )
        else:  # Appendix B.2: candidates by the stale score, re-scored with h
            local = self._two_stage_topk(rows, all_queries, n)
        top = merge_topk(rows.procs, local, rows.row_ids, width, queries.shape[0])
        if rows.first_stage is not None and n and self.search.overlap_due():
            self._record_overlap(rows, all_queries, n, top, width)
        if include is None and not num_random:
            return top
        return complete_selection(
            queries,
            self.extra_rows_source(),
            corrector,
            top,
            k,
            include=include,
            num_random=num_random,
            generator=self.generator,
            excluded=self.search.removed,
        )

    def _two_stage_topk(self, rows, queries: Tensor, n: int) -> TopK:
        """The top `n` of every process's `queries` over this process's scanned `rows` by two-stage search:
        candidates from the rows' first stage, re-scored with h, the removed rows never among them."""
        stage = rows.first_stage
        return two_stage_corrected_topk(
            queries,
            rows.vectors,
            rows.corrector,
            n,
            stage.index,
            stage.candidates,
            chunk_size=self.search.chunk_size,
            excluded=rows.excluded,
        )

    def _record_overlap(self, rows, queries: Tensor, n: int, top: TopK, width: int) -> None:
        """Log how much of the exact top-k the two-stage `top` found (every process takes part)."""
        chunk = self.search.chunk_size
        exact = corrected_topk(
            queries, rows.vectors, rows.corrector, n, chunk_size=chunk, excluded=rows.excluded
        )
        batch = top.indices.shape[0]
        self.search.record_overlap(top, merge_topk(rows.procs, exact, rows.row_ids, width, batch), width)

    def prune_refreshes(self, checkpoint_steps: Sequence[int], step: int) -> None:
        """Delete the refreshed rows (`refresh_dir/step_<s>`) that neither this step nor a kept checkpoint
        needs; the main process calls it after optimizer step `step`, with the steps of the checkpoints it keeps.

        A checkpoint taken after s optimizer steps references the refresh done before the latest step < s, but
        a run resumed from it reads those rows only if step s does not refresh first (or if no step s follows).
        With checkpoints every 2R steps, each one falls on a refresh: only the current refresh is kept, not
        also the two the kept checkpoints reference (3 x 32 GB for 21M x 768 fp16 rows). A folder of step
        `step` or later is never touched: another process, already at the next step, may be writing it."""
        if self.refresh_dir is None or not self.refresh_dir.is_dir():
            return
        found = sorted(int(p.name[5:]) for p in self.refresh_dir.glob("step_*") if p.name[5:].isdigit())
        keep = {self.refresh_step}
        for s in checkpoint_steps:
            if not (s < self.max_steps and self.refreshes_at(s)):
                keep.add(max((r for r in found if r < s), default=None))
        for r in found:
            if r not in keep and r < step:
                shutil.rmtree(self.refresh_dir / f"step_{r:07d}", ignore_errors=True)

    def state_dict(self) -> dict:
        return {
            "reembedded": self.reembedded,
            "generator": self.generator.get_state(),
            "corpus_rows": len(self.buffer),
        }

    def load_state_dict(self, state: dict) -> None:
        self.reembedded = int(state["reembedded"])
        self.generator.set_state(state["generator"])
        # Rows a corpus update appended since the checkpoint (`rlm corpus update --buffer`): the buffer's
        # rows are scanned as they are; a refreshing strategy re-embeds first (`_RefreshingStrategy`).
        self.corpus_grew = int(state.get("corpus_rows", len(self.buffer))) != len(self.buffer)
