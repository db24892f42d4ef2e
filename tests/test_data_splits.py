"""train / dev / test as DPR, FiD and the paper name them (rlm.data.splits): test is the published validation,
dev a fixed carve-out of the published train, and no dev or test question is ever a train question."""

import json
import random

import pytest

from rlm.data.qa import dataset_name, load_qa_dataset, load_qa_split
from rlm.data.splits import PROTOCOLS, carve_dev, dev_count, normalize_question
from rlm.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def made_questions(count: int, start: int = 0, tag: str = "q") -> list[dict]:
    return [
        {"question": f"who made thing {tag}{i}", "answer": [f"maker {i}"]}
        for i in range(start, start + count)
    ]


def questions_of(examples) -> set[str]:
    return {normalize_question(ex.question) for ex in examples}


def assert_disjoint(**named):
    names = list(named)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            shared = questions_of(named[first]) & questions_of(named[second])
            assert not shared, f"{first} and {second} share {sorted(shared)[:3]}"


@pytest.fixture
def made_nq(tmp_path):
    """Google's NQ-open layout, made: a train of 2,000 questions that repeats some of its own (other case and
    punctuation) and asks 40 of the test's, and a test of 300."""
    test = made_questions(300, tag="t")
    train = made_questions(2000)
    train += [{"question": f"Who made Thing q{i}?", "answer": ["again"]} for i in range(0, 200, 5)]
    train += [{"question": t["question"].upper() + " ?", "answer": t["answer"]} for t in test[:40]]
    random.Random(0).shuffle(train)
    folder = tmp_path / "nq"
    folder.mkdir()
    write_jsonl(folder / "NQ-open.train.jsonl", train)
    write_jsonl(folder / "NQ-open.dev.jsonl", test)
    return folder, train, test


def test_nq_open_test_is_the_3610_questions_papers_report_and_dev_is_not_them(shared_data):
    test = load_qa_split("nq_open", "test", shared_data / "nq_open")
    assert len(test.examples) == 3610
    assert test.examples[0].question == "when was the last time anyone was on the moon"
    assert test.record()["split"] == "test" and test.record()["questions"] == 3610
    assert "test set ORQA, DPR, FiD and the paper report" in test.source
    # The shared folder has Google's dev file (the literature's test) and no train: dev cannot be made from it,
    # and is never quietly the test set.
    with pytest.raises(UserError, match=r"NQ-open\.train\.jsonl is missing.*dev: 8,757 questions carved out"):
        load_qa_dataset("nq_open", "dev", shared_data / "nq_open")


def test_no_dev_or_test_question_appears_in_train_on_made_files(made_nq):
    folder, train_rows, test_rows = made_nq
    splits = {name: load_qa_split("nq", name, folder) for name in ("train", "dev", "test")}
    train, dev, test = (splits[name].examples for name in ("train", "dev", "test"))
    assert_disjoint(train=train, dev=dev, test=test)
    assert len(test) == 300
    # Every published train row is in train or dev, but the 40 that test asks.
    assert splits["train"].facts["dropped_from_train_as_in_test"] == 40
    assert len(train) + len(dev) + 40 == len(train_rows)
    # Dev: the protocol's share of a 2,080-row sample of the 87,925, counted in distinct questions.
    assert len(questions_of(dev)) == dev_count(PROTOCOLS["nq_open"], len(train_rows)) == 207
    assert splits["dev"].facts["dev_ids"] == splits["train"].facts["dev_ids"]
    assert {ex.id for ex in dev}.isdisjoint(ex.id for ex in train)
    assert all(ex.id.startswith("nq-train-") for ex in train + dev)


def test_the_dev_carve_out_depends_on_the_questions_not_on_their_order_or_ids(made_nq, tmp_path):
    folder, train_rows, test_rows = made_nq
    dev = load_qa_dataset("nq_open", "dev", folder)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    rows = [dict(row, id=f"other-{i}") for i, row in enumerate(reversed(train_rows))]
    write_jsonl(shuffled / "NQ-open.train.jsonl", rows)
    write_jsonl(shuffled / "NQ-open.dev.jsonl", test_rows)
    assert questions_of(load_qa_dataset("nq_open", "dev", shuffled)) == questions_of(dev)
    # A question asked twice (other case, punctuation) lands wholly on one side.
    repeated = normalize_question("Who made Thing q0?")
    assert sum(
        normalize_question(ex.question) == repeated for ex in load_qa_dataset("nq", "dev", folder)
    ) in (
        0,
        2,
    )


def test_the_full_published_train_gives_the_literature_sizes(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    write_jsonl(folder / "NQ-open.train.jsonl", made_questions(87_925))
    write_jsonl(folder / "NQ-open.dev.jsonl", made_questions(3_610, tag="t"))
    sizes = {name: len(load_qa_dataset("nq_open", name, folder)) for name in ("train", "dev", "test")}
    assert sizes == {"train": 79_168, "dev": 8_757, "test": 3_610}  # DPR's NQ split


def test_no_dev_or_test_question_appears_in_train_with_the_shared_nq_files(shared_data, tmp_path):
    """The real NQ-open test (3,610) against a published train made of the real EfficientQA questions plus
    100 test questions as users type them (other case, extra spaces)."""
    nq = shared_data / "nq_open"
    real = [
        json.loads(line)
        for name in ("NQ-open.efficientqa.dev.1.1.jsonl", "NQ-open.efficientqa.test.1.1.jsonl")
        for line in (nq / name).read_text(encoding="utf-8").splitlines()
    ]
    test_rows = [json.loads(line) for line in (nq / "NQ-open.dev.jsonl").read_text().splitlines()]
    leaked = [
        {"question": "  " + r["question"].title() + "?", "answer": r["answer"]} for r in test_rows[::36]
    ]
    folder = tmp_path / "nq"
    folder.mkdir()
    write_jsonl(
        folder / "NQ-open.train.jsonl",
        [{"question": r["question"], "answer": r["answer"]} for r in real] + leaked,
    )
    (folder / "NQ-open.dev.jsonl").write_bytes((nq / "NQ-open.dev.jsonl").read_bytes())
    train, dev, test = (load_qa_split("nq_open", name, folder) for name in ("train", "dev", "test"))
    assert len(test.examples) == 3610
    assert_disjoint(train=train.examples, dev=dev.examples, test=test.examples)
    assert train.facts["dropped_from_train_as_in_test"] >= len(leaked)


@pytest.mark.parametrize("name", ["trivia_qa", "hotpot_qa"])
def test_trivia_qa_and_hotpot_qa_local_copies_take_test_from_validation(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    rows = [{"question": f"question {i}", "answers": [f"answer {i}"]} for i in range(1000)]
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(
        folder / "validation.jsonl", [dict(r, question=f"held out {i}") for i, r in enumerate(rows[:130])]
    )
    train, dev, test = (load_qa_split(name, split, folder) for split in ("train", "dev", "test"))
    assert len(test.examples) == 130 and "validation: the test set" in test.source
    assert len(dev.examples) == dev_count(PROTOCOLS[name], 1000) and len(train.examples) == 1000 - len(
        dev.examples
    )
    assert_disjoint(train=train.examples, dev=dev.examples, test=test.examples)
    # The published split stays reachable by its own name.
    assert len(load_qa_dataset(name, "validation", folder)) == 130


def test_a_folder_of_your_own_splits_is_taken_as_it_is_and_refused_when_they_overlap(tmp_path):
    rows = made_questions(30)
    for split, part in (("train", rows[:20]), ("dev", rows[20:25]), ("test", rows[25:])):
        write_jsonl(tmp_path / f"{split}.jsonl", part)
    assert [len(load_qa_dataset("nq", s, tmp_path)) for s in ("train", "dev", "test")] == [20, 5, 5]
    write_jsonl(tmp_path / "dev.jsonl", rows[20:25] + [{"question": "WHO MADE THING Q3?", "answer": ["x"]}])
    with pytest.raises(
        UserError, match=r"dev\.jsonl asks 'WHO MADE THING Q3\?'.*which train\.jsonl asks too"
    ):
        load_qa_dataset("trivia_qa", "test", tmp_path)


def test_carve_dev_refuses_a_dev_as_large_as_the_train():
    from rlm.data.qa import QAExample

    train = [QAExample(str(i), f"q{i}", ["a"]) for i in range(5)]
    with pytest.raises(UserError, match="cannot carve a dev set of 5 distinct questions from a train of 5"):
        carve_dev(train, [], 5)


@pytest.mark.parametrize(
    "typed, name",
    [
        ("nq", "nq_open"),
        ("NQ-open", "nq_open"),
        ("nq_open", "nq_open"),
        ("tqa", "trivia_qa"),
        ("trivia_qa", "trivia_qa"),
        ("TriviaQA", "trivia_qa"),
        ("hotpotqa", "hotpot_qa"),
        ("hotpot_qa", "hotpot_qa"),
    ],
)
def test_dataset_names_users_type_are_accepted(typed, name):
    assert dataset_name(typed) == name


def test_an_unknown_dataset_lists_the_ones_that_exist():
    with pytest.raises(
        UserError, match=r"unknown QA dataset 'nqopen' \(did you mean nq_open\?\).*tqa = trivia_qa"
    ):
        dataset_name("nqopen")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.dev_split=validation"],
            r"data\.dev_split=validation validates on nq_open's test set \(the 3,610",
        ),
        (["data.dev_split=test"], r"data\.dev_split=test validates on a test set"),
        (["data.train_split=dev"], r"data\.train_split=dev trains on the dev set"),
        (["data.train=tqa", "data.train_split=validation"], r"trains on trivia_qa's test set \(the 11,313"),
    ],
)
def test_training_refuses_to_train_or_validate_on_a_test_set(tmp_path, overrides, message):
    from rlm.components import load_dev_split
    from rlm.config import load_config

    base = [f"data.corpus={tmp_path / 'corpus.jsonl'}", "data.train=nq", "data.dev=nq_open"]
    cfg = load_config(None, base + overrides)
    with pytest.raises(UserError, match=message):
        load_dev_split(cfg)  # refused before any question is loaded


@pytest.mark.parametrize("config", ["nq.yaml", "tqa.yaml", "hotpotqa.yaml"])
def test_the_shipped_paper_configs_validate_on_dev_and_score_test_apart(config):
    from pathlib import Path

    from rlm.components import check_splits
    from rlm.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / config)
    assert (cfg.data.train_split, cfg.data.dev_split) == ("train", "dev")
    check_splits(cfg)


def test_rlm_splits_writes_the_three_splits_and_devs_ids_and_the_folder_loads_as_it_is(
    made_nq, tmp_path, capsys
):
    from rlm.cli import main

    folder, _, _ = made_nq
    out = tmp_path / "nq_splits"
    assert main(["splits", "--dataset", "nq", "--data-path", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    made = {name: load_qa_split("nq", name, folder) for name in ("train", "dev", "test")}
    for name, split in made.items():
        assert f"nq_open {name}: {len(split.examples):,} questions" in printed
        written = load_qa_split("nq_open", name, out)
        assert [(e.id, e.question, e.answers) for e in written.examples] == [
            (e.id, e.question, e.answers) for e in split.examples
        ]
        assert "checked disjoint" in written.source
    assert (out / "dev_ids.txt").read_text().split() == [ex.id for ex in made["dev"].examples]
    records = json.loads((out / "splits.json").read_text())
    assert (
        records["dev"]["dev_ids"]
        == made["dev"].facts["dev_ids"]
        == load_qa_split("nq", "dev", out).facts["dev_ids"]
    )
    assert records["test"]["questions"] == 300
    # A folder holding anything else is refused before anything is written.
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert (
        main(["splits", "--dataset", "nq", "--data-path", str(folder), "--out", str(tmp_path / "busy")]) == 2
    )
    assert "did not write (notes.txt)" in capsys.readouterr().err


def hub_rows(name: str, split: str, count: int) -> list[dict]:
    """Rows in the hub's schema of `name` (the fields the loader reads), `count` of them for `split`."""
    asked = [f"{split} question {i}" for i in range(count)]
    if name == "nq_open":
        return [{"question": q, "answer": [f"a{i}"]} for i, q in enumerate(asked)]
    if name == "trivia_qa":
        answer = {"value": "Paris", "aliases": ["Paris", "City of Light"]}
        return [
            {"question_id": f"tqa-{split}-{i}", "question": q, "answer": answer} for i, q in enumerate(asked)
        ]
    facts = {"title": ["A", "B", "A"], "sent_id": [0, 1, 2]}
    return [
        {
            "id": f"h{split}{i}",
            "question": q,
            "answer": "yes",
            "supporting_facts": facts,
            "type": "bridge",
            "level": "easy",
        }
        for i, q in enumerate(asked)
    ]


@pytest.mark.parametrize("name", ["nq_open", "trivia_qa", "hotpot_qa"])
def test_from_the_hub_test_is_validation_and_dev_is_carved_from_train(monkeypatch, name):
    """The hub's schema through the same protocol (the hub itself is out of reach here: its `load_dataset`
    answers from rows in its schema, with the published split sizes scaled down)."""
    import datasets

    asked = []

    def load_dataset(path, config=None, split=None):
        asked.append((path, config, split))
        return datasets.Dataset.from_list(hub_rows(path, split, {"train": 500, "validation": 40}[split]))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    train, dev, test = (load_qa_split(name, split) for split in ("train", "dev", "test"))
    assert {split for _, _, split in asked} == {"train", "validation"}
    assert {config for _, config, _ in asked} == {
        {"nq_open": None, "trivia_qa": "unfiltered.nocontext"}.get(name, "distractor")
    }
    assert len(test.examples) == 40 and all(q.question.startswith("validation") for q in test.examples)
    assert len(dev.examples) == dev_count(PROTOCOLS[name], 500) and len(train.examples) == 500 - len(
        dev.examples
    )
    assert all(q.question.startswith("train") for q in dev.examples)
    assert "the hub's" in test.source and "carve-out of seed 0" in dev.source
    if name == "trivia_qa":
        assert test.examples[0].answers == ["Paris", "City of Light"]
    if name == "hotpot_qa":
        assert test.examples[0].gold_passage_ids == ["A", "B"]
