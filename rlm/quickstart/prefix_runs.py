"""The quickstart's shared prefix as runs: the gold-passage steps trained once and saved, and runs of each
strategy that continue from them (`rlm.training.prefix` holds what a prefix is and how it is saved and loaded).
"""

from __future__ import annotations

from pathlib import Path

from rlm.config import TrainConfig
from rlm.training.loop import train_loop, training_run
from rlm.training.prefix import load_prefix, place_tokenizer, save_prefix, shared_steps


def train_prefix(cfg: TrainConfig, folder: Path) -> dict:
    """Train `cfg`'s run (a fresh one, in its own folder) through its shared steps and save them to `folder`."""
    with training_run(cfg, overwrite=True) as run:
        train_loop(run, until=shared_steps(cfg))
        save_prefix(run, folder, Path(cfg.output_dir) / "log.jsonl")
        run.accelerator.end_training()
    return {"steps": shared_steps(cfg), "prefix": str(folder)}


def train_from_prefix(cfg: TrainConfig, folder: Path) -> dict:
    """Train `cfg`'s run (a fresh one) from the prefix in `folder` to the end, as if it had trained the prefix's
    steps itself; returns the summary."""
    place_tokenizer(folder, cfg)  # before the reader is built: the run would train the same tokenizer
    with training_run(cfg, overwrite=True) as run:
        load_prefix(run, folder)
        return train_loop(run)
