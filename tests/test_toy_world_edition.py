"""The toy world's next edition (`rlm toy-world --next-edition-of`): every change is a real edit of the world's
own passages, each question about it is answered by the edition's text, and nothing else moves."""

from __future__ import annotations

import json

import pytest

from rlm.cli import main
from rlm.data.toy_world import build_toy_world
from rlm.data.toy_world_edition import CHANGES, build_toy_world_edition


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_toy_world(tmp_path_factory.mktemp("world"), num_passages=3000, seed=0, kin_facts=2).root


@pytest.fixture(scope="module")
def edition(world, tmp_path_factory):
    return build_toy_world_edition(world, tmp_path_factory.mktemp("edition") / "ed", per_change=5, seed=1)


def test_replaced_and_deleted_passages_are_the_worlds_own_and_new_ones_are_new(world, edition):
    corpus = {p["id"]: p for p in rows(world / "corpus.jsonl")}
    added = rows(edition.add)
    new = [p for p in added if p["id"] not in corpus]
    replaced = [p for p in added if p["id"] in corpus]
    made = json.loads(edition.manifest.read_text())
    assert len(new) == made["added"] == 15 and len(replaced) == made["replaced"] > 0
    assert len({p["id"] for p in added}) == len(added)  # one line per id
    for passage in replaced:  # the world redrawn from world.json names the very entity the passage is about
        old = corpus[passage["id"]]
        assert old["text"] != passage["text"]
        assert old["title"] == passage["title"] or passage["title"] not in corpus_titles(corpus)
    deleted = edition.delete.read_text().split()
    assert len(deleted) == made["deleted"] == 15 and set(deleted) <= set(corpus)
    assert not set(deleted) & {p["id"] for p in added}


def corpus_titles(corpus: dict) -> set[str]:
    return {p["title"] for p in corpus.values()}


def test_each_question_is_answered_by_the_edition_and_a_removed_persons_by_nothing(edition):
    added = {p["id"]: p for p in rows(edition.add)}
    deleted = set(edition.delete.read_text().split())
    questions = rows(edition.dev)
    assert {q["meta"]["change"] for q in questions} == set(CHANGES)
    for q in questions:
        if q["meta"]["change"] == "removed":
            assert q["gold_passage_ids"] == []
            continue
        (gold,) = q["gold_passage_ids"]
        assert gold in added and gold not in deleted
        assert q["answers"][0] in added[gold]["text"] and q["meta"]["subject"] in added[gold]["text"]


def test_unchanged_dev_questions_are_the_worlds_own_whose_gold_no_change_touches(world, edition):
    edited = set(edition.delete.read_text().split()) | {p["id"] for p in rows(edition.add)}
    unchanged = rows(edition.unchanged_dev)
    dev = {q["id"]: q for q in rows(world / "dev.jsonl")}
    assert unchanged and all(q == dev[q["id"]] for q in unchanged)
    assert not any(edited & set(q["gold_passage_ids"]) for q in unchanged)
    assert len(unchanged) < len(dev)  # some dev questions were about what changed


def test_the_edition_is_a_function_of_the_world_and_its_seed(world, edition, tmp_path):
    again = build_toy_world_edition(world, tmp_path / "again", per_change=5, seed=1)
    assert again.add.read_bytes() == edition.add.read_bytes()
    assert again.dev.read_bytes() == edition.dev.read_bytes()
    other = build_toy_world_edition(world, tmp_path / "other", per_change=5, seed=2)
    assert other.add.read_bytes() != edition.add.read_bytes()


def test_the_command_writes_an_edition_and_refuses_a_world_too_small_or_missing(world, tmp_path, capsys):
    out = tmp_path / "ed"
    assert main(["toy-world", "--next-edition-of", str(world), "--out", str(out), "--per-change", "3"]) == 0
    assert "passages added" in capsys.readouterr().out and (out / "add.jsonl").is_file()
    assert (
        main(
            [
                "toy-world",
                "--next-edition-of",
                str(world),
                "--out",
                str(tmp_path / "x"),
                "--per-change",
                "500",
            ]
        )
        == 2
    )
    assert "too small" in capsys.readouterr().err
    assert main(["toy-world", "--next-edition-of", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "holds no toy world" in capsys.readouterr().err


def test_an_edition_asks_only_what_the_world_asks_and_still_edits_the_rest(tmp_path):
    """A reader trained on a world's questions can write only their kinds of answers: the quickstart's world asks
    birthplaces, occupations and cities, so an employer that changed edits the corpus and is not asked about."""
    asked = ("born_in", "occupation", "located_in")
    world = build_toy_world(tmp_path / "w", num_passages=3000, seed=0, kin_facts=0, question_types=asked).root
    edition = build_toy_world_edition(world, tmp_path / "ed", per_change=5, seed=1)
    questions = rows(edition.dev)
    assert {q["meta"]["type"] for q in questions} <= set(asked)
    made = json.loads(edition.manifest.read_text())
    assert made["questions"]["changed_employer"] == 0 and made["questions"]["changed_occupation"] == 5
    employed = [p for p in rows(edition.add) if "employed by" in p["text"] or "works for" in p["text"]]
    assert employed  # the new people's employers and the changed ones, in the corpus all the same
