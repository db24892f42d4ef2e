"""QA datasets behind one loader: `load_qa_dataset(name, split, path=None) -> list[QAExample]`.

Hub datasets are loaded with `datasets.load_dataset` under their real names (users with internet get exactly
those); each also has a local layout, which is what works offline:

| name | hub (`load_dataset`) | local layout (`path=`) |
| --- | --- | --- |
| `nq_open` | `nq_open` (train / validation) | NQ-open JSONL `{question, answer: [...]}` (a file, or a folder with `NQ-open.<split>.jsonl`) |
| `trivia_qa` | `trivia_qa`, `unfiltered.nocontext` (answers = value + aliases) | JSONL `{question, answers}` |
| `hotpot_qa` | `hotpot_qa`, `distractor` or `fullwiki` (`split="validation"` or `"fullwiki/validation"`) | multihop200 `qa.jsonl` |
| `multihop200` | - | `qa.jsonl` `{id, question, answers, gold_passage_ids, dataset, type}` |
| `jsonl` | - | JSONL `{question, answers}` (+ optional `id`, `gold_passage_ids`; other keys go to `meta`) |
| `toy` | - | a toy-world folder (`rlm toy-world`), `<split>.jsonl`; `dev_unanswerable` / `test_unanswerable`: questions its corpus does not answer, made on first use |
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlm.errors import UserError, not_utf8


@dataclass
class QAExample:
    """One question with its gold answers and, where known, the ids of the passages that support them."""

    id: str
    question: str
    answers: list[str]
    gold_passage_ids: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def _question_id(question: str, line_no: int) -> str:
    return f"q{line_no}-{hashlib.sha1(question.encode('utf-8')).hexdigest()[:8]}"


def _as_answer_list(value, path: Path, line_no: int) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(a, str) for a in value):
        return list(value)
    raise UserError(f"{path}:{line_no}: answers must be a string or a list of strings, got {value!r}")


def read_qa_jsonl(path: str | os.PathLike, allow_empty_answers: bool = False) -> list[QAExample]:
    """Read a QA JSONL file: `{question, answers | answer}` a line, plus optional `id`, `gold_passage_ids`.

    Keys other than these go to `QAExample.meta`. A malformed line, one that is not UTF-8, or a question
    without an answer raises a UserError naming file and line. `allow_empty_answers` is for files of
    questions that have no answer by design (`rlm.data.unanswerable`): there `"answers": []` is the label.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"QA file not found: {path}")
    examples, seen = [], {}
    # Read as bytes and decode line by line: a text-mode read decodes in blocks, so its UnicodeDecodeError
    # cannot say which line holds the bad byte.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise not_utf8(path, line_no, raw) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path}:{line_no}: malformed JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(record, dict) or "question" not in record:
                raise UserError(f"{path}:{line_no}: expected a JSON object with a 'question' key")
            if "answers" in record:
                answers = _as_answer_list(record.pop("answers"), path, line_no)
            elif "answer" in record:
                answers = _as_answer_list(record.pop("answer"), path, line_no)
            else:
                raise UserError(f"{path}:{line_no}: no 'answers' (or NQ-open 'answer') key")
            if not allow_empty_answers and not any(a.strip() for a in answers):
                # Caught here, not as a crash in the middle of training or of an evaluation.
                raise UserError(
                    f"{path}:{line_no}: the question has no answer ({answers!r}); every training and "
                    "evaluation question needs at least one non-empty answer"
                )
            question = str(record.pop("question"))
            qid = str(record.pop("id", None) or _question_id(question, line_no))
            if qid in seen:
                raise UserError(f"{path}: duplicate question id {qid!r} on lines {seen[qid]} and {line_no}")
            seen[qid] = line_no
            gold = record.pop("gold_passage_ids", None) or []
            if not isinstance(gold, list):
                raise UserError(f"{path}:{line_no}: gold_passage_ids must be a list")
            meta = record.pop("meta", None) or {}
            meta.update(record)
            examples.append(QAExample(qid, question, answers, [str(g) for g in gold], meta))
    return examples


def _hub(name: str, config: str | None, split: str, local_hint: str):
    try:
        import datasets

        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # offline: ConnectionError, HF_HUB_OFFLINE errors, missing cache, ...
        raise UserError(
            f"could not load the hub dataset {name!r}"
            + (f" ({config})" if config else "")
            + f" split {split!r}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
            f"Offline, pass path= with the local layout instead: {local_hint}"
        ) from None


def _nq_open(split: str, path: str | None) -> list[QAExample]:
    if path is not None:
        p = Path(path)
        if p.is_dir():
            p = p / f"NQ-open.{split}.jsonl"
        return read_qa_jsonl(p)
    hub_split = {"dev": "validation"}.get(split, split)
    rows = _hub("nq_open", None, hub_split, "an NQ-open JSONL file {question, answer: [...]} or its folder")
    return [QAExample(f"nq-{hub_split}-{i}", r["question"], list(r["answer"])) for i, r in enumerate(rows)]


def _trivia_qa(split: str, path: str | None) -> list[QAExample]:
    if path is not None:
        return read_qa_jsonl(path)
    hub_split = {"dev": "validation"}.get(split, split)
    rows = _hub("trivia_qa", "unfiltered.nocontext", hub_split, "a JSONL file {question, answers: [...]}")
    out = []
    for r in rows:
        answer = r["answer"]
        # value + aliases, deduplicated in order: the aliases are what the TriviaQA EM is computed against.
        answers = list(dict.fromkeys([answer["value"], *answer.get("aliases", [])]))
        out.append(QAExample(r["question_id"], r["question"], answers))
    return out


def _hotpot_qa(split: str, path: str | None) -> list[QAExample]:
    if path is not None:
        examples = read_qa_jsonl(Path(path) / "qa.jsonl" if Path(path).is_dir() else path)
        return [e for e in examples if e.meta.get("dataset", "hotpotqa") == "hotpotqa"]
    config, _, hub_split = split.rpartition("/")
    config = config or "distractor"
    hub_split = {"dev": "validation"}.get(hub_split, hub_split)
    rows = _hub("hotpot_qa", config, hub_split, "the multihop200 folder (qa.jsonl + corpus.jsonl)")
    out = []
    for r in rows:
        # The supporting facts name paragraphs by title; with a corpus keyed by title these are the gold ids.
        gold = list(dict.fromkeys(r["supporting_facts"]["title"]))
        out.append(
            QAExample(r["id"], r["question"], [r["answer"]], gold, {"type": r["type"], "level": r["level"]})
        )
    return out


def _multihop200(split: str, path: str | None) -> list[QAExample]:
    if path is None:
        raise UserError("multihop200 is a local dataset: pass path= its folder (qa.jsonl + corpus.jsonl)")
    p = Path(path)
    return read_qa_jsonl(p / "qa.jsonl" if p.is_dir() else p)


def _jsonl(split: str, path: str | None) -> list[QAExample]:
    if path is None:
        raise UserError("the jsonl dataset needs path= a JSONL file (or a folder holding <split>.jsonl)")
    p = Path(path)
    return read_qa_jsonl(p / f"{split}.jsonl" if p.is_dir() else p)


def _toy(split: str, path: str | None) -> list[QAExample]:
    if path is None:
        raise UserError(
            "the toy dataset needs path= a toy-world folder; make one with `rlm toy-world --out DIR`"
        )
    if split in ("dev_unanswerable", "test_unanswerable"):
        # Questions its corpus does not answer (rlm.data.unanswerable), made beside the world on first use.
        from rlm.data.unanswerable import write_unanswerable_questions

        asked = split.split("_")[0]
        questions = read_qa_jsonl(Path(path) / f"{asked}.jsonl")
        return read_qa_jsonl(write_unanswerable_questions(path, asked, questions), allow_empty_answers=True)
    if split not in ("train", "dev", "test"):
        raise UserError(
            "toy world splits are train, dev and test (and dev_unanswerable, test_unanswerable: questions its "
            f"corpus does not answer), not {split!r}"
        )
    return read_qa_jsonl(Path(path) / f"{split}.jsonl")


DATASETS: dict[str, Callable[[str, str | None], list[QAExample]]] = {
    "nq_open": _nq_open,
    "trivia_qa": _trivia_qa,
    "hotpot_qa": _hotpot_qa,
    "multihop200": _multihop200,
    "jsonl": _jsonl,
    "toy": _toy,
}


def load_qa_dataset(name: str, split: str, path: str | None = None) -> list[QAExample]:
    """Load a QA dataset from the registry (`DATASETS`): the hub under its real name, or a local layout."""
    if name not in DATASETS:
        raise UserError(f"unknown QA dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[name](split, None if path is None else str(path))
