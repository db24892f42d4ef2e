import json

import pytest

from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.data.toy_world import QUESTION_TYPES, build_toy_world
from rlm.inference.metrics import has_answer


@pytest.fixture(scope="module")
def toy_world_3000(tmp_path_factory):
    """The generator's world at its default options and 3000 passages, seed 3: large enough for the statistics
    tested here (split sizes, near-twin names, question types) to hold. Its own, not the session's tiny world,
    since what is tested is the generator itself."""
    return build_toy_world(tmp_path_factory.mktemp("toy"), num_passages=3000, seed=3)


def test_exact_size_and_deterministic(toy_world_3000, tmp_path):
    corpus = load_corpus(toy_world_3000.corpus)
    assert len(corpus) == 3000
    again = build_toy_world(tmp_path / "again", num_passages=3000, seed=3)
    for name in ("corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "world.json"):
        assert (toy_world_3000.root / name).read_bytes() == (again.root / name).read_bytes(), name
    other = build_toy_world(tmp_path / "other", num_passages=3000, seed=4)
    assert other.corpus.read_bytes() != toy_world_3000.corpus.read_bytes()


def test_gold_passages_support_the_answer(toy_world_3000):
    corpus = load_corpus(toy_world_3000.corpus)
    for split in ("train", "dev", "test"):
        for q in load_qa_dataset("toy", split, toy_world_3000.root):
            gold = [corpus[corpus.index_of(pid)] for pid in q.gold_passage_ids]
            assert len(gold) == q.meta["hops"]
            # The answer is in the last hop's passage; the first hop names the bridge entity.
            assert has_answer(gold[-1].text, q.answers), (q, gold)
            assert q.meta["subject"] in q.question and gold[0].title == q.meta["subject"]
            # Not guessable from the question text: the answer never appears in it.
            assert not has_answer(q.question, q.answers)


def test_dev_and_test_use_held_out_entities(toy_world_3000):
    corpus = load_corpus(toy_world_3000.corpus)
    splits = {s: load_qa_dataset("toy", s, toy_world_3000.root) for s in ("train", "dev", "test")}
    titles = {
        s: {corpus[corpus.index_of(pid)].title for q in qs for pid in q.gold_passage_ids}
        for s, qs in splits.items()
    }
    assert not titles["train"] & titles["dev"] and not titles["train"] & titles["test"]
    assert not titles["dev"] & titles["test"]
    assert {q.meta["type"] for q in splits["dev"]} == set(QUESTION_TYPES)
    assert 0.05 < len(splits["dev"]) / len(splits["train"]) < 0.25


def test_passages_are_short_and_twins_exist(toy_world_3000):
    corpus = load_corpus(toy_world_3000.corpus)
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


def test_manifest_and_options(toy_world_3000, tmp_path):
    manifest = json.loads(toy_world_3000.manifest.read_text())
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


KIN_VERBS = {
    "born_in": "was born in",
    "occupation": "works as",
    "located_in": ("is located in", "is headquartered in"),
}


def _kin_passages(corpus, subject: str, by_title: dict | None = None) -> list[str]:
    """Texts that state a relative's fact about `subject` ("The mother of X ...", "X's uncle ..."); `by_title`
    (from `_by_title`) saves a scan of the corpus per subject."""
    from rlm.data.toy_world import _ORG_KIN, _PERSON_KIN

    starts = [f"The {kin} of {subject} " for kin in _PERSON_KIN + _ORG_KIN]
    starts += [f"{subject}'s {kin} " for kin in _PERSON_KIN + _ORG_KIN]
    passages = corpus if by_title is None else by_title.get(subject, [])
    return [p.text for p in passages if p.title == subject and p.text.startswith(tuple(starts))]


def _by_title(corpus) -> dict:
    by_title = {}
    for p in corpus:
        by_title.setdefault(p.title, []).append(p)
    return by_title


def test_kin_facts_restate_each_asked_relation_about_a_relative_never_with_the_answer(
    toy_world_3000, tmp_path
):
    plain = load_corpus(toy_world_3000.corpus)
    by_title = _by_title(plain)
    assert not any(_kin_passages(plain, p.title, by_title) for p in list(plain)[:300])
    types = ("born_in", "occupation", "located_in")
    kin = build_toy_world(
        tmp_path / "kin",
        1500,
        seed=2,
        question_types=types,
        kin_facts=3,
        twin_rate=0.0,
        mentions_per_person=0,
    )
    corpus = load_corpus(kin.corpus)
    assert len(corpus) == 1500
    questions = load_qa_dataset("toy", "train", kin.root)
    assert {q.meta["type"] for q in questions} == set(types)
    by_title = _by_title(corpus)
    for q in questions:
        texts = _kin_passages(corpus, q.meta["subject"], by_title)
        # Three per asked relation of the subject's kind (a person: born_in and occupation; an organisation:
        # located_in), none about works_for, which no question asks.
        assert len(texts) == (3 if q.meta["type"] == "located_in" else 6), (q, texts)
        verbs = KIN_VERBS[q.meta["type"]]
        same_relation = [
            t for t in texts if any(v in t for v in (verbs if isinstance(verbs, tuple) else (verbs,)))
        ]
        assert len(same_relation) == 3, (q, texts)
        assert not any(has_answer(t, q.answers) for t in same_relation), q
        assert not any("works for" in t for t in texts)
    # A tiny world with many passages per entity fits exactly (organisations round up per split).
    tiny = build_toy_world(tmp_path / "tiny", 150, seed=0, question_types=types, kin_facts=5)
    assert len(load_corpus(tiny.corpus)) == 150
    with pytest.raises(ValueError, match="kin_facts"):
        build_toy_world(tmp_path / "bad", 500, kin_facts=-1)


@pytest.mark.slow
def test_kin_facts_defeat_the_off_the_shelf_retriever(tmp_path):
    """The premise of the quickstart's world: all-MiniLM-L6-v2 ranks a relative's fact, worded like the question,
    above the subject's own paraphrased fact, so its top-4 misses the answer far more often with kin facts."""
    import torch

    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    encoder = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=48)
    recall = {}
    for kin in (0, 5):
        paths = build_toy_world(
            tmp_path / str(kin),
            1200,
            seed=0,
            num_cities=24,
            question_types=("born_in", "occupation", "located_in"),
            filler_rate=0.0,
            twin_rate=0.0,
            kin_facts=kin,
            mentions_per_person=0,
            max_questions={"dev": 60},
        )
        corpus = load_corpus(paths.corpus)
        dev = load_qa_dataset("toy", "dev", paths.root)
        with torch.no_grad():
            passages = encoder.encode(list(corpus.retrieval_texts()), batch_size=128)
            queries = encoder.encode([q.question for q in dev], batch_size=128)
        top = (queries @ passages.T).topk(4, dim=-1).indices.tolist()
        hits = [any(has_answer(corpus[r].text, q.answers) for r in rows) for q, rows in zip(dev, top)]
        recall[kin] = sum(hits) / len(hits)
    assert recall[0] >= 0.9 and recall[5] <= 0.7, recall


def test_scales_to_100k_passages_quickly(tmp_path):
    import time

    start = time.perf_counter()
    paths = build_toy_world(
        tmp_path / "big", 100_000, seed=1, max_questions={"train": 1000, "dev": 100, "test": 100}
    )
    assert time.perf_counter() - start < 30
    with open(paths.corpus, "rb") as f:
        assert sum(1 for _ in f) == 100_000
