"""Throughput where people look (issue 40): questions, passages and tokens per second, seconds per phase, peak
memory and an ETA in `log.jsonl`, the trackers and the progress bar, consistent with what the run did, summed
over processes; and the phase timer's CUDA clock that never waits for the GPU inside a step."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_run import as_set_args, tiny_overrides

PHASES = ("select", "retriever", "reader_scoring", "reader", "corrector", "backward_optimizer")
KEYS = {
    "interval_s",
    "questions_per_step",
    "passages_per_step",
    "reader_tokens_per_step",
    "passage_tokens_per_step",
    "questions_per_s",
    "passages_per_s",
    "tokens_per_s",
    "seconds_step",
    "eta_s",
    "peak_rss_gib",  # on CPU: the process's peak resident set
}
BATCH, ACCUMULATION, K, PASSAGE_TOKENS = 2, 2, 4, 40


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """5 optimizer steps of 2 micro-batches of 2 questions on one process, logged at every step: the first
    trains the reader alone (no passage tower), the other four are Algorithm 2's joint steps. Returns the log
    rows, what accelerate's trackers were given and the progress bar's postfixes."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    import rlm.train
    from rlm.quickstart.concurrent_runs import one_thread

    root = tmp_path_factory.mktemp("throughput")
    schedule = [
        "optim.max_steps=5",
        "optim.warmup_steps=1",
        f"optim.gradient_accumulation_steps={ACCUMULATION}",
        "schedule.gold_passage_steps=0",
        "schedule.reader_only_steps=1",
        "schedule.final_reader_only_steps=0",
        "log_every=1",
        "save_every=0",
        "cpu=true",
    ]
    tracked, postfixes = [], []

    class RecordingBar(tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
            postfixes.append(dict(ordered_dict))
            return super().set_postfix(ordered_dict, refresh=refresh, **kwargs)

    def log(self, values, step=None, log_kwargs=None):
        tracked.append(dict(values))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rlm.train, "tqdm", RecordingBar)
        patch.setattr(Accelerator, "log", log)
        AcceleratorState._reset_state(reset_partial_state=True)
        try:
            with one_thread():
                argv = as_set_args(tiny_overrides(root, "run", *schedule))
                assert rlm.train.main(argv) == 0
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
    return rows(root / "run" / "log.jsonl"), tracked, postfixes


def test_every_logged_step_has_its_throughput_phases_memory_and_eta(tiny_run):
    logged, tracked, postfixes = tiny_run
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    for record in logged:
        assert set(record) >= KEYS, sorted(KEYS - set(record))
        assert "peak_cuda_memory_gib" not in record and record["peak_rss_gib"] > 0
    for record in logged[1:]:  # joint steps: every phase of Algorithm 2 ran
        assert {f"seconds_{p}" for p in PHASES} <= set(record)
    # The trackers (TensorBoard / W&B) get the same figures, and the progress bar shows the speed.
    assert [{k: r[k] for k in KEYS} for r in logged] == [{k: t[k] for k in KEYS} for t in tracked]
    assert len(postfixes) == 5 and all({"q/s", "tok/s", "mem"} <= set(p) for p in postfixes)


def test_the_figures_are_what_the_run_did(tiny_run):
    logged, _, _ = tiny_run
    questions = BATCH * ACCUMULATION  # per optimizer step, one process
    for record in logged:
        assert record["questions_per_step"] == questions
        # One step per interval: the rate times the interval's seconds is the interval's questions.
        assert record["questions_per_s"] * record["interval_s"] == pytest.approx(questions, rel=1e-3)
        phases = sum(v for k, v in record.items() if k.startswith("seconds_") and k != "seconds_step")
        assert phases == pytest.approx(record["seconds_step"], rel=1e-3, abs=1e-4)
        assert record["seconds_step"] <= record["interval_s"]
    reader_only, joint = logged[0], logged[1:]
    # The reader-only step runs no passage tower with gradient; a joint step embeds S_x: questions x k rows.
    assert reader_only["passages_per_step"] == 0 and reader_only["passage_tokens_per_step"] == 0
    assert reader_only["reader_tokens_per_step"] > 0
    for record in joint:
        assert record["passages_per_step"] == questions * K
        assert questions * K <= record["passage_tokens_per_step"] <= questions * K * PASSAGE_TOKENS
        assert record["reader_tokens_per_step"] > 0
        tokens = record["reader_tokens_per_step"] + record["passage_tokens_per_step"]
        assert record["tokens_per_s"] * record["interval_s"] == pytest.approx(tokens, rel=1e-3)
    # At the pace of the steps so far: it falls while the steps keep one pace (the joint ones), 0 at the end.
    etas = [r["eta_s"] for r in joint]
    assert etas[-1] == 0 and etas[0] > 0 and etas == sorted(etas, reverse=True)


@pytest.mark.slow
def test_two_processes_log_the_questions_of_both(two_process_run):
    """The session's two-process run (2 questions a process, log_every=1): counts are summed over processes."""
    for record in rows(two_process_run / "reference" / "log.jsonl"):
        assert record["questions_per_step"] == 2 * BATCH
        assert record["questions_per_s"] * record["interval_s"] == pytest.approx(2 * BATCH, rel=1e-3)


class FakeCudaEvent:
    """A CUDA event on the host clock, counting the waits for it."""

    waits = 0
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.time = None

    def record(self):
        FakeCudaEvent.clock += 1.0  # one second between consecutive marks
        self.time = FakeCudaEvent.clock

    def synchronize(self):
        FakeCudaEvent.waits += 1

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1000  # milliseconds, as CUDA's


def test_the_cuda_phase_timer_records_events_and_waits_once_per_take(monkeypatch):
    from rlm.training.throughput import PhaseTimer

    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    timer = PhaseTimer(torch.device("cuda", 0))
    for _ in range(3):
        timer.start()
        timer.lap("select")
        timer.lap("reader")
    assert FakeCudaEvent.waits == 0  # nothing inside the step waits for the GPU
    assert timer.take() == {"select": 3.0, "reader": 3.0}
    assert FakeCudaEvent.waits == 1
    assert timer.take() == {}
