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

import abc
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from atomicio import atomic_open
from retriever.buffer import PassageBuffer
from retriever.reencode import NystromRegression, residual
from retriever.search import (
    TopK,
    complete_selection,
    correct_buffer,
    corrected_topk,
    full_precision,
    sort_desc_then_row,
    two_stage_corrected_topk,
)
from rlm.config import StrategyConfig
from rlm.errors import UserError

# Re-embeds the given corpus rows with the current passage tower (no gradient) -> [n, D] float32.
EmbedRows = Callable[[Sequence[int]], torch.Tensor]


def _all_gather_identity(tensor: Tensor) -> Tensor:
    return tensor


def _no_barrier() -> None:
    return None


def auto_index_factory(rows: int) -> str:
    """`strategy.index_factory: auto`: exact (Flat) below 100k rows; above, IVF with 4 sqrt(N) lists (faiss's
    guideline) storing fp16 (SQfp16), like the buffer: half of Flat's memory, scores within ~1e-4 of it, and the
    candidates are re-scored from the buffer anyway."""
    return "Flat" if rows < 100_000 else f"IVF{int(4 * rows**0.5)},SQfp16"


@dataclass
class Processes:
    """This process's place among the data-parallel processes, and the collectives a sharded search needs:
    `gather` all-gathers a tensor along dim 0 (same shape on every process), `barrier` waits for all.

    `device` is where `gather`'s tensors must live: NCCL takes only tensors on this process's GPU, gloo takes
    host tensors too (None: where they are, which a CPU-only 2-process test cannot tell apart)."""

    rank: int = 0
    world: int = 1
    gather: Callable[[Tensor], Tensor] = field(default=_all_gather_identity)
    barrier: Callable[[], None] = field(default=_no_barrier)
    gather_object: Callable[[list], list] = field(default=list)  # concatenates every process's list, in order
    device: torch.device | None = None

    def part(self, n: int) -> tuple[int, int]:
        """This process's contiguous share [start, stop) of n rows."""
        per = -(-n // self.world)
        return min(self.rank * per, n), min((self.rank + 1) * per, n)


class ShardedRows:
    """Rows [n, D] one process scans, with the corpus row of each; a top-k is merged across all processes.

    Every process scores every process's queries against its own rows (queries are all-gathered, so a process
    needs only its share of the rows), then the per-process top-k lists are all-gathered and each process keeps
    the global top-k of its own queries. The result equals the top-k over all rows under the ordering contract
    of `retriever.search` (score descending, then row ascending). With one process nothing is gathered.
    """

    def __init__(self, vectors: PassageBuffer | Tensor, row_ids: Tensor, procs: Processes):
        self.vectors, self.row_ids, self.procs = vectors, row_ids, procs

    def topk(self, queries: Tensor, corrector, k: int, chunk_size: int, two_stage=None) -> TopK:
        """`two_stage` = (faiss index over these rows or None for a stale scan, candidates, nprobe): Appendix
        B.2's search instead of every row through h."""
        procs, batch = self.procs, queries.shape[0]
        all_queries = procs.gather(queries)  # [W*B, D]
        count = len(self.vectors)
        if count:
            if two_stage is None:
                local = corrected_topk(
                    all_queries, self.vectors, corrector, min(k, count), chunk_size=chunk_size
                )
            else:
                index, candidates, nprobe = two_stage
                local = two_stage_corrected_topk(
                    all_queries,
                    self.vectors,
                    corrector,
                    min(k, count),
                    index,
                    candidates,
                    nprobe=nprobe,
                    chunk_size=chunk_size,
                )
            found = local.indices >= 0  # an approximate index may return fewer than k
            row_ids = self.row_ids.to(local.indices.device)[local.indices.clamp_min(0)]
            scores, rows = local.scores, torch.where(found, row_ids, torch.full_like(row_ids, -1))
        else:  # a process with no rows (more processes than rows) still takes part in the gathers
            scores = torch.empty(all_queries.shape[0], 0, device=queries.device)
            rows = torch.empty(all_queries.shape[0], 0, dtype=torch.long, device=queries.device)
        if procs.world == 1:
            return TopK(scores[:, :k], rows[:, :k])
        # Pad to k columns so every process contributes the same shape (-inf scores never win).
        pad = k - scores.shape[1]
        if pad > 0:
            scores = torch.cat([scores, scores.new_full((scores.shape[0], pad), float("-inf"))], 1)
            rows = torch.cat([rows, rows.new_full((rows.shape[0], pad), -1)], 1)
        scores = procs.gather(scores.contiguous())  # [W * W*B, k], process-major
        rows = procs.gather(rows.contiguous())
        mine = slice(procs.rank * batch, (procs.rank + 1) * batch)
        scores = torch.cat([part[mine] for part in scores.chunk(procs.world)], dim=1)
        rows = torch.cat([part[mine] for part in rows.chunk(procs.world)], dim=1)
        # Row ascending first (padding -1 sorts first but carries -inf), then a stable sort by score.
        scores, rows = sort_desc_then_row(scores, rows)
        return TopK(scores[:, :k], rows[:, :k])


def _slice_rows(source: PassageBuffer, start: int, stop: int) -> PassageBuffer:
    """Rows [start, stop) of a (memory-mapped) buffer as a buffer of views: nothing is copied."""
    views = []
    for offset, block in source.iter_chunks(max(len(source), 1)):  # one chunk per shard
        lo, hi = max(start, offset), min(stop, offset + block.shape[0])
        if lo < hi:
            views.append(block[lo - offset : hi - offset])
    if not views:
        return PassageBuffer(range(0), [torch.empty(0, source.dim, dtype=source.dtype)])
    return PassageBuffer(range(stop - start), views)


class SelectionStrategy:
    """Base: stale top-k over the fixed buffer, nothing re-embedded. Subclasses change one thing each.

    Where the scanned rows live is set by `distribute`: streamed from host memory (the memory-mapped buffer),
    or resident on a device; whole, or sharded across the data-parallel processes (each scans N/W rows and
    the top-k lists are merged). Rows that are read one by one (Algorithm 1's label and uniform negatives, the
    corrector loss's B_y) come from the whole memory-mapped buffer, where only those rows are touched.
    """

    # What a strategy is, for everything outside this module (building components, validation, config checks):
    name = "stale"
    algorithms = (1, 2)  # the paper's algorithms it takes part in
    trains_retriever = True
    uses_passages = True  # False: the reader answers closed book (nothing selected, nothing retrieved)
    uses_corrector = False  # a corrector network h is built, trained and used for selection
    scans_fixed_buffer = True  # selects from B as built (never re-embedded): an index over B stays valid
    shares_batch = False  # every question of a batch scores the union of the batch's S_x

    def __init__(
        self,
        cfg: StrategyConfig,
        buffer: PassageBuffer,
        max_steps: int,
        seed: int = 0,
        chunk_size: int = 65536,
        start_step: int = 0,
        stop_step: int | None = None,
    ):
        self.cfg = cfg
        self.buffer = buffer  # the fixed stale buffer B; the corrector always reads this one
        self.max_steps = max_steps
        # The first step that updates the retriever (Algorithm 2's reader-only warm-up keeps it frozen
        # before): re-embedding schedules count from here, since re-embedding an unchanged tower buys nothing.
        self.start_step = start_step
        # The step after the retriever's last update (Algorithm 2's final reader-only phase comes after it):
        # a refresh later than this would re-embed a tower that has not moved since.
        self.stop_step = max_steps if stop_step is None else stop_step
        self.chunk_size = chunk_size
        self.reembedded = 0  # passages re-embedded so far, each counted once over all processes
        self.generator = torch.Generator().manual_seed(seed)  # uniform negatives, SNM subsets
        self.procs = Processes()
        self.sharded = False
        self.device: torch.device | None = None  # None: scan from host memory (memory-mapped, streamed)
        self.refresh_dir: Path | None = None  # where refreshed rows are written (None: kept in memory)
        self._resident: ShardedRows | None = None  # this process's scanned rows, built on first use
        self.refresh_step: int | None = None  # the step before which the scanned rows were last re-embedded
        self._index = (
            None  # two-stage search: a faiss index over this process's rows of B, built on first use
        )
        self._measure_overlap = False
        self._h_cache: tuple | None = None  # (key, h's weights, h(rows)): `_corrected_rows`
        self.metrics: dict[str, float] = {}  # logged with the step, then cleared (`pop_metrics`)

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
        self.device = device
        self.refresh_dir = Path(refresh_dir) if refresh_dir is not None else None
        self._resident = None

    @property
    def k(self) -> int:
        return self.cfg.k

    def begin_step(self, step: int) -> None:
        """Called first at optimizer step `step`: two-stage search measures itself against exact every
        `overlap_every` steps."""
        self._measure_overlap = self.cfg.search == "two_stage" and step % self.cfg.overlap_every == 0

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        """Called before optimizer step `step` (0-based); refreshing strategies re-embed here."""

    def refreshes_at(self, step: int) -> bool:
        """Whether `before_step(step)` replaces the scanned rows before anything reads them."""
        return False

    def search_space(self) -> PassageBuffer | torch.Tensor:
        """All rows the queries are scored against at this step (row i = corpus row i)."""
        return self.buffer

    def extra_rows_source(self) -> PassageBuffer | torch.Tensor:
        """Where Algorithm 1's forced and uniform rows are scored from (row i = corpus row i)."""
        return self.search_space()

    def _scanned(self) -> tuple[PassageBuffer | Tensor, Tensor | None, Tensor | None]:
        """(rows scanned by the top-k, their corpus rows or None for 0..n-1, this process's share of them as
        a tensor when it is already in memory, else None)."""
        return self.search_space(), None, None

    def select(
        self,
        queries: torch.Tensor,
        corrector: torch.nn.Module | None = None,
        include: torch.Tensor | None = None,
        num_random: int = 0,
    ) -> TopK:
        """Row indices (into the corpus / buffer) of S_x for each query, and their selection scores."""
        corrector = self._corrector_for_selection(corrector)
        width = min(self.k + (0 if include is None else include.shape[1]), len(self.buffer))
        top = self._topk(queries, corrector, width)
        if include is None and not num_random:
            return top
        return complete_selection(
            queries,
            self.extra_rows_source(),
            corrector,
            top,
            self.k,
            include=include,
            num_random=num_random,
            generator=self.generator,
        )

    def top(self, queries: Tensor, corrector, k: int) -> TopK:
        """The top `k` rows by this strategy's own scoring as it stands (k may exceed `strategy.k`): what its
        selection reads, without the additions of Algorithm 1. Collective when sharded: every process calls it,
        with the same number of queries."""
        return self._topk(queries, self._corrector_for_selection(corrector), min(k, len(self.buffer)))

    def _topk(self, queries: Tensor, corrector, k: int) -> TopK:
        scanned, row_ids, _ = self._scanned()
        k = min(k, len(scanned))
        if self.cfg.search == "two_stage":
            return self._two_stage_topk(queries, corrector, k)
        if not self.sharded and self.device is None:  # stream everything from host memory
            scanned, corrector = self._corrected_rows(scanned, corrector, queries.device)
            top = corrected_topk(queries, scanned, corrector, k, chunk_size=self.chunk_size)
            return top if row_ids is None else TopK(top.scores, row_ids.to(top.indices.device)[top.indices])
        if self._resident is None:
            self._resident = self._make_resident()
        rows, corrector = self._corrected_rows(self._resident.vectors, corrector, queries.device)
        resident = self._resident
        if rows is not resident.vectors:
            resident = ShardedRows(rows, resident.row_ids, resident.procs)
        return resident.topk(queries, corrector, k, self.chunk_size)

    def _corrected_rows(
        self, rows, corrector, device
    ) -> tuple[PassageBuffer | Tensor, torch.nn.Module | None]:
        """(rows to scan, corrector to apply while scanning): h(rows) computed once and reused while neither
        the rows nor any weight of h changed, so the reader-only steps do not run every row through h again
        for the same result. The weights are compared with a copy (h is small next to the rows; version
        counters would miss DeepSpeed's updates through `.data`). Rows too large for
        `strategy.cache_corrected_mb` are corrected chunk by chunk at every scan instead."""
        limit = self.cfg.cache_corrected_mb * 2**20
        width = rows.dim if isinstance(rows, PassageBuffer) else rows.shape[-1]
        weights = [p.detach() for p in corrector.parameters()] if corrector is not None else []
        # ZeRO-3 leaves empty placeholders in place of partitioned weights: nothing to compare.
        if not weights or any(w.numel() == 0 for w in weights) or len(rows) * width * 4 > limit:
            return rows, corrector
        key = (id(rows), len(rows), self.refresh_step, str(device), torch.is_autocast_enabled(device.type))
        if self._h_cache is not None:
            cached_key, cached_weights, corrected = self._h_cache
            same = len(cached_weights) == len(weights) and all(
                a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                for a, b in zip(cached_weights, weights)
            )
            if cached_key == key and same:
                return corrected, None
        self._h_cache = None  # the stale copy goes before the new one is built
        corrected = correct_buffer(rows, corrector, self.chunk_size, device)
        self._h_cache = (key, [w.clone() for w in weights], corrected)
        return corrected, None

    def _two_stage_topk(self, queries: Tensor, corrector, k: int) -> TopK:
        if self._resident is None:
            self._resident = self._make_resident()
        if self.cfg.first_stage == "scan":
            search = (None, self.cfg.candidates, None)
        else:
            if self._index is None:
                self._index = self._build_index(self._resident.vectors)
            nprobe = self.cfg.nprobe if "IVF" in self._index.factory else None
            search = (self._index, self.cfg.candidates, nprobe)
        top = self._resident.topk(queries, corrector, k, self.chunk_size, two_stage=search)
        if self._measure_overlap:
            exact = self._resident.topk(queries, corrector, k, self.chunk_size)
            same = (top.indices.unsqueeze(-1) == exact.indices.unsqueeze(-2)).any(-1) & (top.indices >= 0)
            self.metrics[f"two_stage_overlap@{k}"] = float(same.float().sum(-1).mean() / k)
            self._measure_overlap = False
        return top

    def _build_index(self, rows: PassageBuffer | Tensor):
        from retriever.index import PassageIndex

        rows = rows if isinstance(rows, PassageBuffer) else PassageBuffer(range(len(rows)), [rows.cpu()])
        factory = self.cfg.index_factory
        if factory == "auto":
            factory = auto_index_factory(len(rows))
        return PassageIndex.from_buffer(rows, factory)

    def _make_resident(self) -> ShardedRows:
        scanned, row_ids, mine = self._scanned()
        procs = self.procs if self.sharded else Processes()
        start, stop = procs.part(len(scanned))
        if mine is None:
            source = (
                scanned
                if isinstance(scanned, PassageBuffer)
                else PassageBuffer(range(len(scanned)), [scanned])
            )
            mine = _slice_rows(source, start, stop)
        if self.device is not None:
            rows = mine if isinstance(mine, Tensor) else mine.rows(torch.arange(len(mine)))
            mine = rows.to(self.device)
        ids = torch.arange(start, stop) if row_ids is None else row_ids[start:stop]
        return ShardedRows(mine, ids, procs)

    def _corrector_for_selection(self, corrector: torch.nn.Module | None) -> torch.nn.Module | None:
        return None

    def prune_refreshes(self, checkpoint_steps: Sequence[int]) -> None:
        """Delete the refreshed rows (`refresh_dir/step_<s>`) that neither this step nor a kept checkpoint
        needs; the main process calls it after every step, with the steps of the checkpoints it keeps.

        A checkpoint taken after s optimizer steps references the refresh done before the latest step < s, but
        a run resumed from it reads those rows only if step s does not refresh first (or if no step s follows).
        With checkpoints every 2R steps, each one falls on a refresh: only the current refresh is kept, not
        also the two the kept checkpoints reference (3 x 32 GB for 21M x 768 fp16 rows)."""
        if self.refresh_dir is None or not self.refresh_dir.is_dir():
            return
        found = sorted(int(p.name[5:]) for p in self.refresh_dir.glob("step_*") if p.name[5:].isdigit())
        keep = {self.refresh_step}
        for s in checkpoint_steps:
            if not (s < self.max_steps and self.refreshes_at(s)):
                keep.add(max((r for r in found if r < s), default=None))
        for r in found:
            if r not in keep:
                shutil.rmtree(self.refresh_dir / f"step_{r:07d}", ignore_errors=True)

    def state_dict(self) -> dict:
        return {"reembedded": self.reembedded, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.reembedded = int(state["reembedded"])
        self.generator.set_state(state["generator"])


class StaleStrategy(SelectionStrategy):
    name = "stale"


class FrozenStrategy(SelectionStrategy):
    name = "frozen"
    algorithms = (2,)
    trains_retriever = False


class CorrectorStrategy(SelectionStrategy):
    name = "corrector"
    uses_corrector = True

    def _corrector_for_selection(self, corrector):
        if corrector is None:
            raise ValueError("the corrector strategy needs a corrector network")
        return corrector


class InBatchStrategy(SelectionStrategy):
    """Algorithm 1's cheapest baseline: no buffer search; each question scores the batch's gold passages."""

    name = "in_batch"
    algorithms = (1,)  # its S_x are the batch's gold passages
    scans_fixed_buffer = False
    shares_batch = True

    def select(self, queries, corrector=None, include=None, num_random=0):
        if include is None:
            raise ValueError("in_batch selects the batch's labels: algorithm 1 only")
        include = include.to(queries.device)
        rows = self.buffer.rows(include).to(device=queries.device, dtype=torch.float32)
        with full_precision(queries.device):
            return TopK(torch.einsum("bd,bmd->bm", queries.float(), rows), include)


class ClosedBookStrategy(SelectionStrategy):
    name = "closed_book"
    algorithms = (2,)
    trains_retriever = False
    uses_passages = False
    scans_fixed_buffer = False

    def select(self, queries, corrector=None, include=None, num_random=0):
        raise RuntimeError("closed_book selects no passages")


class _Refreshed:
    """Re-embedded rows [start, stop) of the corpus: on disk as fp16 files (one per process) under a step's
    folder, memory-mapped for reading any row, plus this process's own share in memory for scanning."""

    def __init__(self, folder: Path | None, whole: PassageBuffer, mine: Tensor | None):
        self.folder, self.whole, self.mine = folder, whole, mine

    @staticmethod
    def file_name(rank: int, start: int, stop: int) -> str:
        return f"rank{rank:05d}_rows{start}-{stop}.npy"

    @classmethod
    def write(cls, folder: Path, procs: Processes, sharded: bool, n: int, part: Tensor) -> _Refreshed:
        start, stop = procs.part(n) if sharded else (0, n)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / cls.file_name(procs.rank, start, stop)
        with atomic_open(final, "wb") as fh:  # a file under its final name is complete
            np.save(fh, part.to(torch.float16).cpu().numpy())
        procs.barrier()  # every process's share is on disk before anyone opens them
        return cls.open(folder, procs, sharded, n, mine=part)

    @classmethod
    def open(cls, folder: Path, procs: Processes, sharded: bool, n: int, mine: Tensor | None = None):
        if sharded:
            names = [cls.file_name(r, *Processes(r, procs.world).part(n)) for r in range(procs.world)]
        else:
            names = [cls.file_name(procs.rank, 0, n)]
        missing = [name for name in names if not (folder / name).exists()]
        if missing:
            raise FileNotFoundError(
                f"refreshed rows {missing} not found in {folder}: the run folder is incomplete"
            )
        blocks = [torch.from_numpy(np.load(folder / name, mmap_mode="c")) for name in names]
        blocks = [b for b in blocks if b.shape[0]]
        return cls(folder, PassageBuffer(range(n), blocks), mine)


class _RefreshingStrategy(SelectionStrategy, abc.ABC):
    """Scores against a re-embedded copy of the buffer, refreshed on a schedule.

    With `refresh_dir` set (training runs), each refresh re-embeds this process's share of the corpus (N/W
    rows when sharded), writes it as fp16 under `refresh_dir/step_<s>/`, and checkpoints reference that folder
    instead of pickling N x D floats. Without it (tests, scripts) the refreshed rows stay in memory.
    """

    scans_fixed_buffer = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fresh: PassageBuffer | torch.Tensor | None = None  # None until the first refresh
        self._mine: Tensor | None = None  # this process's share of the fresh rows, in memory
        self._unopened = False  # a loaded checkpoint's refreshed rows, not opened yet (`_open_loaded`)

    @abc.abstractmethod
    def due(self, step: int) -> bool:
        """Whether the buffer is re-embedded before optimizer step `step`."""

    def refreshes_at(self, step: int) -> bool:
        return self.due(step)

    def prepare_refresh(self, step: int, embed_rows: EmbedRows) -> int:
        """Work a refresh does before its rows are computed; returns the passages it re-embedded (each once,
        however many processes shared the work). Exhaustive re-embeds them all in `refreshed_rows`."""
        return len(self.buffer)

    def refreshed_rows(self, start: int, stop: int, embed_rows: EmbedRows) -> Tensor:
        """Rows [start, stop) of the refreshed buffer: the corpus re-embedded by the current passage tower."""
        return embed_rows(range(start, stop))

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        if not self.due(step):
            return
        n = len(self.buffer)
        reembedded = self.prepare_refresh(step, embed_rows)
        if self.refresh_dir is None:
            # In memory (no run folder): every process computes and holds all rows.
            self.fresh = self.refreshed_rows(0, n, embed_rows).to(torch.float32)
            self._mine = None if self.sharded else self.fresh
        else:
            start, stop = self.procs.part(n) if self.sharded else (0, n)
            # fp16, as written: a run resumed from the files scans exactly what this one scans.
            part = self.refreshed_rows(start, stop, embed_rows).to(torch.float16)
            folder = self.refresh_dir / f"step_{step:07d}"
            refreshed = _Refreshed.write(folder, self.procs, self.sharded, n, part)
            self.fresh, self._mine = refreshed.whole, part
        self.refresh_step = step
        self.reembedded += reembedded
        self._resident = None
        self._unopened = False

    def search_space(self) -> PassageBuffer | torch.Tensor:
        self._open_loaded()
        return self.buffer if self.fresh is None else self.fresh

    def _scanned(self):
        return self.search_space(), None, (None if self.fresh is None else self._mine)

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "refresh_step": self.refresh_step}
        if self.refresh_dir is None:
            state["fresh"] = self.fresh  # in memory only (no run folder): pickled, as small runs afford
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.refresh_step = state.get("refresh_step")
        self._resident = None
        self.fresh = self._mine = None
        if "fresh" in state:
            self.fresh = state["fresh"]
            self._mine = None if self.sharded else self.fresh
        # The files are opened when first scanned: a checkpoint taken just before a refresh is resumed by
        # that refresh, which never reads them, and `prune_refreshes` has deleted them for that reason.
        self._unopened = "fresh" not in state and self.refresh_step is not None

    def _open_loaded(self) -> None:
        if not self._unopened:
            return
        n = len(self.buffer)
        folder = self.refresh_dir / f"step_{self.refresh_step:07d}"
        refreshed = _Refreshed.open(folder, self.procs, self.sharded, n)
        self.fresh = refreshed.whole
        start, stop = self.procs.part(n) if self.sharded else (0, n)
        self._mine = refreshed.whole.rows(torch.arange(start, stop))
        self._unopened = False


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
        mine = embed_rows(rows[start:stop].tolist()) if stop > start else None
        # The passage tower hands back host float32, and NCCL gathers device tensors only.
        device = procs.device or self.device or (mine.device if mine is not None else torch.device("cpu"))
        per = -(
            -count // procs.world
        )  # the gather needs one shape on every process: pad to the largest share
        padded = torch.zeros(per, self.buffer.dim, device=device)
        if mine is not None:
            padded[: stop - start] = mine.to(device=device, dtype=torch.float32)
        gathered = procs.gather(padded)
        shares = [Processes(r, procs.world).part(count) for r in range(procs.world)]
        return torch.cat([gathered[r * per : r * per + (b - a)] for r, (a, b) in enumerate(shares)])

    def refreshed_rows(self, start: int, stop: int, embed_rows: EmbedRows) -> Tensor:
        blocks = (block for _, block in _slice_rows(self.buffer, start, stop).iter_chunks(self.chunk_size))
        return self.model.apply_chunks(blocks, device=self.device)

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
    scans_fixed_buffer = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: torch.Tensor | None = None  # [M] corpus rows of the current subset
        self.subset: torch.Tensor | None = None  # this process's share of their fresh embeddings
        self._unopened = False  # a loaded checkpoint's subset, not opened yet (`_open_loaded`)

    def refreshes_at(self, step: int) -> bool:
        # A subset is needed from step 0; it is resampled every R retriever updates after that.
        trained = step - self.start_step
        return step == 0 or (trained > 0 and trained % self.cfg.refresh_every == 0 and step <= self.stop_step)

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
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
            _Refreshed.write(folder, self.procs, self.sharded, m, self.subset)
        self.refresh_step = step
        self.reembedded += m
        self._resident = None
        self._unopened = False

    def search_space(self) -> PassageBuffer | torch.Tensor:
        self._open_loaded()
        if self.subset is None:
            raise RuntimeError("SNM subset not sampled yet: call before_step first")
        return self.subset

    def extra_rows_source(self):
        return self.buffer

    def _scanned(self):
        self._open_loaded()
        if self.subset is None:
            raise RuntimeError("SNM subset not sampled yet: call before_step first")
        if not self.sharded:
            return self.subset, self.rows, None
        # The scanned set is the whole subset; this process holds (and scans) only its share.
        return _Sized(len(self.rows)), self.rows, self.subset

    def _topk(self, queries, corrector, k):
        self._open_loaded()
        if self.sharded and self._resident is None:
            start, stop = self.procs.part(len(self.rows))
            subset = self.subset if self.device is None else self.subset.to(self.device)
            self._resident = ShardedRows(subset, self.rows[start:stop], self.procs)
        return super()._topk(queries, corrector, k)

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "rows": self.rows, "refresh_step": self.refresh_step}
        if self.refresh_dir is None:
            state["subset"] = self.subset
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rows, self.refresh_step = state["rows"], state.get("refresh_step")
        self._resident = None
        self.subset = state.get("subset")
        # Opened when first scanned, as `_RefreshingStrategy` does: a resample first never reads it.
        self._unopened = "subset" not in state and self.rows is not None

    def _open_loaded(self) -> None:
        if not self._unopened:
            return
        m = len(self.rows)
        folder = self.refresh_dir / f"step_{self.refresh_step:07d}"
        refreshed = _Refreshed.open(folder, self.procs, self.sharded, m)
        start, stop = self.procs.part(m) if self.sharded else (0, m)
        self.subset = refreshed.whole.rows(torch.arange(start, stop))
        self._unopened = False


class _Sized:
    """Stands for a row set of known size that this process does not hold whole."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


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
    cfg: StrategyConfig,
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
