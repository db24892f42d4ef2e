"""scripts/bench/bench_paper_step.py (issue 40's paper-shape step benchmark) end to end at its small shapes, through its
`main` as a user runs it, and the pieces of lab.benchmarking it is built from."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from lab.benchmarking import (
    T5_BASE,
    SyntheticCorpus,
    TimeLimitExceeded,
    ring_allreduce_seconds,
    synthetic_tokenizer,
    synthetic_words,
    time_limit,
)
from script_loader import load_script

from rlm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["corrector_h2048", "corrector_h4096", "corrector_h8192", "stale", "exhaustive"]


@pytest.fixture
def one_thread():
    # Two torch threads spin against the other jobs of a shared 2-core CPU (the script's --threads 1).
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "report"
    work = out.parent / "work"
    script = load_script("bench_paper_step")
    threads = torch.get_num_threads()
    try:
        code = script.main(["--small", "--threads", "1", "--work", str(work), "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, out, json.loads(out.with_suffix(".json").read_text())


def test_small_run_reports_every_strategy_with_phases_that_add_up_to_its_step(small_run):
    code, _, results = small_run
    base = load_config(ROOT / "configs" / "base_gpu.yaml")
    towers_checkpointed = getattr(base.retriever, "gradient_checkpointing", False)
    assert base.gradient_checkpointing  # the reader's, as the paper's config sets it
    assert code == 0
    assert list(results["strategies"]) == results["args"]["strategies"]
    assert sorted(results["strategies"]) == sorted(STRATEGIES)
    for name, record in results["strategies"].items():
        assert record["status"] == "ok", (name, record.get("traceback"))
        assert [s["warmup"] for s in record["steps"]] == [True, False, False]
        assert min(record["phases"].values()) >= 0, (name, record["phases"])
        assert sum(record["phases"].values()) <= record["step_s"] * (1 + 1e-9)
        # The step's own hooks fired: selection, both towers, the reader's scoring and its FiD pass.
        assert {"select", "retriever", "reader_scoring", "reader"} <= set(record["phases"])
        assert record["steps_per_s"] == pytest.approx(1 / record["step_s"])
        assert "peak_memory_gib" in record and record["peak_memory_gib"] is None  # a CPU: said, not guessed
        assert record["trainable_parameters"]["reader"] > 0
        assert ("corrector" in record["trainable_parameters"]) == name.startswith("corrector")
        # The models were made by the project's build_retriever / build_reader: the config's settings hold.
        assert record["gradient_checkpointing"] == {"reader": True, "towers": towers_checkpointed}


def test_small_run_feeds_the_models_the_shapes_it_claims(small_run):
    _, _, results = small_run
    # 2 questions x 4 passages x 32 tokens, questions of 8 tokens, answers of 4, 2 micro-steps, 2,000 rows.
    assert results["shapes"] == {
        "reader_input": [2, 4, 32],
        "answer_labels": [2, 4],
        "query_tower": [2, 8],
        "passage_tower": [8, 32],
        "micro_steps": 2,
        "rows": 2000,
    }
    assert results["buffer"] == {**results["buffer"], "rows": 2000, "dim": 64, "dtype": "torch.float16"}


def test_small_run_amortises_only_exhaustive_refresh_and_projects_eight_devices(small_run):
    _, out, results = small_run
    table2 = {row["method"]: row for row in results["table2"]}
    assert set(table2) == set(STRATEGIES)
    assert results["embedding"]["passages_per_s"] > 0
    assert table2["exhaustive"]["refresh_s"] > 0
    assert all(table2[n]["refresh_s"] == 0 for n in STRATEGIES if n != "exhaustive")
    assert all(row["total_s"] == row["step_s"] + row["refresh_s"] for row in table2.values())
    projection = {row["method"]: row for row in results["projection"]}
    assert set(projection) == set(STRATEGIES)
    for row in projection.values():
        assert (
            row["allreduce_fp32_s"] == pytest.approx(2 * row["allreduce_bf16_s"])
            and row["allreduce_fp32_s"] > 0
        )
        assert row["step_s"] == pytest.approx(
            row["device_step_s"] + row["allreduce_fp32_s"] + row["refresh_s"]
        )
    # 2,625,000 rows a device (21M / 8) re-embedded every 500 steps: exhaustive's projected refresh is its own.
    rate = results["embedding"]["passages_per_s"]
    assert projection["exhaustive"]["refresh_s"] == pytest.approx(21_000_000 / 8 / rate / 500)
    goals = results["goals"]
    assert goals["h8192_over_exhaustive"] == pytest.approx(
        projection["corrector_h8192"]["steps_per_s"] / projection["exhaustive"]["steps_per_s"]
    )
    assert goals["peak_memory_gib"] is None and goals["memory_leaves_room"] is None
    report = out.with_suffix(".md").read_text()
    assert "NOT the paper's shapes" in report and "Projection to 8 GPUs" in report
    assert out.with_suffix(".png").stat().st_size > 5_000


def test_render_redoes_the_report_from_the_json_alone(small_run):
    _, out, _ = small_run
    report = out.with_suffix(".md").read_text()
    out.with_suffix(".md").unlink()
    assert load_script("bench_paper_step").main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text() == report


def test_a_strategy_past_its_time_limit_is_reported_and_the_others_still_run(tmp_path, one_thread):
    out = tmp_path / "report"
    argv = ["--small", "--threads", "1", "--strategies", "stale,exhaustive", "--work", str(tmp_path / "w")]
    code = load_script("bench_paper_step").main([*argv, "--timeout-per-strategy", "0.001", "--out", str(out)])
    assert code == 1  # not every strategy finished
    results = json.loads(out.with_suffix(".json").read_text())
    assert set(results["strategies"]) == {"stale", "exhaustive"}
    assert all(r["status"].startswith("TimeLimitExceeded") for r in results["strategies"].values())
    assert "TimeLimitExceeded: ran past its limit of 0.001 s" in out.with_suffix(".md").read_text()


def test_time_limit_interrupts_a_long_block_even_one_that_catches_exceptions():
    with pytest.raises(TimeLimitExceeded, match="limit of 0.05 s"), time_limit(0.05):
        while True:
            # What library code does to carry on past an error must not swallow the limit.
            with contextlib.suppress(Exception, OSError):
                sum(range(1000))


def test_ring_allreduce_moves_each_byte_over_two_p_minus_one_over_p_links():
    # 1 GB over 8 devices at 200 GB/s bus bandwidth: 1e9 x 2 x 7/8 / 200e9 = 8.75 ms; one device: nothing.
    assert ring_allreduce_seconds(1e9, 8, 200e9) == pytest.approx(8.75e-3)
    assert ring_allreduce_seconds(1e9, 1, 200e9) == 0.0


def test_synthetic_text_has_the_token_lengths_the_benchmark_asks_for():
    words = synthetic_words()
    tokenizer = synthetic_tokenizer(words)
    corpus = SyntheticCorpus(10, 300, words)
    assert len(tokenizer(" ".join(words))["input_ids"]) == len(words) + 1  # one token a word, then </s>
    passage = corpus[7]
    assert passage == corpus[7] and passage != corpus[8]  # made from the row number, the same at every read
    assert len(passage.text.split()) == 300 and passage.title
    assert corpus.retrieval_texts()[7] == f"{passage.title}. {passage.text}"
    with pytest.raises(IndexError):
        corpus[10]
    config = T5_BASE.t5_config(tokenizer)
    assert (config.d_model, config.d_ff, config.num_layers, config.num_heads, config.vocab_size) == (
        768,
        3072,
        12,
        12,
        32128,
    )
