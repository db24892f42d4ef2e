"""configs/slurm/train_multinode.sbatch requeues a job only when THIS attempt was stopped by the scheduler's
signal with a complete checkpoint (issue 40, item 6; issue 48, item 1), at most --max-requeues times.

The real script runs under bash with stand-ins first on PATH: `srun` (this node's task, started in a process
group of its own as slurmstepd starts it; it records its options), `scontrol` (answers `show hostnames`,
records `requeue`) and `accelerate` (torchrun's side of `accelerate launch`: `WORKERS` training processes,
ranks 0 and 1, each in a session of its own; the signals torchrun handles forwarded to them; and when a worker
fails, SIGTERM to the others, SIGKILL `SHUTDOWN_S` later and exit 1, as torchrun ends a failed worker group).

The training processes are stand-ins too, which keep rlm's protocol and write its records with rlm's own
functions (`rlm.training.attempt`): on a stop signal every rank waits until every rank has agreed (rlm's
collective; a rank that died never agrees), then the checkpoint (longer than torchrun's grace), then the main
process records the stop (`stopped.json`) and each exits 75; a rank that raises records its error
(`failed-rank-*.txt`). The test plays Slurm: the job's log is appended to by every attempt, and a signal goes
to the job step's processes (every one, as cgroup tracking does, or the task's process group, as pgid
tracking does) or to the batch shell."""

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

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "configs" / "slurm" / "train_multinode.sbatch"
JOB = "4242"
WORKERS = 2  # training processes the stand-in launcher starts (8 GPUs a node in the script's own arithmetic)
SHUTDOWN_S = 0.5  # the stand-in torchrun's grace between forwarding a signal and SIGKILL (torchrun's 30 s)
CHECKPOINT_S = 2.0  # the stand-in training's checkpoint after an agreed stop: longer than the grace

SRUN = """#!/bin/bash
# srun: this node's task (node 0) in a process group of its own; a signal srun gets goes to that group.
printf '%s\\n' "$@" > "$STANDIN/srun.args"
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
import json, os, signal, subprocess, sys, time
standin = os.environ["STANDIN"]
args = sys.argv[1:]
with open(os.path.join(standin, "launch.json"), "w") as f:
    json.dump(args, f)
training = args[args.index("-m") + 2:]
workers = [
    subprocess.Popen(
        [sys.executable, os.path.join(standin, "training.py"), *training],
        env={{**os.environ, "RANK": str(rank), "WORLD_SIZE": "{workers}"}},
        start_new_session=True,
    )
    for rank in range({workers})
]
class SignalException(Exception):
    pass
def raise_it(signum, frame):
    raise SignalException(signum)
# torchrun's --signals-to-handle (PET_SIGNALS_TO_HANDLE); its handlers replace an inherited SIG_IGN
handled = [getattr(signal, name.strip()) for name in
           os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")]
for sig in handled:
    signal.signal(sig, raise_it)
def close(sig):  # torchrun's shutdown of the worker group: the signal, its grace, SIGKILL
    for w in workers:
        if w.poll() is None:
            w.send_signal(sig)
    deadline = time.monotonic() + {shutdown_s}
    for w in workers:
        try:
            w.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
try:
    while True:
        codes = [w.poll() for w in workers]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:  # torchrun: the first failure ends the group
            rank = failed[0]
            print(f"torchrun stand-in: rank {{rank}} failed (exitcode {{codes[rank]}})", file=sys.stderr)
            close(signal.SIGTERM)
            sys.exit(1)
        if all(code == 0 for code in codes):
            sys.exit(0)
        time.sleep(0.02)
except SignalException as stop:
    for sig in handled:
        signal.signal(sig, signal.SIG_IGN)
    close(stop.args[0])
    sys.exit(1)
"""

TRAINING = """import os, signal, sys, time, traceback
sys.path.insert(0, {repo!r})
from rlm.training.attempt import attempt_folder, write_failure, write_stalled, write_stopped
standin, what = os.environ["STANDIN"], os.environ["STANDIN_TRAINING"]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
folder = attempt_folder("/nonexistent/output_dir")  # $RLM_ATTEMPT_DIR, which the script gives
with open(os.path.join(standin, f"training{{rank}}.pid"), "w") as f:
    f.write(str(os.getpid()))
def fail(error):  # rlm train's failure: the record, the traceback, exit 1
    write_failure(folder, rank, error)
    traceback.print_exception(error)
    sys.exit(1)
if what == "finishes":
    if rank == 0:
        print('{{"steps": 20000}}', flush=True)
    sys.exit(0)
received = []  # rlm.training.preemption.StopSignals: SIGTERM and SIGUSR1 recorded, acted on after the step
previous = {{sig: signal.signal(sig, lambda signum, frame: received.append(signum))
            for sig in (signal.SIGTERM, signal.SIGUSR1)}}
def give_back():  # StopSignals.installed() restores the inherited handlers as the run ends
    for sig, handler in previous.items():
        signal.signal(sig, handler)
open(os.path.join(standin, f"training{{rank}}.started"), "w").close()
if rank == 1 and what in ("a worker runs out of memory", "a worker raises"):
    while not os.path.exists(os.path.join(standin, "training0.started")):
        time.sleep(0.02)  # the main process is in a refresh (or a step) when this one fails
    if what == "a worker runs out of memory":
        class OutOfMemoryError(RuntimeError):
            pass
        OutOfMemoryError.__module__ = "torch"
        fail(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        {{}}["reader_passages"]
    except KeyError as err:
        fail(err)
if what == "hangs":  # rank 1 never reaches the collective; the process group's timeout ends rank 0
    if rank == 1:
        time.sleep(60)
    held = "held up by rank 1 (node-a): not at the collective the others wait at"
    write_stalled(folder, f"rlm train: no progress for 5 s; {{held}}")
    fail(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"))
deadline = time.monotonic() + 60
while not received and time.monotonic() < deadline:
    time.sleep(0.02)
if what == "finishes after a stop signal":  # the signal came during the final validation: rlm finishes
    give_back()  # a second stop signal (the node's task passes it on) must not kill the exiting process
    if rank == 0:
        print('{{"steps": 20000}}', flush=True)
    sys.exit(0)
# rlm's stop: every rank agrees at one collective (here, a file each); a rank that died never does.
open(os.path.join(standin, f"agreed{{rank}}"), "w").close()
while not all(os.path.exists(os.path.join(standin, f"agreed{{r}}")) for r in range(world)):
    time.sleep(0.02)
time.sleep({checkpoint_s})  # the checkpoint
open(os.path.join(standin, "checkpoint.written"), "w").close()
give_back()
name = signal.Signals(received[0]).name
step = 6 if what == "stops on a signal in a refresh" else 7  # a refresh stops at the step before it
if rank == 0:
    checkpoint = f"/shared/runs/nq/checkpoints/step_{{step:07d}}"
    write_stopped(folder, name, step, checkpoint)
    print(f"rlm train: stopped by {{name}} at step {{step}}: saved {{checkpoint}}; "
          "rerun the command with --resume", file=sys.stderr, flush=True)
sys.exit(75)
"""

EARLIER_ATTEMPT = (
    "rlm-train: stop requested (SIGTERM) on node 0; the training checkpoints and exits\n"
    "rlm train: stopped by SIGTERM at step 5000: saved /shared/runs/nq/checkpoints/step_0005000; "
    "rerun the command with --resume\n"
    "rlm-train: stopped by SIGTERM with a complete checkpoint (attempt 4242.0); requeued (1 of at most 10) "
    "to continue with --resume\n"
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


def wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert proc.poll() is None, f"the script ended ({proc.returncode}) before {[p.name for p in paths]}"
        assert time.monotonic() < deadline, f"no {[p.name for p in paths]} after {timeout} s"
        time.sleep(0.02)


def attempt(
    tmp_path: Path, training: str, stop=None, restarts: int = 0, earlier: str = "", options=()
) -> dict:
    """One attempt of job JOB: the sbatch script under bash (`options` before rlm's arguments), its output
    appended to the job's log. `stop(proc, standin)` plays Slurm once every training process runs. Returns the
    exit code, the requeue calls, this attempt's part of the log, whether the stopped training's checkpoint was
    written, the launcher's and srun's arguments, and the attempt's record folder."""
    standin, bin_dir = tmp_path / "standin", tmp_path / "bin"
    standin.mkdir(parents=True)
    bin_dir.mkdir()
    for name, text in {
        "srun": SRUN,
        "scontrol": SCONTROL,
        "accelerate": ACCELERATE.format(python=sys.executable, shutdown_s=SHUTDOWN_S, workers=WORKERS),
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (standin / "training.py").write_text(TRAINING.format(repo=str(REPO), checkpoint_s=CHECKPOINT_S))
    log = tmp_path / f"rlm-train-{JOB}.out"
    log.write_text(earlier)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "RLM_"))
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID=JOB,
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_CPUS_PER_TASK="64",  # what sbatch exports from #SBATCH --cpus-per-task
        SLURM_RESTART_COUNT=str(restarts),
        STANDIN=str(standin),
        STANDIN_TRAINING=training,
    )
    with log.open("a") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), *options, "--config", "nq"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if stop is not None:
                wait_for([standin / f"training{rank}.started" for rank in range(WORKERS)], proc)
                stop(proc, standin)
            code = proc.wait(timeout=90)
        finally:  # whatever a failed run left behind
            for pidfile in ("task.pid", *(f"training{rank}.pid" for rank in range(WORKERS))):
                if (standin / pidfile).exists():
                    send([int((standin / pidfile).read_text())], signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    requeued = standin / "requeued"
    launched = standin / "launch.json"
    srun_args = standin / "srun.args"
    return {
        "code": code,
        "requeued": requeued.read_text().splitlines() if requeued.exists() else [],
        "output": log.read_text()[len(earlier) :],
        "checkpoint": (standin / "checkpoint.written").exists(),
        "launch": json.loads(launched.read_text()) if launched.exists() else None,
        "srun": srun_args.read_text().splitlines() if srun_args.exists() else None,
        "records": tmp_path / f"rlm-train-{JOB}.attempt-{restarts}",
    }


def term_every_step_process(proc, standin):  # --signal=TERM@N, a preemption's SIGTERM: cgroup tracking
    send(step_processes(int((standin / "task.pid").read_text())), signal.SIGTERM)


def term_the_task_group(proc, standin):  # the same under pgid tracking: the workers' sessions are not reached
    os.killpg(int((standin / "task.pid").read_text()), signal.SIGTERM)


def term_the_batch_shell(proc, standin):  # scancel --batch --signal=TERM, or a preemption that signals it
    proc.send_signal(signal.SIGTERM)


def preempt(proc, standin):  # a preemption with a GraceTime: SIGTERM to every process of the job, shell too
    term_every_step_process(proc, standin)
    term_the_batch_shell(proc, standin)


def lose_the_node(proc, standin):  # the node goes: its processes end at once, with no word from any
    send(step_processes(int((standin / "task.pid").read_text())), signal.SIGKILL)


def last_lines(output: str, count: int = 3) -> str:
    return "\n".join(output.rstrip("\n").splitlines()[-count:])


@pytest.mark.parametrize("stop", [term_every_step_process, term_the_task_group, term_the_batch_shell])
def test_the_time_limit_signal_checkpoints_and_requeues_the_job(tmp_path, stop):
    run = attempt(tmp_path, "stops on a signal", stop=stop)
    assert run["checkpoint"], (
        "no checkpoint (never asked to stop, or killed by its launcher):\n" + run["output"]
    )
    assert "rlm train: stopped by SIG" in run["output"], run["output"]
    assert run["requeued"] == [f"requeue {JOB}"], run["output"]
    assert run["code"] == 0, run["output"]
    assert "requeued (1 of at most 10)" in last_lines(run["output"]), run["output"]


def test_a_preemption_during_a_refresh_checkpoints_and_requeues_the_job(tmp_path):
    run = attempt(tmp_path, "stops on a signal in a refresh", stop=preempt)
    assert run["checkpoint"] and "stopped by SIGTERM at step 6" in run["output"], run["output"]
    assert run["requeued"] == [f"requeue {JOB}"] and run["code"] == 0, run["output"]


def test_a_worker_out_of_memory_while_the_main_process_is_in_a_refresh_ends_the_job_unrequeued(tmp_path):
    """torchrun sends SIGTERM to the main process, which is in a refresh: it never stops (its stop needs the
    failed worker's agreement), records nothing, and the job ends with the worker's error last in the log."""
    run = attempt(tmp_path, "a worker runs out of memory")
    assert run["requeued"] == [] and run["code"] == 1, run["output"]
    assert not run["checkpoint"] and "stopped by" not in run["output"], run["output"]
    last = last_lines(run["output"])
    assert "rlm-train: the first failure:" in last and "rank 1 on" in last, run["output"]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in last, run["output"]


def test_an_exception_in_a_worker_ends_the_job_with_its_exit_code_and_message_last(tmp_path):
    run = attempt(tmp_path, "a worker raises")
    assert run["requeued"] == [] and run["code"] == 1, run["output"]
    assert "Traceback" in run["output"]  # the worker's own, above
    assert "rank 1 on" in last_lines(run["output"]) and "KeyError: 'reader_passages'" in last_lines(
        run["output"]
    ), run["output"]


def test_a_lost_node_ends_the_job_unrequeued_saying_no_process_recorded_why(tmp_path):
    """Slurm itself requeues a job whose node failed (--requeue): the script must neither requeue it nor
    hang."""
    run = attempt(tmp_path, "stops on a signal", stop=lose_the_node)
    assert run["requeued"] == [] and run["code"] != 0, run["output"]
    assert "no training process recorded its failure" in last_lines(run["output"]), run["output"]


def test_a_rank_past_the_process_group_timeout_ends_the_job_unrequeued_naming_it(tmp_path):
    run = attempt(tmp_path, "hangs")
    assert run["requeued"] == [] and run["code"] == 1, run["output"]
    tail = last_lines(run["output"], 4)
    assert "held up by rank 1" in tail and "Timed out" in tail, run["output"]


def test_the_requeue_cap_ends_a_stopped_job_with_75_and_says_how_to_continue(tmp_path):
    run = attempt(
        tmp_path,
        "stops on a signal",
        stop=term_every_step_process,
        restarts=3,
        options=["--max-requeues", "3"],
    )
    assert run["checkpoint"] and run["requeued"] == [], run["output"]
    assert run["code"] == 75, run["output"]
    assert "requeued 3 times already (--max-requeues 3): not requeued" in last_lines(run["output"]), run[
        "output"
    ]


def test_the_requeue_cap_is_ten_by_default(tmp_path):
    below = attempt(tmp_path / "9", "stops on a signal", stop=term_every_step_process, restarts=9)
    assert below["requeued"] == [f"requeue {JOB}"], below["output"]
    at = attempt(tmp_path / "10", "stops on a signal", stop=term_every_step_process, restarts=10)
    assert at["requeued"] == [] and at["code"] == 75, at["output"]


def test_a_failure_after_an_earlier_attempt_was_stopped_is_not_requeued(tmp_path):
    """What earlier attempts wrote to the shared log, and their records, count for nothing."""
    old_records = tmp_path / f"rlm-train-{JOB}.attempt-1"
    old_records.mkdir(parents=True)
    (old_records / "stopped.json").write_text(json.dumps({"attempt": f"{JOB}.0", "signal": "SIGTERM"}) + "\n")
    run = attempt(tmp_path, "a worker runs out of memory", restarts=1, earlier=EARLIER_ATTEMPT)
    assert "CUDA out of memory" in run["output"]
    assert run["requeued"] == [] and run["code"] == 1, run["output"]


def test_a_clean_finish_is_not_requeued_and_srun_is_given_the_cpus_of_a_task(tmp_path):
    run = attempt(tmp_path, "finishes")
    assert run["requeued"] == [] and run["code"] == 0, run["output"]
    launch = " ".join(run["launch"])
    assert launch.startswith("launch --config_file configs/accelerate/multinode.yaml"), launch
    assert "--num_machines 2 --machine_rank 0 --num_processes 16 --main_process_ip node-a" in launch, launch
    assert launch.endswith("-m rlm.train --resume --config nq"), launch
    assert "--cpus-per-task=64" in run["srun"], run["srun"]  # srun no longer takes it from sbatch (22.05)
    seen = re.search(
        r"rlm-train: node 0 \(\S+\) runs 8 training processes on (\d+) CPUs \(([\d,-]+)\)", run["output"]
    )
    assert seen and int(seen[1]) == len(os.sched_getaffinity(0)), run["output"]
    assert not run["records"].exists()  # nothing to keep from a finished attempt


def test_a_finish_after_a_stop_signal_is_not_requeued(tmp_path):
    run = attempt(tmp_path, "finishes after a stop signal", stop=term_every_step_process)
    assert run["requeued"] == [] and run["code"] == 0, run["output"]


def test_max_requeues_is_taken_out_of_rlms_arguments_and_a_bad_one_refused(tmp_path):
    run = attempt(tmp_path / "taken", "finishes", options=["--max-requeues=4"])
    assert run["code"] == 0 and run["launch"][-3:] == ["--resume", "--config", "nq"], run["launch"]
    bad = attempt(tmp_path / "bad", "finishes", options=["--max-requeues", "many"])
    assert bad["code"] == 2 and bad["launch"] is None, bad["output"]
    assert "--max-requeues takes a count of requeues, got 'many'" in bad["output"]


def test_the_stop_signal_leaves_time_for_a_checkpoint_of_the_papers_size():
    """A step, then ~5 GB with a SHA-256 per file written to shared storage: minutes, not torchrun's 30 s."""
    found = re.search(r"^#SBATCH --signal=(?:B:)?(\w+)@(\d+)$", SCRIPT.read_text(), re.MULTILINE)
    assert found and found[1] in ("TERM", "USR1") and int(found[2]) >= 600, found
