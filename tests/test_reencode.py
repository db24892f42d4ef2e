"""Dynnibal-style approximate re-encoding: the Nystrom kernel ridge regression from stale to fresh rows."""

from __future__ import annotations

import pytest
import torch

from rlm.retriever.reencode import NystromRegression, kernel_matrix, median_gamma

pytestmark = pytest.mark.learning  # trains or fits, then asserts what it learned (make test-kernels)


def unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def relative_error(approx, fresh, stale):
    """|R(b) - f|^2 over |b - f|^2: 0 is a perfect refresh, 1 is no better than the stale rows."""
    return float((approx - fresh).square().sum() / (stale - fresh).square().sum())


def test_linear_kernel_recovers_an_affine_drift_of_every_row_from_a_few_samples():
    g = torch.Generator().manual_seed(0)
    dim, n = 16, 2000
    stale = unit(torch.randn(n, dim, generator=g))
    drift = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g)
    fresh = stale @ drift + 0.1 * torch.randn(dim, generator=g)  # a shift too: the kernel's constant
    samples, landmarks = torch.arange(0, n, 20), torch.arange(5, 5 + 64)  # 100 samples, 64 landmarks >= D
    model = NystromRegression.fit(
        stale[samples], fresh[samples], stale[landmarks], kernel="linear", ridge=1e-9
    )
    # Rows it never saw are mapped as well as the samples: an affine map is in the model's span.
    assert relative_error(model(stale), fresh, stale) < 1e-6


def test_rbf_kernel_refreshes_held_out_rows_of_a_nonlinear_drift():
    g = torch.Generator().manual_seed(1)
    dim, n = 16, 4000
    stale = unit(torch.randn(n, dim, generator=g))
    w1, w2 = torch.randn(dim, 64, generator=g), torch.randn(64, dim, generator=g)
    fresh = unit(stale + 0.3 * torch.tanh(stale @ w1) @ w2 / 8)
    perm = torch.randperm(n, generator=g)
    samples, landmarks, held_out = perm[:800], perm[800:928], perm[1000:]
    model = NystromRegression.fit(stale[samples], fresh[samples], stale[landmarks], kernel="rbf")
    assert model.gamma == pytest.approx(median_gamma(stale[samples], stale[landmarks]))
    error = relative_error(model(stale[held_out]), fresh[held_out], stale[held_out])
    assert error < 0.25, error
    # More samples fit better (the paper's s' axis), fewer fit worse but still beat the stale rows.
    few = NystromRegression.fit(stale[samples[:100]], fresh[samples[:100]], stale[landmarks])
    few_error = relative_error(few(stale[held_out]), fresh[held_out], stale[held_out])
    assert error < few_error < 1.0


def test_chunked_application_equals_one_pass_and_keeps_order():
    g = torch.Generator().manual_seed(2)
    stale = unit(torch.randn(300, 8, generator=g))
    fresh = unit(stale + 0.1 * torch.randn(300, 8, generator=g))
    model = NystromRegression.fit(stale[:100], fresh[:100], stale[100:132])
    chunks = (stale[i : i + 64] for i in range(0, 300, 64))
    torch.testing.assert_close(model.apply_chunks(chunks), model(stale))


def test_duplicate_landmarks_and_bad_input_are_handled():
    g = torch.Generator().manual_seed(3)
    stale = unit(torch.randn(50, 8, generator=g))
    fresh = stale + 0.05
    twice = torch.cat([stale[:10], stale[:10]])  # a corpus with repeated passages: a singular K_ZZ
    model = NystromRegression.fit(stale, fresh, twice, ridge=1e-6)
    assert bool(torch.isfinite(model.alpha).all())
    assert relative_error(model(stale), fresh, stale) < 1.0
    with pytest.raises(ValueError, match="differ"):
        NystromRegression.fit(stale, fresh[:10], twice)
    with pytest.raises(ValueError, match="kernel"):
        kernel_matrix(stale, twice, "cosh", 1.0)
    with pytest.raises(ValueError, match="ridge"):
        NystromRegression.fit(stale, fresh, twice, ridge=0)


def test_validated_ridge_beats_a_too_small_fixed_one_where_samples_are_few():
    """A few hundred samples in many dimensions overfit a tiny ridge; the ridge chosen on held-out samples
    does not, and the chosen fit generalises to rows nobody sampled."""
    from rlm.retriever.reencode import RIDGES, residual

    g = torch.Generator().manual_seed(4)
    dim, n = 64, 3000
    stale = unit(torch.randn(n, dim, generator=g))
    w1, w2 = torch.randn(dim, 128, generator=g), torch.randn(128, dim, generator=g)
    fresh = unit(stale + 0.5 * torch.tanh(stale @ w1) @ w2 / 11 + 0.05 * torch.randn(n, dim, generator=g))
    samples, landmarks, rest = torch.arange(0, 150), torch.arange(150, 278), torch.arange(300, n)
    chosen, scores = NystromRegression.fit_validated(stale[samples], fresh[samples], stale[landmarks])
    assert set(scores) == set(RIDGES) and min(scores, key=scores.get) > RIDGES[0]
    tiny = NystromRegression.fit(stale[samples], fresh[samples], stale[landmarks], ridge=RIDGES[0])
    got = residual(chosen(stale[rest]), stale[rest], fresh[rest])
    assert got < residual(tiny(stale[rest]), stale[rest], fresh[rest]) and got < 1.0
