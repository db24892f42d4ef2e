"""Top-k of <q, h(B_y)> over the whole buffer, streamed chunk by chunk (Algorithm 2, step 2).

h(B) is shared by every query of a step, so each chunk of the buffer is corrected once and scored against
all B queries; a running top-k is merged with each chunk's candidates. Extra memory is O(chunk x hidden)
for h plus O(B x chunk) scores, never O(N x hidden).

Ordering contract (what "exact" means in the tests): scores are sorted in descending order and equal
scores are ordered by ascending buffer row, exactly as a stable sort of the full score matrix would.

Devices: the buffer may stay where it is (host memory, memory-mapped) while the queries and h live on an
accelerator. Rows are read where the buffer is and moved to the queries' device; every returned tensor is
on the queries' device. h gets the rows in its parameters' dtype (bf16 under DeepSpeed) unless an autocast
is in force.

Precision: scores are float32 products of float32 operands whatever autocast is in force (h itself runs
under it); only an explicit `compute_dtype` lowers them.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor, nn

from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.errors import InputError


class TopK(NamedTuple):
    """`scores` [B, k'] float32 (descending) and `indices` [B, k'] long buffer rows."""

    scores: Tensor
    indices: Tensor


def _as_buffer(buffer: PassageBuffer | Tensor) -> PassageBuffer:
    if isinstance(buffer, PassageBuffer):
        return buffer
    if not isinstance(buffer, Tensor) or buffer.dim() != 2:
        raise ValueError("buffer must be a PassageBuffer or a [N, D] tensor")
    return PassageBuffer(range(buffer.shape[0]), [buffer])


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def full_precision(device: torch.device):
    """A block where autocast lowers no matmul, for scores and logits: under bf16 autocast (accelerate's
    `mixed_precision: bf16` wraps the whole step in it) cosines near 0.5-1 come out in steps of 1/256, a
    query's top-32 holds a handful of distinct values, ties at the k-th slot go to the lowest rows, and
    beta * s (~16) carries steps of 0.125 into the losses."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _score_matrix(queries: Tensor, vectors: Tensor, dtype: torch.dtype) -> Tensor:
    """<q_b, v_n> [B, n] float32, computed in `dtype` (float32: whatever autocast is in force)."""
    if dtype == torch.float32:
        with full_precision(queries.device):
            return queries.float() @ vectors.float().T
    return (queries.to(dtype) @ vectors.to(dtype).T).float()


def _correct(corrector: nn.Module | None, vectors: Tensor) -> Tensor:
    """h(vectors), or the vectors themselves without a corrector."""
    if corrector is None:
        return vectors
    param = next(corrector.parameters(), None)
    # Buffer rows are float16/float32 whatever h was cast to (DeepSpeed bf16 casts the whole model), and a
    # Linear refuses another dtype; under autocast, its own casts already reconcile them.
    if param is not None and not torch.is_autocast_enabled(vectors.device.type):
        vectors = vectors.to(param.dtype)
    return corrector(vectors)


def sort_desc_then_row(scores: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Reorder each row's (score, row) pairs by score descending, then buffer row ascending."""
    rows, perm = rows.sort(dim=1)
    scores = scores.gather(1, perm)
    scores, perm = scores.sort(dim=1, descending=True, stable=True)
    return scores, rows.gather(1, perm)


def _score_then_row_keys(scores: Tensor) -> Tensor:
    """int64 keys [B, c] of float32 scores [B, c] that order as the contract does: a larger key is a higher
    score, and among equal scores the lower column. The high 32 bits are the score's bits made monotone (a
    negative float's magnitude bits flipped, -0.0 taken as 0.0); the low 32 bits are the column, reversed."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, which it equals
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    column = torch.arange(scores.shape[1], device=scores.device)
    return monotone * 2**32 + (2**32 - 1 - column)


# Devices where the tie width of a chunk's top-k is read back to the host: on a CPU that read waits for
# nothing, and a float topk is ~5x faster there than the keyed one (10 ms against 1 ms for 8 queries x 65k rows).
HOST_TIE_WIDTH_DEVICES = ("cpu",)


def _chunk_candidates(scores: Tensor, start: int, k: int) -> tuple[Tensor, Tensor]:
    """The exact top-k of one chunk's scores [B, c] under the ordering contract, as (scores, rows)."""
    batch, width = scores.shape
    if k >= width:
        rows = torch.arange(start, start + width, device=scores.device).expand(batch, width)
        return sort_desc_then_row(scores, rows)
    if scores.device.type not in HOST_TIE_WIDTH_DEVICES:
        # topk breaks ties arbitrarily, so a tie at the k-th score could pick the wrong rows. Keys that hold
        # the column beside the score have no ties: their topk is the contract's top-k, in its order, without
        # asking the device how wide the ties run (a host sync per chunk: ~40 a selection for a process
        # scanning 2.6M of 21M rows).
        positions = _score_then_row_keys(scores).topk(k, dim=1).indices
        return scores.gather(1, positions), positions + start
    values, positions = scores.topk(k, dim=1)
    # All rows scoring >= the k-th value are the top `widest` of their query, so one wider topk holds every
    # tied row, and the row-ordered sort below picks the lowest rows among them. (Ties are common in bf16,
    # rare in fp32.)
    widest = int((scores >= values[:, -1:]).sum(dim=1).max())
    if widest > k:
        values, positions = scores.topk(widest, dim=1)
    values, rows = sort_desc_then_row(values, positions + start)
    return values[:, :k], rows[:, :k]


def _merge(
    run_scores: Tensor, run_rows: Tensor, scores: Tensor, rows: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    # Both inputs follow the ordering contract and every running row precedes every new one, so a stable
    # sort of the concatenation keeps it.
    all_scores = torch.cat([run_scores, scores], dim=1)
    all_rows = torch.cat([run_rows, rows], dim=1)
    all_scores, perm = all_scores.sort(dim=1, descending=True, stable=True)
    return all_scores[:, :k], all_rows.gather(1, perm[:, :k])


def score_rows(
    queries: Tensor,
    buffer: PassageBuffer | Tensor,
    corrector: nn.Module | None,
    rows: Tensor,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """<q_b, h(B_rows[b, j])> [B, m] float32 on the queries' device (no grad); `rows` may be on any device."""
    buf = _as_buffer(buffer)
    dtype = compute_dtype or torch.float32
    # Queries of a batch often share candidates: correct each distinct row once, score it against all
    # queries, then pick each query's own columns.
    unique_rows, inverse = rows.clamp(min=0).unique(return_inverse=True)
    with torch.no_grad(), _autocast(queries.device, dtype):
        vectors = _correct(corrector, buf.rows(unique_rows).to(device=queries.device, dtype=dtype))
        scores = _score_matrix(queries.detach(), vectors, dtype)
    return scores.gather(1, inverse.reshape(rows.shape).to(scores.device))


def _random_rows(n: int, count: int, generator: torch.Generator | None) -> Tensor:
    """`count` distinct uniform rows of [0, n)."""
    count = min(count, n)
    if count * 4 >= n:
        return torch.randperm(n, generator=generator)[:count]
    picked = torch.empty(0, dtype=torch.long)
    while picked.numel() < count:
        draw = torch.randint(0, n, (2 * count,), generator=generator)
        picked = torch.cat([picked, draw])
        _, first = _unique_first(picked)
        picked = picked[first]
    return picked[:count]


def _unique_first(values: Tensor) -> tuple[Tensor, Tensor]:
    """Unique values and the position of each one's first occurrence, in order of first occurrence."""
    uniq, inverse = values.unique(return_inverse=True)
    positions = torch.arange(values.numel())
    first = torch.full((uniq.numel(),), values.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, positions, reduce="amin"
    )
    return uniq, first.sort().values


def corrected_topk(
    queries: Tensor,
    buffer: PassageBuffer | Tensor,
    corrector: nn.Module | None,
    k: int,
    chunk_size: int = 65536,
    include: Tensor | None = None,
    num_random: int = 0,
    generator: torch.Generator | None = None,
    compute_dtype: torch.dtype | None = None,
    excluded: Tensor | None = None,
) -> TopK:
    """Top-k buffer rows per query by <q, h(B_y)> over every row (h = `corrector`, None = stale buffer).

    - k > N returns all N rows.
    - `include` [B, m] (row ids, -1 = none) forces rows into each query's set: the result has k + m
      columns = the included rows (deduplicated) + the best other rows filling the rest, so an included
      row already in the top-k costs no slot and the next best row takes it.
    - `num_random` adds that many uniform random rows, the same ones for the whole batch (Appendix B.1),
      except that a query whose set already holds one of them gets the next random row instead.
    - `excluded` (sorted rows): rows never returned while others are left (their score is -inf; a corpus
      update replaced or deleted their passages), nor drawn as random rows.
    All columns are ordered by the ordering contract (scores descending, then row ascending); scores
    are float32 in the query's device, computed in float32 whatever the autocast. Computed without grad;
    `compute_dtype` (e.g. torch.bfloat16) is used for h and the scoring matmul instead.
    """
    buf = _as_buffer(buffer)
    if queries.dim() != 2 or queries.shape[1] != buf.dim:
        raise ValueError(f"queries must be [B, {buf.dim}] to match the buffer, got {tuple(queries.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n, batch, device = len(buf), queries.shape[0], queries.device
    if include is not None:
        if include.dim() != 2 or include.shape[0] != batch:
            raise ValueError(f"include must be [{batch}, m] row ids, got shape {tuple(include.shape)}")
        if include.numel() and int(include.max()) >= n:
            raise ValueError(f"include row {int(include.max())} is out of range for a buffer of {n} rows")
    dtype = compute_dtype or torch.float32
    extra = 0 if include is None else include.shape[1]
    keep = min(k + extra, n)
    run_scores = torch.empty(batch, 0, device=device)
    run_rows = torch.empty(batch, 0, dtype=torch.long, device=device)
    with torch.no_grad(), _autocast(device, dtype):
        q = queries.detach().to(dtype)
        for start, chunk in buf.iter_chunks(chunk_size):
            vectors = _correct(corrector, chunk.to(device=device, dtype=dtype, non_blocking=True))
            scores = _without_excluded(_score_matrix(q, vectors, dtype), start, excluded)
            cand_scores, cand_rows = _chunk_candidates(scores, start, keep)
            run_scores, run_rows = _merge(run_scores, run_rows, cand_scores, cand_rows, keep)
    top = TopK(run_scores, run_rows)
    return complete_selection(
        queries, buf, corrector, top, k, include, num_random, generator, dtype, excluded
    )


def _without_excluded(scores: Tensor, start: int, excluded: Tensor | None) -> Tensor:
    """`scores` [B, c] of rows [start, start + c) with the `excluded` rows' set to -inf."""
    if excluded is None or not len(excluded):
        return scores
    bounds = torch.tensor([start, start + scores.shape[1]])
    first, last = torch.searchsorted(excluded, bounds).tolist()
    if first < last:
        scores[:, (excluded[first:last] - start).to(scores.device)] = float("-inf")
    return scores


def correct_buffer(
    buffer: PassageBuffer | Tensor, corrector: nn.Module, chunk_size: int = 65536, device=None
) -> PassageBuffer:
    """h(B) in float32 on `device`, cut into the very chunks `corrected_topk` scores: searching the result with
    no corrector gives `corrected_topk(queries, buffer, corrector, ...)` bit for bit (same rows through h, same
    matmuls), so a caller may keep it while h does not change."""
    buf = _as_buffer(buffer)
    with torch.no_grad():
        shards = [
            _correct(corrector, chunk.to(device=device, dtype=torch.float32, non_blocking=True)).float()
            for _, chunk in buf.iter_chunks(chunk_size)
        ]
    return PassageBuffer(range(len(buf)), shards)


def complete_selection(
    queries: Tensor,
    buffer: PassageBuffer | Tensor,
    corrector: nn.Module | None,
    top: TopK,
    k: int,
    include: Tensor | None = None,
    num_random: int = 0,
    generator: torch.Generator | None = None,
    compute_dtype: torch.dtype | None = None,
    excluded: Tensor | None = None,
) -> TopK:
    """Force `include` rows into a top-(k + m) list and add `num_random` uniform rows (never `excluded` ones),
    as `corrected_topk` documents. `top` must hold the best k + m rows (m = include's width) of the whole buffer; the forced and
    random rows are scored by reading them from `buffer`, so a sharded search (each process scanning only its
    rows) finishes its merged top-k here against the whole, memory-mapped, buffer."""
    buf = _as_buffer(buffer)
    dtype = compute_dtype or torch.float32
    scores, rows = top
    if include is not None:
        scores, rows = _force_include(
            queries, buf, corrector, include.to(rows.device), scores, rows, k, dtype
        )
    if num_random > 0:
        scores, rows = _add_random(
            queries, buf, corrector, scores, rows, num_random, generator, dtype, excluded
        )
    return TopK(scores, rows)


def _force_include(queries, buf, corrector, include, top_scores, top_rows, k, dtype) -> tuple[Tensor, Tensor]:
    width = min(k + include.shape[1], len(buf))
    inc_scores = score_rows(queries, buf, corrector, include, dtype)
    out_scores, out_rows = [], []
    for b in range(queries.shape[0]):
        forced = include[b][include[b] >= 0].unique()
        forced_scores = (
            torch.stack([inc_scores[b][include[b] == r][0] for r in forced])
            if forced.numel()
            else inc_scores[b][:0]
        )
        others = ~torch.isin(top_rows[b], forced)
        fill = width - forced.numel()
        rows = torch.cat([forced, top_rows[b][others][:fill]])
        scores = torch.cat([forced_scores, top_scores[b][others][:fill]])
        out_scores.append(scores)
        out_rows.append(rows)
    return sort_desc_then_row(torch.stack(out_scores), torch.stack(out_rows))


def _add_random(
    queries, buf, corrector, top_scores, top_rows, num_random, generator, dtype, excluded=None
) -> tuple[Tensor, Tensor]:
    skipped = 0 if excluded is None else len(excluded)
    n, width = len(buf), top_rows.shape[1]
    num_random = min(num_random, n - skipped - width)
    if num_random <= 0:
        return top_scores, top_rows
    # A pool big enough that every query finds num_random rows not already in its set (nor excluded).
    pool = _live_random_rows(n, num_random + width, generator, excluded).to(top_rows.device)
    picks = []
    for b in range(top_rows.shape[0]):
        fresh = pool[~torch.isin(pool, top_rows[b])]
        picks.append(fresh[:num_random])
    random_rows = torch.stack(picks)
    random_scores = score_rows(queries, buf, corrector, random_rows, dtype)
    return sort_desc_then_row(
        torch.cat([top_scores, random_scores], 1), torch.cat([top_rows, random_rows], 1)
    )


def _live_random_rows(n: int, count: int, generator, excluded: Tensor | None) -> Tensor:
    """`count` distinct uniform rows of [0, n) none of which is `excluded` (sorted): drawn as many more as the
    excluded share asks for, so a step's draw does not grow with the number of excluded rows; only when that
    falls short are as many more drawn as there are excluded rows. Without `excluded`: `_random_rows`."""
    if excluded is None or not len(excluded):
        return _random_rows(n, count, generator)
    live = n - len(excluded)
    pool = _random_rows(n, min(n, -(-count * n // live) + count // 10 + 8), generator)
    pool = pool[~in_sorted(pool, excluded)]
    if len(pool) < count:
        pool = _random_rows(n, min(n, count + len(excluded)), generator)
        pool = pool[~in_sorted(pool, excluded)]
    return pool[:count]


def in_sorted(values: Tensor, rows: Tensor) -> Tensor:
    """Whether each of `values` is one of `rows` (sorted ascending), by binary search: O(m log n) for m values,
    where `torch.isin` would sort all n rows again at every call."""
    if not len(rows):
        return torch.zeros_like(values, dtype=torch.bool)
    rows = rows.to(values.device)
    at = torch.searchsorted(rows, values).clamp(max=len(rows) - 1)
    return rows[at] == values


def two_stage_corrected_topk(
    queries: Tensor,
    buffer: PassageBuffer | Tensor,
    corrector: nn.Module | None,
    k: int,
    index=None,
    num_candidates: int = 1024,
    compute_dtype: torch.dtype | None = None,
    nprobe: int | None = None,
    chunk_size: int = 65536,
    excluded: Tensor | None = None,
) -> TopK:
    """Appendix B.2: the top-`num_candidates` rows by the stale buffer, re-scored with h (`excluded` rows never
    among them while others are left, as in `corrected_topk`).

    The candidates come from a faiss `index` built over the same buffer rows (`rlm.retriever.index.PassageIndex
    .from_buffer`), or, with `index=None`, from a streamed scan of <q, B_y> over every row: the exact stale
    candidates, no index to build or hold, one read of the buffer per call (cheap where the buffer sits in
    accelerator memory; the expensive part of the exact corrected top-k is h on every row, not the read).
    Returns the top-k of the corrected scores among the candidates, under the same ordering contract; where
    an approximate index returned fewer than k candidates, the missing columns hold row -1 and score -inf.
    """
    buf = _as_buffer(buffer)
    candidates = min(max(num_candidates, k), len(buf))
    if index is None:
        rows = corrected_topk(
            queries, buf, None, candidates, chunk_size=chunk_size, excluded=excluded
        ).indices
        scores = score_rows(queries, buf, corrector, rows, compute_dtype)
        if excluded is not None and len(excluded):
            scores = scores.masked_fill(in_sorted(rows, excluded), float("-inf"))
        scores, rows = sort_desc_then_row(scores, rows)
        return TopK(scores[:, :k], rows[:, :k])
    if index.ntotal != len(buf):
        raise InputError(
            f"index holds {index.ntotal} vectors but the buffer has {len(buf)} rows; rebuild the index"
        )
    _, rows = index.search_rows(queries.detach().float().cpu().numpy(), candidates, nprobe=nprobe)
    rows = torch.from_numpy(rows).to(queries.device)
    scores = score_rows(queries, buf, corrector, rows, compute_dtype)
    # faiss marks "no result" (possible with IVF/HNSW) with -1: never select those, nor excluded rows.
    unwanted = rows < 0
    if excluded is not None and len(excluded):
        unwanted |= in_sorted(rows, excluded)
    scores = scores.masked_fill(unwanted, float("-inf"))
    scores, rows = sort_desc_then_row(scores, rows)
    keep = min(k, candidates)
    return TopK(scores[:, :keep], rows[:, :keep])
