"""The Section 5.3 synthetic study: drift, corrector shapes, the fit, and the report script (tiny sizes)."""

from __future__ import annotations

import json

import pytest
import torch
from lab.reporting import FINDINGS_END, FINDINGS_START
from lab.synthetic import (
    CorrectorSpec,
    DriftSpec,
    SyntheticWorld,
    build_corrector,
    fit_corrector,
    fit_regression,
    parameter_count,
    softmax_kl,
    train_corrector,
)
from script_loader import load_script

pytestmark = pytest.mark.learning  # trains or fits, then asserts what it learned (make test-kernels)


@pytest.fixture(scope="module")
def synthetic_world() -> SyntheticWorld:
    """Section 5.3's synthetic targets and queries (vectors, not a toy world of passages)."""
    torch.set_num_threads(1)
    return SyntheticWorld.generate(num_targets=512, num_train_queries=48, num_eval_queries=64, seed=3)


def test_identity_drift_gives_zero_stale_kl(synthetic_world):
    fresh = synthetic_world.drifted(DriftSpec(2, 8, 0.0))
    assert torch.equal(fresh, synthetic_world.stale)
    assert abs(synthetic_world.stale_kl(fresh)) < 1e-6


def test_stale_kl_grows_with_init_scale(synthetic_world):
    kls = [
        synthetic_world.stale_kl(synthetic_world.drifted(DriftSpec(1, 4, scale, seed=1)))
        for scale in (0.1, 0.5, 1.5)
    ]
    assert 0 < kls[0] < kls[1] < kls[2]


def test_kl_is_zero_only_for_same_targets(synthetic_world):
    shifted = synthetic_world.stale + 0.3 * torch.randn(
        synthetic_world.stale.shape, generator=torch.Generator().manual_seed(0)
    )
    assert softmax_kl(
        synthetic_world.eval_queries, synthetic_world.stale, synthetic_world.stale, synthetic_world.beta
    ) == pytest.approx(0.0, abs=1e-6)
    assert (
        softmax_kl(synthetic_world.eval_queries, synthetic_world.stale, shifted, synthetic_world.beta) > 1e-2
    )


@pytest.mark.parametrize(
    ("layers", "mult", "params"), [(0, 1, 8 * 8 + 8), (1, 2, 2 * (8 * 16) + 16 + 8), (2, 1, 216)]
)
def test_corrector_is_identity_at_init_with_expected_size(synthetic_world, layers, mult, params):
    h = build_corrector(8, mult * 8, layers)
    with torch.no_grad():
        assert torch.equal(h(synthetic_world.stale), synthetic_world.stale)
    assert parameter_count(h) == params


def test_trained_corrector_beats_stale_buffer(synthetic_world):
    fresh = synthetic_world.drifted(DriftSpec(2, 8, 2.0, seed=5))
    stale_kl = synthetic_world.stale_kl(fresh)
    record = fit_corrector(
        synthetic_world, fresh, CorrectorSpec(1, 4), fraction=0.5, max_epochs=200, patience=50
    )
    assert stale_kl > 0.3
    assert record["corrected_kl"] < 0.3 * stale_kl
    assert record["sampled_targets"] == 256


def test_linear_corrector_recovers_linear_drift(synthetic_world):
    fresh = synthetic_world.drifted(DriftSpec(0, 1, 0.3, seed=2))
    record = fit_corrector(
        synthetic_world, fresh, CorrectorSpec(0, 1), fraction=1.0, max_epochs=400, patience=50
    )
    assert synthetic_world.stale_kl(fresh) > 0.05
    assert record["corrected_kl"] < 1e-3


def test_more_sampled_targets_generalise_better(synthetic_world):
    fresh = synthetic_world.drifted(DriftSpec(2, 8, 3.0, seed=7))
    few = fit_corrector(
        synthetic_world, fresh, CorrectorSpec(2, 8), fraction=0.02, max_epochs=150, patience=50
    )
    all_ = fit_corrector(
        synthetic_world, fresh, CorrectorSpec(2, 8), fraction=1.0, max_epochs=150, patience=50
    )
    # With 10 targets the big corrector fits them (tiny training KL) but not the rest of the softmax.
    assert few["fit_train_kl"] < all_["fit_train_kl"]
    assert all_["corrected_kl"] < 0.5 * few["corrected_kl"]


def test_fit_keeps_best_weights_and_reports_their_loss(synthetic_world):
    fresh = synthetic_world.drifted(DriftSpec(1, 8, 1.0, seed=4))
    h = build_corrector(8, 16, 1)
    # Each epoch scores the weights and then steps them, so without restoring the best state the
    # corrector would hold weights one step past any reported loss.
    fit = train_corrector(
        h,
        synthetic_world.stale,
        fresh,
        synthetic_world.train_queries,
        synthetic_world.beta,
        lr=0.5,
        max_epochs=60,
    )
    with torch.no_grad():
        p = (synthetic_world.beta * synthetic_world.train_queries @ fresh.T).softmax(-1)
        log_q = (
            synthetic_world.beta * synthetic_world.train_queries @ h(synthetic_world.stale).T
        ).log_softmax(-1)
        ce = -(p * log_q).sum(-1).mean().item()
    assert ce == pytest.approx(fit.train_ce, rel=1e-5)


def test_no_drift_stops_after_patience(synthetic_world):
    h = build_corrector(8, 8, 1)
    fit = train_corrector(
        h,
        synthetic_world.stale,
        synthetic_world.stale,
        synthetic_world.train_queries,
        synthetic_world.beta,
        max_epochs=1000,
        patience=7,
    )
    assert fit.epochs == 8 and fit.best_epoch == 1
    assert abs(fit.train_kl) < 1e-5


def test_regression_at_the_corrector_budget_beats_the_stale_buffer(synthetic_world):
    """Dynnibal's closed-form refit sees the same sampled targets the corrector sees; a linear drift is
    recovered exactly by the linear (affine) kernel."""
    fresh = synthetic_world.drifted(DriftSpec(2, 8, 2.0, seed=5))
    record = fit_regression(synthetic_world, fresh, fraction=0.5, kernel="rbf", landmarks=64)
    corrector = fit_corrector(synthetic_world, fresh, CorrectorSpec(0, 1), fraction=0.5, max_epochs=1)
    assert record["sampled_targets"] == corrector["sampled_targets"] == 256
    assert record["regression_kl"] < 0.3 * synthetic_world.stale_kl(fresh)
    linear = synthetic_world.drifted(DriftSpec(0, 1, 0.3, seed=2))
    assert fit_regression(synthetic_world, linear, fraction=0.1, kernel="linear")["regression_kl"] < 1e-4


def test_bad_arguments_are_refused(synthetic_world):
    with pytest.raises(ValueError, match="fraction"):
        fit_corrector(synthetic_world, synthetic_world.stale, CorrectorSpec(0, 1), fraction=0.0)
    with pytest.raises(ValueError, match="differ"):
        softmax_kl(
            synthetic_world.eval_queries,
            synthetic_world.stale,
            synthetic_world.stale[:10],
            synthetic_world.beta,
        )
    with pytest.raises(ValueError, match="init_scale"):
        synthetic_world.drifted(DriftSpec(1, 1, -1.0))


def test_quick_script_writes_report_and_keeps_findings(tmp_path):
    script = load_script("synthetic_corrector")
    out = tmp_path / "report"
    findings = f"{FINDINGS_START}\nhand-written notes\n{FINDINGS_END}"
    out.with_suffix(".md").write_text(f"# old\n\n{findings}\n\nold table\n")

    assert script.main(["--quick", "--out", str(out), "--max-epochs", "30"]) == 0

    results = json.loads(out.with_suffix(".json").read_text())
    # quick grid: 3 drifts x 3 correctors at 10%, plus 5% and 100% for the one Fig. 3 drift
    assert len(results["fits"]) == 15
    assert all(f["fit_epochs"] <= 30 and f["corrected_kl"] >= 0 for f in results["fits"])
    strongest = max(results["drifts"], key=lambda d: d["stale_kl"])
    best = min(f["corrected_kl"] for f in results["fits"] if f["drift"] == strongest["label"])
    assert best < strongest["stale_kl"]
    # Dynnibal's regression beside them: 2 kernels x (3 drifts at 10% + the Fig. 3 drift at 5% and 100%).
    regressions = results["regressions"]
    assert len(regressions) == 2 * 5 and {r["kernel"] for r in regressions} == {"rbf", "linear"}
    sampled = {(f["drift"], f["fraction"]): f["sampled_targets"] for f in results["fits"]}
    assert all(r["sampled_targets"] == sampled[(r["drift"], r["fraction"])] for r in regressions)
    rbf_strongest = [r for r in regressions if r["drift"] == strongest["label"] and r["kernel"] == "rbf"]
    assert all(r["regression_kl"] < strongest["stale_kl"] for r in rbf_strongest)
    report = out.with_suffix(".md").read_text()
    assert findings in report and "old table" not in report
    assert "| 2x8D@3 |" in report and "| Nystrom rbf |" in report

    # --regression-only keeps the corrector fits and the grid of the kept run, and refits the same regressions.
    assert script.main(["--regression-only", "--out", str(out), "--seeds", "3"]) == 0
    again = json.loads(out.with_suffix(".json").read_text())
    assert again["fits"] == results["fits"] and again["command"] == results["command"]
    assert [r["regression_kl"] for r in again["regressions"]] == [r["regression_kl"] for r in regressions]
    for name in ("report_fig3.png", "report_fig4.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --replot re-renders from the JSON alone (no fitting) and still keeps the findings
    out.with_suffix(".md").unlink()
    out.with_suffix(".md").write_text(f"{findings}\n")
    assert script.main(["--out", str(out), "--replot"]) == 0
    assert findings in out.with_suffix(".md").read_text()
    with pytest.raises(FileNotFoundError, match="run the study first"):
        script.main(["--out", str(tmp_path / "missing"), "--replot"])
