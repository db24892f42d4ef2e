"""Evaluation end to end on a tiny toy world: the packaged MiniLM retriever and a tiny random-init FiD reader."""

import json

import pytest
import torch
from tiny_run import tiny_retriever

from rlm.cli import main
from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.data.toy_world import build_toy_world
from rlm.inference import evaluation, indexing
from rlm.inference.reading import with_gold_passages
from rlm.inference.retrieval import Retrieved, retrieve


@pytest.fixture(scope="module")
def setup(tmp_path_factory, minilm_path):
    from rlm.reader.fid import FiDConfig, FiDReader
    from rlm.reader.tokenizer import train_tokenizer
    from rlm.retriever.encoder import DualEncoder

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("eval")
    world = build_toy_world(root / "world", num_passages=120, seed=0, max_questions={"dev": 12})
    corpus = load_corpus(world.corpus)
    dev = load_qa_dataset("toy", "dev", world.root)
    ckpt = root / "ckpt"
    retriever = DualEncoder.from_pretrained(minilm_path)
    retriever.save_pretrained(ckpt / "retriever")
    tokenizer = train_tokenizer(list(corpus.retrieval_texts()), vocab_size=400)
    # Answers are a few tokens; a short generation cap keeps the random-init reader fast.
    fid_config = FiDConfig(max_passage_length=48, max_answer_length=6)
    reader = FiDReader.from_config(
        tokenizer, fid_config=fid_config, seed=0, d_model=32, d_ff=64, num_layers=1, num_heads=2
    )
    reader.save_pretrained(ckpt / "reader")
    (ckpt / "config.yaml").write_text("reader:\n  num_passages: 3\nstrategy:\n  k: 8\n")
    return world, corpus, dev, ckpt, retriever, reader


def test_full_evaluation_writes_consistent_predictions_and_metrics(setup, tmp_path):
    world, corpus, dev, ckpt, retriever, reader = setup
    out = tmp_path / "out"
    result = evaluation.run_evaluation(
        dev, corpus, retriever, reader, k=20, num_passages=3, batch_size=8, out_dir=out
    )
    m = json.loads((out / "metrics.json").read_text())
    assert m.pop("mode") == result.mode == "retrieve+read"
    # No split named by the caller; the corpus that answered, by its fingerprint (an edition's, after updates).
    assert m.pop("data") == {"corpus": {"passages": len(corpus), "fingerprint": corpus.fingerprint}}
    assert m == pytest.approx(result.metrics)
    for key in ("recall@1", "recall@5", "recall@20", "gold_recall@1", "gold_recall@20", "exact_match", "f1"):
        assert 0.0 <= m[key] <= 1.0, key
    assert "recall@100" not in m  # only k <= the retrieved depth
    assert m["recall@1"] <= m["recall@5"] <= m["recall@20"]
    # The pretrained retriever finds the gold passage of most toy questions within 5 (measured ~0.95 at 2k).
    assert m["gold_recall@5"] >= 0.6
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == len(dev) == m["num_questions"]
    assert sum(r["exact_match"] for r in rows) / len(rows) == pytest.approx(m["exact_match"])
    first = rows[0]
    assert set(first) >= {"question", "answers", "prediction", "retrieved_ids", "retrieved_scores"}
    assert (
        len(first["retrieved_ids"]) == 20
        and first["retrieved_scores"] == sorted(first["retrieved_scores"])[::-1]
    )
    table = evaluation.format_table(m, "toy/dev")
    assert "| recall@5 |" in table and "| exact_match |" in table


def test_retrieval_only_and_closed_book_modes(setup):
    world, corpus, dev, ckpt, retriever, reader = setup
    only = evaluation.run_evaluation(dev, corpus, retriever, None, k=5)
    assert "exact_match" not in only.metrics and "recall@5" in only.metrics
    closed = evaluation.run_evaluation(dev, None, None, reader, closed_book=True, batch_size=8)
    assert "recall@1" not in closed.metrics and closed.metrics["reader_passages"] == 0
    assert all("retrieved_ids" not in r for r in closed.records)
    with pytest.raises(ValueError, match="closed-book evaluation needs a reader"):
        evaluation.run_evaluation(dev, closed_book=True)


def test_saved_index_is_reused_and_checked(setup, tmp_path):
    world, corpus, dev, ckpt, retriever, reader = setup
    embeddings = indexing.embed_corpus(retriever.passage_tower, corpus.retrieval_texts())
    index = indexing.build_index(embeddings, corpus.ids)
    index.save(tmp_path / "index")
    loaded = indexing.load_index_for(tmp_path / "index", corpus.ids)
    a = retrieve(retriever.query_tower, index, [q.question for q in dev], k=5)
    b = retrieve(retriever.query_tower, loaded, [q.question for q in dev], k=5)
    assert a.ids == b.ids
    with pytest.raises(ValueError, match="row 3 is passage 'tw0000003' but the corpus has 'x'"):
        indexing.load_index_for(tmp_path / "index", [*corpus.ids[:3], "x", *corpus.ids[4:]])
    with pytest.raises(ValueError, match="holds 120 passages but the corpus has 119"):
        indexing.load_index_for(tmp_path / "index", corpus.ids[:119])


def test_cli_evaluate_and_errors(setup, tmp_path, capsys):
    world, corpus, dev, ckpt, retriever, reader = setup
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data-path", str(world.root), "--k", "10"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--max-examples", "6", "--batch-size", "6"]) == 0
    out = capsys.readouterr().out
    assert "retrieve + read" in out and "| exact_match |" in out
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["reader_passages"] == 3 and metrics["num_questions"] == 6  # from the checkpoint's config
    # The report names the questions: dataset, split and size (of the whole split).
    data = metrics["data"]
    assert (data["dataset"], data["split"], data["questions"], data["of_questions"]) == (
        "toy",
        "dev",
        6,
        len(dev),
    )
    assert "toy dev: 6 questions" in out
    assert main(["evaluate", "--data-path", str(world.root)]) == 2
    assert "pass --checkpoint" in capsys.readouterr().err
    assert (
        main(["evaluate", "--checkpoint", str(tmp_path), "--data-path", str(world.root), "--retrieval-only"])
        == 2
    )
    assert "retriever/ and reader/" in capsys.readouterr().err


def test_majority_answer_baseline_is_low_on_held_out_entities(tmp_path):
    world = build_toy_world(tmp_path / "w", num_passages=2000, seed=0)
    train, dev = (load_qa_dataset("toy", s, world.root) for s in ("train", "dev"))
    scores = evaluation.majority_answer_baseline(train, dev)
    assert 0.0 < scores["exact_match"] < 0.12  # ~1/24 on city questions, 1/16 on occupations, ~0 on names
    # On the train split itself the per-type majority is just as weak: facts are drawn uniformly.
    assert evaluation.majority_answer_baseline(train, train)["exact_match"] < 0.12


def test_gold_passages_swapped_into_the_reading_list():
    from rlm.data.qa import QAExample

    examples = [QAExample("a", "q", ["x"], ["g1"]), QAExample("b", "q", ["x"], ["g2", "g3"])]
    retrieved = Retrieved(ids=[["p1", "g1", "p2", "p3"], ["p4", "p5", "g3", "p6"]], scores=[[], []])
    assert with_gold_passages(examples, retrieved, 3) == [["p1", "g1", "p2"], ["p4", "g2", "g3"]]
    assert with_gold_passages(examples, None, 3) == [["g1"], ["g2", "g3"]]
    assert with_gold_passages(examples, retrieved, 1) == [["g1"], ["g2"]]
    with pytest.raises(ValueError, match="question c has no gold passage ids"):
        with_gold_passages([QAExample("c", "q", ["x"])], None, 3)


def test_gold_passage_mode_reads_gold(setup, tmp_path, capsys):
    world, corpus, dev, ckpt, retriever, reader = setup
    result = evaluation.run_evaluation(
        dev, corpus, None, reader, num_passages=3, gold_passages=True, batch_size=8
    )
    assert result.mode == "gold_passages" and "recall@1" not in result.metrics
    assert [r["read_ids"] for r in result.records] == [q.gold_passage_ids for q in dev]
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data-path", str(world.root), "--max-examples", "4"]
    assert main([*argv, "--gold-passages", "--no-retriever", "--out", str(tmp_path / "g")]) == 0
    assert json.loads((tmp_path / "g" / "metrics.json").read_text())["mode"] == "gold_passages"
    assert main([*argv, "--no-retriever"]) == 2
    assert "--no-retriever only goes with --gold-passages" in capsys.readouterr().err


def _count_encoded_rows(monkeypatch) -> list[int]:
    """How many texts each call of `SentenceEncoder.encode` (the in-memory float32 path) was handed."""
    from rlm.retriever.encoder import SentenceEncoder

    calls: list[int] = []
    encode = SentenceEncoder.encode

    def counting(self, texts, *args, **kwargs):
        calls.append(len(texts))
        return encode(self, texts, *args, **kwargs)

    monkeypatch.setattr(SentenceEncoder, "encode", counting)
    return calls


def test_evaluation_embeds_the_corpus_as_float16_shards_never_one_float32_array(setup, monkeypatch):
    """Without an index the corpus goes through the buffer's path (a block at a time into float16 shards on
    disk, then indexed chunk by chunk), not through `encode` into one float32 array of every passage: only the
    questions are `encode`d."""
    world, corpus, dev, ckpt, retriever, reader = setup
    calls = _count_encoded_rows(monkeypatch)
    result = evaluation.run_evaluation(dev, corpus, retriever, None, k=5)
    assert calls and max(calls) <= len(dev) < len(corpus)
    assert result.metrics["gold_recall@5"] >= 0.6  # the MiniLM retriever still finds the gold passages


def test_rlm_evaluate_keeps_its_embeddings_in_a_buffer_folder_and_reuses_them(
    setup, tmp_path, monkeypatch, capsys
):
    """`--embeddings DIR` holds the corpus embedded by the checkpoint's passage tower at its own max length, in
    float16, with the encoder's and corpus's fingerprints; a second evaluation reuses it and embeds nothing,
    and gives the same figures. A stale buffer (another encoder) in that folder is refused, not used."""
    import rlm.retriever.buffer

    world, corpus, dev, ckpt, retriever_model, reader = setup
    embeddings = tmp_path / "emb"
    args = ["evaluate", "--checkpoint", str(ckpt), "--dataset", "toy", "--data-path", str(world.root)]
    args += ["--k", "5", "--no-progress", "--retrieval-only", "--embeddings", str(embeddings)]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    meta = json.loads((embeddings / "meta.json").read_text())
    tower = retriever_model.passage_tower
    assert meta["dtype"] == "float16" and meta["count"] == len(corpus)
    assert meta["encoder_fingerprint"] == tower.fingerprint() and meta["max_length"] == tower.max_length
    assert meta["corpus_fingerprint"] == corpus.fingerprint

    def no_embedding(*a, **k):
        raise AssertionError("the kept embeddings must be reused")

    monkeypatch.setattr(rlm.retriever.buffer, "embed_shards", no_embedding)
    assert main([*args, "--out", str(tmp_path / "two")]) == 0
    first, second = (json.loads((tmp_path / o / "metrics.json").read_text()) for o in ("one", "two"))
    timing = {"embed_seconds", "retrieve_seconds", "read_seconds"}
    assert {k: v for k, v in first.items() if k not in timing} == {
        k: v for k, v in second.items() if k not in timing
    }

    other = tiny_retriever(tmp_path / "other")  # a buffer of another tower in that folder: refused
    capsys.readouterr()
    assert main([*args, "--retriever", str(other), "--out", str(tmp_path / "three")]) != 0
    assert (
        "already holds a complete buffer with other settings (encoder_fingerprint" in capsys.readouterr().err
    )


def test_rlm_evaluate_under_accelerate_launch_shares_the_questions_and_writes_once(setup, tmp_path):
    """Two processes (`accelerate launch`, the README's CPU config) evaluate their halves of the questions and
    gather the results once: the predictions and metrics equal one process's, written by the main process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from local_port import accelerate_launch

    world, corpus, dev, ckpt, retriever_model, reader = setup
    repo = Path(__file__).resolve().parents[1]
    embeddings = tmp_path / "emb"
    args = ["evaluate", "--checkpoint", str(ckpt), "--dataset", "toy", "--data-path", str(world.root)]
    args += ["--k", "5", "--batch-size", "4", "--no-progress", "--embeddings", str(embeddings)]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    launch = accelerate_launch(repo / "configs" / "accelerate" / "cpu_2proc.yaml", "-m", "rlm", *args)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    done = subprocess.run(
        [*launch, "--out", str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("x 2 processes") == 1 and done.stdout.count("| exact_match |") == 1
    one, two = (
        [json.loads(line) for line in (tmp_path / o / "predictions.jsonl").read_text().splitlines()]
        for o in ("one", "two")
    )
    assert [r["retrieved_ids"] for r in one] == [r["retrieved_ids"] for r in two]
    assert [r["prediction"] for r in one] == [r["prediction"] for r in two]
    metrics = [json.loads((tmp_path / o / "metrics.json").read_text()) for o in ("one", "two")]
    for key in ("num_questions", "exact_match", "recall@5", "gold_recall@5"):
        assert metrics[0][key] == metrics[1][key], key
    assert sys.executable  # the launch used this interpreter (local_port.accelerate_launch)


@pytest.mark.slow
def test_rlm_evaluate_under_accelerate_launch_outlasts_its_index_build_maps_the_index_and_scores_once(
    setup, tmp_path, monkeypatch
):
    """Two processes, the main one's IVF build slowed past the process group's timeout (`--dist-timeout 10`, the least it takes):
    the other waits for the index on disk, not at a collective, and maps it instead of reading a copy; the index
    is tuned once, on every question (as one process tunes it), and each question's passages are checked for
    its answer once, by one process. The results are one process's. Then, in the same processes, that index
    reused (`--index`): every process maps it."""
    import subprocess
    from pathlib import Path

    from local_port import launch_env, two_processes

    from rlm.inference import metrics
    from rlm.retriever.index import PassageIndex

    world, corpus, dev, ckpt, retriever_model, reader = setup
    embeddings, reports = tmp_path / "emb", tmp_path / "reports"
    args = ["evaluate", "--checkpoint", str(ckpt), "--dataset", "toy", "--data-path", str(world.root)]
    args += ["--k", "5", "--retrieval-only", "--factory", "IVF4,Flat", "--no-progress"]
    args += ["--dist-timeout", "10", "--embeddings", str(embeddings)]
    has_answer, checked = metrics.has_answer, []
    monkeypatch.setattr(metrics, "has_answer", lambda *a: checked.append(a) or has_answer(*a))
    # One process: the reference, and the embeddings the launch reuses (its processes then wait only for the index).
    assert main([*args, "--out", str(tmp_path / "one"), "--save-index", str(tmp_path / "one_index")]) == 0
    monkeypatch.undo()
    two = [*args, "--out", str(tmp_path / "two"), "--save-index", str(tmp_path / "two_index")]
    reuse = [*args[: args.index("--factory")], "--index", str(tmp_path / "two_index")]
    reuse += ["--no-progress", "--dist-timeout", "10", "--out", str(tmp_path / "reused")]
    helper = Path(__file__).with_name("multiprocess_evaluate.py")
    # The main process sleeps 16 s before it builds: past the timeout of every collective, with room for skew.
    launch = two_processes(str(helper), str(reports), "16", *two, "--", *reuse)
    done = subprocess.run(launch, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    main_process, other = (json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1))
    assert main_process["timeout_s"] == other["timeout_s"] == 10
    assert (main_process["tunes"], other["tunes"]) == (1, 0)
    mapped = {"mapped": "IO_FLAG_MMAP", "factory": "IVF4,Flat"}
    assert other["loads"] == [mapped, mapped] and main_process["loads"] == [mapped]
    assert main_process["has_answer_calls"] > 0 and other["has_answer_calls"] > 0
    # Two evaluations (built, then reused), each checking every question's passages once, as one process does.
    assert main_process["has_answer_calls"] + other["has_answer_calls"] == 2 * len(checked)
    one_index, two_index = (PassageIndex.load(tmp_path / f"{o}_index") for o in ("one", "two"))
    assert two_index.tuning["queries"] == one_index.tuning["queries"] == len(dev)
    assert two_index.search_params == one_index.search_params
    one, two, reused = (
        [json.loads(line) for line in (tmp_path / o / "predictions.jsonl").read_text().splitlines()]
        for o in ("one", "two", "reused")
    )
    assert [r["retrieved_ids"] for r in one] == [r["retrieved_ids"] for r in two]
    assert [r["retrieved_ids"] for r in one] == [r["retrieved_ids"] for r in reused]
    scores = [json.loads((tmp_path / o / "metrics.json").read_text()) for o in ("one", "two", "reused")]
    recall = [{key: value for key, value in s.items() if "recall@" in key} for s in scores]
    assert recall[0] == recall[1] == recall[2] and "recall@5" in recall[0]


def test_the_demos_own_index_is_built_from_float16_shards_and_records_its_tower(setup, tmp_path, monkeypatch):
    """The demo's index of a corpus it was given no index for is built through `index_corpus` (no float32
    array of every passage beside the index), records the tower and corpus it came from, and leaves only the
    index in its cache folder (the shards were temporary)."""
    from rlm.inference.index_cache import INDEX_CACHE, cached_index
    from rlm.retriever.index import INDEX_FILES

    world, corpus, dev, ckpt, retriever_model, reader = setup
    calls = _count_encoded_rows(monkeypatch)
    tower = retriever_model.passage_tower
    index = cached_index(tmp_path / "ckpt", tower, corpus)
    assert calls == [] and index.ntotal == len(corpus)
    assert index.provenance["encoder_fingerprint"] == tower.fingerprint()
    assert index.provenance["corpus_fingerprint"] == corpus.fingerprint
    (cached,) = (tmp_path / "ckpt" / INDEX_CACHE).iterdir()
    assert sorted(p.name for p in cached.iterdir()) == sorted(
        set(INDEX_FILES) - {"removed.npy"}
    )  # none removed


def test_rlm_evaluate_tunes_an_approximate_index_on_its_own_questions(setup, tmp_path):
    """`--factory IVF...` without `--index`: the index built from the float16 shards is tuned on the query
    tower's embeddings of the questions being evaluated (what it will be asked), not on passages as queries."""
    from rlm.retriever.index import PassageIndex

    world, corpus, dev, ckpt, retriever_model, reader = setup
    args = ["evaluate", "--checkpoint", str(ckpt), "--dataset", "toy", "--data-path", str(world.root)]
    args += ["--k", "5", "--no-progress", "--retrieval-only", "--factory", "IVF4,Flat"]
    assert main([*args, "--save-index", str(tmp_path / "ivf")]) == 0
    index = PassageIndex.load(tmp_path / "ivf")
    assert index.factory == "IVF4,Flat" and index.tuning["queries_from"] == "query vectors"
    assert index.tuning["queries"] == len(dev) and index.tuning["recall"] >= 0.95
    assert index.provenance["encoder_fingerprint"] == retriever_model.passage_tower.fingerprint()


@pytest.mark.parametrize(
    "typed, published",
    [
        ("nq", {"NQ-open.train.jsonl": 60, "NQ-open.dev.jsonl": 7}),
        ("tqa", {"train.jsonl": 60, "validation.jsonl": 7}),
        ("hotpotqa", {"train.jsonl": 60, "validation.jsonl": 7}),
    ],
)
def test_rlm_evaluate_scores_each_datasets_test_split_from_a_local_copy(
    setup, tmp_path, capsys, typed, published
):
    """`--split test` is the published validation (what papers report), for every dataset, by the names users
    type; the questions are the toy world's, laid out as each dataset's local copy."""
    world, corpus, dev, ckpt, retriever, reader = setup
    asked = load_qa_dataset("toy", "train", world.root)
    folder = tmp_path / typed
    folder.mkdir()
    start = 0
    for name, count in published.items():
        rows = [{"question": ex.question, "answers": ex.answers} for ex in asked[start : start + count]]
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        start += count
    argv = ["evaluate", "--retriever", str(ckpt / "retriever"), "--retrieval-only", "--k", "5"]
    argv += ["--dataset", typed, "--split", "test", "--data-path", str(folder), "--corpus", str(world.corpus)]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "metrics.json").read_text())["data"]
    assert (data["split"], data["questions"]) == ("test", 7)
    assert "validation: the test set" in data["source"]
    assert f"{data['dataset']} test: 7 questions" in capsys.readouterr().out
