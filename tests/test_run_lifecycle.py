"""What a day-long job meets between steps (issue 28): a re-queued command, preemption, a torn log, a torn or
planted checkpoint, a full disk, a resume with other settings, a user error under the GPU entry point.

Runs are the tiny ones of tests/tiny_run.py, trained in this process through `rlm.train.main` (the entry
point `python -m rlm.train` uses) unless the test needs a process to signal or kill."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from local_port import launch_env, two_processes
from tiny_run import as_set_args, launch_two, read_log, runs_beside, same_losses, train_args, train_here

from rlm.training import checkpointing
from rlm.training.checkpointing import MANIFEST, checkpoints, verify, write_manifest
from rlm.training.preemption import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[1]


def steps_of(out: Path) -> list[int]:
    return [checkpointing.checkpoint_step(p) for p in checkpoints(out)]


@pytest.fixture(scope="module")
def root(tiny_world, tmp_path_factory):
    return runs_beside(tiny_world, tmp_path_factory.mktemp("lifecycle"))


@pytest.fixture(scope="module")
def reference(root):
    """An uninterrupted 6-step run: its log is what every interrupted and resumed run must reproduce."""
    assert train_here(train_args(root, "reference")) == 0
    return read_log(root / "reference" / "log.jsonl")


# ---- 1. a rerun without --resume ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_rerun_is_refused_and_overwrite_starts_over_without_the_old_checkpoints(root, reference, capsys):
    out = root / "rerun"
    shutil.copytree(root / "reference", out)
    before = (out / "log.jsonl").read_bytes()
    assert train_here(train_args(root, "rerun", steps=4)) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "log.jsonl").read_bytes() == before and steps_of(out) == [4, 6]  # nothing was touched
    # --overwrite starts over: the old run's step 6 must not survive beside the new run's checkpoints (pruning
    # by step kept it and deleted the new run's own), nor be resumed later.
    assert train_here([*train_args(root, "rerun", steps=4), "--overwrite"]) == 0
    assert steps_of(out) == [2, 4]
    log = read_log(out / "log.jsonl")
    assert sorted(log) == [1, 2, 3, 4]
    # A new run from the start: its first steps are the reference's (the lr schedules part after step 3).
    same_losses({s: log[s] for s in (1, 2, 3)}, {s: reference[s] for s in (1, 2, 3)})


# ---- 2. preemption ------------------------------------------------------------------------------------


def wait_for_step(log: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and max(read_log(log) or [0]) >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before step {step}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for step {step}")


def stopped_here(argv: list[str], signum: signal.Signals, monkeypatch, capsys) -> tuple[int, str]:
    """`train_here(argv)` with `signum` sent to this process once step 2 is done: (exit code, stderr)."""
    from rlm.training import loop

    train_step = loop.train_step

    def step_then_signal(run, *timer):
        record = train_step(run, *timer)
        if record is not None and record["step"] == 2:
            os.kill(os.getpid(), signum)
        return record

    monkeypatch.setattr(loop, "train_step", step_then_signal)
    capsys.readouterr()
    code = train_here(argv)
    monkeypatch.undo()
    return code, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_the_current_step_and_resume_gives_the_same_losses(
    root, reference, signum, monkeypatch, capsys
):
    """SIGTERM to a `python -m rlm.train` process, as a scheduler sends it; SIGUSR1 (Slurm's --signal) to a run
    in this process, through the same handler (a process start is ~8 CPU-s of imports)."""
    out = root / f"preempted_{signum.name}"
    # No periodic checkpoints: all that survives is the one the signal makes.
    argv = train_args(root, out.name, "save_every=0")
    if signum == signal.SIGTERM:
        cmd = [sys.executable, "-m", "rlm.train", *argv]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env()
        )
        try:
            wait_for_step(out / "log.jsonl", 2, proc)
            proc.send_signal(signum)
            _, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
        code = proc.returncode
    else:
        code, stderr = stopped_here(argv, signum, monkeypatch, capsys)
    assert code == EXIT_PREEMPTED, stderr[-3000:]
    stopped = steps_of(out)
    assert len(stopped) == 1 and 2 <= stopped[0] < 6, (stopped, stderr[-2000:])
    assert f"stopped by {signum.name} at step {stopped[0]}" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    assert train_here([*train_args(root, out.name, "save_every=0"), "--resume"]) == 0
    same_losses(read_log(out / "log.jsonl"), reference)


@pytest.mark.slow
def test_sigterm_to_accelerate_launch_stops_both_processes_at_one_step_and_resume_matches(two_process_run):
    """What a cluster does: SIGTERM to the launcher, which forwards it to both processes. The uninterrupted
    two-process run to match is the session's (tests/conftest.py), launched with these same arguments."""
    root = two_process_run
    out = root / "two_stopped"
    proc = subprocess.Popen(
        launch_two(root, out.name),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(),
    )
    try:
        wait_for_step(out / "log.jsonl", 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stopped = steps_of(out)
    assert len(stopped) == 1 and 2 <= stopped[0] < 6, (stopped, stderr[-3000:])
    # One line from the main process; the launcher then reports the signal in its own words.
    assert stderr.count(f"stopped by SIGTERM at step {stopped[0]}") == 1
    # The record a launcher requeues on, written once both processes agreed and the checkpoint was complete.
    record = json.loads((out / "attempt" / "stopped.json").read_text())
    assert (record["signal"], record["step"]) == ("SIGTERM", stopped[0]) and record["checkpoint"].endswith(
        f"step_{stopped[0]:07d}"
    )
    resume_two_and_compare(root, out, root / "reference")


@pytest.mark.slow
def test_a_signal_during_a_refresh_stops_it_and_the_refresh_is_redone_on_resume(root, monkeypatch):
    """Exhaustive re-embeds before every step; SIGTERM arrives while step 3's refresh embeds its first part:
    the rest of the refresh is not done, the checkpoint is step 3's start, and resuming redoes the refresh."""
    import rlm.training.run

    extra = ("strategy.name=exhaustive", "strategy.refresh_every=1", "save_every=0")
    assert train_here(train_args(root, "refresh_ref", *extra)) == 0
    reference = read_log(root / "refresh_ref" / "log.jsonl")

    embed_rows, parts = rlm.training.run.embed_rows, []
    per_refresh = -(-len((root / "toy" / "corpus.jsonl").read_text().splitlines()) // 32)
    assert per_refresh > 1

    def embed_and_signal(tower, texts, rows, batch_size=64):
        parts.append(len(rows))
        if len(parts) == 2 * per_refresh + 1:  # refreshes before steps 1 and 2 done: step 3's first part
            os.kill(os.getpid(), signal.SIGTERM)
        return embed_rows(tower, texts, rows, batch_size)

    monkeypatch.setattr(rlm.training.run, "REEMBED_PART_ROWS", 32)  # a refresh in several parts
    monkeypatch.setattr(rlm.training.run, "embed_rows", embed_and_signal)
    out = root / "refresh_stop"
    assert train_here(train_args(root, out.name, *extra)) == EXIT_PREEMPTED
    assert len(parts) == 2 * per_refresh + 1, "the refresh went on after the signal"
    assert steps_of(out) == [3]
    assert json.loads((out / "attempt" / "stopped.json").read_text())["step"] == 3
    monkeypatch.undo()
    assert train_here([*train_args(root, out.name, *extra), "--resume"]) == 0
    same_losses(read_log(out / "log.jsonl"), reference)


@pytest.mark.slow
def test_a_signal_to_one_process_during_a_refresh_stops_both_at_one_part_with_a_checkpoint_and_a_record(root):
    """Two processes; exhaustive re-embeds before every step; SIGTERM reaches only rank 1, in the refresh before
    step 2: both stop at the refresh's next part, checkpoint step 2's start together, the main process records
    the stop, and resuming redoes the refresh and trains as an uninterrupted run does."""
    extra = ("strategy.name=exhaustive", "strategy.refresh_every=1")
    reference = subprocess.run(
        launch_two(root, "two_refresh_ref", *extra),
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = root / "two_refresh_stop"
    stop = two_processes(
        str(REPO / "tests" / "multiprocess_refresh_stop.py"),
        *train_args(root, out.name, "save_every=0", *extra),
    )
    done = subprocess.run(stop, capture_output=True, text=True, env=launch_env(), timeout=600)
    assert done.returncode != 0 and "stopped by SIGTERM at step 2" in done.stderr, done.stderr[-3000:]
    assert steps_of(out) == [2], (steps_of(out), done.stderr[-3000:])
    record = json.loads((out / "attempt" / "stopped.json").read_text())
    assert (record["signal"], record["step"]) == ("SIGTERM", 2), record
    resume_two_and_compare(root, out, root / "two_refresh_ref", *extra)


def resume_two_and_compare(root: Path, out: Path, reference: Path, *extra: str) -> None:
    """Resume the stopped two-process run `out` under `accelerate launch` and check it logs `reference`'s
    losses, step for step."""
    resumed = subprocess.run(
        [*launch_two(root, out.name, *extra), "--resume"],
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    same_losses(read_log(out / "log.jsonl"), read_log(reference / "log.jsonl"))


# ---- 3. resume trusts nothing on disk -----------------------------------------------------------------


@pytest.mark.slow
def test_resume_drops_a_torn_log_line_skips_a_torn_checkpoint_and_ignores_stray_folders(
    root, reference, capsys
):
    out = root / "torn"
    shutil.copytree(root / "reference", out)
    shutil.rmtree(out / "final")
    # A kill at step 5 of a run that saved 2 and 4 would leave this; then disk trouble tears the log's last
    # line and the newest checkpoint's optimizer file, and someone leaves a folder of their own.
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    shutil.copytree(root / "reference" / "checkpoints" / "step_0000004", out / "checkpoints" / "step_0000002")
    log = out / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:4]) + '{"step": 5, "lo')
    optimizer = out / "checkpoints" / "step_0000004" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    (out / "checkpoints" / "step_final").mkdir()
    assert "optimizer.bin has 100 bytes" in verify(out / "checkpoints" / "step_0000004")
    with pytest.warns(UserWarning, match="torn last line"):
        assert train_here([*train_args(root, "torn"), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "skipping checkpoint" in printed and "step_0000004: optimizer.bin has 100 bytes" in printed
    # The copy named step 2 holds step 4's state: resuming from it continues at step 4, as the log shows.
    assert "at step 4" in printed
    same_losses({s: r for s, r in read_log(log).items() if s > 4}, {5: reference[5], 6: reference[6]})


def tiny_accelerator_state(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def test_a_save_that_fails_midway_keeps_the_checkpoint_it_would_replace(tmp_path, monkeypatch):
    accelerator, model = tiny_accelerator_state(tmp_path)
    saved = checkpointing.save_checkpoint(accelerator, tmp_path, 5, 2, {"step": 5}, "seed: 0\n")
    assert verify(saved) is None and checkpointing.read_state(saved) == {"step": 5}
    weights = (saved / "model.safetensors").read_bytes()

    def full_disk(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    # The same step saved again (a resumed run reaching it), and the disk fills during the write.
    monkeypatch.setattr(checkpointing, "write_manifest", full_disk)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(
        checkpointing.UserError, match="step_0000005: the disk is full; the last complete one"
    ):
        checkpointing.save_checkpoint(accelerator, tmp_path, 5, 2, {"step": 5}, "seed: 0\n")
    assert verify(saved) is None and (saved / "model.safetensors").read_bytes() == weights
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000005"]  # no temporary left


def test_each_checkpoint_keeps_its_state_as_json_and_safetensors_without_pickles(tmp_path):
    accelerator, _ = tiny_accelerator_state(tmp_path)
    state = {"train": {"step": 3, "align_best": float("inf"), "align_end": None}, "rng": torch.arange(4)}
    saved = checkpointing.save_checkpoint(accelerator, tmp_path, 3, 1, state, "seed: 0\n")
    back = checkpointing.read_state(saved)
    assert back["train"] == state["train"] and torch.equal(back["rng"], state["rng"])
    assert not list(saved.glob("custom_checkpoint_*"))
    assert set(json.loads((saved / MANIFEST).read_text())["files"]) >= {"state.json", "config.yaml"}


# ---- 4. resume with other settings --------------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_other_settings_is_refused_by_name_unless_allowed(root, reference, capsys):
    out = root / "changed"
    shutil.copytree(root / "reference", out)
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    config_before = (out / "config.yaml").read_text()
    assert train_here([*train_args(root, "changed", "seed=1", "optim.batch_size=3"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "optim.batch_size: 2 -> 3" in err and "seed: 0 -> 1" in err and "--allow-changed" in err
    assert (out / "config.yaml").read_text() == config_before  # the run's config is not overwritten
    # Training longer is a deliberate change: allowed by name, and said.
    argv = [*train_args(root, "changed", steps=8), "--resume", "--allow-changed", "optim.max_steps"]
    assert train_here(argv) == 0
    assert "optim.max_steps: 6 -> 8" in capsys.readouterr().out
    assert max(read_log(out / "log.jsonl")) == 8
    assert "max_steps: 8" in (out / "checkpoints" / "step_0000008" / "config.yaml").read_text()


def test_a_changed_process_count_is_a_changed_setting():
    changed = checkpointing.changed_settings("seed: 0\nlog_every: 1\n", "seed: 0\nlog_every: 5\n", 2, 1)
    assert changed == {"processes": (2, 1)}  # how often it logs is not what it trains


# ---- 5. resume runs no code from a file ---------------------------------------------------------------


class Planted:
    """A pickle that, when loaded, creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


@pytest.mark.slow
def test_resume_refuses_a_planted_pickle_in_every_file_it_reads(root, reference, tmp_path, capsys):
    source = root / "reference" / "checkpoints" / "step_0000006"
    pickled = sorted(p.name for p in source.iterdir() if p.suffix in checkpointing.PICKLED_SUFFIXES)
    assert {"optimizer.bin", "random_states_0.pkl"} <= set(pickled)
    for name in pickled:
        out = tmp_path / name
        (out / "checkpoints").mkdir(parents=True)
        folder = out / "checkpoints" / source.name
        shutil.copytree(source, folder)
        marker = tmp_path / f"marker_{name}"
        torch.save({"state": Planted(marker)}, folder / name)
        write_manifest(folder)  # whoever plants it can rewrite the manifest too
        assert train_here([*train_args(root, str(out)), "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"refusing to resume from {folder}" in err and f"{name}: io.open" in err
        assert not marker.exists()


# ---- 8. the GPU entry point ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_user_error_under_accelerate_launch_is_one_line_from_the_main_process(root, tmp_path):
    cmd = two_processes("-m", "rlm.train", *train_args(root, str(tmp_path / "bad"), "strategy.name=nonsense"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=300, cwd=REPO)
    assert done.returncode != 0
    # The launcher reports the failed processes in its own words; no traceback comes from our code. Ours are
    # the package's files, not any path with an `rlm` folder in it (a checkout cloned into `rlm/` has one).
    frames = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("File ")]
    ours = (f'"{REPO / "rlm"}{os.sep}', f"site-packages{os.sep}rlm{os.sep}")
    assert not [frame for frame in frames if any(package in frame for package in ours)], frames
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "nonsense" in errors[0], done.stderr[-3000:]


# ---- 10. a hung process -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hung_process_ends_the_run_after_dist_timeout_s_and_is_named_before(tmp_path):
    # The smallest timeout the config allows: rank 0 itself reports how long it waited at the collective.
    hang = as_set_args(["cpu=true", "dist_timeout_s=10", f"output_dir={tmp_path}"])
    cmd = two_processes(str(REPO / "tests" / "multiprocess_hang.py"), *hang)
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=600, cwd=REPO)
    took = time.monotonic() - start
    waited = float((tmp_path / "rank0_waited_s.txt").read_text())
    # Without the setting rank 0 would wait PyTorch's default 30 minutes (the subprocess timeout would fire).
    assert done.returncode != 0 and 10 <= waited < 60 and took < 180, (waited, took, done.stderr[-3000:])
    # Half-way through the wait the main process named the rank that never came, and where it was.
    named = "held up by rank 1 (" in done.stderr and "not at the collective the others wait at" in done.stderr
    assert named, done.stderr[-3000:]
    stalled = (tmp_path / "attempt" / "stalled.txt").read_text()
    assert "held up by rank 1" in stalled and "multiprocess_hang.py" in stalled.splitlines()[2], stalled


# ---- 6. final/ whole or not at all --------------------------------------------------------------------


@pytest.mark.slow
def test_final_is_replaced_whole_or_not_at_all(root, reference, monkeypatch):
    from rlm.retriever.corrector import CorrectorNetwork

    out = root / "final_whole"
    shutil.copytree(root / "reference", out)
    before = {p.relative_to(out): p.read_bytes() for p in (out / "final").rglob("*") if p.is_file()}

    def failed(*_, **__):  # the retriever and reader are written, then the disk fails
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(CorrectorNetwork, "save_pretrained", failed)
    with pytest.raises(OSError, match="Input/output error"):
        train_here([*train_args(root, out.name, steps=8), "--resume", "--allow-changed", "optim.max_steps"])
    after = {p.relative_to(out): p.read_bytes() for p in (out / "final").rglob("*") if p.is_file()}
    assert after == before  # the old final/ whole, no new retriever beside the old reader
    assert not [p for p in out.iterdir() if p.name.startswith(".final")]


# ---- 9. a stop on non-finite losses prunes nothing ----------------------------------------------------


@pytest.mark.slow
def test_the_checkpoint_of_a_non_finite_stop_pushes_no_good_one_out(root, monkeypatch):
    from rlm.training import loop

    finite = loop.finite_on_every_process
    state = {}
    build_run = loop.build_run

    def remember_run(*a, **k):
        state["run"] = build_run(*a, **k)
        return state["run"]

    def nan_from_step_5(accelerator, loss):
        return finite(accelerator, loss) and state["run"].state.step < 5

    monkeypatch.setattr(loop, "build_run", remember_run)
    monkeypatch.setattr(loop, "finite_on_every_process", nan_from_step_5)
    out = root / "nonfinite_stop"
    assert train_here(train_args(root, out.name, "max_nonfinite_in_a_row=2", steps=8)) == 1
    assert steps_of(out) == [2, 4, 5]  # keep_last=2 would have dropped step 2 for the stop's own


@pytest.mark.slow
def test_a_signal_during_the_buffer_build_stops_it_between_batches_and_a_rerun_resumes(
    root, reference, monkeypatch
):
    from rlm.retriever.encoder import SentenceEncoder

    forward, calls = SentenceEncoder.forward, []

    def forward_and_signal(self, *a, **k):  # the build runs the tower's forward once per batch
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *a, **k)

    monkeypatch.setattr(SentenceEncoder, "forward", forward_and_signal)
    out = root / "buffer_stop"
    own_buffer = (f"buffer.dir={out / 'buffer'}", "buffer.batch_size=16")
    assert train_here(train_args(root, out.name, *own_buffer)) == EXIT_PREEMPTED
    assert len(calls) == 2 and not (out / "buffer" / "meta.json").exists()
    monkeypatch.undo()
    assert train_here([*train_args(root, out.name, *own_buffer), "--resume"]) == 0
    same_losses(read_log(out / "log.jsonl"), reference)


def test_a_preemption_survives_the_trip_back_from_a_worker_process():
    """`rlm.quickstart.concurrent_runs` returns a worker's exception pickled: a Preempted must unpickle whole (one that
    did not hung the quickstart's process pool)."""
    import pickle

    from rlm.training.preemption import Preempted

    again = pickle.loads(pickle.dumps(Preempted(signal.SIGTERM, 7, "runs/x/checkpoints/step_0000007")))
    assert (again.signum, again.step, again.checkpoint) == (
        signal.SIGTERM,
        7,
        "runs/x/checkpoints/step_0000007",
    )
    assert "stopped by SIGTERM at step 7" in str(again)
