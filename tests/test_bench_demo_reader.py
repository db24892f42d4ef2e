"""scripts/bench/bench_demo_reader.py (issue 47's paper-size reader in the demo) at tiny settings, through its `main` as a
user runs it: every precision and k measured through the demo's batching queue with the bound beside it, the
bf16 check on the tiny quickstart's dev set, the report written; and its FLOP count checked against torch's."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from script_loader import load_script

TINY = ["--layers", "1", "--k", "2,3", "--length", "32", "--answer-tokens", "3", "--repeats", "2"]
TINY += ["--users", "2", "--per-user", "1", "--precisions", "fp32,bf16"]

pytestmark = pytest.mark.learning  # reads with the tiny quickstart's trained checkpoint (make test-kernels)


@pytest.fixture(scope="module")
def script():
    return load_script("bench_demo_reader")


@pytest.fixture(scope="module")
def tiny_run(script, tiny_quickstart, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_reader") / "demo_reader"
    threads = torch.get_num_threads()
    argv = [*TINY, "--checkpoint", str(tiny_quickstart / "final"), "--dev-limit", "4", "--out", str(out)]
    try:
        code = script.main(argv)
    finally:
        torch.set_num_threads(threads)
    return code, out, json.loads(out.with_suffix(".json").read_text())


def test_tiny_run_measures_every_precision_and_k_through_the_queue_beside_its_bound(tiny_run):
    code, out, results = tiny_run
    assert code == 0
    assert [(r["precision"], r["k"]) for r in results["rows"]] == [
        ("fp32", 2),
        ("fp32", 3),
        ("bf16", 2),
        ("bf16", 3),
    ]
    for row in results["rows"]:
        assert row["tokens"] == row["k"] * 32
        assert row["bound_ms"] == pytest.approx(1e3 * row["flops"]["total"] / row["matmul_flops_per_s"])
        assert 0 < row["one_user"]["p50_ms"] <= row["one_user"]["p95_ms"]
        assert row["p50_over_bound"] == pytest.approx(row["one_user"]["p50_ms"] / row["bound_ms"])
        users = row["users"]
        assert (
            1 <= users["mean_batch"] <= 2 and users["wall_s"] > 0
        )  # answered by the queue, 2 at most a pass
        assert row["throughput_ratio"] == pytest.approx(
            users["questions_per_s"] / row["one_user"]["questions_per_s"]
        )
    assert "Model name:" in results["lscpu"] and results["machine"]["torch"] == torch.__version__
    report = out.with_suffix(".md").read_text()
    assert "| bf16 | 3 |" in report and "Served precision:" in report and "<summary>lscpu</summary>" in report


def test_tiny_run_checks_bf16_answers_against_float32_on_the_quickstart_dev_set(tiny_run, tiny_quickstart):
    _, out, results = tiny_run
    check = results["precision_check"]
    assert check["questions"] == 4 and check["dev"].endswith("dev.jsonl") and 0 <= check["identical"] <= 1
    assert set(check["exact_match"]) == {"fp32", "bf16"}
    assert (
        f"{100 * check['identical']:.1f}% of the bf16 answers are identical"
        in out.with_suffix(".md").read_text()
    )


def test_without_a_checkpoint_the_report_says_bf16_was_not_checked(script, tiny_run, tmp_path):
    _, _, results = tiny_run
    saved = tmp_path / "unchecked.json"
    saved.write_text(json.dumps({**results, "precision_check": None}))
    assert script.main(["--render", str(saved)]) == 0
    report = saved.with_suffix(".md").read_text()
    assert "bf16 against float32: not checked (no `--checkpoint`)" in report
    assert "bf16's answers were not checked against float32's: an assumption" in report


def test_the_counted_flops_are_torchs_count_of_the_readers_matmuls(script):
    """torch's FlopCounterMode counts the reader's matrix products as it answers. Within 1%: the attention's
    own products, under 1% at these lengths, are counted by the script and, depending on how the model computes
    them, perhaps not by torch; leaving out a part (the cross-attention's keys and values, a decoder step, the
    LM head) would miss by 5% or more."""
    from torch.utils.flop_counter import FlopCounterMode

    args = argparse.Namespace(layers=2, length=32, answer_tokens=4, k=[3], repeats=1, users=1, per_user=1)
    service, shape, questions = script.reader_service(args)
    for k in (1, 3):
        with FlopCounterMode(display=False) as counter:
            service.answer_many([questions[0]], k)
        counted = script.answer_flops(shape, k, args.length, args.answer_tokens)
        assert counter.get_total_flops() == pytest.approx(counted["total"], rel=0.01)
