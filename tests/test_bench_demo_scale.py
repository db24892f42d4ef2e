"""scripts/bench/bench_demo_scale.py (issue 39's demo at scale) end to end in its quick mode, through its `main` as a user
runs it, over a tiny checkpoint (the packaged MiniLM retriever and a tiny random-init FiD reader): a corpus and
a tuned index re-scored from its rows on disk are built, the service is started twice in fresh processes as `rlm demo --index` starts it, and
the report holds every measurement and the projection to 21M passages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from script_loader import load_script

from rlm.cache import corpus_fingerprint_cache
from rlm.data.toy_world import build_toy_world

LATENCIES = [
    "search alone",
    "search, 20 threads",
    "retrieval alone",
    "retrieval, 20 threads",
    "answer alone",
    "answer, 20 threads",
    "answer, 20 users through the demo's queue",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, minilm_path):
    from rlm.reader.fid import FiDConfig, FiDReader
    from rlm.reader.tokenizer import train_tokenizer
    from rlm.retriever.encoder import DualEncoder

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("demo_scale")
    world = build_toy_world(root / "world", num_passages=120, seed=0, max_questions={"dev": 12})
    checkpoint = root / "ckpt"
    DualEncoder.from_pretrained(minilm_path).save_pretrained(checkpoint / "retriever")
    texts = [line for line in world.corpus.read_text().splitlines() if line]
    reader = FiDReader.from_config(
        train_tokenizer(texts, vocab_size=400),
        fid_config=FiDConfig(max_passage_length=48, max_answer_length=6),
        seed=0,
        d_model=32,
        d_ff=64,
        num_layers=1,
        num_heads=2,
    )
    reader.save_pretrained(checkpoint / "reader")
    (checkpoint / "config.yaml").write_text("reader:\n  num_passages: 3\n")
    out, work = root / "report", root / "work"
    argv = [
        "bench_demo_scale.py",
        "--quick",
        "--checkpoint",
        str(checkpoint),
        "--work",
        str(work),
        "--rescore",
        "2",
    ]
    argv += ["--sentences", str(world.corpus), "--questions", str(world.split("dev")), "--out", str(out)]
    script = load_script("bench_demo_scale")
    saved = sys.argv
    sys.argv = argv
    try:
        code = script.main()
    finally:
        sys.argv = saved
    return code, checkpoint, work, out, json.loads((out / "demo_scale.json").read_text()), script


def test_quick_run_builds_the_corpus_and_a_tuned_index_of_it(quick_run):
    code, _, work, _, results, _ = quick_run
    assert code == 0
    corpus = results["corpus"]
    assert corpus["passages"] == 5_000
    lines = Path(corpus["path"]).read_text().splitlines()
    assert len(lines) == 5_000
    first = json.loads(lines[0])
    assert first["id"] == "0" and first["title"] and len(first["text"].split()) == 100
    index = results["index"]
    # {nlist}: 5,000 / 1,000 rounded to a power of two, at least 4.
    assert index["factory"] == "IVF4,SQ8" and index["rows"] == 5_000 and index["dim"] == 384
    assert index["tuning"]["parameter"] == "nprobe" and index["bytes"] > 0
    # Re-scored from the synthetic buffer, which the service reopens (its fingerprints are the index's).
    assert index["rescore_k_factor"] == 2
    assert json.loads((Path(index["path"]) / "index.json").read_text())["rescoring"]["k_factor"] == 2
    assert str(work) in corpus["path"] and str(work) in index["path"]


def test_both_starts_report_time_memory_and_what_grows_with_the_corpus(quick_run):
    _, checkpoint, work, _, results, _ = quick_run
    for name in ("first", "second"):
        start = results["starts"][name]
        assert start["startup_s"] > 0 and start["rss_mb"] > 0 and start["peak_rss_mb"] > 0
        phases = start["phases"]
        assert {"imports", "models", "corpus scan", "index read", "index checks", "warm-up"} <= set(phases)
        assert all(p["seconds"] >= 0 for p in phases.values())
        assert sum(p["seconds"] for p in phases.values()) <= start["startup_s"]
        assert start["corpus_arrays_bytes"]["offsets"] >= 8 * 5_000
        assert start["index_ids_bytes"] > 0
        assert start["search_params"] == {"nprobe": results["index"]["tuning"]["value"]}
        assert start["all_startup_s"] == [start["startup_s"]]  # --quick: one start of each kind
    # The service remembered the corpus fingerprint in the study's own cache folder, in neither checkpoint.
    assert corpus_fingerprint_cache(work / "demo_cache").is_file()
    assert (
        not list(checkpoint.glob("demo_corpus_fingerprint*"))
        and not (work / "checkpoint" / "demo_index").exists()
    )


def test_latencies_are_ordered_and_every_question_is_answered(quick_run):
    _, _, _, _, results, script = quick_run
    latency = results["serving"]["latency"]
    assert list(latency) == LATENCIES
    counts = script.COUNTS["quick"]
    for name, stats in latency.items():
        assert 0 < stats["p50_ms"] <= stats["p95_ms"], name
        kind = name.split(",")[0].split()[0]
        alone, per_thread = counts[kind]
        assert stats["count"] == (alone if name.endswith("alone") else 20 * per_thread), name
        if kind == "answer":
            assert stats["returned"] == stats["count"], name  # an answer and k passages for each question
    parts = latency["retrieval alone"]
    assert all(parts[f"{part}_p50_ms"] > 0 for part in ("encode", "search", "read"))
    sweep = results["serving"]["sweep"]
    assert [row["value"] for row in sweep] == sorted(row["value"] for row in sweep)
    assert sum(row["tuned"] for row in sweep) == 1


def test_projection_to_21m_scales_what_grows_and_says_whether_the_goal_is_met(quick_run):
    _, _, _, _, results, _ = quick_run
    projection = results["projection"]
    second = results["starts"]["second"]
    assert projection["passages"] == 21_015_324
    assert projection["rss_mb"] > second["rss_mb"]
    assert projection["peak_rss_mb"] >= projection["rss_mb"]
    for name in ("first", "second"):
        assert projection["startup_s"][name] > results["starts"][name]["startup_s"]
        assert projection["first_answer_s"][name] > projection["startup_s"][name]
    assert projection["search_p50_ms"]["ms"] > 0
    assert projection["retrieval_p50_ms"] > projection["search_p50_ms"]["ms"]
    assert isinstance(projection["meets_retrieval_goal"], bool)
    assert len(projection["sweep"]) == len(results["serving"]["sweep"])


def test_report_states_the_vectors_are_synthetic_and_rerenders_from_its_json(quick_run, tmp_path):
    _, _, _, out, _, script = quick_run
    report = (out / "README.md").read_text()
    assert "synthetic" in report and "## Projection to 21M passages" in report
    assert "measured at 5,000" in report
    assert script.main(["--render", str(out / "demo_scale.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == report


def test_mean_id_bytes_counts_dpr_ids_with_their_newline():
    script = load_script("bench_demo_scale")
    assert script.mean_id_bytes(9) == 2.0
    assert script.mean_id_bytes(10) == pytest.approx((9 * 2 + 3) / 10)
