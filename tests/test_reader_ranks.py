"""The quickstart's reader picks the gold passage among distractors that state other answers to the same
question when the retriever ranks it first, because it reads each passage's place in the retriever's order
({rank} in its template): moved to the last place, the same gold passage is mostly passed over. A reader
trained from scratch here does not learn to match the question's name with a passage's
(docs/reader_recipe.md, "Why the reader reads ranks instead of names"); the rank is what lets a better retriever show in its answers."""

from __future__ import annotations

import random

import pytest
import torch

from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.data.toy_world import build_toy_world
from rlm.inference.metrics import exact_match
from rlm.reader.fid import FiDConfig, FiDReader
from rlm.reader.formatting import RANKED_TEMPLATE
from rlm.reader.small_t5 import SmallT5Config
from rlm.reader.tokenizer import train_tokenizer
from rlm.training.schedule import lr_lambda

pytestmark = [pytest.mark.slow, pytest.mark.learning]

OPTIONS = {
    "num_cities": 24,
    "question_types": ["born_in", "occupation", "located_in"],
    "filler_rate": 0.0,
    "twin_rate": 0.0,
    "kin_facts": 0,
    "mentions_per_person": 0,
    "split_fractions": [0.8, 0.2, 0.0],
}


@pytest.fixture(scope="module")
def reading_task(tmp_path_factory):
    """(corpus, train, dev, questions by type, tokenizer) of a 1500-passage world without fillers, near-twins
    or kin facts (OPTIONS), so that every question type has many other answers for the distractors."""
    root = build_toy_world(
        tmp_path_factory.mktemp("ranks") / "world", num_passages=1500, seed=3, **OPTIONS
    ).root
    corpus = load_corpus(root / "corpus.jsonl")
    train, dev = (load_qa_dataset("toy", split, str(root)) for split in ("train", "dev"))
    same_type = {}
    for q in train + dev:
        same_type.setdefault(q.meta["type"], []).append(q)
    texts = [f"{p.title} {p.text}" for p in corpus] + [q.question for q in train] + ["rank: 1 2 3 4"] * 5
    return corpus, train, dev, same_type, train_tokenizer(texts, vocab_size=4000)


def reading_lists(corpus, questions, same_type, rng, gold_first: float):
    """Gold + 3 other entities' passages of the asked relation (other answers); gold first with probability
    `gold_first`, else at a random place, as a retriever that usually ranks it first would give them."""
    out = []
    for q in questions:
        gold = corpus[corpus.index_of(q.gold_passage_ids[0])]
        others = [o for o in same_type[q.meta["type"]] if o.answers != q.answers]
        picked = [corpus[corpus.index_of(o.gold_passage_ids[0])] for o in rng.sample(others, 3)]
        at = 0 if rng.random() < gold_first else rng.randrange(4)
        picked.insert(at, gold)
        out.append([(p.title, p.text) for p in picked])
    return out


def train_reader(reading_task, template: str, steps: int = 400, copy_steps: int = 150) -> FiDReader:
    corpus, train, dev, same_type, tok = reading_task
    # The quickstart's reader (configs/quickstart.yaml), learning rate and schedule: 30 steps of warm-up, then a
    # linear decay to a tenth. At a constant rate the reader is still hopping between solutions at step 400
    # (held-out EM with the gold first 51-54% on two kernel families, 82-94% on others, 0.41-0.94 along one
    # run); the decay lets every family settle.
    config = SmallT5Config(d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32, dropout_rate=0.0)
    reader = FiDReader.from_config(tok, config, FiDConfig(template=template, max_passage_length=40), seed=0)
    optimizer = torch.optim.AdamW(reader.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(30, steps))
    rng = random.Random(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(steps):
            batch = rng.sample(train, 16)
            # The quickstart's recipe in small: copy from the gold passage alone, then read the top-4.
            lists = (
                [[(corpus[corpus.index_of(q.gold_passage_ids[0])].title, corpus[corpus.index_of(q.gold_passage_ids[0])].text)] for q in batch]
                if step < copy_steps
                else reading_lists(corpus, batch, same_type, rng, gold_first=0.9)
            )  # fmt: skip
            loss = reader(
                **reader.collator([q.question for q in batch], lists, [q.answers[0] for q in batch])
            ).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
    return reader


def exact_match_reading(reading_task, reader, gold_last: bool) -> float:
    corpus, _, dev, same_type, _ = reading_task
    held_out = dev[:80]
    lists = reading_lists(corpus, held_out, same_type, random.Random(1), gold_first=1.0)
    if gold_last:
        lists = [plist[1:] + plist[:1] for plist in lists]
    answers = reader.answer([q.question for q in held_out], lists, batch_size=40)
    return sum(exact_match(a, q.answers) for a, q in zip(answers, held_out)) / len(held_out)


@pytest.fixture
def one_thread():
    """The same float sums whatever thread count earlier tests left: 400 steps from scratch follow them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_reader_that_reads_the_ranks_picks_the_gold_among_other_answers(reading_task, one_thread):
    reader = train_reader(reading_task, RANKED_TEMPLATE)
    # Held-out people; each list holds four answers to the question.
    first = exact_match_reading(reading_task, reader, gold_last=False)
    last = exact_match_reading(reading_task, reader, gold_last=True)
    # Four answers to each question: copying one at random gets 25%. With the schedule, 400 steps land at
    # 88.75-97.5% with the gold first and 0% with it last over seeds 0-2 and the default, avx2 and avx512
    # kernel families (this test's seed: 88.75 / 90.0 / 93.75%; at a constant rate it was 51-54% on two
    # families); `make test-kernels` runs it under each.
    assert first >= 0.75, (first, last)
    assert last <= 0.1, (first, last)
