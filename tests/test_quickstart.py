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


# ---- the last stage: a living corpus ------------------------------------------------------------------------

# A world of the tiny run's settings with dev entities enough for every kind of change (2 of each): the tiny run's
# own 150 passages leave 2 dev organisations, too few for an edition.
EDITION_WORLD = 300


def _predictions(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def living_corpus(tiny_quickstart, tmp_path_factory):
    """The last stage on the tiny quickstart's checkpoint, over a world of its settings large enough for an
    edition: (its folders, what it measured)."""
    from rlm.data.toy_world import build_toy_world
    from rlm.quickstart.living_corpus import measure_living_corpus, prepare_living_corpus

    root = tmp_path_factory.mktemp("living_corpus")
    config = json.loads((tiny_quickstart / "toy_world" / "world.json").read_text())["config"]
    options = {key: value for key, value in config.items() if key not in ("num_passages", "seed")}
    build_toy_world(root / "world", num_passages=EDITION_WORLD, seed=config["seed"], **options)
    living = prepare_living_corpus(root, root / "world", tiny_quickstart / "final")
    return living, measure_living_corpus(living, num_passages=4)


def test_the_living_corpus_counts_every_change_kind_and_shows_no_retired_passage(living_corpus):
    from rlm.data.toy_world_edition import CHANGES
    from rlm.quickstart.living_corpus import CHANGED_FACTS, SHOWN_K

    living, edition = living_corpus
    manifest = json.loads(living.update.manifest.read_text())
    # The world asks about birthplaces, occupations and cities: an employer changes in its corpus, unasked.
    asked = [kind for kind in CHANGES if kind != "changed_employer"]
    assert list(edition["kinds"]) == [*asked, "unchanged"] and manifest["questions"]["changed_employer"] == 0
    for kind in asked:
        assert edition["kinds"][kind]["questions"] == manifest["questions"][kind] > 0, kind
    assert edition["kinds"]["unchanged"]["questions"] == manifest["unchanged_dev"] > 0
    update = edition["update"]
    assert (update["added"], update["replaced"], update["deleted"]) == (
        manifest["added"],
        manifest["replaced"],
        manifest["deleted"],
    )
    # The invariant: after the update no question is shown a passage it deleted or the text it replaced.
    retired = edition["retired_shown"]
    asked = manifest["unchanged_dev"] + sum(manifest["questions"].values())
    assert retired == {
        "shown": SHOWN_K * asked,
        "retired": 0,
        "passages_retired": manifest["replaced"] + manifest["deleted"],
    }
    # The changed facts in four groups; the edition draws its subjects from dev, so training asked about none.
    groups = edition["changed_facts"]
    assert len(groups) == 4
    assert sum(g["questions"] for g in groups) == sum(manifest["questions"][k] for k in CHANGED_FACTS)
    assert all(g["questions"] == 0 for g in groups if g["subject_in_training"])
    assert edition["question_types"]["trained"] == ["born_in", "located_in", "occupation"]
    assert edition["question_types"]["asked_untrained"] == []  # the edition asks what the world asks
    assert edition["example"]["question"] in living.update.dev.read_text()
    assert edition["seconds"]["stage"] > 0
    json.dumps(edition)  # what metrics.json holds


def test_the_updated_index_finds_the_new_passages_and_none_it_deleted(living_corpus):
    living, edition = living_corpus
    from rlm.data.corpus import load_corpus

    added = {json.loads(line)["id"] for line in living.update.add.read_text().splitlines()}
    new = added - set(load_corpus(living.world / "corpus.jsonl").ids)
    deleted = set(living.update.delete.read_text().split())
    before, after = _predictions(living.root / "before"), _predictions(living.root / "after")
    assert not any(new & set(r["retrieved_ids"]) for r in before)  # not in the corpus yet
    assert not any(deleted & set(r["retrieved_ids"]) for r in after)
    # Each new person's question names them: their own passage is in the top 20 of a few hundred (MiniLM).
    asked = [r for r in after if r["meta"].get("change") == "new"]
    found = [bool(set(r["gold_passage_ids"]) & set(r["retrieved_ids"])) for r in asked]
    assert sum(found) >= 0.75 * len(asked)
    # The folder the demo serves holds the update as its next generation, of the edition measured.
    saved = json.loads((living.index / "index.json").read_text())
    assert saved["generation"] == 1
    assert saved["edition"]["fingerprint"] == edition["update"]["corpus_edition"]
    answered_from = json.loads((living.root / "after" / "metrics.json").read_text())["data"]["corpus"]
    assert answered_from["fingerprint"] == edition["update"]["corpus_edition"]


def test_the_living_corpus_table_prints_each_kind_and_the_retired_count(living_corpus):
    from rlm.quickstart.living_corpus import LABELS, format_edition

    _, edition = living_corpus
    table = format_edition(edition)
    for kind, counts in edition["kinds"].items():
        row = f"| {LABELS[kind]} | {counts['questions']} | {counts['abstained_before']} | {counts['right_before']} |"
        assert row in table, kind
    assert "| subject asked about in training | question type trained | questions |" in table
    assert "passages the update deleted or replaced among the top 20 shown after it: 0 (of " in table
    assert "which neither its retriever nor its reader trained on" not in table


def test_a_world_too_small_for_an_edition_skips_the_last_stage_and_says_why(tiny_quickstart):
    metrics = json.loads((tiny_quickstart / "metrics.json").read_text())
    printed = (tiny_quickstart / "printed.txt").read_text()
    assert metrics["edition"]["skipped"].startswith("no edition of this world")
    assert "[5/5] a living corpus" in printed and "\nskipped: no edition of this world" in printed
    assert not (tiny_quickstart / "edition" / "index").exists()


def test_no_edition_leaves_the_last_stage_out(tmp_path, monkeypatch, capsys):
    import rlm.quickstart.pipeline as pipeline
    from rlm.commands.quickstart import demo_options
    from rlm.quickstart.living_corpus import LivingCorpus

    asked, staged = [], []

    def run_quickstart(cfg, baselines, jobs, on_checkpoint, edition):
        asked.append(edition)
        return pipeline.QuickstartResult({"k": 4}, "TABLE", tmp_path / "final", tmp_path / "metrics.json")

    monkeypatch.setattr(pipeline, "run_quickstart", run_quickstart)
    monkeypatch.setattr(pipeline, "living_corpus_stage", lambda result: staged.append(result) or "EDITION")
    argv = ["quickstart", "--no-serve", "--output-dir", str(tmp_path)]
    assert main([*argv, "--no-edition"]) == 0
    assert asked == [False] and not staged and "EDITION" not in capsys.readouterr().out
    assert main(argv) == 0
    assert asked == [False, True] and len(staged) == 1 and "EDITION" in capsys.readouterr().out
    # Without the stage the demo serves the corpus as trained; with it, the stage's index, following its updates.
    assert demo_options(None).index_path is None
    options = demo_options(LivingCorpus(tmp_path / "edition", tmp_path, tmp_path, 1))
    assert options.index_path == str(tmp_path / "edition" / "index") and options.follow_updates_s > 0


@pytest.mark.slow
def test_the_served_demo_takes_the_edition_live(tmp_path, monkeypatch, capsys):
    """The quickstart on a world large enough for an edition, its demo served: the service the demo runs starts
    on the corpus as trained and, while the command waits on it, takes the stage's update without a restart."""
    import time

    from tiny_run import as_set_args

    import rlm.commands.demo
    import rlm.quickstart.pipeline
    from rlm.app.service import QAService
    from rlm.quickstart.living_corpus import format_edition

    seen = {}

    class FollowingDemo:
        """`start_demo`'s stand-in: the service the page would serve, with the options the quickstart gave it;
        blocking waits (a minute at most) for it to take the update, then asks it the example question."""

        def __init__(self, checkpoint, options=None, **_):
            self.service = QAService.from_checkpoint(checkpoint, None, options)
            seen["options"], seen["first"] = options, self.service.edition

        def block_thread(self):
            deadline = time.monotonic() + 60
            while self.service.edition == seen["first"] and time.monotonic() < deadline:
                time.sleep(0.2)
            seen["then"] = self.service.edition
            seen["answer"] = self.service.answer(seen["question"])

    monkeypatch.setattr(rlm.commands.demo, "start_demo", lambda c, **kw: FollowingDemo(c, **kw))
    out = tmp_path / "qs"
    overrides = [*TINY, f"data.toy_world.num_passages={EDITION_WORLD}"]
    argv = ["quickstart", "--no-baselines", "--output-dir", str(out), *as_set_args(overrides)]
    original = rlm.quickstart.pipeline.living_corpus_stage

    def stage(result):
        text = original(result)
        seen["question"] = result.metrics["edition"]["example"]["question"]
        return text

    monkeypatch.setattr(rlm.quickstart.pipeline, "living_corpus_stage", stage)
    assert main(argv) == 0
    edition = json.loads((out / "metrics.json").read_text())["edition"]
    printed = capsys.readouterr().out
    assert "[5/5] a living corpus" in printed and format_edition(edition) in printed
    assert f'ask it about a person it added: "{seen["question"]}"' in printed
    assert seen["options"].index_path == str(out / "edition" / "index")
    assert seen["first"] != seen["then"] == edition["update"]["corpus_edition"]
    assert seen["answer"]["corpus_edition"] == seen["then"]
    deleted = set((out / "edition" / "update" / "delete.txt").read_text().split())
    assert not deleted & {p["id"] for p in seen["answer"]["passages"]}
    assert edition["retired_shown"]["retired"] == 0
