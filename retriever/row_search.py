"""The selection primitive every training strategy shares: the top-k rows by <q, h(row)>.

`RowSearch` holds the rows a strategy scans at this step and decides nothing about them: where they live
(streamed from the memory-mapped buffer, or resident on a device), whether they are sharded across the
data-parallel processes (each scans its share, the lists are merged: `retriever.distributed`), whether the top-k
is exact or two-stage (Appendix B.2: candidates from a faiss index over the rows, re-scored with h), and the
h(rows) cache that spares the reader-only steps a pass of every row through an unchanged h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from retriever.buffer import PassageBuffer
from retriever.distributed import Processes, ShardedRows, slice_rows
from retriever.search import TopK, correct_buffer, corrected_topk


def auto_index_factory(rows: int) -> str:
    """`strategy.index_factory: auto`: exact (Flat) below 100k rows; above, IVF with 4 sqrt(N) lists (faiss's
    guideline) storing fp16 (SQfp16), like the buffer: half of Flat's memory, scores within ~1e-4 of it, and the
    candidates are re-scored from the buffer anyway."""
    return "Flat" if rows < 100_000 else f"IVF{int(4 * rows**0.5)},SQfp16"


@dataclass(frozen=True)
class TwoStage:
    """Appendix B.2's search: `candidates` rows by the uncorrected score, from a faiss index over the rows
    (`first_stage="index"`) or a streamed scan (`"scan"`), re-scored with h."""

    candidates: int = 1024
    first_stage: str = "index"
    index_factory: str = "auto"
    nprobe: int = 64


class RowSearch:
    """Top-k over a set of rows (row i of the set = corpus row `row_ids[i]`), corrected by h when given one.

    `set_rows` says what is scanned: the whole set (`whole`), or only this process's share of it (`mine`) when
    the process does not hold the rest; `count` is the size of the whole set either way.
    """

    def __init__(self, chunk_size: int = 65536, two_stage: TwoStage | None = None, cache_bytes: int = 0):
        self.chunk_size, self.two_stage, self.cache_bytes = chunk_size, two_stage, cache_bytes
        self.procs, self.sharded, self.device = Processes(), False, None
        self.metrics: dict[str, float] = {}  # logged with the step, then cleared by the strategy
        self._measure_overlap = False
        self.set_rows(0)

    def place(self, procs: Processes, shard: bool, device: torch.device | None) -> None:
        """Shard the rows across `procs` (`shard`) and keep them on `device` (None: host memory, streamed)."""
        self.procs, self.sharded, self.device = procs, shard and procs.world > 1, device
        self._resident = self._index = None

    def set_rows(
        self, count: int, whole=None, mine: Tensor | None = None, row_ids: Tensor | None = None
    ) -> None:
        self.count, self.whole, self.mine, self.row_ids = count, whole, mine, row_ids
        self._resident = self._index = None
        self._h_cache: tuple | None = None  # (key, h's weights, h(rows)): `_corrected_rows`

    def measure_overlap(self) -> None:
        """The next two-stage top-k also computes the exact one and logs their overlap."""
        self._measure_overlap = self.two_stage is not None

    def topk(self, queries: Tensor, corrector, k: int) -> TopK:
        """The top `k` rows for each query. Collective when sharded: every process calls it, with the same
        number of queries."""
        k = min(k, self.count)
        if self.two_stage is not None:
            return self._two_stage_topk(queries, corrector, k)
        if not self.sharded and self.device is None:  # stream everything from host memory
            rows, corrector = self._corrected_rows(self.whole, corrector, queries.device)
            top = corrected_topk(queries, rows, corrector, k, chunk_size=self.chunk_size)
            if self.row_ids is None:
                return top
            return TopK(top.scores, self.row_ids.to(top.indices.device)[top.indices])
        resident = self._resident_rows()
        rows, corrector = self._corrected_rows(resident.vectors, corrector, queries.device)
        if rows is not resident.vectors:
            resident = ShardedRows(rows, resident.row_ids, resident.procs)
        return resident.topk(queries, corrector, k, self.chunk_size)

    def _corrected_rows(
        self, rows, corrector, device
    ) -> tuple[PassageBuffer | Tensor, torch.nn.Module | None]:
        """(rows to scan, corrector to apply while scanning): h(rows) computed once and reused while neither
        the rows nor any weight of h changed, so the reader-only steps do not run every row through h again
        for the same result. The weights are compared with a copy (h is small next to the rows; version
        counters would miss DeepSpeed's updates through `.data`). Rows larger than `cache_bytes` are corrected
        chunk by chunk at every scan instead."""
        width = rows.dim if isinstance(rows, PassageBuffer) else rows.shape[-1]
        weights = [p.detach() for p in corrector.parameters()] if corrector is not None else []
        # ZeRO-3 leaves empty placeholders in place of partitioned weights: nothing to compare.
        if not weights or any(w.numel() == 0 for w in weights) or len(rows) * width * 4 > self.cache_bytes:
            return rows, corrector
        key = (id(rows), len(rows), str(device), torch.is_autocast_enabled(device.type))
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
        resident, settings = self._resident_rows(), self.two_stage
        if settings.first_stage == "scan":
            search = (None, settings.candidates, None)
        else:
            if self._index is None:
                self._index = self._build_index(resident.vectors)
            nprobe = settings.nprobe if "IVF" in self._index.factory else None
            search = (self._index, settings.candidates, nprobe)
        top = resident.topk(queries, corrector, k, self.chunk_size, two_stage=search)
        if self._measure_overlap:
            exact = resident.topk(queries, corrector, k, self.chunk_size)
            same = (top.indices.unsqueeze(-1) == exact.indices.unsqueeze(-2)).any(-1) & (top.indices >= 0)
            self.metrics[f"two_stage_overlap@{k}"] = float(same.float().sum(-1).mean() / k)
            self._measure_overlap = False
        return top

    def _build_index(self, rows: PassageBuffer | Tensor):
        from retriever.index import PassageIndex

        rows = rows if isinstance(rows, PassageBuffer) else PassageBuffer(range(len(rows)), [rows.cpu()])
        factory = self.two_stage.index_factory
        if factory == "auto":
            factory = auto_index_factory(len(rows))
        return PassageIndex.from_buffer(rows, factory)

    def _resident_rows(self) -> ShardedRows:
        """This process's rows (its share when sharded), on `device` when one is set; built on first use."""
        if self._resident is not None:
            return self._resident
        procs = self.procs if self.sharded else Processes()
        start, stop = procs.part(self.count)
        mine = self.mine
        if mine is None:
            whole = self.whole
            if not isinstance(whole, PassageBuffer):
                whole = PassageBuffer(range(len(whole)), [whole])
            mine = slice_rows(whole, start, stop)
        if self.device is not None:
            rows = mine if isinstance(mine, Tensor) else mine.rows(torch.arange(len(mine)))
            mine = rows.to(self.device)
        ids = torch.arange(start, stop) if self.row_ids is None else self.row_ids[start:stop]
        self._resident = ShardedRows(mine, ids, procs)
        return self._resident
