"""Train several runs at once, each in a process of its own on one torch thread, with one progress bar.

Why: the quickstart's runs are small (a 6-layer MiniLM, a 2-layer T5 on batches of 16), too small for a
second torch thread to double a run's speed, so two runs side by side on one thread each get more done than
one after the other on two (measured by `scripts/kernel_families.py quickstart`). A
run's digits depend on its thread count (the order of floating-point sums), so every run trains on one
thread, also when only one is trained (then in this process, no worker is started).

Each worker writes what its run prints to `<output_dir>/train.log` and runs at a lower priority than this
process, which shows the runs' combined progress (read from their `log.jsonl` files) and hands each finished
run to a callback while the others go on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from rlm.config import TrainConfig

LOG_NAME = "train.log"


@dataclass
class RunJob:
    """One run to train: its name (for the messages), config and the shared prefix it continues, if any."""

    name: str
    cfg: TrainConfig
    prefix: Path | None = None

    @property
    def first_step(self) -> int:
        from rlm.training.prefix import shared_steps

        return shared_steps(self.cfg) if self.prefix is not None else 0


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the block, its earlier setting restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_one(cfg: TrainConfig, prefix: Path | None = None, prefix_out: Path | None = None) -> dict:
    """`rlm.training.loop.train` on one thread, with accelerate's process-wide state fresh before and after."""
    from accelerate.state import AcceleratorState

    from rlm.quickstart.prefix_runs import train_from_prefix, train_prefix
    from rlm.training.loop import train

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with one_thread():
            if prefix_out is not None:
                return train_prefix(cfg, prefix_out)
            if prefix is not None:
                return train_from_prefix(cfg, prefix)
            return train(cfg, overwrite=True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Everything this process writes to stdout and stderr (C libraries included) goes to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def worker_context() -> multiprocessing.context.BaseContext:
    """Where a pool's worker processes come from: a fork server that imported the training code once, so
    each worker starts without repeating its ~8 CPU-s of imports (torch, transformers' model code), which for
    the quickstart's small runs is as long as the training. Not a fork of this process: a copy of a process
    that has run torch (its thread pools) can deadlock; the server has only imported it. Children inherit
    the server's environment, taken when the first pool starts. Spawn where there is no fork server
    (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["rlm.training.loop"])
    return context


def _yield_cpu() -> None:
    """A worker's start: lower its priority, so that what this process does meanwhile (fitting the answer
    policy, serving the demo of a finished run) is not slowed down by the runs still training."""
    if hasattr(os, "nice"):
        os.nice(10)


def _train_in_worker(cfg: TrainConfig, prefix: Path | None) -> tuple[dict, float]:
    """(the run's summary, its wall seconds), what it printed in its train.log."""
    started = time.perf_counter()
    with _output_to(Path(cfg.output_dir) / LOG_NAME):
        summary = train_one(cfg, prefix)
    return summary, time.perf_counter() - started


def _steps_done(job: RunJob) -> int:
    """Optimizer steps the run has logged beyond the prefix it started from."""
    try:
        lines = (Path(job.cfg.output_dir) / "log.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
    return max(0, lines - job.first_step)


def train_runs(
    jobs: list[RunJob], workers: int, on_done: Callable[[RunJob, dict, float], None] | None = None
) -> dict[str, dict]:
    """Train every job, `workers` at a time (one: in this process), each on one torch thread; returns each
    run's training summary by name. As each one finishes, `on_done(job, summary, seconds)` is called in this
    process (it may print; the progress bar makes way), while the others go on training."""
    results: dict[str, dict] = {}
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        for job in jobs:
            started = time.perf_counter()
            results[job.name] = train_one(job.cfg, job.prefix)
            if on_done:
                on_done(job, results[job.name], time.perf_counter() - started)
        return results
    from tqdm import tqdm

    total = sum(job.cfg.optim.max_steps - job.first_step for job in jobs)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=worker_context(), initializer=_yield_cpu)
    try:
        with tqdm(total=total, desc=f"{len(jobs)} runs, {workers} at a time", unit="step") as bar:
            pending = {pool.submit(_train_in_worker, job.cfg, job.prefix): job for job in jobs}
            while pending:
                done, _ = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
                for future in done:
                    job = pending.pop(future)
                    try:
                        results[job.name], seconds = future.result()
                    except BaseException:
                        bar.write(
                            f"{job.name}: failed; its output is in {Path(job.cfg.output_dir) / LOG_NAME}"
                        )
                        raise
                    if on_done:
                        # The callback may run long and draw its own bars, from other threads too (the
                        # demo's warm-up request encodes in a server thread and waits for it): hold no tqdm
                        # lock while it runs (`external_write_mode` would, and deadlock), only take the bar
                        # off the screen and draw it again after.
                        bar.clear()
                        on_done(job, results[job.name], seconds)
                        bar.refresh()
                steps = sum(
                    job.cfg.optim.max_steps - job.first_step if job.name in results else _steps_done(job)
                    for job in jobs
                )
                bar.update(steps - bar.n)
    except BaseException:
        # One run failed (or the user stopped us): the others would only finish for nothing. SIGKILL, not
        # SIGTERM: a training run takes SIGTERM as "checkpoint this step and stop" (rlm.training.preemption).
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results
