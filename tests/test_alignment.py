"""DAFT's measurements of a heterogeneous dual encoder: the kNN KL estimate and the collapse detector."""

from __future__ import annotations

import math

import pytest
import torch

from rlm.retriever.alignment import alignment_metrics, knn_kl_divergence, mean_pairwise_cosine


def gaussian(n, dim, mean=0.0, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return mean + std * torch.randn(n, dim, generator=g)


def test_knn_kl_estimates_the_kl_between_two_gaussians():
    """KL(N(0, I) || N(mu, I)) = |mu|^2 / 2 in any dimension; the estimator converges to it."""
    dim, n = 4, 4000
    p = gaussian(n, dim, seed=1)
    shift = torch.tensor([1.0, 0.0, 0.0, 0.0])
    q = gaussian(n, dim, seed=2) + shift
    assert knn_kl_divergence(p, q) == pytest.approx(0.5, abs=0.15)
    assert abs(knn_kl_divergence(p, gaussian(n, dim, seed=3))) < 0.1  # the same distribution
    # Wider Q: KL(N(0, I) || N(0, 4 I)) = a/2 (1/4 - 1 + ln 4) per the closed form.
    wide = gaussian(n, dim, std=2.0, seed=4)
    assert knn_kl_divergence(p, wide) == pytest.approx(dim / 2 * (0.25 - 1 + math.log(4)), abs=0.2)


def test_paired_samples_of_one_tower_give_zero_and_a_moved_tower_more():
    x = torch.nn.functional.normalize(gaussian(300, 16, seed=5), dim=-1)
    assert knn_kl_divergence(x, x.clone(), paired=True) == pytest.approx(0.0, abs=1e-9)
    moved = torch.nn.functional.normalize(x + 0.8, dim=-1)  # every query pushed towards one direction
    assert knn_kl_divergence(x, moved, paired=True) > 1.0
    with pytest.raises(ValueError, match="paired"):
        knn_kl_divergence(x, x[:10], paired=True)


def test_mean_pairwise_cosine_detects_collapse():
    spread = gaussian(500, 32, seed=6)
    assert abs(mean_pairwise_cosine(spread)) < 0.05  # random directions
    collapsed = torch.ones(500, 32) + 0.01 * spread
    assert mean_pairwise_cosine(collapsed) > 0.99
    x = gaussian(7, 5, seed=7)
    unit = torch.nn.functional.normalize(x.double(), dim=-1)
    brute = (unit @ unit.T).sum() - 7
    assert mean_pairwise_cosine(x) == pytest.approx(float(brute) / 42, rel=1e-9)


def test_alignment_metrics_of_the_packaged_minilm(minilm_path):
    from rlm.retriever.encoder import DualEncoder

    questions = [f"Where was person number {i} born?" for i in range(20)] + [
        "What does the chemist study?",
        "Which river flows through Lyon?",
    ]
    same = DualEncoder.from_pretrained(minilm_path, max_length=24).eval()
    metrics = alignment_metrics(same, questions)
    assert metrics["query_passage_knn_kl"] == pytest.approx(0.0, abs=1e-6)  # identical towers
    assert 0.3 < metrics["query_mean_cosine"] < 0.99  # templated questions are similar, not collapsed
    light = DualEncoder.from_towers(minilm_path, query_path="layers:1", max_length=24).eval()
    assert alignment_metrics(light, questions)["query_passage_knn_kl"] > 1.0  # a 1-layer tower is elsewhere
