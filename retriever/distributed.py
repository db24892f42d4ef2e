"""Rows spread over data-parallel processes: each process's share, a top-k merged across all of them, and
re-embedded rows kept on disk as one fp16 file per process.

Nothing here knows about training: `Processes` carries the rank, the world size and the collectives (from
accelerate in training, from threads in tests), so the same code runs with one process, two CPU processes
(gloo) or many GPUs (NCCL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rlm.base.atomicio import atomic_open
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.search import TopK, corrected_topk, sort_desc_then_row


def _all_gather_identity(tensor: Tensor) -> Tensor:
    return tensor


def _no_barrier() -> None:
    return None


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

    @classmethod
    def of(cls, state) -> Processes:
        """The processes of an accelerate `Accelerator` or `PartialState`: its rank, world size and device, with
        accelerate's collectives (training, `rlm evaluate` under `accelerate launch`, a corpus every process
        opens); one process alone for None."""
        if state is None:
            return cls()
        from accelerate.utils import gather, gather_object

        return cls(
            state.process_index,
            state.num_processes,
            gather,
            state.wait_for_everyone,
            gather_object,
            device=state.device,  # NCCL gathers only tensors on this process's GPU
        )

    def part(self, n: int) -> tuple[int, int]:
        """This process's contiguous share [start, stop) of n rows."""
        per = -(-n // self.world)
        return min(self.rank * per, n), min((self.rank + 1) * per, n)


def slice_rows(source: PassageBuffer, start: int, stop: int) -> PassageBuffer:
    """Rows [start, stop) of a (memory-mapped) buffer as a buffer of views: nothing is copied."""
    views = []
    for offset, block in source.iter_chunks(max(len(source), 1)):  # one chunk per shard
        lo, hi = max(start, offset), min(stop, offset + block.shape[0])
        if lo < hi:
            views.append(block[lo - offset : hi - offset])
    if not views:
        return PassageBuffer(range(0), [torch.empty(0, source.dim, dtype=source.dtype)])
    return PassageBuffer(range(stop - start), views)


def merge_topk(procs: Processes, local: TopK, row_ids: Tensor | None, k: int, batch: int) -> TopK:
    """The top `k` of this process's `batch` queries over every process's rows.

    `local` is this process's top-k of *every* process's queries (all-gathered, process-major, `batch` each)
    over its own rows (indices into them, -1 where fewer were found); `row_ids` maps them to corpus rows
    (None: the same). The lists are all-gathered and each process keeps the global top-k of its own queries:
    the top-k over all rows under the ordering contract of `rlm.retriever.search` (score descending, then row
    ascending). With one process nothing is gathered."""
    scores, rows = local
    if row_ids is not None:
        mapped = row_ids.to(rows.device)[rows.clamp_min(0)]
        rows = torch.where(rows >= 0, mapped, torch.full_like(mapped, -1))
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


def no_rows(queries: Tensor) -> TopK:
    """The top-k of a process that holds no rows (more processes than rows): it still takes part in the
    gathers, with nothing of its own."""
    return TopK(
        torch.empty(queries.shape[0], 0, device=queries.device),
        torch.empty(queries.shape[0], 0, dtype=torch.long, device=queries.device),
    )


class ShardedRows:
    """Rows [n, D] one process scans, with the corpus row of each; a top-k is merged across all processes.

    Every process scores every process's queries against its own rows (queries are all-gathered, so a process
    needs only its share of the rows), then `merge_topk` keeps the global top-k of each process's own queries.
    """

    def __init__(self, vectors: PassageBuffer | Tensor, row_ids: Tensor, procs: Processes):
        self.vectors, self.row_ids, self.procs = vectors, row_ids, procs

    def topk(
        self, queries: Tensor, corrector, k: int, chunk_size: int, excluded: Tensor | None = None
    ) -> TopK:
        """The global top-k of this process's `queries`; `excluded`: positions among this process's rows
        (sorted) never returned (`corrected_topk`)."""
        all_queries = self.procs.gather(queries)  # [W*B, D]
        n = min(k, len(self.vectors))
        local = (
            corrected_topk(all_queries, self.vectors, corrector, n, chunk_size, excluded=excluded)
            if n
            else no_rows(all_queries)
        )
        return merge_topk(self.procs, local, self.row_ids, k, queries.shape[0])


class RefreshedRows:
    """Re-embedded rows of the corpus (n of them): on disk as fp16 files (one per process) under a step's
    folder, memory-mapped for reading any row, plus this process's own share in memory for scanning."""

    def __init__(self, whole: PassageBuffer, mine: Tensor | None):
        self.whole, self.mine = whole, mine

    @staticmethod
    def file_name(rank: int, start: int, stop: int) -> str:
        return f"rank{rank:05d}_rows{start}-{stop}.npy"

    @classmethod
    def write(cls, folder: Path, procs: Processes, sharded: bool, n: int, part: Tensor) -> RefreshedRows:
        """Write this process's `part` (its share when `sharded`, else all n rows); every process calls it."""
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
        whole = PassageBuffer(range(n), blocks)
        if mine is None:
            start, stop = procs.part(n) if sharded else (0, n)
            mine = whole.rows(torch.arange(start, stop))
        return cls(whole, mine)
