"""The shared prefix (`rlm.training.prefix`): the gold-passage steps every strategy trains alike, trained once and
continued by runs of other strategies exactly as if each had trained them itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_run import tiny_overrides

from rlm.config import load_config
from rlm.errors import UserError
from rlm.training.prefix import shared_settings_key, shared_steps

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

# Two gold-passage steps (the prefix), one step of the reader alone on the selection, two Algorithm 2 steps
# (MiniLM-layout dropout draws from the random stream there), one reader-only step at the end.
SCHEDULE = [
    "optim.max_steps=6",
    "optim.warmup_steps=2",
    "schedule.gold_passage_steps=2",
    "schedule.reader_only_steps=3",
    "schedule.final_reader_only_steps=1",
    "save_every=0",
    "log_every=1",
    "retriever.dropout=0.1",
]


def config(root: Path, out: str, strategy: str, *extra: str):
    return load_config(None, tiny_overrides(root, out, *SCHEDULE, f"strategy.name={strategy}", *extra))


def train_run(cfg, prefix=None, prefix_out=None) -> dict:
    """A run as the quickstart trains it: from scratch, through the prefix only, or from a prefix."""
    from rlm.quickstart.concurrent_runs import train_one

    return train_one(cfg, prefix=prefix, prefix_out=prefix_out)


def losses(run_dir: Path) -> list[dict]:
    keep = ("step", "loss", "reader_loss", "retriever_loss", "corrector_loss")
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keep if k in r} for r in records]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(run_dir / "final" / "reader" / "model.safetensors"))
    tower = run_dir / "final" / "retriever" / "query_tower" / "model.safetensors"
    weights.update({f"query.{k}": v for k, v in load_file(str(tower)).items()})
    return weights


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> tuple[Path, Path]:
    """(root, prefix folder): the corrector run's first two steps, trained once."""
    root = tmp_path_factory.mktemp("prefix")
    cfg = config(root, str(root / "shared"), "corrector")
    summary = train_run(cfg, prefix_out=root / "shared" / "prefix")
    assert summary["steps"] == shared_steps(cfg) == 2
    return root, root / "shared" / "prefix"


@pytest.mark.parametrize("strategy", ["stale", "corrector"])
def test_a_run_continued_from_the_prefix_is_the_run_trained_from_scratch(prefix, strategy):
    root, folder = prefix
    scratch = config(root, str(root / f"scratch_{strategy}"), strategy)
    branch = config(root, str(root / f"branch_{strategy}"), strategy)
    train_run(scratch)
    summary = train_run(branch, prefix=folder)
    assert summary["prefix"] == str(folder) and summary["steps"] == 6
    # The same losses at every step (the prefix's two copied into the branch's log), the same weights after.
    assert losses(Path(branch.output_dir)) == losses(Path(scratch.output_dir))
    assert [r["step"] for r in losses(Path(branch.output_dir))] == [1, 2, 3, 4, 5, 6]
    scratch_w, branch_w = final_weights(Path(scratch.output_dir)), final_weights(Path(branch.output_dir))
    assert scratch_w.keys() == branch_w.keys()
    assert all(torch.equal(scratch_w[k], branch_w[k]) for k in scratch_w)


def test_a_prefix_of_other_settings_or_a_closed_book_run_is_refused(prefix):
    root, folder = prefix
    other = config(root, str(root / "other"), "stale", "optim.lr_reader=5e-4")
    assert shared_settings_key(other) != shared_settings_key(config(root, "x", "stale"))
    with pytest.raises(UserError, match="other settings"):
        train_run(other, prefix=folder)
    with pytest.raises(UserError, match="reads no passages"):
        train_run(config(root, str(root / "closed"), "closed_book"), prefix=folder)
    broken = root / "broken_prefix"
    shutil.copytree(folder, broken)
    (broken / "prefix.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        train_run(config(root, str(root / "broken"), "stale"), prefix=broken)
