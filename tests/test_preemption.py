"""A stop is agreed by every process before anything is recorded (issue 48, item 1): the processes of a refresh
stop together at one part, the survivors of a failed process never stop (torchrun's SIGTERM to them is no
preemption), and the main process's record for the launcher (`rlm.training.attempt`) names the attempt and is
on disk before any process exits. A rank that fails leaves its own line where the launcher asked."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from local_port import free_port

from rlm.cli import main
from rlm.training.preemption import Preempted


def _refresh_process(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo processes running `TrainRun.reembed` in three scenarios (parts of 2 rows; rank 0 has 5
    rows, 3 parts, rank 1 one row): no signal; rank 1 gets SIGUSR1 after its first part; rank 1 gone (its
    process group closed) while rank 0 holds torchrun's SIGTERM. Writes what each process saw."""
    import torch.distributed as dist

    import rlm.training.run as run_module
    from rlm.training.accelerator import CollectiveTimeout
    from rlm.training.heartbeat import Heartbeat
    from rlm.training.preemption import StopSignals

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    run_module.REEMBED_PART_ROWS = 2
    results = {}

    class Accelerator:  # what `reembed` uses of accelerate's
        num_processes, device = world, torch.device("cpu")

        def gather(self, tensor):
            parts = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(parts, tensor)
            return torch.cat(parts)

        def autocast(self):
            return contextlib.nullcontext()

    for scenario in ("no signal", "rank 1 gets a signal after its first part", "rank 1 is gone"):
        embedded, stops = [], StopSignals()

        class Tower:
            def encode(self, texts, batch_size=64, _embedded=embedded, _stops=stops, _scenario=scenario):
                _embedded.append(len(texts))
                if _scenario.startswith("rank 1 gets") and rank == 1 and len(_embedded) == 1:
                    _stops.received = signal.SIGUSR1  # what the handler does
                return torch.ones(len(texts), 4)

        run = SimpleNamespace(
            accelerator=Accelerator(),
            raw=SimpleNamespace(retriever=SimpleNamespace(passage_tower=Tower())),
            corpus=SimpleNamespace(retrieval_texts=lambda: [f"passage {i}" for i in range(6)]),
            stops=stops,
            state=SimpleNamespace(step=4),
            cfg=SimpleNamespace(buffer=SimpleNamespace(batch_size=8)),
            heartbeat=Heartbeat(None, rank, world),
            timeout=CollectiveTimeout(None, multiprocess=False),
            _refresh_s=0.0,
        )
        if scenario == "rank 1 is gone":
            if rank == 1:  # a failed process: its side of every connection closes
                (Path(out) / "rank1.json").write_text(json.dumps(results))
                dist.destroy_process_group()
                deadline = time.monotonic() + 120
                while not (Path(out) / "rank0.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                return
            stops.received = signal.SIGTERM  # torchrun's, to the survivors of a failed worker
        try:
            rows = run_module.TrainRun.reembed(run, range(0, 5) if rank == 0 else range(5, 6))
            results[scenario] = {"rows": rows.shape[0]}
        except Preempted as err:
            results[scenario] = {"preempted": err.signum, "step": err.step}
        except Exception as err:  # the collective failed: no stop to record
            results[scenario] = {"error": type(err).__name__}
        results[scenario]["embedded"] = embedded
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    # Its process group lost a peer: tearing it down at exit can abort in gloo's destructors (seen once:
    # "terminate called without an active exception"). What was to be seen is written.
    os._exit(0)


@pytest.mark.slow
def test_a_refresh_stops_at_the_same_part_on_every_process_and_never_for_a_survivor_of_a_failure(tmp_path):
    from torch.multiprocessing import start_processes

    start_processes(_refresh_process, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # As many parts on each (the most any has, the rest empty): as many agreements, none waiting for a refresh.
    assert rank0["no signal"] == {"rows": 5, "embedded": [2, 2, 1]}
    assert rank1["no signal"] == {"rows": 1, "embedded": [1, 0, 0]}
    # Rank 1's signal stops both before their second part, rank 0 having heard nothing itself.
    stopped = {"preempted": int(signal.SIGUSR1), "step": 4}
    assert rank0["rank 1 gets a signal after its first part"] == {**stopped, "embedded": [2]}
    assert rank1["rank 1 gets a signal after its first part"] == {**stopped, "embedded": [1]}
    # torchrun's SIGTERM after rank 1 failed: the agreement fails instead of stopping, so nothing is recorded.
    assert "error" in rank0["rank 1 is gone"] and rank0["rank 1 is gone"]["embedded"] == [], rank0


def test_a_regression_refit_embeds_an_empty_share_so_every_process_refreshes_in_step():
    from rlm.retriever.distributed import Processes
    from rlm.training.strategies.refreshing import RegressionStrategy

    calls = []

    def embed_rows(rows):
        calls.append(list(rows))
        return torch.ones(len(rows), 4)

    last_of_three = SimpleNamespace(
        sharded=True,
        procs=Processes(2, 3, gather=lambda t: t.repeat(3, 1)),
        search=SimpleNamespace(device=None),
        buffer=SimpleNamespace(dim=4),
    )
    fresh = RegressionStrategy._embed_shared(last_of_three, torch.arange(2), embed_rows)
    assert calls == [[]] and fresh.shape == (2, 4)  # two samples over three processes: the third has none


def test_the_stop_record_names_the_attempt_and_is_on_disk_before_any_process_moves_on(tmp_path, monkeypatch):
    from rlm.training.run import stop_recorded

    monkeypatch.delenv("RLM_ATTEMPT_DIR", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    record = tmp_path / "run" / "attempt" / "stopped.json"
    released = []

    class Accelerator:
        is_main_process = True

        def wait_for_everyone(self):
            released.append(record.exists())

    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000007"
    err = stop_recorded(
        Accelerator(), SimpleNamespace(output_dir=str(tmp_path / "run")), signal.SIGTERM, 7, checkpoint
    )
    assert released == [True]
    assert json.loads(record.read_text()) == {
        "attempt": "4242.3",
        "signal": "SIGTERM",
        "step": 7,
        "checkpoint": str(checkpoint),
        "time": json.loads(record.read_text())["time"],
    }
    assert record.read_text().count("\n") == 1  # one line: the sbatch script greps it
    assert isinstance(err, Preempted) and (err.signum, err.step, err.checkpoint) == (
        signal.SIGTERM,
        7,
        checkpoint,
    )


def test_a_failing_rank_leaves_its_error_in_one_line_where_the_launcher_asked(tmp_path, monkeypatch):
    from rlm.training import loop

    def broken(*args, **kwargs):
        raise KeyError("reader_passages")

    monkeypatch.setattr(loop, "train", broken)
    monkeypatch.setenv("RLM_ATTEMPT_DIR", str(tmp_path / "attempt"))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(KeyError):
        main(["train", "--set", f"output_dir={tmp_path / 'run'}"])
    line = (tmp_path / "attempt" / "failed-rank-00003.txt").read_text()
    assert line.count("\n") == 1 and f"rank 3 on {os.uname().nodename}" in line, line
    assert line.rstrip().endswith("failed: KeyError: 'reader_passages'"), line


def test_a_refused_run_leaves_no_failure_record_in_its_output_dir(tmp_path, monkeypatch, capsys):
    from rlm.errors import UserError
    from rlm.training import loop

    def refused(*args, **kwargs):
        raise UserError("runs/x already holds a run")

    monkeypatch.setattr(loop, "train", refused)
    monkeypatch.delenv("RLM_ATTEMPT_DIR", raising=False)
    (tmp_path / "run").mkdir()
    assert main(["train", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    assert list((tmp_path / "run").iterdir()) == []
