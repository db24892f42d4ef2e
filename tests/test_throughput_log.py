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
    "model_tflops_per_step",
    "input_wait_s",
}
STAND_IN_PEAK = 1e9  # FLOP/s: a CPU has no entry in the peak table (rlm.training.throughput.PEAK_TFLOPS)
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
    from rlm.training import loop, throughput

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
        patch.setattr(loop, "tqdm", RecordingBar)
        patch.setattr(throughput, "peak_flops", lambda device, mixed_precision: STAND_IN_PEAK)
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
    # Model FLOPs: a joint step runs the towers and the scoring pass besides the reader; MFU is the FLOPs the
    # interval ran over what the (stand-in) peak could have run in it.
    assert 0 < reader_only["model_tflops_per_step"] < min(r["model_tflops_per_step"] for r in joint)
    for record in logged:
        flops = record["model_tflops_per_step"] * 1e12  # one step per interval
        assert record["mfu"] == pytest.approx(
            flops / (record["interval_s"] * STAND_IN_PEAK), rel=1e-2, abs=1e-4
        )
        assert 0 <= record["input_wait_s"] <= record["seconds_step"]
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


def test_a_gpus_peak_comes_from_the_table_by_its_name_and_precision_and_a_cpu_has_none(monkeypatch):
    from rlm.training.throughput import peak_flops

    cuda = torch.device("cuda", 0)
    assert peak_flops(torch.device("cpu"), "bf16") is None  # its peak depends on what nothing here measures
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, mixed, tflops in [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "no", 494.7),  # float32 matmuls on TF32 tensor cores
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(cuda, mixed) == pytest.approx(tflops * 1e12), (name, mixed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce GTX 1080")
    assert peak_flops(cuda, "bf16") is None


def test_dense_flops_count_each_gradient_and_not_the_recomputation_of_checkpointed_layers():
    from torch.utils.checkpoint import checkpoint

    from rlm.training.throughput import DenseFlops

    layer = torch.nn.Linear(4, 3)
    flops = DenseFlops(layer)
    flops.counting = True
    forward = 2 * 5 * 4 * 3  # 2 x rows x in x out
    x = torch.randn(5, 4)
    with torch.no_grad():
        layer(x)
    assert flops.take() == forward
    layer(x).sum().backward()  # and the weight's gradient
    assert flops.take() == 2 * forward
    layer(x.requires_grad_()).sum().backward()  # and the input's
    assert flops.take() == 3 * forward
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # its forward runs again inside the backward
    assert flops.take() == 3 * forward
    flops.counting = False  # outside the training step
    layer(x)
    assert flops.take() == 0
