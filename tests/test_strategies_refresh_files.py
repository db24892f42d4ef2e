"""Refreshed rows on disk (`<output_dir>/refresh/step_<s>`): kept while the current step or a kept checkpoint
needs them, deleted otherwise, and a run resumed from any kept checkpoint selects what the run did.

The loop below calls the strategy as a training run does: refresh (which deletes the earlier refreshes no
kept checkpoint needs) and select at each step, a checkpoint (the strategy's state) every `save_every` steps
with the newest `keep_last` kept, after which the strategy is told the kept checkpoints' steps and
`prune_refreshes` runs (`rlm.training.run.TrainRun.save`).
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlm.config import RegressionConfig, StrategyConfig
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.distributed import Processes
from rlm.training.strategies import make_strategy

N, DIM, MAX_STEPS, REFRESH_EVERY, KEEP_LAST = 60, 8, 12, 2, 2

_g = torch.Generator().manual_seed(0)
STALE = F.normalize(torch.randn(N, DIM, generator=_g), dim=-1)
BUFFER = PassageBuffer.from_embeddings([str(i) for i in range(N)], STALE.half())
DRIFT = torch.randn(DIM, DIM, generator=_g)
QUERIES = F.normalize(torch.randn(4, DIM, generator=_g), dim=-1)
REFRESHING = ["exhaustive", "regression", "two_round", "snm"]


def tower(step: int, rows) -> torch.Tensor:
    """The passage tower after `step` updates, drifting away from B at every step."""
    rows = torch.as_tensor(list(rows), dtype=torch.long)
    return F.normalize(STALE[rows] @ (torch.eye(DIM) + 0.05 * step * DRIFT), dim=-1)


def strategy(name: str, refresh_dir: Path):
    cfg = StrategyConfig(
        name=name,
        k=4,
        refresh_every=REFRESH_EVERY,
        snm_size=20,
        regression=RegressionConfig(samples=20, landmarks=6),
    )
    made = make_strategy(cfg, BUFFER, MAX_STEPS, seed=0)
    made.distribute(Processes(), False, refresh_dir=refresh_dir)
    return made


def refreshes(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.iterdir()) if folder.is_dir() else []


def train(name: str, folder: Path, save_every: int):
    """(selection at each step, kept checkpoints {step: state}, refresh folders after each step, the strategy)."""
    run = strategy(name, folder)
    picks, checkpoints, kept_folders = {}, {}, []
    for step in range(MAX_STEPS):
        run.before_step(step, partial(tower, step))
        picks[step] = run.select(QUERIES).indices
        done = step + 1
        if done % save_every == 0:
            checkpoints[done] = run.state_dict()
            for old in sorted(checkpoints)[:-KEEP_LAST]:
                del checkpoints[old]
            run.checkpoint_steps = tuple(sorted(checkpoints))
            run.prune_refreshes(run.checkpoint_steps, done)
        kept_folders.append(refreshes(folder))
    return picks, checkpoints, kept_folders, run


def assert_every_kept_checkpoint_resumes(name, folder, tmp_path, picks, checkpoints):
    for saved, state in checkpoints.items():
        # The run folder as the run left it (a resumed run writes its own refreshes into it).
        copy = tmp_path / f"resume_{saved}"
        shutil.copytree(folder, copy)
        resumed = strategy(name, copy)
        resumed.load_state_dict(state)
        if saved == MAX_STEPS:  # a finished run: the final validation reads the selection as it stands
            assert torch.equal(resumed.select(QUERIES).indices, picks[MAX_STEPS - 1])
        for step in range(saved, MAX_STEPS):
            resumed.before_step(step, partial(tower, step))
            assert torch.equal(resumed.select(QUERIES).indices, picks[step]), (saved, step)


@pytest.mark.parametrize("name", REFRESHING)
def test_checkpoints_on_refresh_steps_keep_only_the_current_refresh(name, tmp_path):
    """Checkpoints every 2R steps (the paper's configs: R = 500, save_every = 1000): each is resumed by a
    refresh, so the folders they reference are not kept. Before, exhaustive kept three at a time, the current
    one and the two the kept checkpoints referenced: 3 x 32 GB for 21M x 768 fp16 rows."""
    folder = tmp_path / "refresh"
    picks, checkpoints, kept_folders, run = train(name, folder, save_every=2 * REFRESH_EVERY)
    assert sorted(checkpoints) == [8, 12]
    for step, kept in enumerate(kept_folders):
        assert len(kept) <= 1, (step, kept)
    assert kept_folders[-1] == [run.refresh_step]  # what the checkpoint after the last step reads
    assert_every_kept_checkpoint_resumes(name, folder, tmp_path, picks, checkpoints)


@pytest.mark.parametrize("name", REFRESHING)
def test_checkpoints_between_refreshes_keep_the_refresh_they_read(name, tmp_path):
    folder = tmp_path / "refresh"
    picks, checkpoints, kept_folders, _ = train(name, folder, save_every=3)
    assert sorted(checkpoints) == [9, 12]
    assert_every_kept_checkpoint_resumes(name, folder, tmp_path, picks, checkpoints)
    if name == "exhaustive":
        # Checkpoint 9 reads the refresh before step 8; step 11 reads the one before step 10.
        assert kept_folders[-1] == [8, 10]


def test_a_missing_refresh_that_a_resume_reads_is_an_error_when_the_rows_are_read(tmp_path):
    folder = tmp_path / "refresh"
    _, checkpoints, _, _ = train("exhaustive", folder, save_every=3)
    shutil.rmtree(folder / "step_0000008")
    resumed = strategy("exhaustive", folder)
    resumed.load_state_dict(checkpoints[9])  # step 9 does not refresh: it scans the rows of step 8
    with pytest.raises(FileNotFoundError, match="run folder is incomplete"):
        resumed.select(QUERIES)


def test_the_main_process_never_prunes_a_refresh_another_process_is_writing(tmp_path):
    """Under `accelerate launch` a process may already be at the next step's refresh, writing its share into
    `step_<s>`, while the main process prunes after step s: that folder is not the main's to delete (it was,
    and the other process's write failed now and then under load)."""
    folder = tmp_path / "refresh"
    run = strategy("exhaustive", folder)
    for step in range(3):
        run.before_step(step, partial(tower, step))
        run.prune_refreshes([], step + 1)
    assert refreshes(folder) == [run.refresh_step] == [2]
    ahead = folder / "step_0000003"  # the refresh before step 4, begun by a faster process
    ahead.mkdir()
    (ahead / ".rank00001_rows30-60.npy.tmp").write_bytes(b"being written")
    run.prune_refreshes([], 3)
    assert refreshes(folder) == [2, 3] and (ahead / ".rank00001_rows30-60.npy.tmp").is_file()


@pytest.mark.parametrize("name", ["exhaustive", "snm"])
def test_a_refresh_deletes_the_earlier_refreshes_no_kept_checkpoint_reads(name, tmp_path):
    """The training loop prunes nothing: a refresh deletes the refreshed rows it replaces, except those a kept
    checkpoint (the steps the run told the strategy) would resume from."""
    folder = tmp_path / "refresh"
    run = strategy(name, folder)
    run.checkpoint_steps = (5,)  # a checkpoint after step 5 reads the rows refreshed before step 4
    for step in range(8):
        run.before_step(step, partial(tower, step))
    assert refreshes(folder) == [4, 6] == [4, run.refresh_step]
