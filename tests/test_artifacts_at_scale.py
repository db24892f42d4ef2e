"""Artifacts a user can move and guards at scale (issue 47, items 5 and 6), through the commands as users run
them over a 120-passage toy world and the packaged MiniLM as the trained retriever: an index and its embeddings
moved together serve the same answers; `rlm evaluate` and the demo refuse to embed a corpus above a size limit
in one line naming the commands to run; `rlm embed` and `rlm evaluate` share the corpus fingerprint cache; an
index is tuned at the k it is searched at; help texts read their defaults from the constants."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from rlm.cli import build_parser, main
from rlm.data.corpus import load_corpus
from rlm.data.toy_world import build_toy_world
from rlm.errors import UserError


@pytest.fixture(scope="module")
def world(tmp_path_factory, minilm_path):
    """(toy world, its corpus, the retriever folder): MiniLM saved as a trained dual encoder."""
    from rlm.retriever.encoder import DualEncoder

    root = tmp_path_factory.mktemp("artifacts")
    built = build_toy_world(root / "world", num_passages=120, seed=0, max_questions={"dev": 12})
    DualEncoder.from_pretrained(minilm_path).save_pretrained(root / "retriever")
    return built, load_corpus(built.corpus), root / "retriever"


def evaluate_args(world, *extra: str) -> list[str]:
    built, _, retriever = world
    argv = ["evaluate", "--retriever", str(retriever), "--retrieval-only", "--dataset", "toy"]
    return [*argv, "--data-path", str(built.root), "--k", "5", "--no-progress", *extra]


def test_an_index_and_its_embeddings_moved_together_serve_rlm_evaluate_the_same_answers(
    world, tmp_path, capsys
):
    """`rlm embed` then `rlm index --rescore` in one folder, the folder moved (another disk, another machine):
    `rlm evaluate --index` retrieves exactly what it did. A buffer moved apart from its index is found where
    `--rescore-buffer` says, and the error without it names that option."""
    built, _, retriever = world
    run = tmp_path / "run"
    embed = ["embed", "--corpus", str(built.corpus), "--encoder", str(retriever), "--no-progress"]
    assert main([*embed, "--out", str(run / "embeddings")]) == 0
    index = ["index", "--buffer", str(run / "embeddings"), "--factory", "IVF4,Flat", "--rescore", "2"]
    assert main([*index, "--out", str(run / "index")]) == 0

    def retrieved(folder, *extra):
        out = tmp_path / f"eval{len(list(tmp_path.glob('eval*')))}"
        assert main(evaluate_args(world, "--index", str(folder), *extra, "--out", str(out))) == 0
        return [
            json.loads(line)["retrieved_ids"] for line in (out / "predictions.jsonl").read_text().splitlines()
        ]

    before = retrieved(run / "index")
    run.rename(tmp_path / "moved")
    assert retrieved(tmp_path / "moved" / "index") == before
    (tmp_path / "moved" / "embeddings").rename(tmp_path / "apart")
    capsys.readouterr()
    assert main(evaluate_args(world, "--index", str(tmp_path / "moved" / "index"))) == 2
    assert "--rescore-buffer DIR" in capsys.readouterr().err
    assert retrieved(tmp_path / "moved" / "index", "--rescore-buffer", str(tmp_path / "apart")) == before
    assert main(evaluate_args(world, "--rescore-buffer", str(tmp_path / "apart"))) == 2
    assert "--rescore-buffer goes with --index DIR" in capsys.readouterr().err


def test_rlm_evaluate_refuses_a_corpus_above_the_limit_in_one_line_naming_the_commands(
    world, capsys, monkeypatch
):
    """Before any model loads: hours of embedding and an exact index of 21M rows are not started by accident."""
    import rlm.inference.checkpoint

    built, _, retriever = world

    def no_loading(*args, **kwargs):
        raise AssertionError("the refusal comes before the models load")

    monkeypatch.setattr(rlm.inference.checkpoint, "load_checkpoint", no_loading)
    assert main(evaluate_args(world, "--embed-limit", "100")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    assert f"{built.corpus} holds 120 passages, more than the 100 `rlm evaluate` embeds" in err
    assert f"`rlm embed --corpus {built.corpus} --encoder {retriever} --out EMBEDDINGS`" in err
    assert "`rlm index --buffer EMBEDDINGS --out INDEX --factory" in err and "pass --index INDEX" in err
    assert main(evaluate_args(world, "--embed-limit", "-1")) == 2
    assert "--embed-limit is a number of passages" in capsys.readouterr().err


def test_the_demo_refuses_to_embed_a_corpus_above_the_limit_unless_its_index_is_cached(
    world, tmp_path, monkeypatch
):
    """The demo's own index: refused above the limit (naming the checkpoint's retriever), but one already cached
    (here, where an earlier version cached it: inside the checkpoint, read and never written) is served."""
    from rlm.inference import indexing
    from rlm.inference.index_cache import INDEX_CACHE, cached_index
    from rlm.retriever.encoder import SentenceEncoder

    _, corpus, retriever = world
    tower = SentenceEncoder.from_pretrained(retriever / "passage_tower")
    checkpoint = retriever.parent
    with pytest.raises(UserError, match=f"more than the 100 `rlm demo` embeds .*--encoder {retriever} "):
        cached_index(tmp_path / "cache", tower, corpus, embed_limit=100, checkpoint=checkpoint)
    old = tmp_path / "old_checkpoint"
    built = cached_index(old, tower, corpus)  # laid out as an earlier version's checkpoint/demo_index/<key>

    def no_embedding(*args, **kwargs):
        raise AssertionError("the cached index is served, not rebuilt")

    monkeypatch.setattr(indexing, "index_corpus", no_embedding)
    served = cached_index(tmp_path / "cache", tower, corpus, embed_limit=100, checkpoint=old)
    assert served.ntotal == built.ntotal == len(corpus) and not (tmp_path / "cache" / INDEX_CACHE).exists()


def test_rlm_embed_and_rlm_evaluate_share_the_corpus_fingerprint_cache(
    world, tmp_path, hashed_files, rlm_cache
):
    """`rlm embed` hashes a corpus once; `rlm evaluate` over the same file then neither hashes nor parses it
    (the cache in `RLM_CACHE_DIR`); `--cache-dir` moves the cache."""
    from rlm.cache import corpus_fingerprint_cache

    built, _, retriever = world
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(built.corpus.read_text().splitlines(keepends=True)[:10]))
    embed = ["embed", "--corpus", str(corpus), "--encoder", str(retriever), "--no-progress"]
    assert main([*embed, "--out", str(tmp_path / "embeddings")]) == 0
    assert hashed_files == [str(corpus)] and corpus_fingerprint_cache(rlm_cache).is_file()
    refused = evaluate_args(
        world, "--corpus", str(corpus), "--embed-limit", "1"
    )  # stops once the corpus is open
    assert main(refused) == 2
    assert hashed_files == [str(corpus)], "the cached fingerprint is used"
    assert main([*refused, "--cache-dir", str(tmp_path / "elsewhere")]) == 2
    assert hashed_files == [str(corpus)] * 2 and corpus_fingerprint_cache(tmp_path / "elsewhere").is_file()


def test_an_index_rlm_evaluate_builds_is_tuned_at_the_k_it_retrieves(world, tmp_path):
    from rlm.retriever.index import PassageIndex

    argv = evaluate_args(world, "--factory", "IVF4,Flat", "--save-index", str(tmp_path / "ivf"))
    assert main([*argv, "--k", "30"]) == 0  # the last --k wins
    assert PassageIndex.load(tmp_path / "ivf").tuning["k"] == 30


def test_a_prebuilt_index_tuned_for_a_smaller_k_than_it_is_searched_at_is_warned_about(world):
    """Searched at k = 20, an index tuned for recall@5 may miss more of exact search's top 20 than its target
    allowed: the evaluation says so, and how to fix it; not when the user set the search parameter."""
    from rlm.data.qa import load_qa_dataset
    from rlm.inference.evaluation import run_evaluation
    from rlm.retriever.encoder import DualEncoder
    from rlm.retriever.index import PassageIndex

    built, corpus, retriever = world
    vectors = np.random.default_rng(0).standard_normal((len(corpus), 384)).astype(np.float32)
    index = PassageIndex.build(vectors, corpus.ids, "IVF4,Flat")
    index.tune(vectors, k=5, queries=50)
    dev = load_qa_dataset("toy", "dev", built.root)
    towers = DualEncoder.from_pretrained(str(retriever))
    with pytest.warns(UserWarning, match=r"tuned for recall@5 .* searched at k = 20.*--tune-k 20"):
        run_evaluation(dev, corpus, towers, index=index, k=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_evaluation(dev, corpus, towers, index=index, k=5)
        index.set_search_params({"nprobe": 4 if index.tuning["value"] != 4 else 2})
        run_evaluation(dev, corpus, towers, index=index, k=20)


def option_help(command: str, dest: str) -> str:
    parser, _ = build_parser(command)
    (action,) = [a for a in parser._actions if a.dest == dest]
    return action.help


def test_help_texts_state_the_defaults_the_code_uses():
    from rlm.data.toy_world import ToyWorldConfig
    from rlm.inference.indexing import EMBED_LIMIT
    from rlm.retriever.index import (
        QUESTION_FOUND_SHARE,
        QUESTION_FOUND_WITHIN,
        TRAIN_ROWS_PER_LIST,
        TRAIN_SAMPLE,
    )
    from rlm.retriever.index_spec import IndexSpec

    spec = IndexSpec()  # the one description's defaults, in every command's help (tests/test_index_spec.py)
    assert f"(default {spec.factory}; auto: Flat (exact) below 100,000 rows" in option_help(
        "evaluate", "factory"
    )
    assert f"(default {spec.target_recall:g})" in option_help("evaluate", "target_recall")
    assert f"(default {spec.tune_k};" in option_help("demo", "tune_k")
    assert f"{TRAIN_SAMPLE:,}, or {TRAIN_ROWS_PER_LIST} per IVF list" in option_help("index", "train_sample")
    shown = option_help("index", "tune_questions") % {}
    assert f"top {QUESTION_FOUND_WITHIN} for {QUESTION_FOUND_SHARE:.0%} of them" in shown
    defaults = ToyWorldConfig()
    parser, _ = build_parser("toy-world")
    parsed = parser.parse_args(["--out", "x"])
    assert (parsed.num_passages, parsed.num_cities, parsed.twin_rate, parsed.filler_rate) == (
        defaults.num_passages,
        defaults.num_cities,
        defaults.twin_rate,
        defaults.filler_rate,
    )
    for command in ("evaluate", "demo"):
        parser, _ = build_parser(command)
        assert parser.parse_args(["--checkpoint", "c"]).embed_limit == EMBED_LIMIT


def test_rlm_demo_hands_its_cache_limit_and_rescore_buffer_to_the_service():
    from rlm.app.service import ServiceOptions
    from rlm.commands.demo import service_options

    parser, _ = build_parser("demo")
    argv = [
        "--checkpoint",
        "c",
        "--index",
        "i",
        "--rescore-buffer",
        "b",
        "--cache-dir",
        "x",
        "--embed-limit",
        "5",
    ]
    options = service_options(parser.parse_args(argv))
    assert (options.index_path, options.rescore_buffer, options.cache_dir, options.embed_limit) == (
        "i",
        "b",
        "x",
        5,
    )
    with pytest.raises(UserError, match="--rescore-buffer goes with --index"):
        ServiceOptions(rescore_buffer="b")
    with pytest.raises(UserError, match="--embed-limit is a number of passages"):
        ServiceOptions(embed_limit=-1)


def test_the_cache_folder_is_the_option_else_the_environment_else_xdg_else_home(tmp_path, monkeypatch):
    from pathlib import Path

    from rlm.cache import CACHE_ENV, cache_dir

    assert cache_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "rlm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "rlm"
