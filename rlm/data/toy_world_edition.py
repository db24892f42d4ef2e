"""The toy world's next edition: what changed in the world since its corpus was written, as a corpus update.

A world changes the way an encyclopedia does, and each change is a kind of edit a living corpus must take:

* **new** people join organisations of the world: their three fact passages are added (new ids);
* **moved**: an organisation's head office moved to another city: its `located_in` passage is replaced (same id,
  new text);
* **changed occupation**: a person took up another occupation: the `occupation` passage is replaced;
* **changed employer**: a person works for another organisation now: the `works_for` passage is replaced;
* **renamed**: an organisation took a new name: its own fact passages and its employees' `works_for` passages
  are replaced, all naming it by the new name;
* **removed**: people left the world: their fact passages are deleted.

Everything is drawn from the dev split's entities (and the new people join dev organisations), so the questions
about the edition are held out like the world's own dev questions. A question is asked only of a relation the
world's own questions ask (its `question_types`): a reader trained on them can write its answers (a change of a
relation the world never asks about, e.g. an employer in the quickstart's world, still edits the corpus, and is
asked about in a world whose questions cover it). `build_toy_world_edition(world, out)` writes
`add.jsonl` (the new and the replacing passages, `{id, title, text}`), `delete.txt` (one id a line), `dev.jsonl`
(a question about each change, `meta.change` saying which, the answer the edited world gives; for a removed
person the answer it gave before, which no passage states any more), `unchanged_dev.jsonl` (the world's dev
questions no change touches: what an update must not break) and `edition.json` (the settings and counts).
Deterministic from the world and the edition's seed.
"""

from __future__ import annotations

import io
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from rlm.base.atomicio import atomic_open, atomic_write_text
from rlm.data.toy_world import (
    ToyWorldConfig,
    _asked,
    _CorpusWriter,
    _draw_world,
    _fact_text,
    _Names,
    _Person,
    _question,
    _write_passages,
)
from rlm.errors import UserError

CHANGES = ("new", "moved", "changed_occupation", "changed_employer", "renamed", "removed")


@dataclass(frozen=True)
class EditionPaths:
    """Where an edition's files are."""

    root: Path
    add: Path
    delete: Path
    dev: Path
    unchanged_dev: Path
    manifest: Path


def edition_paths(root: str | os.PathLike) -> EditionPaths:
    root = Path(root)
    return EditionPaths(
        root,
        root / "add.jsonl",
        root / "delete.txt",
        root / "dev.jsonl",
        root / "unchanged_dev.jsonl",
        root / "edition.json",
    )


def _world_as_written(world: Path):
    """The world's entities with the ids of their fact passages, drawn again from world.json's settings exactly
    as `build_toy_world` drew and wrote them (the passages go to a sink: only the ids are kept)."""
    manifest = json.loads((world / "world.json").read_text())
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["config"].items()}
    config = ToyWorldConfig(**settings)
    rng, cities, occupations, persons, orgs = _draw_world(config)
    _write_passages(config, rng, _CorpusWriter(io.StringIO()), persons, orgs, cities, occupations)
    return config, cities, occupations, persons, orgs


class _EditionWriter:
    """The edition's passages: a new id each for added ones, the old id for a replaced one."""

    def __init__(self, f, prefix: str):
        self.f, self.prefix, self.added, self.replaced = f, prefix, 0, set()

    def add(self, title: str, text: str) -> str:
        pid = f"{self.prefix}{self.added:06d}"
        self.added += 1
        return self._write(pid, title, text)

    def replace(self, pid: str, title: str, text: str) -> str:
        self.replaced.add(pid)
        return self._write(pid, title, text)

    def _write(self, pid: str, title: str, text: str) -> str:
        self.f.write(json.dumps({"id": pid, "title": title, "text": text}, ensure_ascii=False) + "\n")
        return pid


def _draw_changes(rng: random.Random, persons, orgs, per_change: int) -> dict[str, list[int]]:
    """Which dev entities each change touches: `per_change` persons for changed_occupation, changed_employer and
    removed, a fifth
    as many organisations (at least one) for moved and renamed (a renamed one's employees' passages change too);
    none touched twice, and a touched organisation's employees and every founder left alone."""
    dev_orgs = [i for i, o in enumerate(orgs) if o.split == "dev"]
    rng.shuffle(dev_orgs)
    per_org_change = max(1, per_change // 5)
    moved, renamed = dev_orgs[:per_org_change], dev_orgs[per_org_change : 2 * per_org_change]
    touched_orgs = set(moved) | set(renamed)
    founders = {o.founder for o in orgs}
    free = [
        i
        for i, p in enumerate(persons)
        if p.split == "dev" and p.works_for not in touched_orgs and i not in founders
    ]
    rng.shuffle(free)
    if len(free) < 3 * per_change or len(dev_orgs) < 2 * per_org_change + 2:
        raise UserError(
            f"the world's dev split ({len(free)} free persons, {len(dev_orgs)} organisations) is too small for "
            f"{per_change} changes of each kind: give a smaller --per-change or a larger world"
        )
    return {
        "moved": moved,
        "renamed": renamed,
        "changed_occupation": free[:per_change],
        "changed_employer": free[per_change : 2 * per_change],
        "removed": free[2 * per_change : 3 * per_change],
    }


def build_toy_world_edition(
    world: str | os.PathLike, out_dir: str | os.PathLike, per_change: int = 10, seed: int = 1
) -> EditionPaths:
    """Write the next edition of the toy world in `world` (a `build_toy_world` folder) into `out_dir`:
    `per_change` new, re-occupied, re-employed and removed people, a fifth as many moved and renamed
    organisations, drawn with `seed`."""
    world, paths = Path(world), edition_paths(out_dir)
    if not (world / "world.json").is_file():
        raise UserError(f"{world} holds no toy world (world.json): make one with `rlm toy-world`")
    if per_change < 1:
        raise UserError(f"per_change must be at least 1, got {per_change}")
    config, cities, occupations, persons, orgs = _world_as_written(world)
    rng = random.Random(f"edition-{seed}")
    changes = _draw_changes(rng, persons, orgs, per_change)
    names = _Names(rng)
    names.used |= {p.name for p in persons} | {o.name for o in orgs} | set(cities)
    asked = frozenset(_asked(config, (*_PERSON_FACTS, "located_in", "founded_by")))
    world_now = _World(rng, names, persons, orgs, cities, occupations, config.filler_rate, asked)
    paths.root.mkdir(parents=True, exist_ok=True)
    with atomic_open(paths.add) as f:
        writer = _EditionWriter(f, prefix=f"twe{seed}-")
        questions = world_now.new_people(writer, per_change, avoid=changes["renamed"])
        questions += world_now.moved(writer, changes["moved"])
        questions += world_now.changed_occupation(writer, changes["changed_occupation"])
        questions += world_now.changed_employer(writer, changes["changed_employer"], avoid=changes["renamed"])
        questions += world_now.renamed(writer, changes["renamed"])
    deleted = [persons[i].passage_ids[r] for i in changes["removed"] for r in _PERSON_FACTS]
    questions += world_now.removed(changes["removed"])
    atomic_write_text(paths.delete, "".join(f"{pid}\n" for pid in deleted))
    _write_questions(paths.dev, questions, "edition-dev")
    unchanged = _unchanged(world / "dev.jsonl", writer.replaced | set(deleted))
    _write_questions(paths.unchanged_dev, unchanged, None)
    counts = {change: sum(q["meta"]["change"] == change for q in questions) for change in CHANGES}
    manifest = {"world": str(world.resolve()), "seed": seed, "per_change": per_change, "questions": counts}
    manifest |= {"added": writer.added, "replaced": len(writer.replaced), "deleted": len(deleted)}
    manifest["unchanged_dev"] = len(unchanged)
    atomic_write_text(paths.manifest, json.dumps(manifest, indent=2) + "\n")
    return paths


_PERSON_FACTS = ("born_in", "works_for", "occupation")


@dataclass
class _World:
    """The world as the edition changes it: each method writes one kind of change and returns its questions."""

    rng: random.Random
    names: _Names
    persons: list[_Person]
    orgs: list
    cities: list[str]
    occupations: list[str]
    filler_rate: float
    asked: frozenset[str]  # the relations the world's questions ask about (`_asked`)

    def _ask(self, qtype: str, subject: str, answer: str, gold: list[str], change: str) -> list[dict]:
        """A question about one change, if the world asks about `qtype` (else none)."""
        if qtype not in self.asked:
            return []
        question = _question(self.rng, qtype, subject, answer, gold)
        question["meta"]["change"] = change
        return [question]

    def _fact(self, relation: str, name: str, obj: str, gender: str | None) -> str:
        return _fact_text(self.rng, relation, name, obj, gender, self.filler_rate)

    def _dev_org(self, avoid) -> int:
        return self.rng.choice([i for i, o in enumerate(self.orgs) if o.split == "dev" and i not in avoid])

    def new_people(self, writer: _EditionWriter, count: int, avoid) -> list[dict]:
        questions = []
        for _ in range(count):
            gender = self.rng.choice("fm")
            person = _Person(self.names.person(gender), gender, "dev")
            person.born_in, person.occupation = (
                self.rng.choice(self.cities),
                self.rng.choice(self.occupations),
            )
            employer = self.orgs[self._dev_org(avoid)].name
            for relation, answer in zip(_PERSON_FACTS, (person.born_in, employer, person.occupation)):
                pid = writer.add(person.name, self._fact(relation, person.name, answer, gender))
                questions += self._ask(relation, person.name, answer, [pid], "new")
        return questions

    def moved(self, writer: _EditionWriter, orgs: list[int]) -> list[dict]:
        questions = []
        for i in orgs:
            org = self.orgs[i]
            org.located_in = self.rng.choice([c for c in self.cities if c != org.located_in])
            pid = writer.replace(
                org.passage_ids["located_in"],
                org.name,
                self._fact("located_in", org.name, org.located_in, None),
            )
            questions += self._ask("located_in", org.name, org.located_in, [pid], "moved")
        return questions

    def changed_employer(self, writer: _EditionWriter, persons: list[int], avoid) -> list[dict]:
        questions = []
        for i in persons:
            person = self.persons[i]
            person.works_for = self._dev_org({*avoid, person.works_for})
            employer = self.orgs[person.works_for].name
            text = self._fact("works_for", person.name, employer, person.gender)
            pid = writer.replace(person.passage_ids["works_for"], person.name, text)
            questions += self._ask("works_for", person.name, employer, [pid], "changed_employer")
        return questions

    def changed_occupation(self, writer: _EditionWriter, persons: list[int]) -> list[dict]:
        questions = []
        for i in persons:
            person = self.persons[i]
            person.occupation = self.rng.choice([o for o in self.occupations if o != person.occupation])
            text = self._fact("occupation", person.name, person.occupation, person.gender)
            pid = writer.replace(person.passage_ids["occupation"], person.name, text)
            questions += self._ask("occupation", person.name, person.occupation, [pid], "changed_occupation")
        return questions

    def renamed(self, writer: _EditionWriter, orgs: list[int]) -> list[dict]:
        """An organisation's new name in its own facts and its employees' `works_for` passages."""
        questions = []
        for i in orgs:
            org = self.orgs[i]
            org.name = self.names.org()
            founder = self.persons[org.founder].name
            for relation, obj in (("located_in", org.located_in), ("founded_by", founder)):
                pid = writer.replace(
                    org.passage_ids[relation], org.name, self._fact(relation, org.name, obj, None)
                )
                questions += self._ask(relation, org.name, obj, [pid], "renamed")
            for person in (p for p in self.persons if p.works_for == i):
                text = self._fact("works_for", person.name, org.name, person.gender)
                pid = writer.replace(person.passage_ids["works_for"], person.name, text)
                questions += self._ask("works_for", person.name, org.name, [pid], "renamed")
        return questions

    def removed(self, persons: list[int]) -> list[dict]:
        """A question about each removed person (of the first fact of theirs the world asks about), its answer
        the one no passage states any more."""
        relation = next((r for r in _PERSON_FACTS if r in self.asked), None)
        if relation is None:
            return []
        answers = {"born_in": lambda p: p.born_in, "occupation": lambda p: p.occupation}
        answers["works_for"] = lambda p: self.orgs[p.works_for].name
        return [
            q
            for i in persons
            for q in self._ask(
                relation, self.persons[i].name, answers[relation](self.persons[i]), [], "removed"
            )
        ]


def _unchanged(dev: Path, edited: set[str]) -> list[dict]:
    """The world's dev questions none of whose gold passages the edition replaces or deletes."""
    questions = [json.loads(line) for line in dev.read_text().splitlines() if line.strip()]
    return [q for q in questions if not edited & set(q["gold_passage_ids"])]


def _write_questions(path: Path, questions: list[dict], prefix: str | None) -> None:
    with atomic_open(path) as f:
        for n, question in enumerate(questions):
            if prefix is not None:
                question["id"] = f"{prefix}-{n:06d}"
            f.write(json.dumps(question, ensure_ascii=False) + "\n")
