"""The literature's train / dev / test of open-domain QA, made from the splits a dataset is published with.

The hub publishes NQ-open, TriviaQA and HotpotQA as `train` and `validation` (TriviaQA's and HotpotQA's own
`test` carry no answers). The papers this project reproduces (ORQA, DPR, FiD, Atlas, Monath et al.) report
**test** = the hub's `validation`, and hold out a **dev** set carved from the hub's `train`; their train is the
rest. So `dev` here is never the hub's `validation`: a model tuned on that would be tuned on the test set.

| dataset | test (what papers report) | dev: carved from hub train | train: the rest of hub train |
| --- | --- | --- | --- |
| `nq_open` | `validation`, 3,610 | 8,757 (DPR's size) | 79,168 of 87,925, less what test asks |
| `trivia_qa` (unfiltered.nocontext) | `validation`, 11,313 | 8,837 (DPR's size) | 78,785 of 87,622, less the same |
| `hotpot_qa` (distractor; same questions in fullwiki) | `validation`, 7,405 | 7,405 (as many as test) | 83,042 of 90,447, less the same |

The carve-out (`carve_dev`) is a pure function of the questions' text: the distinct normalised questions
(`normalize_question`) ranked by sha256 of `"<seed>\\n<question>"`, the first `size` of them with every row that
asks them. It does not depend on the order or the ids of the rows, so the hub and a local copy of the same files
give the same dev, and a question asked twice in train lands wholly on one side. Before it, every train question
equal (normalised) to a test question is dropped from train: no dev or test question appears in train. The
membership of DPR's own dev was never published as a rule; `rlm splits` writes this one's questions and ids
(`dev_ids.txt`), and a folder of your own `train.jsonl` / `dev.jsonl` / `test.jsonl` (DPR's, converted) is taken
as it is, checked for overlap.
"""

from __future__ import annotations

import hashlib
import string
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rlm.errors import UserError

LITERATURE_SPLITS = ("train", "dev", "test")
DEV_SEED = 0  # the carve-out's seed: changing it changes every published dev figure
_DROP = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class SplitProtocol:
    """How one dataset's literature splits come from its published ones (the module's table)."""

    hub_test: str  # the published split that papers report as test
    test_size: int  # its questions
    hub_train_size: int  # the published train's size: a smaller copy is a sample and gets dev in proportion
    dev_size: int  # distinct questions carved out of the published train as dev
    reported_as: str  # who reports the test set, for the reports' one line


PROTOCOLS = {
    "nq_open": SplitProtocol("validation", 3_610, 87_925, 8_757, "ORQA, DPR, FiD and the paper"),
    "trivia_qa": SplitProtocol("validation", 11_313, 87_622, 8_837, "DPR and FiD (unfiltered)"),
    "hotpot_qa": SplitProtocol("validation", 7_405, 90_447, 7_405, "the paper (its held-out validation set)"),
}


def normalize_question(text: str) -> str:
    """A question as the overlap checks compare it: accents stripped (NFKD), lowercase, no punctuation, single
    spaces. "Who wrote 'Dune'?" and "who wrote dune" are one question."""
    decomposed = unicodedata.normalize("NFKD", text)
    bare = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return " ".join(bare.lower().translate(_DROP).split())


class Asked(Protocol):
    """What the checks read of an example (`rlm.data.qa.QAExample` is one): its id and its question."""

    id: str
    question: str


Example = TypeVar("Example", bound=Asked)


@dataclass
class CarvedSplits(Generic[Example]):
    """`carve_dev`'s result: train and dev, and what was dropped from train because test asks it too."""

    train: list[Example]
    dev: list[Example]
    dropped_as_test: int


def dev_count(protocol: SplitProtocol, published_train: int) -> int:
    """Distinct questions dev takes from a published train of `published_train` rows: the protocol's size, or
    the same share of a smaller copy (a sample of the published file), at least one when there are two rows."""
    if published_train >= protocol.hub_train_size:
        return protocol.dev_size
    share = round(published_train * protocol.dev_size / protocol.hub_train_size)
    return max(share, 1) if published_train > 1 else 0


def carve_dev(
    train: Sequence[Example], test: Sequence[Asked], size: int, seed: int = DEV_SEED
) -> CarvedSplits[Example]:
    """Drop from `train` every question `test` asks (normalised), then carve out as dev the `size` distinct
    questions whose sha256 of `"<seed>\\n<normalised question>"` is smallest, with all their rows; the rest,
    in its order, is train."""
    asked_in_test = {normalize_question(ex.question) for ex in test}
    kept = [ex for ex in train if normalize_question(ex.question) not in asked_in_test]
    distinct = {normalize_question(ex.question) for ex in kept}
    if size >= len(distinct):
        raise UserError(
            f"cannot carve a dev set of {size:,} distinct questions from a train of {len(distinct):,}: "
            "give the whole published train"
        )
    rank = sorted(distinct, key=lambda q: hashlib.sha256(f"{seed}\n{q}".encode()).hexdigest())
    dev_questions = set(rank[:size])
    dev = [ex for ex in kept if normalize_question(ex.question) in dev_questions]
    rest = [ex for ex in kept if normalize_question(ex.question) not in dev_questions]
    return CarvedSplits(rest, dev, len(train) - len(kept))


def first_overlap(named: dict[str, Sequence[Example]]) -> tuple[str, Example, str, Example] | None:
    """The first question two of the `named` splits share (normalised), as (split, its example, other split,
    its example), or None: train, dev and test ask disjoint questions."""
    seen: dict[str, tuple[str, Example]] = {}
    for split, examples in named.items():
        mine: dict[str, Example] = {}
        for ex in examples:
            key = normalize_question(ex.question)
            if key in seen:
                return seen[key][0], seen[key][1], split, ex
            mine.setdefault(key, ex)
        seen.update({key: (split, ex) for key, ex in mine.items()})
    return None


def ids_digest(examples: Sequence[Asked]) -> str:
    """sha256 of the examples' ids, sorted, one a line: names a split's membership in a report."""
    lines = "".join(f"{i}\n" for i in sorted(ex.id for ex in examples))
    return "sha256:" + hashlib.sha256(lines.encode("utf-8")).hexdigest()


def test_set_named(dataset: str | None, split: str) -> str | None:
    """What makes `split` of `dataset` (a registry name) a test set, or None: `test`, or the published split
    the literature reports as test (`validation` of nq_open, trivia_qa and hotpot_qa)."""
    protocol = PROTOCOLS.get(dataset or "")
    if split == "test":
        return "a test set"
    if protocol is not None and split.rpartition("/")[2] == protocol.hub_test:
        return f"{dataset}'s test set (the {protocol.test_size:,} questions {protocol.reported_as} report as test)"
    return None


def check_training_splits(train: str, train_split: str, dev: str | None, dev_split: str) -> None:
    """Refuse a run that would train or validate on a test set (`test_set_named`): its test figure would then
    be a figure on what it was trained or tuned on. `train`, `dev`: registry names (or files)."""
    for key, name, split, use in (
        ("data.train_split", train, train_split, "trains on"),
        ("data.dev_split", dev, dev_split, "validates on"),
    ):
        what = test_set_named(name, split) if name else None
        if what is None and key == "data.train_split" and split == "dev":
            what = "the dev set"
        if what is not None:
            right = "train" if key == "data.train_split" else "dev"
            raise UserError(
                f"{key}={split} {use} {what}; training trains on train and validates on dev "
                f"(set {key}={right}; score the test set after training with `rlm evaluate --split test`)"
            )
