"""QA datasets behind one loader: `load_qa_split(name, split, path=None) -> QASplit`, the questions with what
they are (`QASplit.record()` for a report), and `load_qa_dataset(...)`, the questions alone.

`train`, `dev` and `test` mean what DPR, FiD and the paper mean (`rlm.data.splits`): for the three published
datasets, test is the hub's `validation` and dev a fixed carve-out of the hub's `train`, removed from train.
Any other split name is the published split of that name, as it is (`validation`, NQ's
`efficientqa.dev.1.1`). Hub datasets are loaded with `datasets.load_dataset` under their real names (users with
internet get exactly those); each also has local layouts, which are what works offline:

| name (also) | hub (`load_dataset`) | local layout (`path=`) |
| --- | --- | --- |
| `nq_open` (`nq`) | `nq_open`: train / validation | Google's folder: `NQ-open.train.jsonl`, `NQ-open.dev.jsonl` (= the hub's validation, the literature's test), `NQ-open.<name>.jsonl` |
| `trivia_qa` (`tqa`) | `trivia_qa`, `unfiltered.nocontext` (answers = value + aliases) | `train.jsonl`, `validation.jsonl`: the hub's splits as JSONL `{question, answers}` |
| `hotpot_qa` (`hotpotqa`) | `hotpot_qa`, `distractor` (`fullwiki/<split>` for fullwiki) | `train.jsonl`, `validation.jsonl` as for trivia_qa; or multihop200's `qa.jsonl` (its HotpotQA rows, as given) |
| `multihop200` | - | `qa.jsonl` `{id, question, answers, gold_passage_ids, dataset, type}` |
| `jsonl` | - | JSONL `{question, answers}` (+ optional `id`, `gold_passage_ids`; other keys go to `meta`) |
| `toy` | - | a toy-world folder (`rlm toy-world`), `<split>.jsonl`; `dev_unanswerable` / `test_unanswerable`: questions its corpus does not answer, made on first use |

For every dataset, a folder holding `train.jsonl`, `dev.jsonl` and `test.jsonl` (your own split, or what
`rlm splits` wrote) is taken as it is, after checking that the three ask disjoint questions; a file is the
split asked for, as given.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlm.data.splits import (
    DEV_SEED,
    LITERATURE_SPLITS,
    PROTOCOLS,
    carve_dev,
    dev_count,
    first_overlap,
    ids_digest,
)
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


def read_qa_jsonl(
    path: str | os.PathLike, allow_empty_answers: bool = False, id_prefix: str | None = None
) -> list[QAExample]:
    """Read a QA JSONL file: `{question, answers | answer}` a line, plus optional `id`, `gold_passage_ids`.

    Keys other than these go to `QAExample.meta`. A malformed line, one that is not UTF-8, or a question
    without an answer raises a UserError naming file and line. `allow_empty_answers` is for files of
    questions that have no answer by design (`rlm.data.unanswerable`): there `"answers": []` is the label.
    A question without an `id` gets `<id_prefix>-<n>` (n: its place among the file's questions, from 0, as the
    hub numbers the rows of a dataset without ids), else one made from its line and text.
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
            made_id = f"{id_prefix}-{len(examples)}" if id_prefix else _question_id(question, line_no)
            qid = str(record.pop("id", None) or made_id)
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


@dataclass
class QASplit:
    """A split's questions and what they are: `dataset` and `split` as asked, `source` one phrase saying
    where they come from, `facts` what a report needs to reproduce them (the dev carve-out's seed and ids)."""

    dataset: str
    split: str
    examples: list[QAExample]
    source: str
    facts: dict = field(default_factory=dict)

    def record(self) -> dict:
        """What a report (metrics.json, summary.json, the model card) says of the split."""
        return {
            "dataset": self.dataset,
            "split": self.split,
            "questions": len(self.examples),
            "source": self.source,
            **self.facts,
        }

    def describe(self) -> str:
        return f"{self.dataset} {self.split}: {len(self.examples):,} questions ({self.source})"

    def limited(self, limit: int | None) -> QASplit:
        """The first `limit` questions (all with None), saying so in `facts`."""
        if not limit or limit >= len(self.examples):
            return self
        facts = {**self.facts, "of_questions": len(self.examples)}
        return QASplit(self.dataset, self.split, self.examples[:limit], self.source, facts)


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


def _nq_open_hub(split: str, config: str | None) -> list[QAExample]:
    rows = _hub("nq_open", config, split, "Google's NQ-open folder (NQ-open.train.jsonl, NQ-open.dev.jsonl)")
    return [QAExample(f"nq-{split}-{i}", r["question"], list(r["answer"])) for i, r in enumerate(rows)]


def _trivia_qa_hub(split: str, config: str | None) -> list[QAExample]:
    rows = _hub(
        "trivia_qa",
        config or "unfiltered.nocontext",
        split,
        "a folder with the hub's splits as JSONL {question, answers}: train.jsonl, validation.jsonl",
    )
    out = []
    for r in rows:
        answer = r["answer"]
        # value + aliases, deduplicated in order: the aliases are what the TriviaQA EM is computed against.
        answers = list(dict.fromkeys([answer["value"], *answer.get("aliases", [])]))
        out.append(QAExample(r["question_id"], r["question"], answers))
    return out


def _hotpot_qa_hub(split: str, config: str | None) -> list[QAExample]:
    rows = _hub(
        "hotpot_qa",
        config or "distractor",
        split,
        "a folder with train.jsonl and validation.jsonl, or the multihop200 folder (qa.jsonl)",
    )
    out = []
    for r in rows:
        # The supporting facts name paragraphs by title; with a corpus keyed by title these are the gold ids.
        gold = list(dict.fromkeys(r["supporting_facts"]["title"]))
        out.append(
            QAExample(r["id"], r["question"], [r["answer"]], gold, {"type": r["type"], "level": r["level"]})
        )
    return out


@dataclass(frozen=True)
class PublishedDataset:
    """A dataset published as train + validation on the hub, and the file names of its local copy."""

    read_hub: Callable[[str, str | None], list[QAExample]]  # (published split, hub config) -> questions
    local_file: Callable[[str], str]  # published split -> its file in a local folder
    id_prefix: str | None = None  # ids for a local copy whose rows have none, as the hub numbers them

    def read_local(self, folder: Path, split: str, name: str) -> list[QAExample]:
        path = folder / self.local_file(split)
        if not path.is_file():
            raise UserError(f"{name}: {path} is missing; {_layout_hint(name, folder)}")
        prefix = f"{self.id_prefix}-{split}" if self.id_prefix else None
        examples = read_qa_jsonl(path, id_prefix=prefix)
        if name == "hotpot_qa":  # a multihop200-style file mixes datasets
            examples = [e for e in examples if e.meta.get("dataset", "hotpotqa") == "hotpotqa"]
        return examples


PUBLISHED = {
    # Google's files: NQ-open.dev.jsonl is the hub's validation, the literature's test.
    "nq_open": PublishedDataset(
        _nq_open_hub, lambda split: f"NQ-open.{'dev' if split == 'validation' else split}.jsonl", "nq"
    ),
    "trivia_qa": PublishedDataset(_trivia_qa_hub, lambda split: f"{split}.jsonl"),
    "hotpot_qa": PublishedDataset(_hotpot_qa_hub, lambda split: f"{split}.jsonl"),
}


def _layout_hint(name: str, folder: Path) -> str:
    published = PUBLISHED[name]
    protocol = PROTOCOLS[name]
    train, test = published.local_file("train"), published.local_file(protocol.hub_test)
    return (
        f"{name}'s train and dev are made from {train} (dev: {protocol.dev_size:,} questions carved out of "
        f"it, docs/data.md) and its test is {test}; put them in {folder}, or give a folder of your own "
        "train.jsonl, dev.jsonl and test.jsonl"
    )


def _open_domain_qa(name: str, split: str, path: str | None) -> QASplit:
    """A published dataset's split: the literature's `train` / `dev` / `test` (`rlm.data.splits`), or a
    published split by its own name, from the hub or a local layout."""
    config, _, split = split.rpartition("/")  # hotpot_qa's "fullwiki/test"
    config = config or None
    published = PUBLISHED[name]
    if path is None:
        where = f"the hub's {name}" + (f" ({config})" if config else "")

        def read(published_split: str) -> list[QAExample]:
            return published.read_hub(published_split, config)
    else:
        folder = Path(path)
        if folder.is_file():
            examples = read_qa_jsonl(folder)
            if name == "hotpot_qa":
                examples = [e for e in examples if e.meta.get("dataset", "hotpotqa") == "hotpotqa"]
            return QASplit(name, split, examples, f"{folder}, as given")
        if all((folder / f"{s}.jsonl").is_file() for s in LITERATURE_SPLITS):
            return _own_split(name, split, folder)
        if name == "hotpot_qa" and (folder / "qa.jsonl").is_file():
            examples = published.read_local(folder, "qa", name)
            return QASplit(name, split, examples, f"{folder / 'qa.jsonl'}'s HotpotQA rows, as given")
        where = str(folder)

        def read(published_split: str) -> list[QAExample]:
            return published.read_local(folder, published_split, name)

    if split not in LITERATURE_SPLITS:
        return QASplit(name, split, read(split), f"{where} {split}, the published split as it is")
    return _literature_split(name, split, read, where)


def _literature_split(name: str, split: str, read: Callable[[str], list[QAExample]], where: str) -> QASplit:
    protocol = PROTOCOLS[name]
    test = read(protocol.hub_test)
    if split == "test":
        source = f"{where} {protocol.hub_test}: the test set {protocol.reported_as} report"
        return QASplit(name, split, test, source)
    published_train = read("train")
    carved = carve_dev(published_train, test, dev_count(protocol, len(published_train)), DEV_SEED)
    facts = {
        "published_train": len(published_train),
        "dev_seed": DEV_SEED,
        "dev_questions": len(carved.dev),
        "dev_ids": ids_digest(carved.dev),
        "dropped_from_train_as_in_test": carved.dropped_as_test,
    }
    if split == "dev":
        source = (
            f"{where} train, the carve-out of seed {DEV_SEED} (not the published validation: that is test)"
        )
        return QASplit(name, split, carved.dev, source, facts)
    source = f"{where} train without dev and without the questions test asks"
    return QASplit(name, split, carved.train, source, facts)


def _own_split(name: str, split: str, folder: Path) -> QASplit:
    """`<split>.jsonl` of a folder holding train, dev and test, checked to ask disjoint questions."""
    if split not in LITERATURE_SPLITS:
        if not (folder / f"{split}.jsonl").is_file():
            raise UserError(f"{folder} holds train.jsonl, dev.jsonl and test.jsonl, not {split}.jsonl")
        return QASplit(name, split, read_qa_jsonl(folder / f"{split}.jsonl"), f"{folder / split}.jsonl")
    named = {s: read_qa_jsonl(folder / f"{s}.jsonl") for s in LITERATURE_SPLITS}
    overlap = first_overlap(named)
    if overlap is not None:
        first, ex, second, other = overlap
        raise UserError(
            f"{folder}: {second}.jsonl asks {other.question!r} (id {other.id}), which {first}.jsonl asks too "
            f"(id {ex.id}); a question in two splits scores a model on what it was trained or tuned on: "
            "remove it from one of them"
        )
    source = f"{folder / split}.jsonl, checked disjoint from the folder's other splits"
    return QASplit(name, split, named[split], source, {"dev_ids": ids_digest(named["dev"])})


def _multihop200(name: str, split: str, path: str | None) -> QASplit:
    if path is None:
        raise UserError("multihop200 is a local dataset: pass path= its folder (qa.jsonl + corpus.jsonl)")
    p = Path(path)
    file = p / "qa.jsonl" if p.is_dir() else p
    # HotpotQA and MuSiQue *train* questions with their paragraphs (../shared/data/multihop200/README.txt).
    return QASplit(name, split, read_qa_jsonl(file), f"{file}, as given (one set: no train/dev/test)")


def _jsonl(name: str, split: str, path: str | None) -> QASplit:
    if path is None:
        raise UserError("the jsonl dataset needs path= a JSONL file (or a folder holding <split>.jsonl)")
    p = Path(path)
    if p.is_dir() and all((p / f"{s}.jsonl").is_file() for s in LITERATURE_SPLITS):
        return _own_split(name, split, p)
    file = p / f"{split}.jsonl" if p.is_dir() else p
    return QASplit(name, split, read_qa_jsonl(file), f"{file}, as given")


def _toy(name: str, split: str, path: str | None) -> QASplit:
    if path is None:
        raise UserError(
            "the toy dataset needs path= a toy-world folder; make one with `rlm toy-world --out DIR`"
        )
    if split in ("dev_unanswerable", "test_unanswerable"):
        # Questions its corpus does not answer (rlm.data.unanswerable), made beside the world on first use.
        from rlm.data.unanswerable import write_unanswerable_questions

        asked = split.split("_")[0]
        questions = read_qa_jsonl(Path(path) / f"{asked}.jsonl")
        file = write_unanswerable_questions(path, asked, questions)
        examples = read_qa_jsonl(file, allow_empty_answers=True)
        return QASplit(name, split, examples, f"{file}: questions its corpus does not answer")
    if split not in LITERATURE_SPLITS:
        raise UserError(
            "toy world splits are train, dev and test (and dev_unanswerable, test_unanswerable: questions its "
            f"corpus does not answer), not {split!r}"
        )
    # Generated with held-out entities per split (rlm.data.toy_world): disjoint by construction.
    file = Path(path) / f"{split}.jsonl"
    return QASplit(name, split, read_qa_jsonl(file), f"{file}, entities held out per split")


DATASETS: dict[str, Callable[[str, str, str | None], QASplit]] = {
    "nq_open": _open_domain_qa,
    "trivia_qa": _open_domain_qa,
    "hotpot_qa": _open_domain_qa,
    "multihop200": _multihop200,
    "jsonl": _jsonl,
    "toy": _toy,
}
# The names users type for them (papers' and other toolkits' spellings).
ALIASES = {
    "nq": "nq_open",
    "natural_questions": "nq_open",
    "tqa": "trivia_qa",
    "triviaqa": "trivia_qa",
    "trivia": "trivia_qa",
    "hotpotqa": "hotpot_qa",
    "hotpot": "hotpot_qa",
    "hpqa": "hotpot_qa",
}


def dataset_name(name: str) -> str:
    """The registry's name of a dataset as a user types it (`nq`, `NQ-open`, `tqa`, `hotpotqa` ...); an unknown
    name is refused with the names that exist."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key in DATASETS:
        return key
    known = [*DATASETS, *ALIASES]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    aliases = ", ".join(f"{a} = {ALIASES[a]}" for a in ALIASES)
    raise UserError(
        f"unknown QA dataset {name!r}{hint}; the datasets are {', '.join(DATASETS)} (also: {aliases}), or a "
        "JSONL file's path"
    )


def load_qa_split(name: str, split: str, path: str | os.PathLike | None = None) -> QASplit:
    """Load a QA dataset's split from the registry (`DATASETS`, names as `dataset_name` takes them): the hub
    under its real name, or a local layout; `train` / `dev` / `test` as the literature names them."""
    canonical = dataset_name(name)
    return DATASETS[canonical](canonical, split, None if path is None else str(path))


def load_qa_dataset(name: str, split: str, path: str | os.PathLike | None = None) -> list[QAExample]:
    """The questions of `load_qa_split(name, split, path)`."""
    return load_qa_split(name, split, path).examples
