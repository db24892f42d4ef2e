"""Stopping cleanly when the cluster says so: SIGTERM (what torchrun forwards and schedulers send before a
kill) and SIGUSR1 (Slurm's `--signal` warning).

A handler only records the signal; the training loop asks after each optimizer step whether any process got
one (`requested_anywhere`: one tiny all-gather, so every process stops at the same step), writes one
checkpoint of that step and exits with `EXIT_PREEMPTED`. Long work inside a step (a refresh of re-embedded
rows) asks the same between its parts (`stop_together`), and the buffer build between batches, with its
processes meeting at its end (`rlm.retriever.buffer.BuildStopped`): finishing either could outlast the
scheduler's grace, and it is redone on resume.

Every stop is agreed by every process, at one collective, before anything is written: torchrun sends SIGTERM
to the survivors of a failed worker, and those must not take it for a stop (the failed one never takes part,
so the collective fails instead). Only after an agreed stop does the main process record it for the launcher
(`rlm.training.attempt`), which requeues on that record alone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry" -- resubmit with --resume.
EXIT_PREEMPTED = 75
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


class Preempted(Exception):
    """A stop signal arrived; `checkpoint` is where the run can resume from (None: its last checkpoint)."""

    def __init__(self, signum: int, step: int, checkpoint=None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"saved {checkpoint}" if checkpoint else "resume continues from the last checkpoint"
        super().__init__(f"stopped by {name} at step {step}: {where}; rerun the command with --resume")

    def __reduce__(self):
        # Pickled back from a worker process (rlm.quickstart.concurrent_runs): rebuilt from its fields, not its message.
        return (type(self), (self.signum, self.step, self.checkpoint))


class StopSignals:
    """Records SIGTERM/SIGUSR1 while active (installed only in the main thread; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum, frame) -> None:
        self.received = signum

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_together(self, accelerator, step: int) -> None:
        """Raise `Preempted` on every process if any process got a signal (collective: every process calls it
        at the same point of its work, which is where they all stop)."""
        got = self.requested_anywhere(accelerator)
        if got is not None:
            raise Preempted(got, step)

    def requested_anywhere(self, accelerator) -> int | None:
        """The signal any process received (the same answer on every process), or None."""
        # One process has nothing to agree on, and reading a tensor back would wait for the GPU.
        if accelerator.num_processes == 1:
            return self.received
        mine = torch.tensor([self.received or 0], device=accelerator.device)
        if accelerator.num_processes > 1:
            mine = accelerator.gather(mine)
        got = int(mine.max())
        return got or None
