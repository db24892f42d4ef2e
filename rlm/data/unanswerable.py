"""Questions a toy world's corpus does not answer, for fitting and measuring abstention (`rlm.inference.answer_policy`).

Two kinds per split, written to `<world>/<split>_unanswerable.jsonl` with `"answers": []`:

* `unstated_fact`: a fact the world never states, about one of the split's own people or organisations
  ("Who is the spouse of X?"). The hard case: the retriever finds X's passages, and none holds the answer.
  dev and test ask with disjoint wordings, so a rule fitted on dev is measured on relations it never saw.
* `unknown_entity`: the world's own question wordings about a person or organisation that does not exist in
  it (an invented name no passage carries), so the passages found are about somebody else.

They are a deterministic function of the world folder (its seed, corpus titles and split questions) and are
generated beside an existing world without changing any of its files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from rlm.base.atomicio import atomic_open
from rlm.errors import UserError

KINDS = ("unstated_fact", "unknown_entity")
_PERSON_TYPES = ("born_in", "works_for", "occupation", "employer_city")
# Half of them ask for a kind of answer the world's questions never ask for (a year, a date, a number, a person):
# a reader that knows only birthplaces and jobs answers those with a place or a job, and the answer policy learns
# from these that an answer of the wrong kind is a wrong answer (`rlm.inference.answer_kinds`).
_UNSTATED = {
    "dev": {
        "person": (
            "Who is the spouse of {s}?",
            "Which school did {s} attend?",
            "What is the favourite food of {s}?",
            "How old is {s}?",
            "In what year was {s} born?",
            "When did {s} get married?",
            "How many children does {s} have?",
        ),
        "org": (
            "How many employees does {s} have?",
            "Who is the chief executive of {s}?",
            "In which year was {s} founded?",
        ),
    },
    "test": {
        "person": (
            "What car does {s} drive?",
            "Which language does {s} speak at home?",
            "Who is the best friend of {s}?",
            "What instrument does {s} play?",
            "What year did {s} retire?",
            "On what date did {s} move house?",
            "How tall is {s}?",
        ),
        "org": (
            "What does {s} sell?",
            "What is the annual revenue of {s}?",
            "In what month did {s} open its first shop?",
        ),
    },
}


def unanswerable_path(world_dir: str | os.PathLike, split: str) -> Path:
    """Where the split's unanswerable questions are (or will be) written."""
    return Path(world_dir) / f"{split}_unanswerable.jsonl"


def write_unanswerable_questions(
    world_dir: str | os.PathLike, split: str, questions, per_kind: int = 100, overwrite: bool = False
) -> Path:
    """Write `per_kind` questions of each kind for `split` ("dev" or "test") of the toy world in `world_dir`,
    whose questions of that split (`rlm.data.qa.QAExample`s: their subjects are asked about) are `questions`.

    Kept when already there (unless `overwrite`): the file depends on the world alone."""
    from rlm.data.toy_world import _QUESTION_TEMPLATES, _Names

    if split not in _UNSTATED:
        raise UserError(f"unanswerable questions are made for dev and test, not {split!r}")
    root = Path(world_dir)
    out = unanswerable_path(root, split)
    if out.is_file() and not overwrite:
        return out
    manifest = root / "world.json"
    if not manifest.is_file():
        raise UserError(f"{root} is not a toy world folder (no world.json)")
    world = json.loads(manifest.read_text())
    titles = set()
    with open(root / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            titles.add(json.loads(line)["title"])
    subjects = asked_subjects(questions)
    asked = {"person": [], "org": []}
    for qtype in world["config"]["question_types"]:
        asked["person" if qtype in _PERSON_TYPES else "org"].append(qtype)
    rng = random.Random(f"unanswerable:{world['config']['seed']}:{split}")
    names = _Names(rng)
    names.used |= titles
    records = []
    for n in range(per_kind):
        kind = "person" if not subjects["org"] or (subjects["person"] and n % 3) else "org"
        subject = rng.choice(subjects[kind])
        question = rng.choice(_UNSTATED[split][kind]).format(s=subject)
        records.append(_record(question, "unstated_fact", subject))
    for n in range(per_kind):
        kind = "person" if not asked["org"] or (asked["person"] and n % 3) else "org"
        subject = names.person(rng.choice("fm")) if kind == "person" else names.org()
        template = rng.choice(_QUESTION_TEMPLATES[rng.choice(asked[kind])])
        records.append(_record(template.format(s=subject), "unknown_entity", subject))
    with atomic_open(out) as f:
        for i, record in enumerate(records):
            f.write(json.dumps({"id": f"{split}-unanswerable-{i:05d}", **record}, ensure_ascii=False) + "\n")
    return out


def asked_subjects(questions) -> dict[str, list[str]]:
    """The people and the organisations a toy world's questions (`QAExample`s) ask about, each once, in order."""
    subjects = {"person": [], "org": []}
    for q in questions:
        kind = "person" if q.meta.get("type") in _PERSON_TYPES else "org"
        if q.meta.get("subject") not in subjects[kind]:
            subjects[kind].append(q.meta["subject"])
    return subjects


def _record(question: str, kind: str, subject: str) -> dict:
    return {
        "question": question,
        "answers": [],
        "gold_passage_ids": [],
        "meta": {"type": kind, "subject": subject, "answerable": False},
    }
