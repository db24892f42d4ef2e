"""`rlm embed` and `rlm index` end to end on a small JSONL corpus with the packaged MiniLM."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlm.cli import main
from rlm.config import RetrieverConfig
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.encoder import SentenceEncoder, default_retriever_path
from rlm.retriever.index import PassageIndex

PASSAGES = [
    ("capital-fr", "France", "Paris is the capital and largest city of France."),
    ("volcano", "Mount Etna", "Etna is an active volcano on the east coast of Sicily."),
    ("photo", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into sugar."),
    ("jazz", "Jazz", "Jazz is a music genre that originated in New Orleans."),
    ("moon", "Moon", "The Moon is Earth's only natural satellite."),
    ("python", "Python", "Python is a programming language created by Guido van Rossum."),
    ("nile", "Nile", "The Nile is a major river flowing north through Egypt."),
]


def write_corpus(path):
    lines = [json.dumps({"id": i, "title": t, "text": x}) for i, t, x in PASSAGES]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_embed_then_index_then_search(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    buffer_dir, index_dir = tmp_path / "buffer", tmp_path / "index"
    assert (
        main(
            ["embed", "--corpus", str(corpus), "--out", str(buffer_dir), "--shard-size", "3", "--no-progress"]
        )
        == 0
    )
    assert "7 passages x 384" in capsys.readouterr().out
    # rlm embed's default length is rlm train's retriever.passage_max_length, so training accepts the buffer.
    encoder = SentenceEncoder.from_pretrained(
        default_retriever_path(), max_length=RetrieverConfig.passage_max_length
    )
    buffer = PassageBuffer.load(buffer_dir, encoder_fingerprint=encoder.fingerprint())
    assert buffer.ids == [p[0] for p in PASSAGES] and len(buffer.meta["shards"]) == 3

    assert main(["index", "--buffer", str(buffer_dir), "--out", str(index_dir)]) == 0
    index = PassageIndex.load(index_dir)
    queries = encoder.encode(["Which river runs through Egypt?", "Who created Python?"]).numpy()
    _, ids = index.search(queries, 2)
    assert [row[0] for row in ids] == ["nile", "python"]


def test_index_from_npy_and_user_errors(tmp_path, capsys):
    np.save(tmp_path / "emb.npy", np.eye(3, dtype=np.float32))
    (tmp_path / "ids.txt").write_text("a\nb\nc\n")
    args = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    assert main([*args, "--out", str(tmp_path / "idx")]) == 0
    assert PassageIndex.load(tmp_path / "idx").search(np.eye(3, dtype=np.float32)[[2]], 1)[1] == [["c"]]
    capsys.readouterr()
    assert main(["index", "--embeddings", str(tmp_path / "emb.npy"), "--out", str(tmp_path / "x")]) == 2
    assert "--embeddings needs --ids" in capsys.readouterr().err
    assert main(["embed", "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "b")]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    write_corpus(tmp_path / "c.jsonl")
    assert (
        main(
            [
                "embed",
                "--corpus",
                str(tmp_path / "c.jsonl"),
                "--out",
                str(tmp_path / "b"),
                "--encoder",
                "no-such/model",
            ]
        )
        == 2
    )
    assert "packaged default" in capsys.readouterr().err


def test_rlm_index_tunes_an_ivf_search_for_the_target_recall_or_takes_the_users(tmp_path, capsys):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((3000, 16)).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb / np.linalg.norm(emb, axis=1, keepdims=True))
    (tmp_path / "ids.txt").write_text("".join(f"p{i}\n" for i in range(3000)))
    args = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    args += ["--factory", "IVF32,Flat", "--tune-k", "10", "--tune-queries", "200"]
    assert main([*args, "--out", str(tmp_path / "tuned"), "--target-recall", "0.9"]) == 0
    out = capsys.readouterr().out
    tuned = PassageIndex.load(tmp_path / "tuned")
    assert tuned.tuning["recall"] >= 0.9 and tuned.search_params["nprobe"] > 1
    assert f"nprobe={tuned.search_params['nprobe']}: the index's top 10 holds the source row of" in out
    assert main([*args, "--out", str(tmp_path / "fixed"), "--nprobe", "3"]) == 0
    assert PassageIndex.load(tmp_path / "fixed").search_params == {"nprobe": 3}
    assert main([*args, "--out", str(tmp_path / "bare"), "--target-recall", "0"]) == 0
    assert PassageIndex.load(tmp_path / "bare").search_params == {}  # faiss's defaults, as asked
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "bad"), "--nprobe", "0"]) == 2
    assert "--nprobe must be >= 1 (or null), got 0" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "bad"), "--ef-search", "64"]) == 2
    assert "no search parameter 'efSearch'" in capsys.readouterr().err


def test_a_trained_tower_is_embedded_at_its_own_length_and_its_index_refuses_another_encoder(
    tmp_path, capsys
):
    from rlm.data.corpus import load_corpus
    from rlm.errors import UserError
    from rlm.inference.indexing import load_index_for
    from rlm.retriever.encoder import DualEncoder

    corpus_file = write_corpus(tmp_path / "corpus.jsonl")
    trained = DualEncoder.from_pretrained(default_retriever_path(), max_length=24)
    trained.save_pretrained(tmp_path / "retriever")  # what a run saves: query_tower/ and passage_tower/
    assert main(["embed", "--corpus", str(corpus_file), "--encoder", str(tmp_path / "retriever"), "--out", str(tmp_path / "b"), "--no-progress"]) == 0  # fmt: skip
    assert "at max length 24" in capsys.readouterr().out
    assert PassageBuffer.load(tmp_path / "b").meta["max_length"] == 24
    assert main(["index", "--buffer", str(tmp_path / "b"), "--out", str(tmp_path / "i")]) == 0
    corpus = load_corpus(corpus_file)
    tower = trained.passage_tower
    index = load_index_for(
        tmp_path / "i", corpus.ids, passage_tower=tower, corpus_fingerprint=corpus.fingerprint
    )
    assert index.provenance["max_length"] == 24
    # The same weights at another length, other weights (a run's stale buffer), another corpus: refused.
    tower.max_length = 128
    with pytest.raises(UserError, match="another encoder .* max length 24"):
        load_index_for(tmp_path / "i", corpus.ids, passage_tower=tower)
    tower.max_length = 24
    with torch.no_grad():
        next(tower.parameters()).add_(0.01)
    with pytest.raises(UserError, match="another encoder"):
        load_index_for(tmp_path / "i", corpus.ids, passage_tower=tower)
    with pytest.raises(UserError, match="built for corpus jsonl:sha256:"):
        load_index_for(tmp_path / "i", corpus.ids, corpus_fingerprint="jsonl:sha256:0000")


def test_rlm_index_tunes_on_questions_embedded_by_the_query_tower(tmp_path, capsys):
    """`--tune-questions FILE --query-encoder DIR`: the search is tuned on the questions the index will be
    asked (a text file or JSONL with "question"), and index.json says so; a missing or mismatched encoder is
    one error line."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    assert main(["embed", "--corpus", str(corpus), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "Where is the Eiffel Tower?"}\n\n{"question": "What do bees make?"}\n')
    args = ["index", "--buffer", str(tmp_path / "b"), "--factory", "IVF2,Flat", "--tune-k", "3"]
    args += ["--tune-questions", str(questions)]
    assert main([*args, "--out", str(tmp_path / "i"), "--query-encoder", default_retriever_path()]) == 0
    tuning = PassageIndex.load(tmp_path / "i").tuning
    assert tuning["queries_from"] == "query vectors" and tuning["queries"] == 2
    assert "of exact search's top 3 for 2 questions" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "j")]) == 2
    assert "--tune-questions needs --query-encoder" in capsys.readouterr().err
    other = tmp_path / "small"
    SentenceEncoder.from_pretrained(default_retriever_path()).save_pretrained(other)
    emb = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb)
    (tmp_path / "ids.txt").write_text("".join(f"p{i}\n" for i in range(40)))
    small = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    small += ["--factory", "IVF2,Flat", "--tune-questions", str(questions), "--query-encoder", str(other)]
    assert main([*small, "--out", str(tmp_path / "k")]) == 2
    assert "embeds in 384 dimensions but the index holds 16" in capsys.readouterr().err


def test_rlm_index_rescores_from_its_buffer_and_the_flag_needs_one(tmp_path, capsys):
    """`rlm index --buffer B --rescore F`: the index re-scores its top F x k from B's float16 rows (saved with
    it, reopened on load: a prebuilt index searched as `rlm evaluate --index` and the demo load it); with
    --embeddings there are no such rows, and a negative factor is one error line."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    assert main(["embed", "--corpus", str(corpus), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    args = ["index", "--buffer", str(tmp_path / "b"), "--factory", "IVF2,SQ4", "--rescore", "3"]
    assert main([*args, "--out", str(tmp_path / "i")]) == 0
    assert f"the top 3 x k re-scored from {tmp_path / 'b'}" in capsys.readouterr().out
    meta = json.loads((tmp_path / "i" / "index.json").read_text())
    assert meta["rescoring"] == {
        "rows": "../b",
        "rows_absolute": str((tmp_path / "b").resolve()),
        "k_factor": 3,
    }
    index = PassageIndex.load(tmp_path / "i")
    encoder = SentenceEncoder.from_pretrained(
        default_retriever_path(), max_length=RetrieverConfig.passage_max_length
    )
    queries = encoder.encode(["Which river runs through Egypt?", "Who created Python?"]).numpy()
    scores, ids = index.search(queries, 2)
    assert [row[0] for row in ids] == ["nile", "python"]
    buffer = PassageBuffer.load(tmp_path / "b")
    best = [buffer.index_of(row[0]) for row in ids]
    np.testing.assert_allclose(
        scores[:, 0], (queries * buffer.embeddings[best].float().numpy()).sum(1), rtol=1e-5
    )
    np.save(tmp_path / "emb.npy", buffer.embeddings.float().numpy())
    (tmp_path / "ids.txt").write_text("".join(f"{pid}\n" for pid in buffer.ids))
    bare = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    assert main([*bare, "--rescore", "2", "--out", str(tmp_path / "j")]) == 2
    assert "--rescore re-scores from the float16 rows of a buffer folder" in capsys.readouterr().err
    assert main([*args[:-1], "-1", "--out", str(tmp_path / "k")]) == 2
    assert "--rescore must be >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


def test_rlm_index_streams_a_float16_npy_and_holds_its_ids_as_one_blob(tmp_path, capsys):
    """`rlm index --embeddings X.npy --ids ids.txt`: the file memory-mapped and added a block at a time, the ids
    read into one `IdSequence`; neither a float32 copy of every row nor a list of every id string is made."""
    import tracemalloc

    np.save(tmp_path / "warm.npy", np.eye(2, dtype=np.float16))  # a first run imports what the command uses
    (tmp_path / "warm.txt").write_text("a\nb\n")
    warm = ["index", "--embeddings", str(tmp_path / "warm.npy"), "--ids", str(tmp_path / "warm.txt")]
    assert main([*warm, "--out", str(tmp_path / "warm")]) == 0
    n, d = 400_000, 32
    rows = np.lib.format.open_memmap(tmp_path / "emb.npy", mode="w+", dtype=np.float16, shape=(n, d))
    rows[:] = 0.01
    rows.flush()
    del rows
    (tmp_path / "ids.txt").write_text("".join(f"passage-{i}\n" for i in range(n)))
    args = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    args += [
        "--factory",
        "Flat",
    ]  # exact at any size (auto is IVF from 100k rows: its training sample is float32)
    tracemalloc.start()
    try:
        assert main([*args, "--out", str(tmp_path / "index")]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * n * d * 4, f"peak {peak / 2**20:.1f} MiB of Python and numpy objects"
    index = PassageIndex.load(tmp_path / "index")
    assert index.ntotal == n and index.ids[n - 1] == f"passage-{n - 1}"
    capsys.readouterr()


def test_rlm_index_reads_ids_written_on_windows_and_refuses_a_count_that_is_not_the_rows(tmp_path, capsys):
    np.save(tmp_path / "emb.npy", np.eye(3, dtype=np.float32))
    (tmp_path / "ids.txt").write_bytes(b"a\r\nb\r\nc\r\n")
    args = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt")]
    assert main([*args, "--out", str(tmp_path / "idx")]) == 0
    assert PassageIndex.load(tmp_path / "idx").ids == ["a", "b", "c"]
    (tmp_path / "ids.txt").write_text("a\nb\n")
    assert main([*args, "--out", str(tmp_path / "short")]) == 2
    assert f"ids.txt has 2 ids but {tmp_path / 'emb.npy'} has 3 rows" in capsys.readouterr().err
    (tmp_path / "ids.txt").write_bytes(b"a\nb\n\xff\n")
    assert main([*args, "--out", str(tmp_path / "bad")]) == 2
    assert "ids.txt: not UTF-8" in capsys.readouterr().err
