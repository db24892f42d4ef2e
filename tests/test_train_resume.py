"""End-to-end runs of `rlm train`: exact resume after SIGKILL (a `python -m rlm.train` process killed, resumed
here), non-finite losses and bf16 on CPU (the same entry point, called in this process: a process start is ~8
CPU-s of imports).

Two-process runs (launched with `accelerate launch`) are in tests/test_train_multiprocess.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_run import LOSS_KEYS, as_set_args, read_log, tiny_overrides

pytestmark = pytest.mark.slow

STEPS = 8


def tiny_run_args(root: Path, out: Path, *extra: str, minilm: bool = False) -> list[str]:
    schedule = [
        f"optim.max_steps={STEPS}",
        "optim.warmup_steps=2",
        "log_every=1",
        "save_every=2",
        "keep_last=2",
    ]
    return as_set_args(tiny_overrides(root, out, *schedule, "cpu=true", *extra, minilm=minilm))


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def train_here(
    root: Path, out: Path, *extra: str, minilm: bool = False, one_thread: bool = False, resume: bool = False
) -> int:
    """`rlm train` with the tiny run's arguments, in this process (accelerate's process-wide state reset around
    it); `one_thread`: on one torch thread, as the `python -m rlm.train` processes (`OMP_NUM_THREADS=1`), whose
    losses must then agree with it to the last digits."""
    import contextlib

    from accelerate.state import AcceleratorState

    from rlm.quickstart.concurrent_runs import one_thread as on_one_thread
    from rlm.train import main

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with on_one_thread() if one_thread else contextlib.nullcontext():
            return main(tiny_run_args(root, out, *extra, minilm=minilm) + (["--resume"] if resume else []))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The toy world and buffer the runs share; each run writes under its test's tmp_path (checkpoints are
    ~0.5 GB each with MiniLM, and pytest deletes a passed test's tmp_path)."""
    return tmp_path_factory.mktemp("resume")


def test_sigkill_then_resume_gives_the_same_losses(root, tmp_path, capsys):
    # The uninterrupted run in this process (a process start is ~8 CPU-s of imports), on one thread as the killed one.
    assert train_here(root, tmp_path / "full", one_thread=True) == 0
    reference = read_log(tmp_path / "full" / "log.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))
    shutil.rmtree(tmp_path / "full")  # only its log is needed: keep the test's disk peak at one run

    # Start the same run and kill it hard once step 3 is logged (so step 2's checkpoint is complete), with five
    # steps still to go: the kill lands mid-run however fast the steps are. Then resume.
    cmd = [sys.executable, "-m", "rlm.train", *tiny_run_args(root, tmp_path / "killed")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    log = tmp_path / "killed" / "log.jsonl"
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            if log.exists() and max(read_log(log) or [0]) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail("the run ended before it could be killed")
            time.sleep(0.05)
        else:
            pytest.fail("timed out waiting for step 3")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = max(read_log(log))
    assert killed_at < STEPS, "the run finished before the kill"
    folder = tmp_path / "killed" / "checkpoints"
    complete = sorted(p.name for p in folder.iterdir() if p.name.startswith("step_"))
    last = int(complete[-1][5:])
    assert last in (2, 4, 6) and last <= killed_at
    # A kill that lands while a checkpoint is written leaves its temporary folder behind (it did when the kill
    # caught a save). Make that the case every time: resuming must start from the last complete checkpoint,
    # and the next save of that step replaces the leftover.
    (folder / f".tmp-step_{last + 2:07d}" / "pytorch_model").mkdir(parents=True, exist_ok=True)

    # Resumed in this process, as the reference ran: what must carry over is in the checkpoint, not the process.
    capsys.readouterr()
    assert train_here(root, tmp_path / "killed", one_thread=True, resume=True) == 0
    assert f"at step {last}" in capsys.readouterr().out  # the last complete checkpoint, not the leftover
    assert not any(p.name.startswith(".tmp") for p in folder.iterdir())
    got = read_log(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in LOSS_KEYS:
            assert got[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert (tmp_path / "killed" / "final" / "reader" / "model.safetensors").exists()


def test_non_finite_losses_stop_the_run_at_the_nth_distinct_bad_batch_with_a_checkpoint(
    root, tmp_path, capsys
):
    # A learning rate this large sends the reader's weights to inf within a few updates: from then on every
    # batch is bad. Each is skipped and named, the data moving on a window each time, until the third.
    code = train_here(
        root, tmp_path / "nan", "optim.lr_reader=1e30", "optim.warmup_steps=0", "max_bad_batches=3"
    )
    assert code != 0
    printed = capsys.readouterr()
    skipped = [line for line in printed.out.splitlines() if "non-finite loss; skipped the batch" in line]
    assert len(skipped) == 3
    step = skipped[0].split(":")[0]
    assert all(line.startswith(f"{step}: ") for line in skipped)  # no step taken between the skips
    windows = [int(line.split("window ")[1].split()[0]) for line in skipped]
    first = windows[0]
    assert windows == [first, first + 1, first + 2]  # the data moved on a window at each skip
    named = [line.split("questions ")[1].split() for line in skipped]  # each batch's 2 question ids
    assert all(len(ids) == 2 for ids in named) and len({id_ for ids in named for id_ in ids}) == 6
    assert f"3 batches with non-finite losses (windows {first}, {first + 1}, {first + 2};" in printed.err
    assert (tmp_path / "nan" / "checkpoints").is_dir()


def test_a_skipped_bad_batch_stays_skipped_after_a_crash_and_resume_with_the_same_losses(
    root, tmp_path, capsys, monkeypatch
):
    """A batch whose loss is non-finite (here: any batch holding a question of step 3's batch) is skipped, and
    the skip is part of the saved state: a run that crashed after it resumes from the step-4 checkpoint on the
    windows the uninterrupted run trained, with the same losses."""
    from rlm.training import loop
    from rlm.training.model import RetrievalAugmentedModel

    forward, poisoned, calls = RetrievalAugmentedModel.forward, set(), []

    def forward_with_nan(self, batch, *args, **kwargs):
        out = forward(self, batch, *args, **kwargs)
        calls.append(batch.questions)
        if len(calls) == 4 and not poisoned:  # the uninterrupted run's step 3 (one micro-batch a step)
            poisoned.update(batch.questions)
        if poisoned & set(batch.questions):
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(RetrievalAugmentedModel, "forward", forward_with_nan)
    assert train_here(root, tmp_path / "full", one_thread=True) == 0
    assert "step 3: non-finite loss; skipped the batch of window 3" in capsys.readouterr().out
    reference = read_log(tmp_path / "full" / "log.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS]["nonfinite_skipped"] == 1
    shutil.rmtree(tmp_path / "full")

    train_step = loop.train_step

    def crash_after_step_5(run, *timer):
        record = train_step(run, *timer)
        if run.state.step == 5:
            raise RuntimeError("crashed")
        return record

    monkeypatch.setattr(loop, "train_step", crash_after_step_5)
    with pytest.raises(RuntimeError, match="crashed"):
        train_here(root, tmp_path / "crashed", one_thread=True)
    monkeypatch.setattr(loop, "train_step", train_step)
    assert train_here(root, tmp_path / "crashed", one_thread=True, resume=True) == 0
    assert "at step 4" in capsys.readouterr().out  # after the skip: the state it resumes holds it
    got = read_log(tmp_path / "crashed" / "log.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS]["nonfinite_skipped"] == 1
    for step in range(1, STEPS + 1):
        for key in LOSS_KEYS:
            assert got[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.learning
def test_bf16_mixed_precision_trains_on_cpu_and_validates_close_to_fp32(root, tmp_path):
    """mixed_precision=bf16 on CPU: the step, refreshes and validation run under autocast (faster only on CPUs
    with native bf16, docs/training.md), and the losses and dev recall stay close to the float32 run's. With
    the default retriever, MiniLM: bf16's error is to be judged on the weights people train."""
    extra = ("optim.max_steps=2", "data.dev=toy", "data.max_dev_examples=16", "save_every=0")
    # A refresh before step 2 that re-embeds 16 sampled passages (regression's s'), not all 120: bf16 is
    # emulated, ~17x slower, on CPUs without native bf16, and each re-embedded passage is ~0.1 s there.
    extra += ("strategy.name=regression", "strategy.refresh_every=1", "strategy.regression.samples=16")
    runs = {}
    # force_cpu_bf16: what is tested is bf16's numerics, which a CPU without native bf16 would otherwise skip
    # by falling back to float32 (rlm.precision).
    for precision, force in (("no", ()), ("bf16", ("force_cpu_bf16=true",))):
        code = train_here(
            root,
            tmp_path / f"precision_{precision}",
            *extra,
            f"mixed_precision={precision}",
            *force,
            minilm=True,
        )
        assert code == 0
        summary = json.loads((tmp_path / f"precision_{precision}" / "summary.json").read_text())
        runs[precision] = (read_log(tmp_path / f"precision_{precision}" / "log.jsonl"), summary)
    (log32, sum32), (log16, sum16) = runs["no"], runs["bf16"]
    assert sum16["reembedded"] == sum32["reembedded"] > 0
    for key in ("loss", "reader_loss", "retriever_loss"):
        assert log16[1][key] == pytest.approx(log32[1][key], rel=0.05), key
    assert log16[1]["loss"] != log32[1]["loss"], "bf16 changed nothing: autocast is not in force"
    assert abs(sum16["dev_recall@20"] - sum32["dev_recall@20"]) <= 0.15
