"""Streamed corrected top-k: exactly the brute-force answer, ties and edge cases included."""

from __future__ import annotations

import pytest
import torch

from rlm.retriever import search
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.index import PassageIndex
from rlm.retriever.search import correct_buffer, corrected_topk, score_rows, two_stage_corrected_topk


def brute_force(queries, embeddings, corrector, k):
    """Reference: full score matrix, stable sort (ties -> lower row first)."""
    with torch.no_grad():
        vectors = embeddings.float() if corrector is None else corrector(embeddings.float())
        scores = queries @ vectors.T
    values, rows = scores.sort(dim=1, descending=True, stable=True)
    return values[:, :k], rows[:, :k]


def int_data(n=300, d=8, b=5, seed=0):
    """Small-integer vectors: every dot product is exact in float32 and ties are everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (b, d), generator=g).float(), torch.randint(
        -2, 3, (n, d), generator=g
    ).float()


@pytest.fixture(params=["host_tie_width", "keyed"])
def tie_path(request, monkeypatch):
    """Each way a chunk's top-k finds its ties: reading their width on the host (a CPU's), or keys that hold the
    row beside the score (an accelerator's, without a host sync), taken here on the CPU."""
    if request.param == "keyed":
        monkeypatch.setattr(search, "HOST_TIE_WIDTH_DEVICES", ())
    return request.param


@pytest.mark.parametrize("chunk_size,k", [(7, 5), (64, 100), (1000, 16), (50, 50), (1, 3)])
def test_stale_topk_is_exact_with_ties(chunk_size, k, tie_path):
    queries, emb = int_data()
    got = corrected_topk(queries, emb, None, k, chunk_size=chunk_size)
    ref_scores, ref_rows = brute_force(queries, emb, None, k)
    assert torch.equal(got.indices, ref_rows)
    assert torch.equal(got.scores, ref_scores)
    assert got.indices.dtype == torch.long


def test_all_tied_picks_lowest_rows(tie_path):
    emb = torch.ones(40, 4)
    got = corrected_topk(torch.ones(2, 4), emb, None, 6, chunk_size=9)
    assert got.indices.tolist() == [list(range(6))] * 2


def test_ties_between_negative_zero_and_zero_and_among_negatives_go_to_the_lower_row(tie_path):
    # Scores -0.0 and 0.0 are equal, so the lower row comes first whichever sign it carries; among equal
    # negative scores too, and a more negative score never outranks a less negative one.
    emb = torch.tensor([[-1.0], [0.0], [-2.0], [-1.0], [-0.0], [0.0], [-2.0], [-0.5]])
    got = corrected_topk(torch.ones(1, 1), emb, None, 7, chunk_size=8)
    assert got.indices.tolist() == [[1, 4, 5, 7, 0, 3, 2]]
    assert got.scores.tolist() == [[0.0, 0.0, 0.0, -0.5, -1.0, -1.0, -2.0]]


def test_the_streamed_top_k_reads_nothing_back_from_the_device_while_it_scans(host_reads, monkeypatch):
    # Every chunk's candidates are found on the device: no per-chunk read of tie widths (a host sync each on
    # a GPU, ~40 per selection of a process scanning 2.6M rows), whatever the number of chunks. On the CPU the
    # accelerator's path is taken by making the CPU one of them.
    monkeypatch.setattr(search, "HOST_TIE_WIDTH_DEVICES", ())
    queries, emb = int_data(n=600)
    corrector = CorrectorNetwork(8, 16)
    host_reads.active = True
    got = corrected_topk(queries, emb, corrector, 5, chunk_size=7)
    host_reads.active = False
    assert host_reads.total() == 0, host_reads.sites
    assert torch.equal(got.indices, brute_force(queries, emb, corrector, 5)[1])


def test_k_larger_than_buffer_returns_everything():
    queries, emb = int_data(n=20)
    got = corrected_topk(queries, emb, None, 50, chunk_size=6)
    assert got.indices.shape == (5, 20)
    assert torch.equal(got.indices, brute_force(queries, emb, None, 20)[1])


def test_corrected_matches_brute_force_on_sharded_fp16_buffer():
    torch.manual_seed(0)
    corrector = CorrectorNetwork(16, 64, num_hidden_layers=2)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.3)
    emb = torch.nn.functional.normalize(torch.randn(500, 16), dim=-1).half()
    buffer = PassageBuffer([str(i) for i in range(500)], [emb[:130], emb[130:400], emb[400:]])
    queries = torch.randn(6, 16)
    got = corrected_topk(queries, buffer, corrector, 10, chunk_size=64)
    ref_scores, ref_rows = brute_force(queries, emb, corrector, 10)
    assert torch.equal(got.indices, ref_rows)
    torch.testing.assert_close(got.scores, ref_scores, atol=1e-5, rtol=1e-5)
    # identity corrector == stale
    fresh = CorrectorNetwork(16, 32)
    assert torch.equal(
        corrected_topk(queries, buffer, fresh, 10, 64).indices,
        corrected_topk(queries, buffer, None, 10, 64).indices,
    )


def test_bf16_compute_close_to_fp32():
    torch.manual_seed(1)
    emb = torch.nn.functional.normalize(torch.randn(2000, 32), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(4, 32), dim=-1)
    corrector = CorrectorNetwork(32, 128)
    full = corrected_topk(queries, emb, corrector, 20, chunk_size=512)
    low = corrected_topk(queries, emb, corrector, 20, chunk_size=512, compute_dtype=torch.bfloat16)
    assert low.scores.dtype == torch.float32
    overlap = [len(set(a.tolist()) & set(b.tolist())) / 20 for a, b in zip(full.indices, low.indices)]
    assert min(overlap) >= 0.8


def test_include_forces_rows_without_duplicates():
    queries, emb = int_data(n=200)
    k = 6
    top = brute_force(queries, emb, None, k + 2)[1]
    # row 0: one id already in its top-k and one far away; row 1: two far away; others: padding (-1)
    bottom = brute_force(-queries, emb, None, 3)[1]
    include = torch.full((5, 2), -1, dtype=torch.long)
    include[0] = torch.tensor([int(top[0, 0]), int(bottom[0, 0])])
    include[1] = bottom[1, :2]
    include[2] = torch.tensor([int(bottom[2, 0]), int(bottom[2, 0])])
    got = corrected_topk(queries, emb, None, k, chunk_size=17, include=include)
    assert got.indices.shape == (5, k + 2)
    all_scores = queries @ emb.T
    for b in range(5):
        rows = got.indices[b].tolist()
        assert len(set(rows)) == len(rows), "no duplicates"
        forced = {r for r in include[b].tolist() if r >= 0}
        assert forced <= set(rows)
        # the other slots are the best non-forced rows
        others = [
            r
            for r in top[b].tolist() + brute_force(queries, emb, None, k + 4)[1][b].tolist()
            if r not in forced
        ]
        expected_others = list(dict.fromkeys(others))[: k + 2 - len(forced)]
        assert set(rows) - forced == set(expected_others)
        torch.testing.assert_close(got.scores[b], all_scores[b, got.indices[b]])
        assert torch.all(got.scores[b][:-1] >= got.scores[b][1:])


def test_random_rows_shared_and_distinct():
    queries, emb = int_data(n=400)
    g = torch.Generator().manual_seed(3)
    got = corrected_topk(queries, emb, None, 8, chunk_size=50, num_random=10, generator=g)
    assert got.indices.shape == (5, 18)
    top = brute_force(queries, emb, None, 8)[1]
    randoms = []
    for b in range(5):
        rows = got.indices[b].tolist()
        assert len(set(rows)) == 18 and set(top[b].tolist()) <= set(rows)
        randoms.append(set(rows) - set(top[b].tolist()))
    # shared across the batch except where a query's top-k already held one of them
    common = set.intersection(*randoms)
    assert len(common) >= 5
    again = corrected_topk(
        queries, emb, None, 8, chunk_size=50, num_random=10, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(again.indices, got.indices)


def test_errors_are_clear():
    queries, emb = int_data()
    with pytest.raises(ValueError, match=r"\[B, 8\]"):
        corrected_topk(queries[:, :4], emb, None, 3)
    with pytest.raises(ValueError, match="k must be"):
        corrected_topk(queries, emb, None, 0)
    with pytest.raises(ValueError, match="out of range"):
        corrected_topk(queries, emb, None, 3, include=torch.full((5, 1), 10_000))


def test_two_stage_equals_full_when_candidates_cover_the_answer():
    torch.manual_seed(0)
    emb = torch.nn.functional.normalize(torch.randn(3000, 16), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    corrector = CorrectorNetwork(16, 32)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.05)
    buffer = PassageBuffer.from_embeddings([f"p{i}" for i in range(3000)], emb)
    index = PassageIndex.from_buffer(buffer, "Flat")
    full = corrected_topk(queries, buffer, corrector, 10)
    two = two_stage_corrected_topk(queries, buffer, corrector, 10, index, num_candidates=3000)
    assert torch.equal(two.indices, full.indices)
    torch.testing.assert_close(two.scores, full.scores, atol=1e-5, rtol=1e-5)
    small = two_stage_corrected_topk(queries, buffer, corrector, 10, index, num_candidates=200)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(small.indices, full.indices)) / 40
    assert overlap >= 0.9
    torch.testing.assert_close(small.scores, score_rows(queries, buffer, corrector, small.indices))


def test_two_stage_scan_takes_the_exact_stale_candidates_without_an_index():
    """index=None: candidates from <q, B> over every row (streamed), so the result is what an exact (Flat)
    index gives with the same candidate count, and the exact corrected top-k once candidates cover it."""
    torch.manual_seed(0)
    emb = torch.nn.functional.normalize(torch.randn(3000, 16), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    corrector = CorrectorNetwork(16, 32)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.05)
    buffer = PassageBuffer.from_embeddings([f"p{i}" for i in range(3000)], emb)
    full = corrected_topk(queries, buffer, corrector, 10)
    everything = two_stage_corrected_topk(
        queries, buffer, corrector, 10, None, num_candidates=3000, chunk_size=700
    )
    assert torch.equal(everything.indices, full.indices)
    torch.testing.assert_close(everything.scores, full.scores, atol=1e-5, rtol=1e-5)
    index = PassageIndex.from_buffer(buffer, "Flat")
    for candidates in (10, 50, 200):
        scan = two_stage_corrected_topk(queries, buffer, corrector, 10, None, candidates, chunk_size=700)
        flat = two_stage_corrected_topk(queries, buffer, corrector, 10, index, candidates)
        assert torch.equal(scan.indices, flat.indices), candidates
        torch.testing.assert_close(scan.scores, score_rows(queries, buffer, corrector, scan.indices))
    # With as many candidates as k, the corrector only re-orders the stale top-k.
    stale = corrected_topk(queries, buffer, None, 10)
    few = two_stage_corrected_topk(queries, buffer, corrector, 10, None, num_candidates=10)
    assert [set(r.tolist()) for r in few.indices] == [set(r.tolist()) for r in stale.indices]


def test_a_corrected_buffer_searched_without_h_gives_the_corrected_top_k_bit_for_bit():
    """`correct_buffer` (what selection keeps between steps while h does not move): h applied once, chunked
    as `corrected_topk` chunks, then searched without h: the same scores and rows, on a float16 buffer of
    two shards cut into uneven chunks."""
    g = torch.Generator().manual_seed(3)
    rows = torch.nn.functional.normalize(torch.randn(530, 16, generator=g), dim=-1).half()
    buffer = PassageBuffer(range(530), [rows[:300], rows[300:]])
    corrector = CorrectorNetwork(16, 64)
    torch.nn.init.normal_(corrector.output.weight, std=0.3, generator=g)
    queries = torch.randn(7, 16, generator=g)
    corrected = correct_buffer(buffer, corrector, chunk_size=128)
    assert len(corrected) == 530 and corrected.dim == 16
    want = corrected_topk(queries, buffer, corrector, 9, chunk_size=128)
    got = corrected_topk(queries, corrected, None, 9, chunk_size=128)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.scores, want.scores)
    assert not torch.equal(want.indices, corrected_topk(queries, buffer, None, 9).indices)  # h mattered
