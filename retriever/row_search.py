"""The rows a selection strategy scans, wherever they live; the strategy's `select` runs the top-k over them.

`RowSearch` holds the rows a strategy scans at this step and decides nothing about them: where they live
(streamed from the memory-mapped buffer, or resident on a device), whether they are sharded across the
data-parallel processes (each scans its share; `rlm.retriever.distributed.merge_topk` merges the lists), whether
the top-k is exact or two-stage (Appendix B.2: candidates from a faiss index over the rows, re-scored with h;
`rlm.retriever.index_spec.TwoStage` describes it, `FirstStage` is what `scanned` hands the top-k),
and the h(rows) cache that spares the reader-only steps a pass of every row through an unchanged h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.distributed import Processes, ShardedRows, slice_rows
from rlm.retriever.index_spec import TwoStage, auto_index_factory  # noqa: F401 (auto_index_factory: its old home)
from rlm.retriever.search import TopK, correct_buffer

if TYPE_CHECKING:
    from rlm.retriever.index import PassageIndex


@dataclass(frozen=True)
class FirstStage:
    """Where two-stage search takes its candidates from (`RowSearch.scanned`): `index`, a faiss index over the
    rows, its search set as `TwoStage.index` says (None: a streamed scan of the stale rows), and `candidates`
    of them per query."""

    index: PassageIndex | None
    candidates: int


@dataclass(frozen=True)
class ScannedRows:
    """The rows one process scans for a top-k (`RowSearch.scanned`)."""

    vectors: PassageBuffer | Tensor  # this process's rows; h(rows) already, when the cache holds them
    corrector: torch.nn.Module | None  # h still to apply while scanning (None: stale, or already corrected)
    row_ids: Tensor | None  # the corpus row of each (None: row i is corpus row i)
    procs: Processes  # whose lists are merged (`rlm.retriever.distributed.merge_topk`); one process: none
    first_stage: FirstStage | None  # two-stage search's candidates; None: exact
    excluded: Tensor | None = None  # rows of `vectors` never returned (sorted; `RowSearch.exclude`)


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
        self.removed: Tensor | None = None  # corpus rows never returned (`exclude`)
        self._excluded: tuple | None = None  # (row_ids, its positions of removed rows): `_local_excluded`
        self.set_rows(0)

    def exclude(self, rows) -> None:
        """Never return these corpus rows (those of passages a corpus update replaced or deleted)."""
        rows = torch.as_tensor(rows, dtype=torch.long).unique()
        self.removed, self._excluded = (rows if len(rows) else None), None

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
        """The next two-stage top-k also computes the exact one (`overlap_due`) and logs their overlap."""
        self._measure_overlap = self.two_stage is not None

    def overlap_due(self) -> bool:
        """Whether this top-k is the one `measure_overlap` asked for (then it is not asked for again)."""
        due, self._measure_overlap = self._measure_overlap, False
        return due

    def scanned(self, corrector: torch.nn.Module | None, device: torch.device) -> ScannedRows:
        """What this process scans for a top-k through `corrector` (None: the rows as they are) on `device`:
        streamed from host memory when nothing is placed or sharded, else its resident share; h(rows) from
        the cache when it holds them."""
        if (
            self.two_stage is not None
        ):  # candidates by the stale rows, re-scored with h: h(rows) never scanned
            resident = self._resident_rows()
            stage = self._first_stage(resident.vectors)
            excluded = self._local_excluded(resident.row_ids)
            return ScannedRows(resident.vectors, corrector, resident.row_ids, resident.procs, stage, excluded)
        if not self.sharded and self.device is None:
            rows, corrector = self._corrected_rows(self.whole, corrector, device)
            excluded = self._local_excluded(self.row_ids)
            return ScannedRows(rows, corrector, self.row_ids, Processes(), None, excluded)
        resident = self._resident_rows()
        rows, corrector = self._corrected_rows(resident.vectors, corrector, device)
        excluded = self._local_excluded(resident.row_ids)
        return ScannedRows(rows, corrector, resident.row_ids, resident.procs, None, excluded)

    def _local_excluded(self, row_ids: Tensor | None) -> Tensor | None:
        """The positions in a set of rows (`row_ids`: the corpus row of each; None: row i is corpus row i) of
        the removed corpus rows, sorted; found once per set of rows."""
        if self.removed is None:
            return None
        if row_ids is None:
            return self.removed
        if self._excluded is None or self._excluded[0] is not row_ids:
            where = torch.isin(row_ids, self.removed.to(row_ids.device)).nonzero().squeeze(1).cpu()
            self._excluded = (row_ids, where)
        return self._excluded[1]

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
            # Every weight compared on the device, then one read of the answer (a host sync on a GPU), not
            # one per weight tensor.
            same = (
                cached_key == key
                and len(cached_weights) == len(weights)
                and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(cached_weights, weights))
                and not torch.cat([(a != b).flatten() for a, b in zip(cached_weights, weights)]).any()
            )
            if same:
                return corrected, None
        self._h_cache = None  # the stale copy goes before the new one is built
        corrected = correct_buffer(rows, corrector, self.chunk_size, device)
        self._h_cache = (key, [w.clone() for w in weights], corrected)
        return corrected, None

    def _first_stage(self, rows) -> FirstStage | None:
        """Two-stage search's first stage (a faiss index over `rows`, built on first use, or a stale scan);
        None for exact search."""
        settings = self.two_stage
        if settings is None:
            return None
        if settings.first_stage == "scan":
            return FirstStage(None, settings.candidates)
        if self._index is None:
            self._index = self._build_index(rows)
        return FirstStage(self._index, settings.candidates)

    def record_overlap(self, top: TopK, exact: TopK, k: int) -> None:
        """Log the fraction of the exact top-k that two-stage search found."""
        same = (top.indices.unsqueeze(-1) == exact.indices.unsqueeze(-2)).any(-1) & (top.indices >= 0)
        self.metrics[f"two_stage_overlap@{k}"] = float(same.float().sum(-1).mean() / k)

    def _build_index(self, rows: PassageBuffer | Tensor) -> PassageIndex:
        """The faiss index `two_stage.index` describes over `rows`, its search set as it says (tuned on rows
        made question-like unless its parameters are fixed)."""
        from rlm.retriever.index import PassageIndex

        rows = rows if isinstance(rows, PassageBuffer) else PassageBuffer(range(len(rows)), [rows.cpu()])
        spec = self.two_stage.index
        index = PassageIndex.from_buffer(rows, spec.factory, use_gpu=spec.use_gpu)
        index.apply_search(spec, rows)
        return index

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
