"""A hung or slow rank is named (issue 48, item 2): every process's heartbeat, the main process's report of the
ranks that hold the others up, and a process-group timeout sized by what the run's collectives wait for."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest

from rlm.training import accelerator as accelerator_module
from rlm.training.accelerator import CollectiveTimeout
from rlm.training.heartbeat import Heartbeat, heartbeat_path, holding_up, main_thread_frames

NOW = 1_000_000.0
WAITING = ["torch/distributed/distributed_c10d.py:4870 in barrier", "rlm/train.py:98 in train_loop"]
READING = ["rlm/data/corpus.py:88 in passage", "rlm/training/steps.py:51 in algorithm2_step"]


def beat(rank, marks=12, frames=WAITING, written=NOW - 1, steps=5):
    return {
        "rank": rank,
        "host": f"node-{rank // 2}",
        "pid": 100 + rank,
        "steps": steps,
        "step_ended": NOW - 300,
        "doing": f"step {steps + 1}",
        "since": NOW - 300,
        "marks": marks,
        "frames": frames,
        "ours": next((f for f in frames if f.startswith(("rlm/", "tests/"))), None),
        "written": written,
    }


def test_the_rank_not_at_the_collective_the_others_wait_at_is_named():
    beats = {0: beat(0), 1: beat(1), 2: beat(2, frames=READING), 3: beat(3)}
    assert holding_up(beats, 4, NOW, 10.0) == {2: "not at the collective the others wait at"}


def test_a_rank_behind_the_others_marks_is_named_before_any_stack_is_looked_at():
    beats = {0: beat(0), 1: beat(1, marks=11, steps=4), 2: beat(2, frames=READING)}
    assert list(holding_up(beats, 3, NOW, 10.0)) == [1]


def test_a_rank_whose_heartbeat_stopped_or_never_came_is_named_as_frozen_or_gone():
    beats = {0: beat(0), 1: beat(1, written=NOW - 200)}
    named = holding_up(beats, 3, NOW, 10.0)
    assert sorted(named) == [1, 2]
    assert "stopped 200 s ago" in named[1] and "no heartbeat" in named[2]


def test_a_rank_reading_back_a_collectives_result_waits_there_as_under_nccl():
    """Under NCCL a collective returns at once; the host waits where the project reads its result back."""
    verdict = [
        "rlm/training/accelerator.py:262 in finite_on_every_process",
        "rlm/train.py:190 in accumulation_window",
    ]
    beats = {0: beat(0, frames=verdict), 1: beat(1, frames=READING), 2: beat(2, frames=verdict)}
    assert list(holding_up(beats, 3, NOW, 10.0)) == [1]


def test_ranks_all_at_work_are_no_stall(tmp_path):
    """A long validation: every rank embeds its share, none waits; nothing to report, however long it takes."""
    reports = []
    main = Heartbeat(tmp_path, 0, 2, timeout=lambda: 10.0, report=reports.append)
    main.step_ended = main.since = time.time() - 20  # past the whole timeout
    for rank in (0, 1):
        heartbeat_path(tmp_path, rank).write_text(
            json.dumps({**beat(rank, frames=READING), "written": time.time()})
        )
    assert main.watch() is None and reports == [] and not (tmp_path / "stalled.txt").exists()


def test_ranks_that_all_wait_alike_are_not_guessed_at():
    assert holding_up({0: beat(0), 1: beat(1)}, 2, NOW, 10.0) == {}


def test_the_main_process_reports_a_stall_once_naming_the_rank_and_every_ranks_time_since_its_step(tmp_path):
    reports = []
    main = Heartbeat(tmp_path, 0, 2, timeout=lambda: 10.0, report=reports.append)
    idle_since = time.time() - 6  # past half the timeout
    main.steps, main.step_ended, main.since = 5, idle_since, idle_since
    (tmp_path / "heartbeat-rank-00000.json").write_text(json.dumps({**beat(0), "written": time.time()}))
    stuck = {**beat(1, frames=READING), "written": time.time(), "step_ended": time.time() - 7}
    heartbeat_path(tmp_path, 1).write_text(json.dumps(stuck))
    report = main.watch()
    assert report is not None and reports == [report]
    first, *ranks = report.splitlines()
    assert (
        "no progress for 6 s; held up by rank 1 (node-0): not at the collective the others wait at" in first
    )
    assert len(ranks) == 2 and "rank 1 (node-0, pid 101): 5 steps, the last 7 s ago" in ranks[1]
    assert ranks[1].endswith("at rlm/data/corpus.py:88 in passage")  # its own code: no caller to add
    assert ranks[0].endswith(
        "at torch/distributed/distributed_c10d.py:4870 in barrier, from rlm/train.py:98 in train_loop"
    )
    assert (tmp_path / "stalled.txt").read_text() == report + "\n"
    assert main.watch() is None and len(reports) == 1  # the same stall is reported once
    main.step_done(6)
    assert main.watch() is None  # progress again: nothing to say


def test_the_heartbeat_thread_writes_while_the_main_thread_waits_and_says_where_it_waits(tmp_path):
    heartbeat = Heartbeat(tmp_path, 1, 2, timeout=lambda: 10.0).start()  # writes every 0.5 s
    try:
        heartbeat.step_done(3)
        first = json.loads(heartbeat_path(tmp_path, 1).read_text())["written"]
        time.sleep(1.5)  # this (main) thread waits; the heartbeat's own keeps writing
        latest = json.loads(heartbeat_path(tmp_path, 1).read_text())
    finally:
        heartbeat.close()
    assert latest["written"] > first and latest["steps"] == 3 and latest["doing"] == "step 4"
    # time.sleep has no frame of its own: this test is where the main thread is
    assert latest["ours"].startswith("tests/test_heartbeat.py:") and latest["ours"] == latest["frames"][0]


def test_a_process_alone_writes_no_heartbeat(tmp_path):
    heartbeat = Heartbeat(tmp_path, 0, 1).start()
    heartbeat.close()
    assert list(tmp_path.iterdir()) == []


def test_where_the_main_thread_is_comes_innermost_first_with_the_projects_own_frame():
    frames, ours = main_thread_frames()
    assert threading.current_thread() is threading.main_thread()
    assert frames[0].startswith("rlm/training/heartbeat.py:") and frames[0].endswith("in main_thread_frames")
    assert ours == frames[0]  # here the project's code is the innermost; at a collective, the caller


@pytest.fixture
def pg_timeouts(monkeypatch):
    """The timeouts `CollectiveTimeout` gives a live process group, in order."""
    import torch.distributed

    set_to = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.distributed.distributed_c10d,
        "_set_pg_timeout",
        lambda timeout, group=None: set_to.append(timeout),
    )
    return set_to


def test_the_process_group_timeout_follows_the_longest_stretch_the_run_measured(pg_timeouts):
    said = []
    timeout = CollectiveTimeout(None, multiprocess=True, say=said.append)
    assert timeout.seconds == accelerator_module.STARTUP_DIST_TIMEOUT_S  # until the first step: 30 min
    timeout.measured(1.2)  # a step: the floor, not an hour
    timeout.measured(0.9)
    timeout.measured(150.0)  # a checkpoint on slow storage: 4 x it
    timeout.measured(3.0)  # never lowered again
    assert pg_timeouts == [datetime.timedelta(seconds=300), datetime.timedelta(seconds=600)]
    assert timeout.seconds == 600 and len(said) == 2 and "4 x the longest" in said[1]


def test_a_dist_timeout_s_that_is_set_is_kept_whatever_the_run_measures(pg_timeouts):
    timeout = CollectiveTimeout(900, multiprocess=True)
    timeout.measured(400.0)
    assert timeout.seconds == 900 and pg_timeouts == []


def test_a_run_starts_with_half_an_hour_at_a_collective_not_an_hour(fresh_accelerator_state):
    from rlm.config import load_config

    cfg = load_config(None, ["cpu=true", "report_to=none"])
    assert cfg.dist_timeout_s is None
    handler = accelerator_module.make_accelerator(cfg).init_handler
    assert (
        handler.timeout
        == datetime.timedelta(seconds=accelerator_module.STARTUP_DIST_TIMEOUT_S)
        == datetime.timedelta(minutes=30)
    )
