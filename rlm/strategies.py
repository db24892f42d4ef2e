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
| two_round | stale, B re-embedded once at max_steps / 2 | N |
| frozen | top-k <q, B>, retriever not trained | 0 |
| closed_book | none | 0 |
| in_batch (Algorithm 1) | the batch's gold passages | 0 |
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from retriever.buffer import PassageBuffer
from retriever.search import TopK, corrected_topk
from rlm.config import StrategyConfig

# Re-embeds the given corpus rows with the current passage tower (no gradient) -> [n, D] float32.
EmbedRows = Callable[[Sequence[int]], torch.Tensor]


class SelectionStrategy:
    """Base: stale top-k over the fixed buffer, nothing re-embedded. Subclasses change one thing each."""

    name = "stale"
    trains_retriever = True
    uses_passages = True
    uses_corrector = False
    shares_batch = False  # every question of a batch scores the union of the batch's S_x

    def __init__(
        self,
        cfg: StrategyConfig,
        buffer: PassageBuffer,
        max_steps: int,
        seed: int = 0,
        chunk_size: int = 65536,
        start_step: int = 0,
    ):
        self.cfg = cfg
        self.buffer = buffer  # the fixed stale buffer B; the corrector always reads this one
        self.max_steps = max_steps
        # The first step that updates the retriever (Algorithm 2's reader-only warm-up keeps it frozen
        # before): re-embedding schedules count from here, since re-embedding an unchanged tower buys nothing.
        self.start_step = start_step
        self.chunk_size = chunk_size
        self.reembedded = 0  # passages re-embedded so far (the paper's cost axis)
        self.generator = torch.Generator().manual_seed(seed)  # uniform negatives, SNM subsets
        self.shard: BufferShard | None = None  # set by shard_across_processes

    def shard_across_processes(
        self, rank: int, world: int, gather: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Hold only rows [rank*N/W, (rank+1)*N/W) of B and merge the processes' top-k (as Atlas shards its index)."""
        if isinstance(self, _RefreshingStrategy | SNMStrategy | InBatchStrategy | ClosedBookStrategy):
            raise ValueError(f"strategy.shard_buffer is not supported with the {self.name!r} strategy")
        self.shard = BufferShard(self.buffer, rank, world, gather)

    @property
    def k(self) -> int:
        return self.cfg.k

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        """Called before optimizer step `step` (0-based); refreshing strategies re-embed here."""

    def search_space(self) -> PassageBuffer | torch.Tensor:
        """What the queries are scored against at this step (the buffer itself streams its memory-mapped shards)."""
        return self.buffer

    def select(
        self,
        queries: torch.Tensor,
        corrector: torch.nn.Module | None = None,
        include: torch.Tensor | None = None,
        num_random: int = 0,
    ) -> TopK:
        """Row indices (into the corpus / buffer) of S_x for each query, and their selection scores."""
        if self.shard is not None:
            if include is not None or num_random:
                raise ValueError(
                    "strategy.shard_buffer supports plain top-k only (no forced labels or random rows)"
                )
            return self.shard.topk(queries, self._corrector_for_selection(corrector), self.k, self.chunk_size)
        return corrected_topk(
            queries,
            self.search_space(),
            self._corrector_for_selection(corrector),
            self.k,
            chunk_size=self.chunk_size,
            include=include,
            num_random=num_random,
            generator=self.generator,
        )

    def _corrector_for_selection(self, corrector: torch.nn.Module | None) -> torch.nn.Module | None:
        return None

    def state_dict(self) -> dict:
        return {"reembedded": self.reembedded, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.reembedded = int(state["reembedded"])
        self.generator.set_state(state["generator"])


class StaleStrategy(SelectionStrategy):
    name = "stale"


class FrozenStrategy(SelectionStrategy):
    name = "frozen"
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
    shares_batch = True

    def select(self, queries, corrector=None, include=None, num_random=0):
        if include is None:
            raise ValueError("in_batch selects the batch's labels: algorithm 1 only")
        include = include.to(queries.device)
        rows = self.buffer.rows(include).to(device=queries.device, dtype=torch.float32)
        return TopK(torch.einsum("bd,bmd->bm", queries.float(), rows), include)


class ClosedBookStrategy(SelectionStrategy):
    name = "closed_book"
    trains_retriever = False
    uses_passages = False

    def select(self, queries, corrector=None, include=None, num_random=0):
        raise RuntimeError("closed_book selects no passages")


class _RefreshingStrategy(SelectionStrategy, abc.ABC):
    """Scores against a re-embedded copy of the buffer, refreshed on a schedule."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fresh: torch.Tensor | None = None  # [N, D] re-embedded buffer, None until the first refresh

    @abc.abstractmethod
    def due(self, step: int) -> bool:
        """Whether the buffer is re-embedded before optimizer step `step`."""

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        if self.due(step):
            self.fresh = embed_rows(range(len(self.buffer))).to(torch.float32)
            self.reembedded += len(self.buffer)

    def search_space(self) -> PassageBuffer | torch.Tensor:
        return self.buffer if self.fresh is None else self.fresh

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fresh": self.fresh}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.fresh = state["fresh"]


class ExhaustiveStrategy(_RefreshingStrategy):
    """Re-embed every passage every R retriever updates (the buffer is fresh until the first update)."""

    name = "exhaustive"

    def due(self, step: int) -> bool:
        trained = step - self.start_step
        return trained > 0 and trained % self.cfg.refresh_every == 0


class TwoRoundStrategy(_RefreshingStrategy):
    """Stale for the first half, then one full re-embedding."""

    name = "two_round"

    def due(self, step: int) -> bool:
        half = self.start_step + (self.max_steps - self.start_step) // 2
        return step == half and step > self.start_step


class SNMStrategy(SelectionStrategy):
    """Stochastic negative mining: top-k over a random subset of M passages, re-embedded every R steps."""

    name = "snm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: torch.Tensor | None = None  # [M] corpus rows of the current subset
        self.subset: torch.Tensor | None = None  # [M, D] their fresh embeddings

    def before_step(self, step: int, embed_rows: EmbedRows) -> None:
        trained = step - self.start_step
        # A subset is needed from step 0; it is resampled every R retriever updates after that.
        if step > 0 and (trained <= 0 or trained % self.cfg.refresh_every):
            return
        m = min(self.cfg.snm_size, len(self.buffer))
        self.rows = torch.randperm(len(self.buffer), generator=self.generator)[:m].sort().values
        self.subset = embed_rows(self.rows.tolist()).to(torch.float32)
        self.reembedded += m

    def select(self, queries, corrector=None, include=None, num_random=0):
        if self.subset is None:
            raise RuntimeError("SNM subset not sampled yet: call before_step first")
        k = min(self.k, len(self.rows))
        top = corrected_topk(queries, self.subset, None, k, chunk_size=self.chunk_size)
        indices = self.rows.to(top.indices.device)[top.indices]
        if include is None and not num_random:
            return TopK(top.scores, indices)
        # The label and the uniform negatives come from the whole corpus, scored against their stale rows.
        extra = [] if include is None else [include.to(queries.device)]
        if num_random:
            uniform = torch.randint(len(self.buffer), (num_random,), generator=self.generator)
            extra.append(uniform.to(queries.device).expand(len(queries), -1))
        extra_idx = torch.cat(extra, dim=1)
        extra_rows = self.buffer.rows(extra_idx).to(device=queries.device, dtype=torch.float32)
        extra_scores = torch.einsum("bd,bmd->bm", queries.float(), extra_rows)
        return _merge(top.scores, indices, extra_scores, extra_idx)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rows": self.rows, "subset": self.subset}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rows, self.subset = state["rows"], state["subset"]


class BufferShard:
    """One process's contiguous slice of B; a step's top-k is merged across all processes' slices.

    Every process scores every process's queries against its own rows (queries are all-gathered, so each
    process needs only N/W rows in memory), then the per-shard top-k lists are all-gathered and each process
    keeps the global top-k of its own queries. The result equals the unsharded top-k (same ordering contract:
    score descending, then row ascending).
    """

    def __init__(
        self, buffer: PassageBuffer, rank: int, world: int, gather: Callable[[torch.Tensor], torch.Tensor]
    ):
        per = -(-len(buffer) // world)
        self.start, stop = min(rank * per, len(buffer)), min((rank + 1) * per, len(buffer))
        self.rows = buffer.rows(torch.arange(self.start, stop))
        self.rank, self.world, self.gather = rank, world, gather

    def topk(self, queries: torch.Tensor, corrector, k: int, chunk_size: int) -> TopK:
        batch = queries.shape[0]
        all_queries = self.gather(queries)  # [W*B, D]; every process has the same batch size
        k_local = min(k, self.rows.shape[0])
        local = corrected_topk(all_queries, self.rows, corrector, k_local, chunk_size=chunk_size)
        scores = self.gather(local.scores.contiguous())  # [W * W*B, k_local], process-major
        rows = self.gather((local.indices + self.start).contiguous())
        mine = slice(self.rank * batch, (self.rank + 1) * batch)
        scores = torch.cat([part[mine] for part in scores.chunk(self.world)], dim=1)
        rows = torch.cat([part[mine] for part in rows.chunk(self.world)], dim=1)
        rows, order = rows.sort(dim=1)  # row ascending, then a stable sort by score descending
        scores, order2 = scores.gather(1, order).sort(dim=1, descending=True, stable=True)
        rows = rows.gather(1, order2)
        return TopK(scores[:, :k], rows[:, :k])


def _merge(scores_a, idx_a, scores_b, idx_b) -> TopK:
    """Append (scores_b, idx_b) to (scores_a, idx_a), dropping rows of b already in a (or repeated in b).

    Rows end up with different lengths; the result is padded with index -1 and score -inf.
    """
    out_scores, out_idx = [], []
    for sa, ia, sb, ib in zip(scores_a, idx_a, scores_b, idx_b):
        seen = set(ia.tolist())
        keep = []
        for j, row in enumerate(ib.tolist()):
            if row not in seen:
                seen.add(row)
                keep.append(j)
        out_scores.append(torch.cat([sa, sb[keep]]))
        out_idx.append(torch.cat([ia, ib[keep]]))
    width = max(len(i) for i in out_idx)
    scores = torch.full((len(out_idx), width), float("-inf"), device=scores_a.device)
    idx = torch.full((len(out_idx), width), -1, dtype=torch.long, device=idx_a.device)
    for r, (s, i) in enumerate(zip(out_scores, out_idx)):
        scores[r, : len(s)], idx[r, : len(i)] = s, i
    return TopK(scores, idx)


STRATEGY_CLASSES: dict[str, type[SelectionStrategy]] = {
    cls.name: cls
    for cls in (
        InBatchStrategy,
        CorrectorStrategy,
        StaleStrategy,
        ExhaustiveStrategy,
        SNMStrategy,
        TwoRoundStrategy,
        FrozenStrategy,
        ClosedBookStrategy,
    )
}


def make_strategy(
    cfg: StrategyConfig,
    buffer: PassageBuffer,
    max_steps: int,
    seed: int = 0,
    chunk_size: int = 65536,
    start_step: int = 0,
) -> SelectionStrategy:
    """The strategy named by `cfg.name`; `start_step` is the first step that updates the retriever."""
    if cfg.name not in STRATEGY_CLASSES:
        raise ValueError(f"unknown strategy {cfg.name!r}; choose one of {', '.join(STRATEGY_CLASSES)}")
    return STRATEGY_CLASSES[cfg.name](
        cfg, buffer, max_steps, seed=seed, chunk_size=chunk_size, start_step=start_step
    )
