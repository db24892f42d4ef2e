"""How a run is watched and recorded (issue 29): trackers chosen by `report_to` with the run's hyperparameters,
a resumed run continuing its W&B run, `rlm train --print-config`, and one place deciding mixed precision."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml
from tiny_run import runs_beside, train_args, train_here

from rlm.config import load_config


@pytest.fixture(scope="module")
def root(tiny_world, tmp_path_factory):
    return runs_beside(tiny_world, tmp_path_factory.mktemp("tracking"))


def test_print_config_shows_the_resolved_config_and_it_loads_back(capsys, tmp_path):
    from rlm.cli import main

    assert (
        main(["train", "--print-config", "--config", "nq", "--set", "seed=3", "--set", "optim.max_steps=7"])
        == 0
    )
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["seed"] == 3 and yaml.safe_load(printed)["optim"]["max_steps"] == 7
    saved = tmp_path / "resolved.yaml"
    saved.write_text(printed)
    assert load_config(str(saved)) == load_config("nq", ["seed=3", "optim.max_steps=7"])
    assert not Path(load_config("nq").output_dir).exists()  # nothing was trained or written


def test_a_launcher_config_with_other_mixed_precision_is_named(monkeypatch):
    from accelerate.state import AcceleratorState

    from rlm.training.accelerator import make_accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.warns(
            UserWarning, match="launcher config asks for mixed_precision=bf16; the run config's"
        ):
            accelerator = make_accelerator(load_config(None, ["cpu=true", "mixed_precision=no"]))
        assert accelerator.mixed_precision == "no"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same value in both places: nothing to say
            AcceleratorState._reset_state(reset_partial_state=True)
            monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
            make_accelerator(load_config(None, ["cpu=true", "mixed_precision=no"]))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_wandb_offline_gets_the_hyperparameters_and_a_resumed_run_continues_the_same_run(root, monkeypatch):
    wandb = pytest.importorskip("wandb")  # an extra; the test extras install it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs, init = [], wandb.init

    def recorded_init(*a, **k):
        runs.append(init(*a, **k))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", recorded_init)
    out = root / "wandb_run"
    extra = ("report_to=all", "save_every=2")
    assert train_here(train_args(root, out.name, *extra, steps=4)) == 0
    assert len(runs) == 1 and runs[0].config["optim.max_steps"] == 4
    assert runs[0].config["strategy.name"] == "corrector" and runs[0].config["data.dev"] == "None"
    assert list((out / "wandb").glob(f"offline-run-*-{runs[0].id}/run-{runs[0].id}.wandb"))
    assert list((out / "rlm").rglob("events.out.tfevents.*"))  # TensorBoard too, with report_to=all
    argv = [*train_args(root, out.name, *extra, steps=6), "--resume", "--allow-changed", "optim.max_steps"]
    assert train_here(argv) == 0
    assert len(runs) == 2 and runs[1].id == runs[0].id  # the resumed run logs into the same W&B run
    assert runs[1].config["optim.max_steps"] == 6


@pytest.mark.slow
def test_report_to_none_writes_no_tracker_files(root):
    out = root / "untracked"
    assert train_here(train_args(root, out.name, "report_to=none", "save_every=0", steps=2)) == 0
    assert (out / "log.jsonl").exists() and not (out / "rlm").exists()
