"""One index description (`rlm.retriever.index_spec.IndexSpec`) for training's two-stage selection, `rlm index`,
`rlm evaluate` and `rlm demo`, with one default; and settings moved into sub-sections read from old configs."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import numpy as np
import pytest
import yaml

from rlm.config import RENAMED_SETTINGS, RenamedSettingWarning, TrainConfig, dump_config, load_config
from rlm.errors import UserError
from rlm.retriever.index_spec import IndexSpec, TwoStage

# Old key -> (a value, the attribute path that reads it now).
MOVED = {
    "retriever.align_steps": 3,
    "retriever.align_kl": 0.5,
    "retriever.align_every": 2,
    "retriever.align_patience": 4,
    "reader.warm_start_path": "some/encoder",
    "reader.warm_start_layers": 3,
    "reader.warm_start_freeze_embeddings": False,
    "strategy.candidates": 64,
    "strategy.first_stage": "scan",
    "strategy.overlap_every": 7,
    "strategy.index_factory": "IVF4,Flat",
    "strategy.nprobe": 4,
}


def _read(cfg: TrainConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _nested(dotted: str, value) -> dict:
    data: dict = {}
    node = data
    *path, last = dotted.split(".")
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value
    return data


def test_every_moved_setting_is_in_the_table_and_its_new_key_exists():
    assert set(MOVED) <= set(RENAMED_SETTINGS)
    for new in RENAMED_SETTINGS.values():
        _read(TrainConfig(), new)  # an AttributeError names a table entry that leads nowhere


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_in_an_old_yaml_is_read_with_one_warning_naming_its_new_place(old, tmp_path):
    new = RENAMED_SETTINGS[old]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_nested(old, MOVED[old])))
    with pytest.warns(RenamedSettingWarning) as seen:
        cfg = load_config(path)
    assert len(seen) == 1 and f"{old} is now {new}" in str(seen[0].message)
    assert _read(cfg, new) == MOVED[old]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_in_an_old_set_is_read_with_one_warning_naming_its_new_place(old):
    new = RENAMED_SETTINGS[old]
    value = MOVED[old]
    written = yaml.safe_dump(value).removesuffix("\n...\n").strip()
    with pytest.warns(RenamedSettingWarning) as seen:
        cfg = load_config(None, [f"{old}={written}"])
    assert len(seen) == 1 and f"{old} is now {new}" in str(seen[0].message)
    assert _read(cfg, new) == value


def test_the_new_keys_load_without_a_warning_and_both_names_at_once_are_refused(tmp_path):
    sets = [
        f"{RENAMED_SETTINGS[old]}={yaml.safe_dump(v).removesuffix(chr(10) + '...' + chr(10)).strip()}"
        for old, v in MOVED.items()
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, sets)
        again = load_config(None, [f"output_dir={tmp_path}"])
    assert cfg.retriever.align.steps == 3 and cfg.reader.warm_start.layers == 3
    assert cfg.strategy.two_stage == TwoStage(64, "scan", 7, IndexSpec(factory="IVF4,Flat", nprobe=4))
    assert again.strategy.two_stage == TwoStage()  # the defaults
    with pytest.raises(UserError, match="strategy.nprobe is the old name of strategy.two_stage.index.nprobe"):
        load_config(None, ["strategy.nprobe=4", "strategy.two_stage.index.nprobe=8"])


def test_an_index_spec_value_out_of_range_is_refused_by_its_config_key():
    with pytest.raises(
        UserError, match=r"strategy.two_stage.index.target_recall must be a finite number in \[0, 1\]"
    ):
        load_config(None, ["strategy.two_stage.index.target_recall=1.5"])
    with pytest.raises(UserError, match="strategy.two_stage.candidates must be >= 1"):
        load_config(None, ["strategy.two_stage.candidates=0"])
    with pytest.raises(UserError, match="unknown config key config.strategy.two_stage.index.nlist"):
        load_config(None, ["strategy.two_stage.index.nlist=4"])
    with pytest.raises(UserError, match="re-scores every candidate with h already"):
        load_config(None, ["strategy.search=two_stage", "strategy.two_stage.index.rescore=2"])


def test_the_paper_settings_come_first_in_the_sections_that_moved_extras():
    names = [f.name for f in dataclasses.fields(TrainConfig().retriever)]
    assert names[:4] == ["path", "shared_towers", "query_max_length", "passage_max_length"]
    assert "align" in names and not any(n.startswith("align_") for n in names)
    reader = [f.name for f in dataclasses.fields(TrainConfig().reader)]
    assert reader[0] == "path" and reader[-1] == "warm_start" and "arch" in reader
    strategy = [f.name for f in dataclasses.fields(TrainConfig().strategy)]
    assert strategy[:2] == ["name", "k"] and "two_stage" in strategy


def _old_layout(cfg: TrainConfig) -> str:
    """`cfg`'s config.yaml as a checkpoint of the version before the moves wrote it."""
    data = yaml.safe_load(dump_config(cfg))
    for old, new in RENAMED_SETTINGS.items():
        if old == "max_nonfinite_in_a_row":
            continue
        *path, key = new.split(".")
        node = data
        for part in path:
            node = node[part]
        value = node.pop(key)
        *old_path, old_key = old.split(".")
        target = data
        for part in old_path:
            target = target[part]
        target[old_key] = value
    for section, sub in (("retriever", "align"), ("reader", "warm_start")):
        assert not data[section].pop(sub)
    two_stage = data["strategy"].pop("two_stage")
    assert set(two_stage["index"]) == {"target_recall", "tune_k", "ef_search", "rescore", "device"}
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize("search", ["exact", "two_stage"])
def test_a_checkpoint_saved_with_the_old_keys_resumes(search, tmp_path):
    """`check_settings` (what a resume runs) reads the checkpoint's config.yaml under the new names: a
    checkpoint of the same run saved with the old keys resumes, one of another run is still refused."""
    from rlm.training.checkpointing import CONFIG, check_settings

    sets = ["retriever.align.steps=2", "reader.warm_start.layers=3", f"strategy.search={search}"]
    sets += ["strategy.two_stage.index.nprobe=64"] if search == "two_stage" else []
    cfg = load_config(None, sets)
    old = _old_layout(cfg)
    assert "align_steps: 2" in old and "warm_start_layers: 3" in old and "index_factory: auto" in old
    (tmp_path / CONFIG).write_text(old)
    assert check_settings(tmp_path, dump_config(cfg), 1, 1, ()) == []
    other = dump_config(load_config(None, [*sets, "retriever.align.steps=5"]))
    with pytest.raises(UserError, match=r"retriever.align.steps: 2 -> 5"):
        check_settings(tmp_path, other, 1, 1, ())


def _parsed(command: str, argv: list[str]) -> argparse.Namespace:
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(f"rlm.commands.{command}").add_arguments(parser)
    return parser.parse_args(argv)


COMMAND_ARGS = {
    "index": ["--buffer", "b", "--out", "o"],
    "evaluate": ["--checkpoint", "c"],
    "demo": ["--checkpoint", "c"],
}


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_every_command_and_training_get_the_one_default_index(command):
    """`rlm index`, `rlm evaluate`, `rlm demo` and training's `strategy.two_stage.index` describe the same index
    when nobody says otherwise: drift in any one of them fails here."""
    from rlm.app.service import ServiceOptions
    from rlm.commands.index import index_spec
    from rlm.inference.evaluation import IndexOptions

    trained = TrainConfig().strategy.two_stage.index
    assert trained == IndexSpec() == ServiceOptions().index_spec == IndexOptions().spec
    assert index_spec(_parsed(command, COMMAND_ARGS[command])) == trained
    assert trained.factory == "auto" and trained.nprobe is None and trained.target_recall == 0.995


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_the_help_shows_the_one_default(command, capsys):
    with pytest.raises(SystemExit):
        _parsed(command, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = IndexSpec()
    assert f"default {default.factory}; auto: Flat (exact) below 100,000 rows" in text
    assert f"(default {default.target_recall:g})" in text and f"(default {default.tune_k};" in text


def test_a_command_line_value_the_spec_refuses_is_told_by_its_flag():
    from rlm.commands.index import index_spec

    with pytest.raises(UserError, match=r"--target-recall must be in \[0, 1\]"):
        index_spec(_parsed("index", [*COMMAND_ARGS["index"], "--target-recall", "2"]))
    with pytest.raises(UserError, match="--nprobe must be >= 1"):
        index_spec(_parsed("evaluate", [*COMMAND_ARGS["evaluate"], "--nprobe", "0"]))


def test_auto_is_exact_on_a_small_corpus_and_ivf_on_a_large_one():
    pytest.importorskip("faiss")
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.index_spec import auto_index_factory

    assert auto_index_factory(99_999) == "Flat" and auto_index_factory(1_000_000) == "IVF4000,SQfp16"
    rows = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    index = PassageIndex.build(rows, [str(i) for i in range(50)], IndexSpec().factory, use_gpu=False)
    assert index.factory == "Flat" and index.apply_search(IndexSpec(nprobe=8), rows) == {}
    assert index.search_params == {}  # auto's Flat takes no nprobe: left aside, not refused
