"""`rlm quickstart`: a tiny end-to-end run (toy world -> buffer -> corrector training -> dev table), the
baseline cache and its labels. The tiny run's checkpoint is also what the app tests serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_run import TINY_QUICKSTART

from rlm.cli import main
from rlm.quickstart import (
    BASELINES,
    baseline_config,
    baseline_rows,
    format_results,
    load_cached_baselines,
    quickstart_config,
    settings_key,
)

TINY = TINY_QUICKSTART


def build_tiny_quickstart(base: Path) -> Path:
    """Run `rlm quickstart --no-serve` once into `base/quickstart` (reused when already there); its run folder."""
    out = base / "quickstart"
    if not (out / "metrics.json").is_file():
        argv = ["quickstart", "--no-serve", "--no-baselines", "--output-dir", str(out)]
        for assignment in TINY:
            argv += ["--set", assignment]
        assert main(argv) == 0
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    return build_tiny_quickstart(tmp_path_factory.getbasetemp())


def test_quickstart_writes_checkpoint_metrics_and_table(tiny_run, capsys):
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    assert metrics["strategy"] == "corrector" and metrics["steps"] == 2
    assert metrics["reembedded"] == 0  # the corrector never re-embeds the buffer
    assert metrics["dev_questions"] == 8
    assert 0.0 <= metrics["dev"]["exact_match"] <= 1.0 and "recall@5" in metrics["dev"]
    assert "recall@4" in metrics["dev"]  # at the reader's K: how many questions its passages can answer
    # The dev figures are the saved checkpoint's: `rlm evaluate` on it over the same 8 questions agrees.
    out = tiny_run / "evaluate_check"
    argv = ["evaluate", "--checkpoint", str(tiny_run / "final"), "--data-path", str(tiny_run / "toy_world")]
    assert main([*argv, "--max-examples", "8", "--out", str(out)]) == 0
    evaluated = json.loads((out / "metrics.json").read_text())
    for key in ("exact_match", "f1", "recall@1", "recall@5"):
        assert evaluated[key] == pytest.approx(metrics["dev"][key], abs=1e-3), key
    predictions = (out / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 8
    for name in BASELINES:
        assert metrics["baselines"][name]["source"].startswith(("not measured", "cached from"))
    for part in ("retriever", "reader", "config.yaml"):
        assert (tiny_run / "final" / part).exists()
    assert (tiny_run / "toy_world" / "corpus.jsonl").is_file()  # --output-dir moved the toy world too


def test_baselines_from_cache_are_labelled_with_their_date():
    cfg = quickstart_config(None, "/tmp/x", TINY)
    key = settings_key(cfg)
    cached = {
        "closed_book": {
            "exact_match": 0.1,
            "f1": 0.2,
            "measured_at": "2026-11-20T10:00:00+00:00",
            "settings": key,
        },
        "frozen": {
            "exact_match": 0.3,
            "f1": 0.4,
            "measured_at": "2026-11-21T10:00:00+00:00",
            "settings": "other",
        },
    }
    rows = baseline_rows({}, cached, key)
    assert rows["closed_book"]["source"] == "cached from 2026-11-20"
    assert rows["frozen"]["source"] == "cached from 2026-11-21, other settings"
    measured = {"frozen": {"exact_match": 0.5, "f1": 0.6, "recall": 0.55, "reembedded": 0}}
    assert baseline_rows(measured, {}, key)["frozen"]["source"] == "measured now"
    rows["exhaustive"] = {
        "exact_match": 0.6,
        "f1": 0.65,
        "recall": 0.99,
        "selection_exact_match": 0.55,
        "selection_recall": 0.98,
        "reembedded": 16000,
        "source": "x",
    }
    assert baseline_rows({}, {}, key)["closed_book"]["source"].startswith("not measured")

    metrics = {
        "strategy": "corrector",
        "steps": 2,
        "train_seconds": 90.0,
        "reembedded": 0,
        "dev_questions": 8,
        "k": 4,
        "dev": {
            "exact_match": 0.625,
            "f1": 0.7,
            "recall@4": 0.875,
            "selection_exact_match": 0.75,
            "selection_recall@4": 0.9,
        },
        "baselines": rows,
        "majority_answer": {"exact_match": 0.05, "f1": 0.05},
    }
    table = format_results(metrics)
    assert table.startswith("dev set: 8 questions, the reader reads K = 4 passages; corrector run: 2 steps")
    assert (
        "| run | EM from its selection | EM re-embedded | answer recall@4 re-embedded | answer recall@4 selection "
        "| passages re-embedded in training | source |"
    ) in table
    assert "| corrector (this run) | 75.0 | 62.5 | 87.5 | 90.0 | 0 | measured now |" in table
    assert "| exhaustive (buffer re-embedded) | 55.0 | 60.0 | 99.0 | 98.0 | 16,000 | x |" in table
    # Closed book reads nothing: the same EM either way; a figure cached before eval_selection shows "-".
    assert "| closed book (no passages) | 10.0 | 10.0 | - | - | - | cached from 2026-11-20 |" in table
    assert "| frozen retriever (reader trained) | - | 30.0 | - | - | - | cached from 2026-11-21" in table
    # Compared on each run's own selection where measured (else re-embedded / closed book).
    assert "EM over the frozen retriever: +45.0 points" in table
    assert "EM over exhaustive re-embedding: +20.0 points" in table
    assert "EM over closed book: +65.0 points" in table


def test_baseline_config_changes_only_strategy_and_folders():
    cfg = quickstart_config(None, "/tmp/qs", TINY)
    frozen = baseline_config(cfg, "frozen")
    assert frozen.strategy.name == "frozen" and frozen.strategy.k == cfg.strategy.k
    assert frozen.output_dir == "/tmp/qs/baselines/frozen"
    assert frozen.buffer.dir == "/tmp/qs/buffer"  # the main run's buffer: same corpus, same initial tower
    assert frozen.data.toy_world.dir == cfg.data.toy_world.dir
    assert frozen.optim == cfg.optim and frozen.reader == cfg.reader
    assert settings_key(frozen) == settings_key(cfg)
    assert settings_key(quickstart_config(None, "/tmp/qs", [*TINY, "optim.max_steps=3"])) != settings_key(cfg)


def test_corrupt_baseline_cache_names_the_file(tmp_path):
    bad = tmp_path / "baselines.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"baselines.json:1: not valid JSON"):
        load_cached_baselines(bad)
    assert load_cached_baselines(tmp_path / "missing.json") == {}


@pytest.mark.slow
def test_baselines_measured_then_reused_from_cache(tmp_path, capsys):
    out = tmp_path / "qs"
    argv = ["quickstart", "--no-serve", "--output-dir", str(out)]
    for assignment in [*TINY, "optim.max_steps=1"]:
        argv += ["--set", assignment]
    assert main(argv) == 0  # a first run measures the baselines it has no figures for
    first = json.loads((out / "metrics.json").read_text())
    assert {row["source"] for row in first["baselines"].values()} == {"measured now"}
    cache = json.loads((out / "baselines.json").read_text())
    assert set(cache) == set(BASELINES) and all(0 <= v["exact_match"] <= 1 for v in cache.values())
    assert (out / "baselines" / "frozen" / "final" / "reader").is_dir()

    assert main(argv) == 0  # the same settings again: the figures come from the cache, labelled with the date
    second = json.loads((out / "metrics.json").read_text())
    for name in BASELINES:
        assert second["baselines"][name]["source"].startswith("cached from 20")
        assert second["baselines"][name]["exact_match"] == cache[name]["exact_match"]
    assert "cached from" in capsys.readouterr().out
    (out / "baselines" / "closed_book" / "log.jsonl").unlink()
    assert main([*argv, "--baselines"]) == 0  # --baselines retrains them even when cached
    assert (out / "baselines" / "closed_book" / "log.jsonl").is_file()
    third = json.loads((out / "metrics.json").read_text())
    assert {row["source"] for row in third["baselines"].values()} == {"measured now"}
