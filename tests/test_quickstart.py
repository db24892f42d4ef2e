"""`rlm quickstart`: a tiny end-to-end run (toy world -> buffer -> corrector training -> dev table), the
baseline cache and its labels. The tiny run's checkpoint is also what the app tests serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from local_port import free_port
from tiny_run import TINY_QUICKSTART, tiny_retriever

from rlm.cli import main
from rlm.errors import UserError
from rlm.quickstart.pipeline import (
    BASELINES,
    baseline_config,
    baseline_rows,
    baselines_to_measure,
    format_results,
    load_cached_baselines,
    quickstart_config,
    settings_key,
)

TINY = TINY_QUICKSTART


@pytest.mark.learning
def test_quickstart_runs_the_recipe_with_the_corrector_over_a_fixed_buffer_and_prints_its_table(
    tiny_quickstart,
):
    """What the README's `make demo` promises, at a size a test can run: the world with held-out dev entities,
    B embedded once by the packaged MiniLM, each phase of the recipe (Algorithm 2 with the corrector among
    them) with nothing re-embedded, and the printed table made from metrics.json."""
    from rlm.data.qa import load_qa_dataset
    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    metrics = json.loads((tiny_quickstart / "metrics.json").read_text())
    assert metrics["strategy"] == "corrector" and metrics["steps"] == 3 and metrics["dev_questions"] == 8
    # Dev questions ask about entities no training question mentions: answering needs retrieval.
    train, dev = (load_qa_dataset("toy", split, tiny_quickstart / "toy_world") for split in ("train", "dev"))
    assert not {q.meta["subject"] for q in dev[:8]} & {q.meta["subject"] for q in train}

    # The three phases, one step each: gold passages (trained once, in the shared prefix the run continued
    # from, whose log line it carries), Algorithm 2, the reader alone on the trained selection.
    log = [json.loads(line) for line in (tiny_quickstart / "log.jsonl").read_text().splitlines()]
    assert [("retriever_loss" in r, "corrector_loss" in r) for r in log] == [
        (False, False),
        (True, True),
        (False, False),
    ]
    prefix = tiny_quickstart / "shared" / "prefix"
    assert json.loads((prefix / "prefix.json").read_text())["steps"] == 1
    assert (prefix / "log.jsonl").read_text().splitlines() == (
        tiny_quickstart / "log.jsonl"
    ).read_text().splitlines()[:1]
    assert json.loads((tiny_quickstart / "summary.json").read_text())["prefix"] == str(prefix)
    # B is the packaged MiniLM's embedding of the corpus, never re-embedded, while the passage tower trained.
    config = yaml.safe_load((tiny_quickstart / "config.yaml").read_text())
    minilm = SentenceEncoder.from_pretrained(
        default_retriever_path(), max_length=config["retriever"]["passage_max_length"]
    )
    buffer = PassageBuffer.load(tiny_quickstart / "buffer", encoder_fingerprint=minilm.fingerprint())
    assert len(buffer) == 150 and metrics["reembedded"] == 0 and all(r["reembedded"] == 0 for r in log)
    trained = SentenceEncoder.from_pretrained(
        str(tiny_quickstart / "final" / "retriever" / "passage_tower"), max_length=minilm.max_length
    )
    assert trained.fingerprint() != minilm.fingerprint()

    # Dev figures both ways (re-embedded corpus, and the run's own selection over h(B)) at the reader's K.
    dev_figures = metrics["dev"]
    for key in ("exact_match", "f1", "recall@4", "selection_exact_match", "selection_recall@4"):
        assert 0.0 <= dev_figures[key] <= 1.0, key
    # On this kin-free world MiniLM's top 4 holds the answer for most questions: the reader is handed it.
    assert dev_figures["recall@4"] >= 0.75 and dev_figures["selection_recall@4"] >= 0.75
    # The table the user reads is metrics.json's, with a row per baseline (here: not measured).
    printed = (tiny_quickstart / "printed.txt").read_text()
    table = format_results(metrics)
    assert table in printed
    assert "| corrector (this run) |" in table and table.count("not measured") == len(BASELINES)
    em = 100 * dev_figures["exact_match"]
    assert f"| corrector (this run) | {100 * dev_figures['selection_exact_match']:.1f} | {em:.1f} |" in table


def test_quickstart_checkpoint_evaluates_to_its_own_dev_figures(tiny_quickstart):
    metrics = json.loads((tiny_quickstart / "metrics.json").read_text())
    # The dev figures are the saved checkpoint's: `rlm evaluate` on it over the same 8 questions agrees.
    out = tiny_quickstart / "evaluate_check"
    argv = [
        "evaluate",
        "--checkpoint",
        str(tiny_quickstart / "final"),
        "--data-path",
        str(tiny_quickstart / "toy_world"),
    ]
    assert main([*argv, "--max-examples", "8", "--out", str(out)]) == 0
    evaluated = json.loads((out / "metrics.json").read_text())
    for key in ("exact_match", "f1", "recall@1", "recall@5"):
        assert evaluated[key] == pytest.approx(metrics["dev"][key], abs=1e-3), key
    predictions = (out / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 8
    for name in BASELINES:
        assert metrics["baselines"][name]["source"].startswith(("not measured", "cached from"))
    for part in ("retriever", "reader", "corrector", "config.yaml"):
        assert (tiny_quickstart / "final" / part).exists()
    assert (tiny_quickstart / "toy_world" / "corpus.jsonl").is_file()  # --output-dir moved the toy world too


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


def test_the_baselines_flags_choose_which_baselines_train():
    import argparse

    import rlm.commands.quickstart

    key = "these settings"
    cached = {"frozen": {"settings": key}, "stale": {"settings": "other settings"}}
    assert baselines_to_measure("missing", cached, key) == [n for n in BASELINES if n != "frozen"]
    assert baselines_to_measure("always", cached, key) == list(BASELINES)
    assert baselines_to_measure("never", {}, key) == []
    with pytest.raises(UserError, match="baselines must be one of"):
        baselines_to_measure("sometimes", cached, key)
    parser = argparse.ArgumentParser()
    rlm.commands.quickstart.add_arguments(parser)
    assert parser.parse_args([]).baselines == "missing"
    assert parser.parse_args(["--baselines"]).baselines == "always"
    assert parser.parse_args(["--no-baselines"]).baselines == "never"


def test_baseline_config_changes_only_strategy_and_folders():
    cfg = quickstart_config(None, "/tmp/qs", TINY)
    frozen = baseline_config(cfg, "frozen")
    assert frozen.strategy.name == "frozen" and frozen.strategy.k == cfg.strategy.k
    assert frozen.output_dir == "/tmp/qs/baselines/frozen"
    assert frozen.buffer.dir == "/tmp/qs/buffer"  # the main run's buffer: same corpus, same initial tower
    assert frozen.data.toy_world.dir == cfg.data.toy_world.dir
    assert frozen.optim == cfg.optim and frozen.reader == cfg.reader
    assert settings_key(frozen) == settings_key(cfg)
    assert settings_key(quickstart_config(None, "/tmp/qs", [*TINY, "optim.max_steps=5"])) != settings_key(cfg)


def test_corrupt_baseline_cache_names_the_file(tmp_path):
    bad = tmp_path / "baselines.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"baselines.json:1: not valid JSON"):
        load_cached_baselines(bad)
    assert load_cached_baselines(tmp_path / "missing.json") == {}


class RecordedDemo:
    """The demo `start_demo` served (real Gradio), recording when it was served and when the command blocked on
    it; blocking fetches the page once and closes it, so the command returns."""

    def __init__(self, demo, checkpoint, port: int, events: list):
        self.demo, self.port, self.events = demo, port, events
        events.append(("served", Path(checkpoint)))

    def block_thread(self):
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=30) as page:
            self.events.append(("blocked", page.status))
        self.demo.close()


@pytest.mark.slow
def test_baselines_measured_then_reused_from_cache(tmp_path, capsys, monkeypatch):
    import rlm.commands.demo
    import rlm.commands.quickstart

    out = tmp_path / "qs"
    port = free_port()
    argv = ["quickstart", "--output-dir", str(out), "--jobs", "2", "--port", str(port)]
    # The cache's bookkeeping holds for any retriever: the tiny one keeps two quickstarts and their baselines
    # quick (the session's `tiny_quickstart` trains the quickstart with MiniLM).
    retriever = f"retriever.path={tiny_retriever(tmp_path / 'tiny_retriever')}"
    for assignment in [*TINY, retriever]:
        argv += ["--set", assignment]
    events = []
    calibrate = rlm.commands.quickstart.calibrate
    monkeypatch.setattr(
        rlm.commands.quickstart, "calibrate", lambda c: events.append(("calibrated",)) or calibrate(c)
    )
    start_demo = rlm.commands.demo.start_demo
    monkeypatch.setattr(
        rlm.commands.demo,
        "start_demo",
        lambda c, **kw: RecordedDemo(start_demo(c, **kw), c, port, events),
    )
    assert main(argv) == 0  # a first run measures the baselines it has no figures for
    # The demo was served from the corrector run's checkpoint (real Gradio, warm-up request included, from
    # inside the runs' progress loop), once its answer policy was fitted, and the command blocked on it only
    # after the table (written with every baseline's figure).
    assert [e[0] for e in events] == ["calibrated", "served", "blocked"] and events[1][1] == out / "final"
    assert events[2][1] == 200
    assert "| corrector (this run) |" in capsys.readouterr().out
    argv = [argv[0], "--no-serve", *argv[1:]]
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
    # --baselines retrains them even when cached (a third quickstart would only retrain what the first did).
    assert baselines_to_measure("always", cache, second["settings"]) == list(BASELINES)
    assert baselines_to_measure("missing", cache, second["settings"]) == []
