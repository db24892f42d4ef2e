"""The demo's answering logic without a browser: QAService over the tiny quickstart checkpoint."""

from __future__ import annotations

import re
import shutil

import pytest

from rlm.app.demo import highlight, launch_kwargs, passages_html, render, respond
from rlm.app.service import InvalidQuestion, QAService, ServiceOptions
from rlm.errors import UserError
from rlm.inference.checkpoint import corpus_from_config
from rlm.inference.index_cache import INDEX_CACHE
from rlm.retriever.index_spec import IndexSpec

pytestmark = pytest.mark.learning  # trains or fits, then asserts what it learned (make test-kernels)


@pytest.fixture(scope="session")
def service(tiny_quickstart) -> QAService:
    run = tiny_quickstart
    return QAService.from_checkpoint(run / "final")


def test_answer_returns_passages_best_first_with_scores(service):
    question = service.examples[0]
    result = service.answer(question, 3)
    assert result["question"] == question and result["k"] == 3
    assert isinstance(result["answer"], str) and result["latency_ms"] > 0
    scores = [p["score"] for p in result["passages"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    first = result["passages"][0]
    assert first["id"] and first["text"] and isinstance(first["has_answer"], bool)


def test_answer_carries_the_readers_confidence_and_the_page_warns_when_it_is_low(service):
    question = service.examples[0]
    result = service.answer(question, 3)
    passages = [[(p["title"], p["text"]) for p in result["passages"]]]
    ((answer, confidence),) = service.reader.answer_with_confidence([question], passages)
    assert result["answer"] == answer and result["confidence"] == pytest.approx(confidence, abs=1e-4)
    assert 0.0 < result["confidence"] <= 1.0
    # Uncalibrated (the tiny run answers no dev question right, so the quickstart fitted no policy): the
    # reader's own probability, nothing abstained, and the result says so.
    assert service.policy is None and not result["calibrated"] and result["abstained"] is False
    assert result["reader_probability"] == result["confidence"] and result["reason"] is None
    page_answer, status, _, shown = respond(service, question, 3)
    assert page_answer == answer and "top-3 passages · corpus " in status and shown["answer"] == answer
    assert status.endswith(service.edition.rpartition(":")[2][:12])  # the corpus (edition) that answered
    # Below 50% the page says in words that the answer may well be wrong; above, it shows the figure.
    assert status.startswith("⚠️ low confidence") == (result["confidence"] < 0.5)
    unsure = render({**result, "confidence": 0.12})[1]
    assert unsure.startswith("⚠️ low confidence (12% reader's probability, uncalibrated)")
    sure = render({**result, "confidence": 0.93, "calibrated": True})[1]
    assert sure.startswith("confidence 93% (chance of being right) · ") and "⚠️" not in sure


def test_gold_passage_is_retrieved_for_a_dev_question(service, tiny_quickstart):
    from rlm.data.qa import read_qa_jsonl

    run = tiny_quickstart
    example = read_qa_jsonl(run / "toy_world" / "dev.jsonl")[0]
    assert example.question == service.examples[0]  # examples come from the dev split next to the corpus
    ids = [p["id"] for p in service.answer(example.question, 5)["passages"]]
    assert set(example.gold_passage_ids) & set(ids)


def test_k_is_clamped_to_the_slider_range(service):
    assert service.answer(service.examples[0], 0)["k"] == service.default_k
    assert service.answer(service.examples[0], 10_000)["k"] == service.max_k


def test_empty_and_oversized_questions_are_refused_with_a_message(service):
    with pytest.raises(InvalidQuestion, match="Type a question"):
        service.answer("   ", 3)
    with pytest.raises(InvalidQuestion, match="limit is 300"):
        service.answer("x" * 301, 3)
    answer, latency, cards, result = respond(service, "", 3)
    assert answer == "" and cards == "" and "Type a question" in latency and "error" in result
    assert "limit" in respond(service, "y" * 1000, 3)[1]


def test_index_is_cached_outside_the_checkpoint_and_reused(service, tiny_quickstart, rlm_cache):
    final = tiny_quickstart / "final"
    # The cache is shared by the session's tests: an h(B) index (corrected-*) may sit beside this one.
    cached = [d for d in (rlm_cache / INDEX_CACHE).iterdir() if not d.name.startswith("corrected-")]
    assert len(cached) == 1 and (cached[0] / "index.faiss").is_file()
    assert not (final / INDEX_CACHE).exists()  # final/ stays as training wrote it
    stamp = (cached[0] / "index.faiss").stat().st_mtime_ns
    again = QAService.from_checkpoint(final)
    assert (cached[0] / "index.faiss").stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert again.index.ids == service.index.ids


def test_corpus_is_found_from_a_relative_config_path(tmp_path):
    run = tmp_path / "runs" / "qs"
    (run / "final").mkdir(parents=True)
    (run / "toy_world").mkdir()
    (run / "toy_world" / "corpus.jsonl").write_text("{}\n")
    config = {"data": {"toy_world": {"dir": "qs/toy_world"}}}
    assert corpus_from_config(config, run / "final") == run.parent / "qs" / "toy_world" / "corpus.jsonl"
    with pytest.raises(FileNotFoundError, match="pass --corpus"):
        corpus_from_config({"data": {"corpus": "nowhere/c.jsonl"}}, run / "final")


def test_missing_checkpoint_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="rlm quickstart --no-serve"):
        QAService.from_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="retriever"):
        QAService.from_checkpoint(tmp_path / "empty")


def test_highlight_escapes_html_and_marks_the_answer():
    out = highlight("Born in <b>Paris</b>, paris.", "paris")
    assert out == "Born in &lt;b&gt;<mark>Paris</mark>&lt;/b&gt;, <mark>paris</mark>."
    assert highlight("a <x>", "") == "a &lt;x&gt;"
    card = passages_html(
        {
            "answer": "Oslo",
            "passages": [{"title": "T", "text": "in Oslo", "score": 0.5, "has_answer": True}],
        }
    )
    assert "<mark>Oslo</mark>" in card and "score 0.500" in card and "contains the answer" in card


def test_launch_policy_binds_localhost_and_serves_no_files(tmp_path):
    kwargs = launch_kwargs(blocked=[tmp_path])
    assert kwargs["server_name"] == "127.0.0.1"
    assert kwargs["allowed_paths"] == []
    assert str(tmp_path.resolve()) in kwargs["blocked_paths"]


def test_service_survives_a_deleted_index_cache(service, tiny_quickstart, rlm_cache):
    final = tiny_quickstart / "final"
    shutil.rmtree(rlm_cache / INDEX_CACHE)
    rebuilt = QAService.from_checkpoint(final)
    assert rebuilt.answer(service.examples[1], 2)["k"] == 2
    assert (rlm_cache / INDEX_CACHE).is_dir()


def test_prebuilt_index_is_used_and_checked_against_the_corpus(service, tiny_quickstart, tmp_path):
    import numpy as np

    from rlm.retriever.index import PassageIndex

    final = tiny_quickstart / "final"
    prebuilt = tmp_path / "index"
    service.index.save(prebuilt)
    reused = QAService.from_checkpoint(final, options=ServiceOptions(index_path=prebuilt))
    assert reused.index.ids == service.index.ids
    # A compressed index keeps its tuned search parameters; the service's own override wins.
    embeddings = np.stack([service.index.index.reconstruct(i) for i in range(service.index.ntotal)])
    ivf = PassageIndex.build(embeddings, service.index.ids, factory="IVF8,Flat")
    ivf.set_search_params({"nprobe": 4})
    ivf.save(tmp_path / "ivf")
    ivf_options = ServiceOptions(index_path=tmp_path / "ivf")
    assert QAService.from_checkpoint(final, options=ivf_options).index.search_params == {"nprobe": 4}
    wider = ServiceOptions(index_path=tmp_path / "ivf", index_spec=IndexSpec(nprobe=8))
    assert QAService.from_checkpoint(final, options=wider).index.search_params == {"nprobe": 8}

    other = PassageIndex.build(np.eye(3, service.index.dim, dtype=np.float32), ["a", "b", "c"])
    other.save(tmp_path / "other")
    with pytest.raises(ValueError, match="holds 3 passages but the corpus has"):
        QAService.from_checkpoint(final, options=ServiceOptions(index_path=tmp_path / "other"))


def test_restart_reuses_the_corpus_fingerprint_until_the_file_changes(
    service, tiny_quickstart, hashed_files, rlm_cache
):
    import os

    from rlm.cache import corpus_fingerprint_cache

    final = tiny_quickstart / "final"
    assert corpus_fingerprint_cache(rlm_cache).is_file()  # written by the first start
    hashed = hashed_files
    index_file = next((rlm_cache / INDEX_CACHE).glob("*/index.faiss"))
    stamp = index_file.stat().st_mtime_ns
    again = QAService.from_checkpoint(final)
    assert hashed == [] and again.corpus.fingerprint == service.corpus.fingerprint
    corpus_file = again.corpus.path
    mtime = corpus_file.stat().st_mtime_ns
    os.utime(corpus_file, ns=(mtime + 10**9, mtime + 10**9))  # touched: same bytes, newer mtime
    try:
        touched = QAService.from_checkpoint(final)
    finally:
        os.utime(corpus_file, ns=(mtime, mtime))
    assert hashed == [str(corpus_file)], "a changed mtime is rehashed"
    assert touched.corpus.fingerprint == service.corpus.fingerprint
    assert index_file.stat().st_mtime_ns == stamp  # same bytes, same key: the cached index is reused


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"index_path": "index", "corrected_buffer": True},
            "--index and --corrected-buffer exclude each other",
        ),
        ({"buffer_path": "buffer"}, "--buffer only goes with --corrected-buffer"),
        (
            {"index_path": "index", "index_spec": IndexSpec(factory="HNSW32")},
            "--factory build an index: they go without --index",
        ),
        ({"index_spec": IndexSpec(rescore=2)}, "the demo builds its index from a temporary folder"),
        ({"num_examples": -1}, "num_examples must be a whole number >= 0, got -1"),
        ({"device": "gpu"}, "unknown device 'gpu': use cpu, cuda or cuda:N"),
    ],
)
def test_service_options_refuse_what_cannot_run_when_made(options, message):
    with pytest.raises(UserError, match=re.escape(message)):
        ServiceOptions(**options)


def test_the_service_loads_through_the_checkpoint_module_and_never_imports_the_evaluation(tiny_quickstart):
    """What the demo imports to answer is loading, device, indexing and the answer policy: not `rlm evaluate`'s
    metrics and records (a fresh process, so nothing another test imported counts)."""
    import subprocess
    import sys

    final = tiny_quickstart / "final"
    script = (
        "import sys\n"
        "from rlm.app.service import QAService\n"
        f"service = QAService.from_checkpoint({str(final)!r})\n"
        "assert service.answer(service.examples[0], 2)['passages']\n"
        "print(sorted(m for m in sys.modules if m.startswith('rlm.inference')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = done.stdout.strip().splitlines()[-1]
    assert "'rlm.inference.checkpoint'" in loaded and "'rlm.inference.evaluation'" not in loaded, loaded


def test_bf16_answers_cast_each_weight_once_not_once_per_generated_token(service, monkeypatch):
    """Under bf16 autocast every weight is cast to bf16 when used; autocast keeps those copies for the whole
    answer only outside `torch.inference_mode`. Inside it, each decoder step casts the decoder's weights again:
    for a T5-base, 138M weights read and written once per answer token."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {p.untyped_storage().data_ptr() for p in service.reader.parameters()}

    class WeightCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            cast = (
                source is not None
                and source.dtype == torch.float32
                and getattr(out, "dtype", None) == torch.bfloat16
            )
            if cast and source.untyped_storage().data_ptr() in weights:
                self.counts[source.untyped_storage().data_ptr()] += 1
            return out

    monkeypatch.setattr(service, "bf16", True)
    with WeightCasts() as casts:
        result = service.answer(service.examples[0], 3)
    assert result["answer"] is not None and casts.counts, "nothing ran under bf16 autocast"
    assert max(casts.counts.values()) == 1, (
        f"a weight was cast {max(casts.counts.values())} times in one answer"
    )
