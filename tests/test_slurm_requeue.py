"""configs/slurm/train_multinode.sbatch requeues a job only when THIS attempt was stopped by a signal (issue 40,
item 6). The real script runs under bash with stand-ins first on PATH: `srun` (this node's task, started in a
process group of its own as slurmstepd starts it), `scontrol` (answers `show hostnames`, records `requeue`) and
`accelerate` (torchrun's side of `accelerate launch`: the training process in a session of its own, the signals
torchrun handles forwarded to it and a SIGKILL `SHUTDOWN_S` later, exit 1 when the training process fails). The
training process is a stand-in too: it finishes, runs out of memory, or stops on SIGTERM/SIGUSR1 with a
checkpoint that takes longer than torchrun's grace, and says so as `rlm train` does. The test plays Slurm: the
job's log is appended to by every attempt, and a stop signal goes to the job step's processes (every one, as
cgroup tracking does, or the task's process group, as pgid tracking does) or to the batch shell."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "configs" / "slurm" / "train_multinode.sbatch"
JOB = "4242"
SHUTDOWN_S = 0.5  # the stand-in torchrun's grace between forwarding a signal and SIGKILL (torchrun's 30 s)
CHECKPOINT_S = (
    2.0  # the stand-in training's last step and checkpoint after a stop signal: longer than the grace
)

SRUN = """#!/bin/bash
# srun: this node's task (node 0) in a process group of its own; a signal srun gets goes to that group.
while [ "${1#-}" != "$1" ]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
setsid "$@" &
task=$!
echo "$task" > "$STANDIN/task.pid"
woken=""
forward() { woken=1; kill -s "$1" -- "-$task" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
status=0
wait "$task" || status=$?
while [ -n "$woken" ]; do woken="" && status=0 && { wait "$task" || status=$?; }; done
exit "$status"
"""

SCONTROL = """#!/bin/bash
case "$1 ${2:-}" in
  "show hostnames") printf 'node-a\nnode-b\n' | cat ;; # one write, as scontrol's buffered stdout
  requeue*) echo "requeue $2" >> "$STANDIN/requeued" ;;
  *) echo "scontrol stand-in: unexpected: $*" >&2; exit 1 ;;
esac
"""

ACCELERATE = """#!{python}
import json, os, signal, subprocess, sys
standin = os.environ["STANDIN"]
args = sys.argv[1:]
with open(os.path.join(standin, "launch.json"), "w") as f:
    json.dump(args, f)
training = args[args.index("-m") + 2:]
worker = subprocess.Popen(
    [sys.executable, os.path.join(standin, "training.py"), *training], start_new_session=True
)
class SignalException(Exception):
    pass
def raise_it(signum, frame):
    raise SignalException(signum)
# torchrun's --signals-to-handle (PET_SIGNALS_TO_HANDLE); its handlers replace an inherited SIG_IGN
handled = [getattr(signal, name.strip()) for name in
           os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")]
for sig in handled:
    signal.signal(sig, raise_it)
try:
    sys.exit(0 if worker.wait() == 0 else 1)
except SignalException as stop:  # torchrun: forward the signal, wait its grace, SIGKILL, fail
    for sig in handled:
        signal.signal(sig, signal.SIG_IGN)
    worker.send_signal(stop.args[0])
    try:
        worker.wait(timeout={shutdown_s})
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
    sys.exit(1)
"""

TRAINING = """import os, signal, sys, time
standin = os.environ["STANDIN"]
what = os.environ["STANDIN_TRAINING"]
with open(os.path.join(standin, "training.pid"), "w") as f:
    f.write(str(os.getpid()))
if what == "finishes":
    print('{{"steps": 20000}}', flush=True)
    sys.exit(0)
if what == "runs out of memory":
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
    sys.exit(1)
received = []  # rlm.training.preemption.StopSignals: SIGTERM and SIGUSR1 recorded, acted on after the step
previous = {{sig: signal.signal(sig, lambda signum, frame: received.append(signum))
            for sig in (signal.SIGTERM, signal.SIGUSR1)}}
def give_back():  # StopSignals.installed() restores the inherited handlers as the run ends
    for sig, handler in previous.items():
        signal.signal(sig, handler)
open(os.path.join(standin, "training.started"), "w").close()
deadline = time.monotonic() + 60
while not received and time.monotonic() < deadline:
    time.sleep(0.02)
if what == "finishes after a stop signal":  # the signal came during the final validation: rlm finishes
    give_back()  # a second stop signal (the node's task passes it on) must not kill the exiting process
    print('{{"steps": 20000}}', flush=True)
    sys.exit(0)
time.sleep({checkpoint_s})  # the step, then a checkpoint
open(os.path.join(standin, "checkpoint.written"), "w").close()
give_back()
name = signal.Signals(received[0]).name if received else "nothing"
print(f"rlm train: stopped by {{name}} at step 7: saved /shared/runs/nq/checkpoints/step_0000007; "
      "rerun the command with --resume", file=sys.stderr, flush=True)
sys.exit(75)
"""

EARLIER_ATTEMPT = (
    "rlm-train: stop requested (SIGTERM) on node 0; the training checkpoints and exits\n"
    "rlm train: stopped by SIGTERM at step 5000: saved /shared/runs/nq/checkpoints/step_0005000; "
    "rerun the command with --resume\n"
)


def step_processes(task: int) -> list[int]:
    """The task and every process below it (what cgroup process tracking signals)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [task]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def send(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the script ended ({proc.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)


def attempt(tmp_path: Path, training: str, stop=None, restarts: int = 0, earlier: str = "") -> dict:
    """One attempt of job JOB: the sbatch script under bash, its output appended to the job's log.
    `stop(proc, standin)` plays Slurm once the training runs. Returns the exit code, the requeue calls, this
    attempt's part of the log, whether the stopped training's checkpoint was written, the launcher's args."""
    standin, bin_dir = tmp_path / "standin", tmp_path / "bin"
    standin.mkdir()
    bin_dir.mkdir()
    for name, text in {
        "srun": SRUN,
        "scontrol": SCONTROL,
        "accelerate": ACCELERATE.format(python=sys.executable, shutdown_s=SHUTDOWN_S),
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (standin / "training.py").write_text(TRAINING.format(checkpoint_s=CHECKPOINT_S))
    log = tmp_path / f"rlm-train-{JOB}.out"
    log.write_text(earlier)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID=JOB,
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_RESTART_COUNT=str(restarts),
        STANDIN=str(standin),
        STANDIN_TRAINING=training,
    )
    with log.open("a") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--config", "nq"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if stop is not None:
                wait_for(standin / "training.started", proc)
                stop(proc, standin)
            code = proc.wait(timeout=60)
        finally:  # whatever a failed run left behind
            for pidfile in ("task.pid", "training.pid"):
                if (standin / pidfile).exists():
                    send([int((standin / pidfile).read_text())], signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    requeued = standin / "requeued"
    launched = standin / "launch.json"
    return {
        "code": code,
        "requeued": requeued.read_text().splitlines() if requeued.exists() else [],
        "output": log.read_text()[len(earlier) :],
        "checkpoint": (standin / "checkpoint.written").exists(),
        "launch": json.loads(launched.read_text()) if launched.exists() else None,
    }


def term_every_step_process(proc, standin):  # --signal=TERM@N, a preemption's SIGTERM: cgroup tracking
    send(step_processes(int((standin / "task.pid").read_text())), signal.SIGTERM)


def term_the_task_group(proc, standin):  # the same under pgid tracking: the workers' sessions are not reached
    os.killpg(int((standin / "task.pid").read_text()), signal.SIGTERM)


def term_the_batch_shell(proc, standin):  # scancel --batch --signal=TERM, or a preemption that signals it
    proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("stop", [term_every_step_process, term_the_task_group, term_the_batch_shell])
def test_an_attempt_stopped_by_a_signal_checkpoints_and_is_requeued(tmp_path, stop):
    run = attempt(tmp_path, "stops on a signal", stop=stop)
    assert run["checkpoint"], (
        "no checkpoint (never asked to stop, or killed by its launcher):\n" + run["output"]
    )
    assert "rlm train: stopped by SIG" in run["output"], run["output"]
    assert run["requeued"] == [f"requeue {JOB}"], run["output"]
    assert run["code"] == 0, run["output"]


def test_a_failure_after_an_earlier_attempt_was_preempted_is_not_requeued(tmp_path):
    run = attempt(tmp_path, "runs out of memory", restarts=1, earlier=EARLIER_ATTEMPT)
    assert "CUDA out of memory" in run["output"]
    assert run["requeued"] == [], run["output"]
    assert run["code"] == 1, run["output"]


def test_a_clean_finish_is_not_requeued(tmp_path):
    run = attempt(tmp_path, "finishes")
    assert run["requeued"] == [] and run["code"] == 0, run["output"]
    launch = " ".join(run["launch"])
    assert launch.startswith("launch --config_file configs/accelerate/multinode.yaml"), launch
    assert "--num_machines 2 --machine_rank 0 --num_processes 16 --main_process_ip node-a" in launch, launch
    assert launch.endswith("-m rlm.train --resume --config nq"), launch


def test_a_finish_after_a_stop_signal_is_not_requeued(tmp_path):
    run = attempt(tmp_path, "finishes after a stop signal", stop=term_every_step_process)
    assert run["requeued"] == [] and run["code"] == 0, run["output"]


def test_a_failure_in_a_first_attempt_is_not_requeued(tmp_path):
    run = attempt(tmp_path, "runs out of memory")
    assert run["requeued"] == [] and run["code"] == 1, run["output"]


def test_the_stop_signal_leaves_time_for_a_checkpoint_of_the_papers_size():
    """A step, then ~5 GB with a SHA-256 per file written to shared storage: minutes, not torchrun's 30 s."""
    found = re.search(r"^#SBATCH --signal=(?:B:)?(\w+)@(\d+)$", SCRIPT.read_text(), re.MULTILINE)
    assert found and found[1] in ("TERM", "USR1") and int(found[2]) >= 600, found
