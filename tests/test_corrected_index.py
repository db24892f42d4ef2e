"""Answering from h(B): retrieval over the run's fixed buffer through its trained corrector, nothing re-embedded,
checked on the tiny quickstart run (a corrector run)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlm.cli import main
from rlm.data.corpus import load_corpus
from rlm.inference.checkpoint import load_checkpoint
from rlm.inference.corrected_index import corrected_index, run_buffer_dir
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.index_spec import IndexSpec
from rlm.retriever.search import corrected_topk


@pytest.fixture(scope="module")
def run(tiny_quickstart):
    return tiny_quickstart


def with_moving_corrector(run, tmp_path):
    """A copy of the run's `final/` whose corrector moves the vectors, as a trained one does (the tiny run's
    took one step from the identity)."""
    final = tmp_path / "final"
    shutil.copytree(run / "final", final, ignore=shutil.ignore_patterns("demo_index"))
    moved = CorrectorNetwork.from_pretrained(final / "corrector")
    with torch.no_grad():
        moved.output.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    moved.save_pretrained(final / "corrector")
    return final


def test_retrieval_over_h_of_b_is_trainings_corrected_top_k(run, tmp_path):
    """The index over h(B) ranks passages exactly as training's selection <q, h(b_y)> does."""
    final = with_moving_corrector(run, tmp_path)
    corpus = load_corpus(run / "toy_world" / "corpus.jsonl")
    built = corrected_index(final, corpus)
    assert built.rows == len(corpus) and built.buffer_dir == run_buffer_dir(run / "final")
    retriever, _, _ = load_checkpoint(final, need_reader=False)
    questions = [json.loads(line)["question"] for line in (run / "toy_world" / "dev.jsonl").open()][:6]
    with torch.no_grad():
        queries = retriever.query_tower.encode(questions)
    buffer = PassageBuffer.load(built.buffer_dir)
    corrector = CorrectorNetwork.from_pretrained(final / "corrector").eval()
    want = corrected_topk(queries, buffer, corrector, 5)
    scores, ids = built.index.search(queries.numpy(), 5)
    assert [list(row) for row in ids] == [[corpus.ids[r] for r in row] for row in want.indices.tolist()]
    torch.testing.assert_close(torch.as_tensor(scores), want.scores, atol=1e-4, rtol=1e-4)
    # Not trivially the stale ranking: h changes which passages come first.
    stale = corrected_topk(queries, buffer, None, 5)
    assert not torch.equal(stale.indices, want.indices)


def test_a_compressed_index_over_h_of_b_is_streamed_through_h_and_tuned(run, tmp_path):
    """`--index corrected` takes any factory: an IVF index over h(B) is trained on a sample and filled chunk by
    chunk through h (h(B) is never one array: `CorrectedRows` refuses to be held whole), and its nprobe is
    tuned so that it finds what exact search over h(B) finds."""
    from rlm.inference.corrected_index import CorrectedRows

    final = with_moving_corrector(run, tmp_path)
    moved = CorrectorNetwork.from_pretrained(final / "corrector")
    corpus = load_corpus(run / "toy_world" / "corpus.jsonl")
    with pytest.raises(TypeError, match="never held whole"):
        _ = CorrectedRows(PassageBuffer.load(run_buffer_dir(final)), moved).embeddings
    built = corrected_index(final, corpus, spec=IndexSpec(factory="IVF8,Flat", target_recall=0.99))
    assert built.index.factory == "IVF8,Flat" and built.index.search_params["nprobe"] > 1
    assert built.index.tuning["recall"] >= 0.99 and built.correct_s > 0
    # Rows of g0 (the buffer's encoder) through h: recorded as such, so a corpus update embeds new passages the
    # same way, and re-scoring them from B (g0's rows, not h's) is refused.
    assert built.index.provenance["corrector_fingerprint"].startswith("corrector:sha256:")
    with pytest.raises(ValueError, match="over h\\(B\\)"):
        built.index.rescore_from(PassageBuffer.load(run_buffer_dir(final)), 2)
    buffer = PassageBuffer.load(built.buffer_dir)
    corrector = CorrectorNetwork.from_pretrained(final / "corrector").eval()
    retriever, _, _ = load_checkpoint(final, need_reader=False)
    questions = [json.loads(line)["question"] for line in (run / "toy_world" / "dev.jsonl").open()][:8]
    with torch.no_grad():
        queries = retriever.query_tower.encode(questions)
    want = corrected_topk(queries, buffer, corrector, 5)
    _, ids = built.index.search(queries.numpy(), 5)
    found = [len(set(row) & {corpus.ids[r] for r in exact}) for row, exact in zip(ids, want.indices.tolist())]
    assert sum(found) >= 0.9 * 5 * len(questions)


def test_a_buffer_of_another_corpus_or_a_run_without_corrector_is_refused(run, tmp_path):
    final = run / "final"
    corpus = load_corpus(run / "toy_world" / "corpus.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line for line in (run / "toy_world" / "corpus.jsonl").open()) + "")
    rows = other.read_text().splitlines()
    other.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # the same passages, two swapped
    with pytest.raises(ValueError, match="corpus fingerprint"):
        corrected_index(final, load_corpus(other))
    no_corrector = tmp_path / "final"
    shutil.copytree(final, no_corrector, ignore=shutil.ignore_patterns("corrector", "demo_index"))
    with pytest.raises(FileNotFoundError, match="strategy.name=corrector"):
        corrected_index(no_corrector, corpus)
    with pytest.raises(FileNotFoundError, match="--buffer DIR"):
        corrected_index(final, corpus, buffer_dir=tmp_path / "nowhere")


def test_rlm_evaluate_and_the_demo_answer_from_h_of_b(run, capsys, rlm_cache):
    from rlm.app.service import QAService, ServiceOptions
    from rlm.inference.index_cache import INDEX_CACHE

    final = run / "final"
    out = run / "evaluate_corrected"
    argv = [
        "evaluate",
        "--checkpoint",
        str(final),
        "--data-path",
        str(run / "toy_world"),
        "--max-examples",
        "8",
    ]
    assert main([*argv, "--index", "corrected", "--out", str(out)]) == 0
    assert "no passage re-embedded" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_questions"] == 8 and 0.0 <= metrics["exact_match"] <= 1.0 and "recall@5" in metrics
    assert main([*argv, "--buffer", str(run)]) == 2  # --buffer without --index corrected

    over_hb = ServiceOptions(corrected_buffer=True)
    service = QAService.from_checkpoint(final, options=over_hb)
    result = service.answer(service.examples[0], 3)
    assert len(result["passages"]) == 3 and isinstance(result["answer"], str)
    cached = [p.name for p in (rlm_cache / INDEX_CACHE).glob("corrected-*")]
    assert len(cached) == 1 and not (final / INDEX_CACHE).exists()
    again = QAService.from_checkpoint(final, options=over_hb)  # from the cache: the same passages
    assert [p["id"] for p in again.answer(service.examples[0], 3)["passages"]] == [
        p["id"] for p in result["passages"]
    ]


@pytest.mark.slow
def test_answer_from_hb_script_compares_the_three_indexes(run, tmp_path):
    from script_loader import load_script

    out = tmp_path / "hb"
    argv = ["--checkpoint", str(run / "final"), "--data-path", str(run / "toy_world"), "--out", str(out)]
    assert load_script("answer_from_hb").main(argv) == 0  # in this process: a process start is ~8 CPU-s
    results = json.loads(out.with_suffix(".json").read_text())
    names = [row["name"] for row in results["rows"]]
    assert names == ["fresh (re-embedded)", "h(B) (corrected)", "B (stale)"]
    assert results["rows"][0]["cost"] == f"{results['passages']:,} passages re-embedded"
    # Its h(B) row is what `rlm evaluate --index corrected` gives on the same questions.
    evaluated = tmp_path / "evaluated"
    argv = ["evaluate", "--checkpoint", str(run / "final"), "--data-path", str(run / "toy_world")]
    assert main([*argv, "--index", "corrected", "--out", str(evaluated)]) == 0
    corrected = json.loads((evaluated / "metrics.json").read_text())
    hb = results["rows"][1]["metrics"]
    assert all(
        hb[key] == pytest.approx(corrected[key], abs=1e-6) for key in ("recall@1", "recall@5", "exact_match")
    )
    assert out.with_suffix(".md").read_text().count("\n| ") == 5  # header, rule, 3 rows
