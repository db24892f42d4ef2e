"""Which rank holds the others up: every process's progress on disk, read by the main process.

In a data-parallel run a rank that hangs (a stuck read, a dead GPU, a deadlock) stops every other rank at the
next collective, and the process group's timeout then ends the run with a message that names no one (or, under
NCCL, none at all). So every process of a launched run writes `heartbeat-rank-NNNNN.json` into the attempt's
folder (`rlm.training.attempt`) from a thread of its own, which keeps writing while the main thread waits at a
collective: its optimizer steps done and when the last one ended, what it is doing and since when, how many
marks (step ends, phase changes: the same sequence on every rank) it has passed, and where its main thread is
(the innermost frames). The main process reads them all as it writes its own. When it has made no progress
for half the process-group timeout, it prints a report with every rank's time since its last step and the
ranks it can name, and writes it to `stalled.txt`; the timeout then ends the run, and the sbatch script prints
the report last and does not requeue.

A rank is named when its heartbeat stopped (the process is frozen or its machine is gone), when it is behind
the others' marks, or when it is the one not waiting at a collective while the others are. One process runs no
heartbeat: there is no other rank to name.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rlm.base.atomicio import atomic_write_json
from rlm.training.attempt import write_stalled

HEARTBEAT_S = 10.0  # the longest interval between two writes of a heartbeat (shorter under a short timeout)
STALE_BEATS = 3  # a heartbeat this many intervals old (and some seconds more) has stopped
FRAMES = 4  # innermost frames of the main thread kept in a heartbeat (and the innermost of the project's)
# A main thread in one of these waits at a collective: torch.distributed's own calls, accelerate's and the
# project's collective helpers (under NCCL a collective returns at once and the host waits where these read
# its result back: the window's verdict on its losses, the stop check).
COLLECTIVE_FILES = (f"torch{os.sep}distributed{os.sep}",)
COLLECTIVE_FUNCTIONS = frozenset(
    {
        "wait_for_everyone",
        "gather",
        "gather_object",
        "broadcast_object_list",
        "reduce",
        "finite_on_every_process",
        "mean_over_processes",
        "requested_anywhere",
        "_stopped_anywhere",
    }
)
PROJECT = Path(__file__).resolve().parents[2]  # the folder holding rlm/, retriever/, reader/ (and tests/)
LIBRARIES = (f"{os.sep}site-packages{os.sep}", sysconfig.get_paths()["stdlib"])


def heartbeat_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"heartbeat-rank-{rank:05d}.json"


def main_thread_frames(limit: int = FRAMES) -> tuple[list[str], str | None]:
    """Where the main thread is: its innermost frames (`file:line in function`, innermost first), and the
    innermost one of the project's own code (where it called into a library: a collective, a read)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    found, ours = [], None
    while frame is not None and (ours is None or len(found) < limit):
        code = frame.f_code
        where = f"{_short(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        if ours is None and not any(library in code.co_filename for library in LIBRARIES):
            ours = where
        if len(found) < limit:
            found.append(where)
        frame = frame.f_back
    return found, ours


def _short(path: str) -> str:
    """A frame's file from its package folder on (`torch/distributed/...`, `rlm/training/loop.py`)."""
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(PROJECT))
    return path


def at_a_collective(frames: list[str]) -> bool:
    """Whether a main thread at `frames` (`main_thread_frames`) waits at a collective."""
    return any(
        any(f in frame for f in COLLECTIVE_FILES) or frame.rsplit(" in ", 1)[-1] in COLLECTIVE_FUNCTIONS
        for frame in frames
    )


class Heartbeat:
    """This process's progress, written every `interval()` seconds to `folder` by a thread; on the main
    process the same thread reads every rank's and reports a stall (`stall_after()` seconds without progress).

    The loop tells it `step_done(step)` and `doing(phase)`; both only set attributes (no I/O on the step's
    path)."""

    def __init__(
        self,
        folder: Path | None,
        rank: int,
        world: int,
        timeout: Callable[[], float] = lambda: 1800.0,
        report: Callable[[str], None] | None = None,
    ):
        self.folder, self.rank, self.world, self.timeout = folder, rank, world, timeout
        self.report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        self.host, self.pid = socket.gethostname(), os.getpid()
        now = time.time()
        self.steps, self.step_ended, self.marks = 0, now, 0
        self.what, self.since = "starting", now
        self.reported: tuple = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.folder is not None and self.world > 1

    def interval(self) -> float:
        return min(HEARTBEAT_S, max(0.5, self.timeout() / 20))

    def stall_after(self) -> float:
        return self.timeout() / 2

    def start(self) -> Heartbeat:
        if self.active and self._thread is None:
            self.write()  # atomic_write_json makes the folder
            self._thread = threading.Thread(target=self._run, name="rlm-heartbeat", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # -- what the loop tells it ----------------------------------------------------------------------------

    def step_done(self, step: int) -> None:
        now = time.time()
        self.steps, self.step_ended = step, now
        self._mark(f"step {step + 1}", now)

    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """A phase (a checkpoint, a validation): the same marks on every rank, which call it together."""
        before = self.what
        self._mark(what, time.time())
        try:
            yield
        finally:
            self._mark(before, time.time())

    def _mark(self, what: str, now: float) -> None:
        self.what, self.since, self.marks = what, now, self.marks + 1

    # -- the thread ----------------------------------------------------------------------------------------

    def beat(self) -> dict:
        frames, ours = main_thread_frames()
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "steps": self.steps,
            "step_ended": self.step_ended,
            "doing": self.what,
            "since": self.since,
            "marks": self.marks,
            "frames": frames,
            "ours": ours,
            "written": time.time(),
        }

    def write(self) -> None:
        atomic_write_json(heartbeat_path(self.folder, self.rank), self.beat(), indent=None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval()):
            try:
                self.write()
                if self.rank == 0:
                    self.watch()
            except OSError as err:  # a full or unmounted disk must not end the training from here
                print(f"rlm train: heartbeat of rank {self.rank} not written: {err}", file=sys.stderr)

    def read_all(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.world):
            with contextlib.suppress(OSError, ValueError):
                beats[rank] = json.loads(heartbeat_path(self.folder, rank).read_text())
        return beats

    def watch(self) -> str | None:
        """On the main process: the stall report when it has made no progress for `stall_after()` seconds and
        can name who holds it up, or waits at a collective itself, printed and written once per stall. Ranks
        that are all at work (a long validation) are no stall."""
        now = time.time()
        idle = now - max(self.since, self.step_ended)
        if idle < self.stall_after():
            self.reported = ()
            return None
        beats = self.read_all()
        named = holding_up(beats, self.world, now, self.interval())
        if not named and not at_a_collective(main_thread_frames()[0]):
            return None
        key = (self.marks, tuple(sorted(named)))
        if key == self.reported:
            return None
        self.reported = key
        report = stall_report(beats, self.world, named, now, idle)
        write_stalled(self.folder, report)
        self.report(report)
        return report


def holding_up(beats: dict[int, dict], world: int, now: float, interval: float) -> dict[int, str]:
    """The ranks that hold the others up, each with why: no heartbeat (or one that stopped), behind the
    others' marks, or the only ones not waiting at a collective. Empty when they cannot be told apart."""
    stale_after = STALE_BEATS * interval + 5
    gone = {
        rank: "no heartbeat: the process never wrote one or is gone"
        for rank in range(world)
        if rank not in beats
    }
    gone.update(
        {
            rank: f"its heartbeat stopped {now - b['written']:.0f} s ago: its process is frozen or its node gone"
            for rank, b in beats.items()
            if now - b["written"] > stale_after
        }
    )
    if gone:
        return gone
    most = max(b["marks"] for b in beats.values())
    behind = {
        rank: f"behind the others ({b['steps']} steps, doing {b['doing']})"
        for rank, b in beats.items()
        if b["marks"] < most
    }
    if behind:
        return behind
    waiting = {rank for rank, b in beats.items() if at_a_collective(b["frames"])}
    if waiting and len(waiting) < len(beats):
        return {rank: "not at the collective the others wait at" for rank in beats if rank not in waiting}
    return {}


def stall_report(beats: dict[int, dict], world: int, named: dict[int, str], now: float, idle: float) -> str:
    """What the log and `stalled.txt` say: the named ranks, then every rank's time since its last step."""
    if named:
        held = "; ".join(
            f"rank {rank} ({beats.get(rank, {}).get('host', '?')}): {why}"
            for rank, why in sorted(named.items())
        )
        head = f"held up by {held}"
    else:
        head = (
            "no rank can be named: every rank waits at a collective or a device sync (a hung device, or a "
            "collective that not every rank entered)"
        )
    lines = [f"rlm train: no progress for {idle:.0f} s; {head}"]
    for rank in range(world):
        b = beats.get(rank)
        if b is None:
            lines.append(f"  rank {rank}: no heartbeat")
            continue
        innermost, ours = (b["frames"] or ["?"])[0], b.get("ours")
        where = innermost if ours in (None, innermost) else f"{innermost}, from {ours}"
        lines.append(
            f"  rank {rank} ({b['host']}, pid {b['pid']}): {b['steps']} steps, the last "
            f"{now - b['step_ended']:.0f} s ago; {b['doing']} for {now - b['since']:.0f} s; heartbeat "
            f"{now - b['written']:.0f} s ago; at {where}"
        )
    return "\n".join(lines)
