"""A run keeps its last embedding of the corpus (`final_embeddings`): a buffer in `rlm embed`'s format, of the
trained passage tower as final/ holds it, which `rlm index --buffer` indexes and `rlm evaluate --index` accepts
with nothing embedded a second time."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_run import runs_beside, train_args, train_here

from rlm.cli import main
from rlm.data.corpus import load_corpus
from rlm.retriever.buffer import PassageBuffer, embed_passages
from rlm.retriever.encoder import SentenceEncoder


@pytest.fixture(scope="module")
def kept_run(tiny_world, tmp_path_factory):
    """A tiny run with dev questions (so the final validation embeds the corpus) that keeps its final
    embeddings; the number of times the corpus was embedded during it."""
    import rlm.training.validation as validation

    root = runs_beside(tiny_world, tmp_path_factory.mktemp("final_embeddings"))
    kept = root / "kept"
    extra = ("data.dev=toy", "data.max_dev_examples=4", "save_every=0", f"final_embeddings={kept}")
    calls = []
    embed = validation.embed_passages
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            validation, "embed_passages", lambda *a, **k: calls.append(a[3] - a[2]) or embed(*a, **k)
        )
        assert train_here(train_args(root, "run", *extra, steps=2)) == 0
    return root, kept, calls


def test_a_run_keeps_its_final_embeddings_as_a_buffer_of_the_trained_tower(kept_run):
    root, kept, calls = kept_run
    corpus = load_corpus(root / "toy" / "corpus.jsonl")
    assert calls == [len(corpus)], "the final validation's rows are kept, not embedded a second time"
    tower = SentenceEncoder.from_pretrained(root / "run" / "final" / "retriever" / "passage_tower")
    buffer = PassageBuffer.load(
        kept, encoder_fingerprint=tower.fingerprint(), corpus_fingerprint=corpus.fingerprint
    )
    assert buffer.ids == corpus.ids and buffer.meta["max_length"] == tower.max_length
    assert buffer.meta["precision"] == "float32" and buffer.dtype.is_floating_point
    again = embed_passages(tower, corpus.retrieval_texts(), precision="float32")
    np.testing.assert_allclose(buffer.embeddings.float().numpy(), again.astype(np.float32), atol=2e-3)


def test_rlm_index_takes_the_kept_embeddings_and_rlm_evaluate_accepts_its_index(kept_run, capsys):
    root, kept, _ = kept_run
    index = root / "index"
    assert main(["index", "--buffer", str(kept), "--out", str(index)]) == 0
    final = root / "run" / "final"
    argv = ["evaluate", "--checkpoint", str(final), "--data-path", str(root / "toy"), "--retrieval-only"]
    assert main([*argv, "--index", str(index), "--max-examples", "4", "--out", str(root / "eval")]) == 0
    assert json.loads((root / "eval" / "metrics.json").read_text())["num_questions"] == 4
    capsys.readouterr()


def test_a_final_embeddings_folder_holding_other_files_is_refused_before_training(
    tiny_world, tmp_path, capsys
):
    root = runs_beside(tiny_world, tmp_path)
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "notes.txt").write_text("mine")
    assert train_here(train_args(root, "run", f"final_embeddings={root / 'elsewhere'}", steps=1)) == 2
    assert "final_embeddings" in capsys.readouterr().err and not (root / "run").exists()
    assert (root / "elsewhere" / "notes.txt").read_text() == "mine"


def test_final_embeddings_are_refused_for_a_strategy_that_reads_no_passages():
    from rlm.config import load_config
    from rlm.errors import UserError

    with pytest.raises(UserError, match="strategy 'closed_book' reads no passages"):
        load_config(None, ["strategy.name=closed_book", "final_embeddings=kept"])


def test_two_processes_keep_a_shard_each_that_together_are_one_processs_rows(two_process_run):
    """Under `accelerate launch` each process writes the share it validated as one shard; the buffer is the
    one a single process would have kept, of the tower final/ holds."""
    root = two_process_run
    corpus = load_corpus(root / "toy" / "corpus.jsonl")
    tower = SentenceEncoder.from_pretrained(root / "reference" / "final" / "retriever" / "passage_tower")
    kept = PassageBuffer.load(
        root / "reference_embeddings",
        encoder_fingerprint=tower.fingerprint(),
        corpus_fingerprint=corpus.fingerprint,
    )
    assert kept.meta["shards"] == ["shard_00000.npy", "shard_00001.npy"] and kept.meta["shard_size"] == 60
    again = embed_passages(tower, corpus.retrieval_texts(), precision="float32")
    np.testing.assert_allclose(kept.embeddings.float().numpy(), again.astype(np.float32), atol=2e-3)


def test_final_embeddings_inside_the_run_folder_survive_resume_and_give_way_to_overwrite(
    tiny_world, tmp_path
):
    """The paper configs keep them in `<output_dir>/embeddings`: a run folder holding them is still the run's
    own, for `--resume` (which continues it) and for `--overwrite` (which starts it again and keeps them anew)."""
    root = runs_beside(tiny_world, tmp_path)
    kept = root / "run" / "embeddings"
    extra = ("save_every=0", f"final_embeddings={kept}")
    assert train_here(train_args(root, "run", *extra, steps=1)) == 0
    first = (kept / "meta.json").read_text()
    assert train_here([*train_args(root, "run", *extra, steps=2), "--resume"]) == 0
    assert (root / "run" / "final").is_dir() and (kept / "meta.json").read_text() != first
    assert train_here([*train_args(root, "run", *extra, steps=1), "--overwrite"]) == 0
    corpus = load_corpus(root / "toy" / "corpus.jsonl")
    assert PassageBuffer.load(kept, corpus_fingerprint=corpus.fingerprint).ids == corpus.ids
