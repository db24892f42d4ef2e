"""A fixed buffer B that corpus updates grew: the training side of `rlm corpus update --buffer DIR`.

B is embedded once by the starting passage tower g0 and never again; the corrector h maps its rows into the
trained space. A passage a corpus update adds is embedded by the same g0 and joins B: its row is appended after
the others, and h corrects it like every other row. The update's passages, deletions and rows are kept in the
buffer folder (`updates/<n>/`: `passages.jsonl`, `deleted.txt`, `rows.npy`), as `rlm corpus update --index`
keeps them in an index folder; the rows of the passages it replaced or deleted are listed in `removed.<n>.npy`,
and `edition.json` records the edition (the base corpus's fingerprint and each update's, chained:
`rlm.data.corpus_edition`). The buffer's own files (meta.json, ids.txt, its shards) never change, so the
buffer is still the one built for the base corpus, and a run that does not know about updates is refused
nothing it accepted before.

A training run over the folder (`rlm.components.build_components`) reads the base corpus with the edition's
passages (`CorpusEdition`), the buffer grown by the updates' rows, and the removed rows, which no selection
returns (`PassageBuffer.removed`, `rlm.retriever.search`). A run resumed from a checkpoint trained over an
earlier edition of the same lineage goes on over the new one (`rlm.training.run`); any other is refused.

Committing an update is one rename of edition.json over a file written beside it; a process killed before
leaves the folder as it was, and the next update deletes what it left (`orphans`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from rlm.base.atomicio import atomic_file, atomic_write_text
from rlm.data.corpus import Corpus
from rlm.data.corpus_edition import CorpusEdition, open_edition_record
from rlm.errors import UserError
from rlm.retriever.buffer import PassageBuffer

EDITION_NAME = "edition.json"
STORES = "updates"


def read_record(folder: str | os.PathLike) -> dict | None:
    """The edition `folder`'s updates made (edition.json), or None when no update was applied to it."""
    path = Path(folder) / EDITION_NAME
    if not path.exists():
        return None
    return json.loads(path.read_text())


def removed_rows(folder: str | os.PathLike, record: dict) -> np.ndarray:
    """The rows the edition's updates replaced or deleted (sorted int64)."""
    if not record.get("removed_file"):
        return np.zeros(0, dtype=np.int64)
    return np.load(Path(folder) / record["removed_file"]).astype(np.int64)


def corpus_of_buffer(folder: str | os.PathLike, base: Corpus) -> Corpus | CorpusEdition:
    """The corpus the buffer in `folder` holds rows of: `base` itself, or `base` as the updates applied to the
    buffer left it (refused when they were applied to another base corpus, or their files changed since)."""
    record = read_record(folder)
    if record is None or not record["updates"]:
        return base
    return open_edition_record(folder, record, base, removed_rows(folder, record))


def check_one_edition(procs, corpus, folder) -> None:
    """Refuse a start whose processes read different editions of the buffer in `folder` (an update committed
    between their reads of edition.json): each would select over other rows. `procs`: a
    `rlm.retriever.distributed.Processes`; one object gathered from each, once a start: the edition's
    fingerprint, or None where no update was read."""
    found = set(procs.gather_object([corpus.fingerprint if isinstance(corpus, CorpusEdition) else None]))
    if len(found) > 1:
        named = ", ".join(sorted(str(f) for f in found))
        raise UserError(
            f"the processes read {len(found)} editions of buffer {folder} ({named}): "
            "a corpus update was committed while the run started; start it again"
        )


def grown_buffer(buffer: PassageBuffer, corpus: Corpus | CorpusEdition) -> PassageBuffer:
    """`buffer` (loaded from its folder, the base corpus's rows) with the rows of `corpus`'s updates appended
    and its removed rows marked (`PassageBuffer.removed`); `buffer` itself when `corpus` is the base."""
    if not isinstance(corpus, CorpusEdition):
        return buffer
    # Each update's rows beside its passages (`updates/<n>/`): the edition's own parts, read once.
    grown = buffer.grown([Path(part.path).parent / "rows.npy" for part in corpus.updates], corpus.ids)
    if len(grown) != len(corpus):
        raise UserError(
            f"buffer {buffer.path}: its updates hold {len(grown) - len(buffer)} rows for "
            f"{len(corpus) - len(buffer)} passages; restore the updates' files or build the buffer again"
        )
    grown.removed = corpus.removed
    return grown


def orphans(folder: str | os.PathLike) -> list[Path]:
    """What an update killed before its commit left in the buffer `folder`: update stores and removed-row files
    its edition.json does not name."""
    folder = Path(folder)
    record = read_record(folder) or {"updates": []}
    named = {u["store"] for u in record["updates"]} | {record.get("removed_file")}
    left = [p for p in sorted((folder / STORES).glob("*")) if f"{STORES}/{p.name}" not in named]
    left += [p for p in sorted(folder.glob("removed.*.npy")) if p.name not in named]
    return left + sorted(folder.glob(f".{EDITION_NAME}.*")) + sorted(folder.glob(".removed.*"))


def commit(folder: str | os.PathLike, record: dict, removed: np.ndarray) -> None:
    """Save `record` as the buffer's edition, with its `removed` rows: the rows' file first under a name of its
    own, then edition.json naming it, replaced in one rename (the commit)."""
    folder = Path(folder)
    name = f"removed.{len(record['updates']):04d}.npy"
    with atomic_file(folder / name) as path, open(path, "wb") as f:
        np.save(f, np.asarray(removed, dtype=np.int64))
    record = {**record, "removed_file": name}
    atomic_write_text(folder / EDITION_NAME, json.dumps(record, indent=2) + "\n")
