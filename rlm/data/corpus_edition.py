"""A corpus as corpus updates left it: the base corpus file, then each update's passages, some rows removed.

`rlm corpus update` never rewrites the base corpus (21M passages) or its embeddings: an update's added and
replacing passages are kept as a JSONL file of their own in the index folder (`updates/<n>/passages.jsonl`),
their rows appended after the base's, and the rows of the passages it replaced or deleted are removed. Row i of
an index with updates is row i of its `CorpusEdition`; a replaced passage's id then names two rows, of which
only the newest is live (`index_of`).

The edition's fingerprint is a chain: the base corpus's, then each update's (its passages file's fingerprint,
the ids it deleted, the encoder that embedded it) hashed onto it, so an index with updates is accepted for
exactly this base corpus with exactly these updates (`rlm.inference.indexing.load_index_for`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from rlm.data.corpus import Corpus, CorpusSubset, Passage, RetrievalTexts
from rlm.errors import UnknownPassageError, UserError
from rlm.retriever.ids import IdSequence


def update_fingerprint(passages_fingerprint: str, deleted: Sequence[str], encoder_fingerprint: str) -> str:
    """One update's fingerprint: what it added or replaced, what it deleted, and which encoder embedded it."""
    digest = hashlib.sha256(f"{passages_fingerprint}\n{encoder_fingerprint}\n".encode())
    for pid in sorted(deleted):
        digest.update(pid.encode("utf-8") + b"\n")
    return "update:sha256:" + digest.hexdigest()


def chained(previous: str, update: str) -> str:
    """The edition's fingerprint after `update`, from the one before (at first the base corpus's)."""
    return "edition:sha256:" + hashlib.sha256(f"{previous}\n{update}".encode()).hexdigest()


def new_record(base: Corpus) -> dict:
    """The record of an edition no update has changed yet: its base corpus and rows (what index.json's
    `edition` and a buffer's edition.json hold, `rlm.data.buffer_edition`)."""
    return {
        "base_corpus": base.fingerprint,
        "base_rows": len(base),
        "updates": [],
        "fingerprint": base.fingerprint,
    }


def read_deletions(path: Path) -> list[tuple[int, str]]:
    """(line number, passage id) of each non-blank line of `path` (UTF-8, one id a line), duplicates refused."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 ({err.reason}); write one passage id a line in UTF-8") from None
    seen: dict[str, int] = {}
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        pid = line.strip()
        if not pid:
            continue
        if pid in seen:
            raise UserError(
                f"{path}:{number}: passage id {pid!r} is listed twice (first on line {seen[pid]})"
            )
        seen[pid] = number
        found.append((number, pid))
    return found


def open_edition_record(folder, record: dict, base: Corpus, removed: np.ndarray) -> CorpusEdition:
    """The corpus an edition `record` (kept in `folder`: its updates' stores) describes: `base` and the passages
    of each update, every update's files checked against the fingerprint it was applied with, and the chain
    against the record's; `removed`: the rows its updates replaced or deleted."""
    if record["base_corpus"] != base.fingerprint:
        raise UserError(
            f"{folder} holds updates of corpus {record['base_corpus']}, not of {base.path} ({base.fingerprint}): "
            "give the corpus file it was built for"
        )
    chain, parts, chains = record["base_corpus"], [], [record["base_corpus"]]
    for update in record["updates"]:
        store = Path(folder) / update["store"]
        passages = Corpus(store / "passages.jsonl") if update["rows"] else None
        deleted = [pid for _, pid in read_deletions(store / "deleted.txt")]
        found = update_fingerprint(
            passages.fingerprint if passages else "", deleted, update["encoder_fingerprint"]
        )
        if found != update["fingerprint"]:
            raise UserError(
                f"{folder}: the files of update {update['number']} ({store}) changed after it was applied; "
                "restore them, or build it again and apply the updates again"
            )
        chain = chained(chain, found)
        chains.append(chain)
        if passages is not None:
            parts.append(passages)
    if chain != record["fingerprint"]:
        raise UserError(f"{folder}: its updates do not chain to the edition it records; build it again")
    return CorpusEdition(base, parts, removed, chain, chains)


class CorpusEdition(Sequence[Passage]):
    """The base `Corpus` and the `updates` (each a `Corpus` over one update's passages file) in row order,
    `removed` rows unreachable by id; the interface of a `Corpus` (`ids`, `index_of`, `retrieval_texts`,
    `fingerprint`, `path`)."""

    def __init__(
        self,
        base: Corpus,
        updates: Sequence[Corpus],
        removed: np.ndarray,
        fingerprint: str,
        lineage: Sequence[str] = (),
    ):
        self.base, self.updates = base, list(updates)
        # The fingerprints this edition had, its base corpus's first and its own last (`lineage`).
        self.lineage = list(lineage) or [base.fingerprint, fingerprint]
        self.removed = np.asarray(removed, dtype=np.int64)
        self.fingerprint = fingerprint
        self.path, self.fmt = base.path, base.fmt
        self.starts = [len(base)]
        for update in self.updates:
            self.starts.append(self.starts[-1] + len(update))
        self.ids: Sequence[str] = IdSequence.joined([base.ids, *(u.ids for u in self.updates)])

    def __len__(self) -> int:
        return self.starts[-1]

    def _part(self, i: int) -> tuple[Corpus, int]:
        """The corpus holding row `i` and the row there."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for a corpus edition of {len(self)} passages")
        i %= len(self)
        if i < len(self.base):
            return self.base, i
        part = bisect.bisect_right(self.starts, i) - 1
        return self.updates[part], i - self.starts[part]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        corpus, row = self._part(int(i))
        return corpus[row]

    def __iter__(self) -> Iterator[Passage]:
        yield from self.base
        for update in self.updates:
            yield from update

    def is_removed(self, row: int) -> bool:
        position = int(np.searchsorted(self.removed, row))
        return position < len(self.removed) and int(self.removed[position]) == row

    def index_of(self, passage_id: str) -> int:
        """The live row of `passage_id`: the newest update's that holds it, else the base's; an id whose
        passage an update deleted is unknown (`UnknownPassageError`, a KeyError)."""
        for part in range(len(self.updates) - 1, -1, -1):
            try:
                row = self.starts[part] + self.updates[part].index_of(passage_id)
            except UnknownPassageError:
                continue
            if not self.is_removed(row):
                return row
        row = self.base.index_of(passage_id)
        if self.is_removed(row):
            raise UnknownPassageError(f"passage id {passage_id!r} was deleted by a corpus update")
        return row

    def was_deleted(self, passage_id: str) -> bool:
        """Whether `passage_id` was in the corpus until an update deleted it."""
        try:
            self.index_of(passage_id)
        except UnknownPassageError:
            return any(_holds(part, passage_id) for part in (self.base, *self.updates))
        return False

    def retrieval_texts(self) -> Sequence[str]:
        return RetrievalTexts(self)

    def live(self) -> CorpusEdition | CorpusSubset:
        """The passages a search may return: this edition without its removed rows (itself when none is)."""
        if not len(self.removed):
            return self
        return CorpusSubset(self, np.setdiff1d(np.arange(len(self)), self.removed))

    def __repr__(self) -> str:
        return f"CorpusEdition({str(self.path)!r}, passages={len(self)}, updates={len(self.updates)})"


def _holds(corpus: Corpus, passage_id: str) -> bool:
    """Whether `corpus` has a row of `passage_id` (its id lookup, not a scan of its ids)."""
    try:
        corpus.index_of(passage_id)
    except UnknownPassageError:
        return False
    return True
