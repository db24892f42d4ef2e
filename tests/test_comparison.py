"""lab.comparison: a strategy comparison's table and plots from its JSON alone (no training)."""

from __future__ import annotations

import json

import pytest
from lab.comparison import render, summarise, table_metrics


def run(strategy, seed, em, reembedded=0, **extra):
    return {"strategy": strategy, "seed": seed, "dev_exact_match": em, "reembedded": reembedded, **extra}


def test_rows_keep_the_strategies_order_with_mean_and_population_spread():
    runs = [run("stale", 0, 0.5), run("corrector", 0, 0.6), run("stale", 1, 0.7), run("corrector", 1, 0.6)]
    rows = summarise(runs, ["dev_exact_match"])
    assert [r["strategy"] for r in rows] == ["stale", "corrector"]
    assert rows[0]["dev_exact_match"] == pytest.approx(0.6) and rows[0][
        "dev_exact_match_std"
    ] == pytest.approx(0.1)
    assert rows[1]["dev_exact_match_std"] == pytest.approx(0.0) and "drift" not in rows[1]


def test_algorithm_2_adds_the_own_selection_columns_only_when_the_runs_have_them():
    assert "dev_selection_exact_match" not in table_metrics(2, [run("frozen", 0, 0.4)])
    metrics = table_metrics(2, [run("frozen", 0, 0.4, dev_selection_exact_match=0.4)])
    assert metrics[:3] == ["dev_exact_match", "dev_selection_exact_match", "dev_selection_gold_recall@1"]


def test_render_writes_the_table_and_plots_from_the_json(tmp_path):
    log = [
        {"step": s, "drift": 0.3 + s / 100, "kl_fresh_stale": 0.1, "kl_fresh_corrected": 0.05}
        for s in range(10)
    ]
    report = {
        "args": {
            "algorithm": 2,
            "data": "toy",
            "start": "minilm",
            "steps": 10,
            "seeds": "0,1",
            "refresh_every": 5,
            "snm_size": 50,
            "regression_samples": 20,
            "overrides": ["eval_selection=true"],
        },
        "runs": [
            run("closed_book", 0, 0.04),
            run("closed_book", 1, 0.06),
            run("corrector", 0, 0.60, drift=0.4, kl_fresh_stale=0.1, kl_fresh_corrected=0.05, drift_log=log),
            run("corrector", 1, 0.70, drift=0.5, kl_fresh_stale=0.1, kl_fresh_corrected=0.05, drift_log=log),
            run("exhaustive", 0, 0.65, reembedded=2000),
            run("exhaustive", 1, 0.65, reembedded=2000),
        ],
        "dropout_floor": 0.29,
        "mixed_precision": "bf16",
        "precision": "no",
    }
    path = tmp_path / "table.json"
    path.write_text(json.dumps(report))
    table = render(path)
    assert (tmp_path / "table.md").read_text() == table + "\n"
    lines = table.splitlines()
    assert (
        lines[0] == "## Algorithm 2, toy, start minilm: 10 steps, seeds 0,1 (R=5, SNM M=50, regression s'=20)"
    )
    corrector = next(line for line in lines if line.startswith("| corrector |"))
    assert corrector.split(" | ")[1:2] == ["65.0 ± 5.0"] and "0.450 ± 0.050" in corrector
    assert "| exhaustive | 65.0 ± 0.0 |" in table and "| 2000 |" in table
    assert "Dropout floor" in table and "0.290" in table and "Settings: eval_selection=true." in table
    assert "Trained with mixed_precision=no" in table  # bf16 asked for, fell back on this CPU
    for png in ("table.png", "table_drift.png"):
        assert (tmp_path / png).stat().st_size > 5_000


def test_a_json_without_drift_logs_leaves_an_existing_drift_plot_alone(tmp_path):
    report = {
        "args": {
            "algorithm": 1,
            "data": "toy",
            "start": "minilm",
            "steps": 10,
            "seeds": "0",
            "refresh_every": 5,
            "snm_size": 50,
            "overrides": [],
        },
        "runs": [{"strategy": "stale", "seed": 0, "dev_gold_recall@1": 0.5, "reembedded": 0}],
        "dropout_floor": 0.2,
    }
    (tmp_path / "old.json").write_text(json.dumps(report))
    (tmp_path / "old_drift.png").write_bytes(b"kept")
    table = render(tmp_path / "old.json")
    assert "| stale | 50.0 |" in table and "regression s'=200" in table  # older JSON: the default s'
    assert (tmp_path / "old_drift.png").read_bytes() == b"kept"
