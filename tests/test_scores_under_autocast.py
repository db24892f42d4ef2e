"""Scores, selections and the losses' logits are float32 whatever autocast is in force.

`mixed_precision: bf16` makes accelerate run the whole training step under autocast, where a matmul returns
bf16: cosines near 0.5-1 are rounded to steps of 1/256 (a query's top-32 among 20,000 rows then holds ~20
distinct values, and ties at the 32nd slot go to the lowest rows) and beta * s (~16) carries steps of 0.125
into the losses. The towers and h may run in bf16; what they are scored with may not. Each test runs under
`torch.autocast("cpu", dtype=torch.bfloat16)` (what a GPU's bf16 autocast does to these ops) and compares with
the same call without it.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rlm.training.steps
from rlm.config import StrategyConfig, TrainConfig
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.distributed import Processes
from rlm.retriever.search import corrected_topk, score_rows, two_stage_corrected_topk
from rlm.training.batch import Batch
from rlm.training.selection import QueryEmbeddingCache, select_window
from rlm.training.steps import algorithm1_step, algorithm2_step
from rlm.training.strategies import make_strategy

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def clustered(
    sizes: list[int], dim: int, generator: torch.Generator, spread: float = 0.6
) -> list[torch.Tensor]:
    """Unit vectors around one direction, as sentence embeddings are: cosines of 0.5-1, where bf16's step is
    1/256 (random directions would give cosines near 0, where bf16 is fine)."""
    centre = F.normalize(torch.randn(dim, generator=generator), dim=0)
    return [
        F.normalize(centre + spread * torch.randn(n, dim, generator=generator) / dim**0.5, dim=-1)
        for n in sizes
    ]


@pytest.fixture(scope="module")
def corpus():
    rows, queries = clustered([20_000, 16], 64, torch.Generator().manual_seed(0))
    buffer = PassageBuffer.from_embeddings([str(i) for i in range(len(rows))], rows.half())
    return buffer, queries


def trained_corrector(dim: int, seed: int = 0) -> CorrectorNetwork:
    torch.manual_seed(seed)
    corrector = CorrectorNetwork(dim, 2 * dim, linear=True)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.02)
        corrector.linear.weight.normal_(std=0.01)
    return corrector


def assert_same(got, ref, exact=True):
    assert got.scores.dtype == torch.float32
    assert torch.equal(got.indices, ref.indices)
    if exact:
        assert torch.equal(got.scores, ref.scores)
    else:
        torch.testing.assert_close(got.scores, ref.scores, rtol=0, atol=1e-4)


# ---- selection ---------------------------------------------------------------------------------------


def test_the_top_32_of_20000_rows_under_bf16_autocast_is_the_float32_top_32(corpus):
    buffer, queries = corpus
    identity = CorrectorNetwork(buffer.dim, 32)  # h at initialisation: the selection is the stale one
    for corrector in (None, identity):
        ref = corrected_topk(queries, buffer, corrector, 32, chunk_size=4096)
        with torch.autocast(**BF16):
            got = corrected_topk(queries, buffer, corrector, 32, chunk_size=4096)
        assert_same(got, ref)
    rows = ref.indices[:, ::3]
    ref_scores = score_rows(queries, buffer, None, rows)
    with torch.autocast(**BF16):
        got_scores = score_rows(queries, buffer, None, rows)
    assert got_scores.dtype == torch.float32 and torch.equal(got_scores, ref_scores)


@pytest.mark.parametrize("first_stage", ["index", "scan"])
def test_two_stage_selection_under_bf16_autocast(corpus, first_stage):
    from rlm.retriever.index import PassageIndex

    buffer, queries = corpus
    index = PassageIndex.from_buffer(buffer, "Flat", use_gpu=False) if first_stage == "index" else None
    ref = two_stage_corrected_topk(queries, buffer, None, 32, index, num_candidates=256)
    with torch.autocast(**BF16):
        got = two_stage_corrected_topk(queries, buffer, None, 32, index, num_candidates=256)
    assert_same(got, ref)


@pytest.mark.parametrize("name", ["stale", "corrector", "exhaustive", "snm"])
@pytest.mark.parametrize("placement", ["host", "resident"])
@pytest.mark.parametrize("cache_mb", [0, 1024])
def test_strategies_select_under_bf16_autocast_what_they_select_in_float32(corpus, name, placement, cache_mb):
    buffer, queries = corpus
    corrector = CorrectorNetwork(buffer.dim, 32)  # at initialisation (the identity), exact in bf16 too
    cfg = StrategyConfig(name=name, k=32, refresh_every=1, snm_size=5_000, cache_corrected_mb=cache_mb)

    def select():
        strategy = make_strategy(cfg, buffer, max_steps=4, seed=0)
        strategy.distribute(
            Processes(), False, device=torch.device("cpu") if placement == "resident" else None
        )
        # The live tower: B drifted (a refresh re-embeds every row, or SNM's subset, in float32).
        strategy.before_step(1, lambda rows: buffer.rows(torch.as_tensor(list(rows))).float() * 1.01)
        return strategy.select(queries, corrector if strategy.uses_corrector else None)

    ref = select()
    with torch.autocast(**BF16):
        got = select()
    assert_same(got, ref)


@pytest.mark.parametrize("cache_mb", [0, 1024])
def test_a_trained_corrector_may_run_in_bf16_but_its_rows_are_scored_in_float32(corpus, cache_mb):
    """h under autocast rounds its correction (x itself passes in float32 through the residual): h(B) moves
    by ~1e-4, which can reorder near-ties among 20,000 rows, but the rows it gives are scored exactly."""
    buffer, queries = corpus
    corrector = trained_corrector(buffer.dim)
    with torch.no_grad(), torch.autocast(**BF16):
        corrected = torch.cat([corrector(block.float()) for _, block in buffer.iter_chunks(65536)]).float()
    ref = corrected_topk(queries, corrected, None, 32)
    cfg = StrategyConfig(name="corrector", k=32, cache_corrected_mb=cache_mb)
    strategy = make_strategy(cfg, buffer, max_steps=4)
    with torch.autocast(**BF16):
        got = strategy.select(queries, corrector)
    assert_same(got, ref)


def test_in_batch_scores_under_bf16_autocast(corpus):
    buffer, queries = corpus
    strategy = make_strategy(StrategyConfig(name="in_batch", k=4), buffer, max_steps=4)
    include = torch.arange(len(queries) * 3).view(len(queries), 3)
    ref = strategy.select(queries, include=include)
    with torch.autocast(**BF16):
        got = strategy.select(queries, include=include)
    assert_same(got, ref)


# ---- the losses' logits ---------------------------------------------------------------------------------


class LookupTowers(nn.Module):
    """Query and passage towers as float32 lookup tables ("q<i>" -> row i, "p<j>" -> row j): autocast changes
    nothing in them, so any difference under it comes from how the step scores their outputs."""

    def __init__(self, queries: torch.Tensor, passages: torch.Tensor):
        super().__init__()
        self.queries, self.passages = nn.Parameter(queries.clone()), nn.Parameter(passages.clone())

    def encode_queries(self, questions):
        return self.queries[[int(q[1:]) for q in questions]]

    def encode_passages(self, texts):
        return self.passages[[int(t[1:]) for t in texts]]

    @property
    def query_tower(self):
        # The window's selection keeps the random state the query tower's dropout draws from, on its device.
        return SimpleNamespace(device=self.queries.device)

    @property
    def passage_tower(self):
        # Algorithm 2's step embeds the passage tower's tokens (`GivenInputs.tower`: here, the texts).
        return SimpleNamespace(embed_tokenized=self.encode_passages)


class GivenInputs:
    """What the background thread makes of a micro-batch's S_x (`rlm.training.step_inputs`), made here at once:
    the texts themselves for the lookup tower, the (questions, passages, answers) the stand-in scores read."""

    def prepare_passages(
        self, retriever, reader, collator, corpus, buffer, batch, rows, reader_passages, scored
    ):
        questions, answers = batch.questions, batch.answers
        texts = [corpus.texts[r] for r in rows.clamp_min(0).reshape(-1).tolist()]
        passages = [[("", corpus.texts[r]) for r in row if r >= 0] for row in rows.tolist()]
        return SimpleNamespace(
            tower=lambda: texts,
            scoring=lambda: (questions, passages, answers),
            reader=dict,
            stale=lambda: buffer.rows(rows.clamp_min(0)),
        )


class _Corpus:
    def __init__(self, n: int):
        self.texts = [f"p{i}" for i in range(n)]

    def retrieval_texts(self):
        return self.texts

    def __getitem__(self, row):
        return SimpleNamespace(title="", text=self.texts[row])


def step_parts(algorithm: int, corrector_loss: str):
    """A tiny Algorithm 1 or 2 step: lookup towers (cosines of 0.5-1), h, a buffer of 300 rows, a reader whose
    per-passage log-likelihoods are fixed numbers and whose own loss is a constant."""
    g = torch.Generator().manual_seed(1)
    passages, queries = clustered([300, 6], 32, g)
    stale = F.normalize(passages + 0.05 * torch.randn(passages.shape, generator=g), dim=-1)
    buffer = PassageBuffer.from_embeddings([str(i) for i in range(300)], stale.half())
    towers = LookupTowers(queries, passages)
    answer_logprobs = -5 * torch.rand(6, 300, generator=g)
    cfg = TrainConfig(algorithm=algorithm)
    cfg = replace(
        cfg,
        strategy=replace(cfg.strategy, name="corrector", k=8, num_random=4),
        corrector=replace(cfg.corrector, loss=corrector_loss),
    )
    corpus = _Corpus(300)
    model = SimpleNamespace(
        retriever=towers,
        reader=lambda **inputs: SimpleNamespace(loss=torch.tensor(2.5, requires_grad=True)),
        collator=lambda questions, passages, answers=None: dict.fromkeys(
            ("input_ids", "attention_mask", "labels")
        ),
        # At initialisation (the identity, exact in bf16 too): h's own rounding may stay, the scores' may not.
        corrector=CorrectorNetwork(32, 64),
        query_cache=QueryEmbeddingCache(),
        inputs=GivenInputs(),
    )
    strategy = partial(make_strategy, cfg.strategy, buffer, max_steps=10)  # uniform rows drawn alike
    batch = Batch(
        questions=[f"q{i}" for i in range(6)],
        answers=["a"] * 6,
        gold_rows=torch.tensor([3, 50, 120, 121, 200, 299]),
    )

    def scores(questions, passages, answers):
        rows = [[int(text[1:]) for _, text in row] for row in passages]
        return torch.stack([answer_logprobs[int(q[1:]), r] for q, r in zip(questions, rows)])

    return model, strategy, corpus, batch, cfg, scores


@pytest.mark.parametrize("algorithm, corrector_loss", [(2, "ce"), (2, "mse"), (1, "ce")])
def test_the_losses_under_bf16_autocast_are_the_float32_losses(algorithm, corrector_loss, monkeypatch):
    """The retriever's softmax over beta <q, g(y)> (distilled from the reader's per-passage likelihoods, or
    against the gold passage), and the corrector's loss on beta <q, h(B_y)>: float32, the float32 values."""
    model, strategy, corpus, batch, cfg, scores = step_parts(algorithm, corrector_loss)
    monkeypatch.setattr(
        rlm.training.steps, "score_inputs", lambda reader, parts, reduction: scores(*parts[0])
    )

    def step(strategy):
        if algorithm == 1:
            return algorithm1_step(model, batch, strategy, corpus, cfg)
        (selection,) = select_window(model, [batch], strategy, corpus, cfg)  # as the loop selects
        return algorithm2_step(model, batch, selection, strategy, cfg)

    ref = step(strategy())
    with torch.autocast(**BF16):
        got = step(strategy())
    assert set(got.terms) == {"retriever", "corrector"} | ({"reader"} if algorithm == 2 else set())
    for name, term in got.terms.items():
        assert term.dtype == torch.float32, name
    for name in ("retriever", "corrector"):
        assert torch.equal(got.terms[name], ref.terms[name]), name
    for key in ("kl_fresh_stale", "kl_fresh_corrected"):
        assert got.metrics[key] == ref.metrics[key], key
