import json

import pytest

from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.data.toy_world import QUESTION_TYPES, build_toy_world
from rlm.metrics import has_answer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_toy_world(tmp_path_factory.mktemp("toy"), num_passages=3000, seed=3)


def test_exact_size_and_deterministic(world, tmp_path):
    corpus = load_corpus(world.corpus)
    assert len(corpus) == 3000
    again = build_toy_world(tmp_path / "again", num_passages=3000, seed=3)
    for name in ("corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "world.json"):
        assert (world.root / name).read_bytes() == (again.root / name).read_bytes(), name
    other = build_toy_world(tmp_path / "other", num_passages=3000, seed=4)
    assert other.corpus.read_bytes() != world.corpus.read_bytes()


def test_gold_passages_support_the_answer(world):
    corpus = load_corpus(world.corpus)
    for split in ("train", "dev", "test"):
        for q in load_qa_dataset("toy", split, world.root):
            gold = [corpus[corpus.index_of(pid)] for pid in q.gold_passage_ids]
            assert len(gold) == q.meta["hops"]
            # The answer is in the last hop's passage; the first hop names the bridge entity.
            assert has_answer(gold[-1].text, q.answers), (q, gold)
            assert q.meta["subject"] in q.question and gold[0].title == q.meta["subject"]
            # Not guessable from the question text: the answer never appears in it.
            assert not has_answer(q.question, q.answers)


def test_dev_and_test_use_held_out_entities(world):
    corpus = load_corpus(world.corpus)
    splits = {s: load_qa_dataset("toy", s, world.root) for s in ("train", "dev", "test")}
    titles = {
        s: {corpus[corpus.index_of(pid)].title for q in qs for pid in q.gold_passage_ids}
        for s, qs in splits.items()
    }
    assert not titles["train"] & titles["dev"] and not titles["train"] & titles["test"]
    assert not titles["dev"] & titles["test"]
    assert {q.meta["type"] for q in splits["dev"]} == set(QUESTION_TYPES)
    assert 0.05 < len(splits["dev"]) / len(splits["train"]) < 0.25


def test_passages_are_short_and_twins_exist(world):
    corpus = load_corpus(world.corpus)
    lengths = [len(text.split()) for text in corpus.retrieval_texts()]
    assert min(lengths) >= 8 and max(lengths) <= 40
    assert 12 <= sum(lengths) / len(lengths) <= 25
    names = {p.title for p in corpus if " " in p.title}
    # Near-duplicate names: same first name, surname one letter apart.
    near = sum(
        1
        for name in names
        for other in names
        if name < other
        and name.split()[0] == other.split()[0]
        and len(name) == len(other)
        and sum(a != b for a, b in zip(name, other)) == 1
    )
    assert near > 0.1 * len(names)


def test_manifest_and_options(world, tmp_path):
    manifest = json.loads(world.manifest.read_text())
    assert manifest["counts"]["passages"] == 3000
    assert len(manifest["answer_vocab"]["cities"]) == 24
    small = build_toy_world(
        tmp_path / "s", 500, seed=0, question_types=("born_in",), num_cities=8, max_questions={"dev": 5}
    )
    dev = load_qa_dataset("toy", "dev", small.root)
    assert len(dev) == 5 and {q.meta["type"] for q in dev} == {"born_in"}
    assert {q.answers[0] for q in load_qa_dataset("toy", "train", small.root)} <= set(
        json.loads(small.manifest.read_text())["answer_vocab"]["cities"]
    )
    with pytest.raises(ValueError, match="unknown question types"):
        build_toy_world(tmp_path / "bad", 500, question_types=("color",))
    with pytest.raises(ValueError, match="num_passages must be at least 100"):
        build_toy_world(tmp_path / "bad", 50)


def test_scales_to_100k_passages_quickly(tmp_path):
    import time

    start = time.perf_counter()
    paths = build_toy_world(
        tmp_path / "big", 100_000, seed=1, max_questions={"train": 1000, "dev": 100, "test": 100}
    )
    assert time.perf_counter() - start < 30
    with open(paths.corpus, "rb") as f:
        assert sum(1 for _ in f) == 100_000
