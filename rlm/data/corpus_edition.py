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

import numpy as np

from rlm.data.corpus import Corpus, Passage, RetrievalTexts
from rlm.errors import UnknownPassageError
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


class CorpusEdition(Sequence[Passage]):
    """The base `Corpus` and the `updates` (each a `Corpus` over one update's passages file) in row order,
    `removed` rows unreachable by id; the interface of a `Corpus` (`ids`, `index_of`, `retrieval_texts`,
    `fingerprint`, `path`)."""

    def __init__(self, base: Corpus, updates: Sequence[Corpus], removed: np.ndarray, fingerprint: str):
        self.base, self.updates = base, list(updates)
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

    def retrieval_texts(self) -> Sequence[str]:
        return RetrievalTexts(self)

    def __repr__(self) -> str:
        return f"CorpusEdition({str(self.path)!r}, passages={len(self)}, updates={len(self.updates)})"
