"""`rlm.quickstart.concurrent_runs`: runs trained side by side in worker processes, one torch thread each."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_overrides
from tqdm import tqdm

from rlm.config import load_config
from rlm.quickstart.concurrent_runs import LOG_NAME, RunJob, one_thread, train_runs

pytestmark = pytest.mark.slow

STEPS = ["optim.max_steps=2", "optim.warmup_steps=1", "save_every=0"]


def test_one_thread_restores_the_earlier_setting():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), one_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError("the block failed")
    assert torch.get_num_threads() == before


def test_runs_side_by_side_report_each_summary_and_a_failing_one_names_its_log(tmp_path, capsys):
    good = [
        RunJob(
            name, load_config(None, tiny_overrides(tmp_path, str(tmp_path / name), *STEPS, f"seed={seed}"))
        )
        for name, seed in (("a", 0), ("b", 1))
    ]
    said = []

    def on_done(job, summary, seconds):
        # As the quickstart's does: start a server whose thread draws a tqdm bar, and wait for it.
        def serve():
            for _ in tqdm(range(3), desc="a request"):
                pass
            said.append(job.name)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        server.join(timeout=60)
        assert not server.is_alive(), "a bar drawn in another thread waited on the runs' progress bar"

    summaries = train_runs(good, workers=2, on_done=on_done)
    assert set(summaries) == {"a", "b"} and all(s["steps"] == 2 for s in summaries.values())
    assert sorted(said) == ["a", "b"]
    for job in good:  # what each worker printed went to its own log, and each logged its steps
        out = Path(job.cfg.output_dir)
        assert "train[" in (out / LOG_NAME).read_text()
        assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2]
    # Different seeds, different runs: the workers did not share one run's state.
    losses = [(Path(job.cfg.output_dir) / "log.jsonl").read_text().splitlines()[0] for job in good]
    assert json.loads(losses[0])["loss"] != json.loads(losses[1])["loss"]

    broken = load_config(None, tiny_overrides(tmp_path, str(tmp_path / "broken"), *STEPS))
    broken.retriever.path = str(tmp_path / "no_such_model")
    with pytest.raises(Exception, match="no_such_model"):
        train_runs([good[0], RunJob("broken", broken)], workers=2)
    printed = capsys.readouterr()
    assert f"broken: failed; its output is in {tmp_path / 'broken' / LOG_NAME}" in printed.out + printed.err
