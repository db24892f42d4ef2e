"""How this attempt of a run ended, written where its launcher looks (`configs/slurm/train_multinode.sbatch`).

A launcher that requeues a stopped job must tell the stop it asked for from a failure, and neither the exit
code nor the log can: torchrun answers a worker's failure by sending SIGTERM to the others, the same signal a
scheduler sends before a preemption or the time limit, and it reports any worker's exit as 1. So the processes
leave records in the attempt's folder:

* `stopped.json`, from the main process, only once every process has agreed to stop on a signal (one
  collective: a process that failed never takes part, so the survivors of a failure never write it) and what
  the run resumes from is on disk (the checkpoint, or the buffer's finished shards). It names the attempt
  (Slurm's job id and restart count) and the signal.
* `failed-rank-NNNNN.txt`, from any process that raised, when the launcher gave the folder: one line, when,
  which rank on which host, the error. The earliest is the root cause; later ones are mostly its echoes (a
  peer lost mid-collective).
* `heartbeat-rank-NNNNN.json` and `stalled.txt` (`rlm.training.heartbeat`): each process's progress, and the
  main process's report of the ranks that hold the others up.

The folder is `$RLM_ATTEMPT_DIR` (the sbatch script gives each attempt a new one), else
`<output_dir>/attempt`, which the main process empties when a run starts. Nothing here imports torch: the
sbatch test's stand-in for the training writes its records with these functions.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from pathlib import Path

from rlm.base.atomicio import atomic_write_text

ATTEMPT_DIR_ENV = "RLM_ATTEMPT_DIR"
STOPPED = "stopped.json"
STALLED = "stalled.txt"
FAILED_PREFIX = "failed-rank-"
MESSAGE_CHARS = 2000  # a failure record is one line of the log, not a traceback (the log above holds that)


def attempt_folder(output_dir: str | os.PathLike) -> Path:
    """Where this attempt's records go: `$RLM_ATTEMPT_DIR`, else `<output_dir>/attempt`."""
    given = os.environ.get(ATTEMPT_DIR_ENV)
    return Path(given) if given else Path(output_dir) / "attempt"


def attempt_name() -> str | None:
    """`JOBID.RESTARTS` under Slurm (what the sbatch script matches), else None."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT') or 0}" if job else None


def start_attempt(output_dir: str | os.PathLike) -> None:
    """Empty the default folder of an earlier attempt's records (the main process, before the others write); a
    folder the launcher gave (`$RLM_ATTEMPT_DIR`) is its own, and new."""
    if os.environ.get(ATTEMPT_DIR_ENV):
        return
    shutil.rmtree(attempt_folder(output_dir), ignore_errors=True)


def now_iso() -> str:
    """UTC with microseconds: records sort by it as text (`sort` in the sbatch script)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_stopped(folder: Path, signal_name: str, step: int, checkpoint: str | None) -> Path:
    """The main process's record that every process stopped on `signal_name` with `checkpoint` complete."""
    path = Path(folder) / STOPPED
    record = {
        "attempt": attempt_name(),
        "signal": signal_name,
        "step": step,
        "checkpoint": checkpoint,
        "time": now_iso(),
    }
    # One line: the sbatch script reads it with grep, not a JSON parser.
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def write_failure(folder: Path, rank: int, error: BaseException) -> Path:
    """This process's one-line record of the error it is failing with."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    message = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + " ..."
    line = f"{now_iso()} rank {rank} on {socket.gethostname()} (pid {os.getpid()}) failed: {name}: {message}"
    path = Path(folder) / f"{FAILED_PREFIX}{rank:05d}.txt"
    atomic_write_text(path, line + "\n")
    return path


def write_stalled(folder: Path, report: str) -> Path:
    path = Path(folder) / STALLED
    atomic_write_text(path, report.rstrip("\n") + "\n")
    return path
