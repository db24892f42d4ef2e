"""Passage corpora read in place: DPR `psgs_w100.tsv`, JSONL `{id, title, text}`, and the FlashRAG/pyserini
`{id, contents}` layout.

A corpus is never held as Python objects: one pass over the file records each passage's byte offset (numpy
int64) and its id (one bytes blob plus offsets), validating every line; `corpus[i]` then reads line i with a
positional read. That keeps the 21M-passage DPR file at a few hundred MB of arrays instead of tens of GB of
strings, and makes a `Corpus` safe to share with forked data-loader workers (no shared file position).
The same pass hashes the file's bytes into `corpus.fingerprint`, which buffers and cached indexes are checked
against, so no start-up pays a second pass over every passage for it.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import operator
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlm.base.atomicio import atomic_file, atomic_write_json
from rlm.errors import UnknownPassageError, UserError, not_utf8
from rlm.retriever.ids import IdSequence

if TYPE_CHECKING:  # torch: a corpus is read without it
    from rlm.retriever.distributed import Processes

FORMATS = ("jsonl", "dpr_tsv", "pyserini")
_DPR_HEADER = b"id\ttext\ttitle"


@dataclass(frozen=True)
class Passage:
    """One retrievable passage."""

    id: str
    title: str
    text: str


def retrieval_text(title: str, text: str) -> str:
    """The string the retriever encodes for a passage: `"{title}. {text}"`, or the text alone without a title."""
    return f"{title}. {text}" if title else text


def detect_format(path: str | os.PathLike) -> str:
    """Guess a corpus format from the file name and its first non-empty line."""
    path = Path(path)
    if path.suffix == ".tsv":
        return "dpr_tsv"
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                break
        else:
            raise UserError(f"{path}: the corpus file is empty")
    if line.startswith(_DPR_HEADER):
        return "dpr_tsv"
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise not_utf8(path, 1, line) from None
    except json.JSONDecodeError as err:
        raise UserError(
            f"{path}:1: cannot tell the corpus format (not JSON: {err.msg}; a DPR TSV needs the header "
            "'id<TAB>text<TAB>title'); pass fmt= one of " + ", ".join(FORMATS)
        ) from None
    if isinstance(record, dict) and "contents" in record:
        return "pyserini"
    if isinstance(record, dict) and "text" in record:
        return "jsonl"
    raise UserError(
        f"{path}:1: cannot tell the corpus format: expected keys {{id, title, text}} (jsonl) or {{id, contents}} "
        f"(pyserini), got {sorted(record) if isinstance(record, dict) else type(record).__name__}"
    )


def _parse_jsonl(path: Path, line_no: int, line: bytes) -> Passage:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{line_no}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    if "id" not in record or "text" not in record:
        missing = [k for k in ("id", "text") if k not in record]
        raise UserError(
            f"{path}:{line_no}: missing key(s) {missing}; a jsonl corpus line is {{id, title, text}}"
        )
    return Passage(str(record["id"]), str(record.get("title") or ""), str(record["text"]))


def _parse_pyserini(path: Path, line_no: int, line: bytes) -> Passage:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{line_no}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict) or "id" not in record or "contents" not in record:
        raise UserError(f"{path}:{line_no}: a pyserini corpus line is {{id, contents}}")
    contents = str(record["contents"])
    # FlashRAG/pyserini Wikipedia: 'contents' is '"Title"\ntext'; the title keeps DPR's surrounding quotes.
    title, sep, text = contents.partition("\n")
    if not sep:
        return Passage(str(record["id"]), "", contents)
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return Passage(str(record["id"]), title, text)


def _unquote(field: str) -> str:
    # DPR writes fields csv-style: quoted when they contain quotes, with "" for a literal quote.
    if len(field) >= 2 and field[0] == field[-1] == '"':
        return field[1:-1].replace('""', '"')
    return field


def _parse_dpr(path: Path, line_no: int, line: bytes) -> Passage:
    raw = line.rstrip(b"\r\n")
    fields = [_unquote(field.decode("utf-8")) for field in raw.split(b"\t")]
    if len(fields) != 3 and b'"' in raw:
        # A tab inside a quoted field: fall back to a real csv parse of this one line (slower, rare).
        fields = next(csv.reader([raw.decode("utf-8")], delimiter="\t"))
    if len(fields) != 3 or not fields[0]:
        raise UserError(
            f"{path}:{line_no}: a DPR TSV line is 'id<TAB>text<TAB>title', got {len(fields)} field(s)"
        )
    pid, text, title = fields
    return Passage(pid, title, text)


_PARSERS = {"jsonl": _parse_jsonl, "pyserini": _parse_pyserini, "dpr_tsv": _parse_dpr}


def _id_hash(pid: bytes) -> int:
    # 64-bit blake2b per id: stable across processes (unlike hash()) so duplicate checks are reproducible.
    return int.from_bytes(hashlib.blake2b(pid, digest_size=8).digest(), "little", signed=True)


class _HashingReader(io.RawIOBase):
    """A raw file whose reads also feed a hash: wrapped in a BufferedReader, the scan's line iteration
    stays in C while every block it reads is hashed."""

    def __init__(self, raw, digest):
        self._raw, self._digest = raw, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        n = self._raw.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
        return n


def file_fingerprint(fmt: str, digest) -> str:
    """`"<fmt>:sha256:<hex>"` from the sha256 of the corpus file's bytes (`sha256sum` gives the same hex).

    Exact: equal bytes and format give equal passages (ids, titles, texts, order), and any changed byte
    changes it. Cheap: it is computed from the blocks the scan reads anyway. The format is part of it
    because the same bytes read as another format are other passages. It also changes when only formatting
    changes (a blank line, JSON key order): then a buffer is refused and rebuilt although its passages are
    the same, which is the safe side.
    """
    return f"{fmt}:sha256:{digest.hexdigest()}"


def _checked_index(i, n: int, what: str) -> int:
    """A non-negative row for index `i` (numpy and torch integer scalars too; negative counts from the end)."""
    i = operator.index(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"passage index {i} out of range for {n} {what}")
    return i


class RetrievalTexts(Sequence[str]):
    """The strings the retriever encodes (`retrieval_text`) of any sequence of passages, read lazily: a
    corpus's `retrieval_texts()`."""

    def __init__(self, corpus: Sequence[Passage]):
        self._corpus = corpus

    def __len__(self) -> int:
        return len(self._corpus)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = self._corpus[i]
        return retrieval_text(p.title, p.text)


class Corpus(Sequence[Passage]):
    """A passage file indexed by byte offsets; `corpus[i]` reads passage i from disk."""

    def __init__(
        self,
        path: str | os.PathLike,
        fmt: str | None = None,
        fingerprint: str | None = None,
        scan: dict[str, np.ndarray] | None = None,
    ):
        """Scan `path` once. `fingerprint`, when the caller already knows it (`load_corpus`'s stat-keyed
        cache), is taken as is and the scan skips hashing; otherwise the scan computes it. `scan`: the arrays
        of an earlier scan of this very file (`scan_arrays`, which `load_corpus` caches with the fingerprint),
        taken instead of reading and parsing the file again (its cost: docs/data.md)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus file not found: {self.path}")
        self.fmt = fmt or detect_format(self.path)
        if self.fmt not in _PARSERS:
            raise UserError(f"unknown corpus format {self.fmt!r}; choose one of {', '.join(FORMATS)}")
        self._parse = _PARSERS[self.fmt]
        self._fd: int | None = None
        self._fd_pid: int | None = None
        if scan is not None and fingerprint is not None:
            self.fingerprint: str = fingerprint
            self._offsets, self._line_numbers = scan["offsets"], scan["line_numbers"]
            self.ids: Sequence[str] = IdSequence(scan["id_blob"].tobytes(), scan["id_offsets"])
            self._order, self._sorted_hashes = scan["order"], scan["sorted_hashes"]
            return
        digest = None if fingerprint is not None else hashlib.sha256()
        self._offsets, self._line_numbers, id_blob, id_offsets, hashes = self._scan(digest)
        # What a buffer or a cached index is checked against: see `file_fingerprint`.
        self.fingerprint = fingerprint if digest is None else file_fingerprint(self.fmt, digest)
        self.ids = IdSequence(id_blob, id_offsets)
        self._order = np.argsort(hashes, kind="stable")
        self._sorted_hashes = hashes[self._order]
        self._check_unique()

    def scan_arrays(self) -> dict[str, np.ndarray]:
        """What the scan found, as arrays (`Corpus(..., scan=...)` takes them back)."""
        return {
            "offsets": self._offsets,
            "line_numbers": self._line_numbers,
            "id_blob": np.frombuffer(self.ids.to_bytes(), dtype=np.uint8),
            "id_offsets": self.ids.offsets,
            "order": self._order,
            "sorted_hashes": self._sorted_hashes,
        }

    def _scan(self, digest=None) -> tuple[np.ndarray, np.ndarray, bytes, np.ndarray, np.ndarray]:
        # array('q') keeps the scan of a 21M-line file at 8 bytes a number, not a Python int object each.
        offsets, line_numbers, id_ends, id_hashes = array("q"), array("q"), array("q"), array("q")
        ids = bytearray()
        position = 0
        with open(self.path, "rb", buffering=0) as raw:
            # The fingerprint hashes the 1 MiB blocks the line reader pulls from the file: every byte once,
            # in order, at C speed, instead of a second pass over 21M parsed passages.
            source = raw if digest is None else _HashingReader(raw, digest)
            f = io.BufferedReader(source, buffer_size=1 << 20)
            for line_no, line in enumerate(f, start=1):
                start, position = position, position + len(line)
                if not line.strip():
                    continue
                if self.fmt == "dpr_tsv" and line_no == 1 and line.startswith(_DPR_HEADER):
                    continue
                try:
                    passage = self._parse(self.path, line_no, line)
                except UnicodeDecodeError:  # from inside json or a field's decode: name the line instead
                    raise not_utf8(self.path, line_no, line) from None
                offsets.append(start)
                line_numbers.append(line_no)
                pid = passage.id.encode("utf-8")
                # "\n"-terminated ids: the blob is then ids.txt as buffers and indexes store it.
                ids += pid
                ids += b"\n"
                id_ends.append(len(ids))
                id_hashes.append(_id_hash(pid))
        if not offsets:
            raise UserError(f"{self.path}: no passages found")
        offsets.append(position)
        id_offsets = np.zeros(len(id_ends) + 1, dtype=np.int64)
        id_offsets[1:] = np.frombuffer(id_ends, dtype=np.int64)
        return (
            np.frombuffer(offsets, dtype=np.int64).copy(),
            np.frombuffer(line_numbers, dtype=np.int64).copy(),
            bytes(ids),
            id_offsets,
            np.frombuffer(id_hashes, dtype=np.int64).copy(),
        )

    def _check_unique(self) -> None:
        same = np.nonzero(self._sorted_hashes[1:] == self._sorted_hashes[:-1])[0]
        for j in same.tolist():
            a, b = sorted(int(r) for r in self._order[j : j + 2])
            if self.ids[a] == self.ids[b]:
                raise UserError(
                    f"{self.path}: duplicate passage id {self.ids[a]!r} on lines "
                    f"{self._line_numbers[a]} and {self._line_numbers[b]}"
                )

    def __len__(self) -> int:
        return len(self._line_numbers)

    def _read_line(self, i: int) -> bytes:
        # A descriptor per process: pread has no shared position, so forked workers never race.
        if self._fd is None or self._fd_pid != os.getpid():
            self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY), os.getpid()
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return os.pread(self._fd, end - start, start)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = _checked_index(i, len(self), f"passages in {self.path}")
        # Blank lines between passages are skipped by the scan, so read up to the next passage's offset and
        # keep only the first line.
        raw = self._read_line(i).split(b"\n", 1)[0]
        return self._parse(self.path, int(self._line_numbers[i]), raw)

    def __iter__(self) -> Iterator[Passage]:
        with open(self.path, "rb") as f:
            for i in range(len(self)):
                f.seek(int(self._offsets[i]))
                yield self._parse(self.path, int(self._line_numbers[i]), f.readline())

    def index_of(self, passage_id: str) -> int:
        """Row of a passage id; `UnknownPassageError` (a KeyError) when the corpus has no such id."""
        key = passage_id.encode("utf-8")
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)
        lo = int(np.searchsorted(self._sorted_hashes, h, side="left"))
        hi = int(np.searchsorted(self._sorted_hashes, h, side="right"))
        for j in range(lo, hi):
            row = int(self._order[j])
            if self.ids[row] == passage_id:
                return row
        raise UnknownPassageError(f"passage id {passage_id!r} not in {self.path}")

    def retrieval_texts(self) -> Sequence[str]:
        """Lazy sequence of the strings the retriever encodes (`"{title}. {text}"`)."""
        return RetrievalTexts(self)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fd"], state["_fd_pid"] = None, None
        return state

    def __del__(self):
        if getattr(self, "_fd", None) is not None and self._fd_pid == os.getpid():
            os.close(self._fd)

    def __repr__(self) -> str:
        return f"Corpus({str(self.path)!r}, fmt={self.fmt!r}, passages={len(self)})"


# What a corpus opened by another process than the first holds as its fingerprint until the first one's arrives.
_FIRST_PROCESS = "pending: the first process's"


def load_corpus(
    path: str | os.PathLike,
    fmt: str | None = None,
    fingerprint_cache: str | os.PathLike | None = None,
    procs: Processes | None = None,
) -> Corpus:
    """Open a passage corpus (fmt in {"jsonl", "dpr_tsv", "pyserini"}; auto-detected when None).

    `fingerprint_cache`: a small JSON file that remembers the corpus fingerprint per corpus file, keyed by
    the file's resolved path, its stamp (`_file_stamp`: size, mtime, ctime and a hash of a few sampled blocks)
    and the format, and beside it the scan's arrays (offsets, ids; `<cache stem>.<key>.scan.npz`, ~50 B a
    passage): on a hit the file is neither hashed nor parsed (the start-up it saves: docs/data.md). Any
    change to the stamp is a miss: the file is scanned and hashed again and the entry replaced.
    `rlm.cache.corpus_fingerprint_cache()` is the one `rlm embed`, `rlm evaluate` and the demo share.

    `procs`: the data-parallel processes that all open this corpus (`rlm.retriever.distributed.Processes`; every
    one must call). Each scans the file for the offsets it reads passages by, all at once, but only the first
    hashes it (or finds it in the cache): the others take its fingerprint, one sha256 of the 13 GB DPR file
    per run instead of one per process.
    """
    if procs is not None and procs.world > 1:
        if procs.rank == 0:
            corpus = load_corpus(path, fmt, fingerprint_cache)
        else:
            corpus = Corpus(path, fmt, fingerprint=_FIRST_PROCESS)  # the scan skips hashing
        corpus.fingerprint = procs.gather_object([corpus.fingerprint])[0]
        return corpus
    if fingerprint_cache is None:
        return Corpus(path, fmt)
    path, cache = Path(path), Path(fingerprint_cache)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    fmt = fmt or detect_format(path)
    key, before = str(path.resolve()), _file_stamp(path)
    entries = _read_fingerprint_cache(cache)
    entry = entries.get(key)
    scan_file = cache.with_name(f"{cache.stem}.{hashlib.sha256(key.encode()).hexdigest()[:12]}.scan.npz")
    if isinstance(entry, dict) and {k: entry.get(k) for k in before} == before and entry.get("fmt") == fmt:
        scan = _read_scan(scan_file, entry.get("scan"))
        corpus = Corpus(path, fmt, fingerprint=entry["fingerprint"], scan=scan)
        if scan is not None:
            return corpus
    else:
        corpus = Corpus(path, fmt)
    # Record only a file that did not change while it was hashed, or the entry would vouch for other bytes.
    if _file_stamp(path) == before:
        entries[key] = {**before, "fmt": fmt, "fingerprint": corpus.fingerprint}
        try:
            entries[key]["scan"] = _write_scan(scan_file, corpus.scan_arrays())
            atomic_write_json(cache, {"format_version": 1, "corpora": entries})
        except OSError as err:  # a read-only checkpoint still works; it just hashes again next time
            print(f"warning: could not cache the corpus fingerprint in {cache} ({err})")
    return corpus


def _write_scan(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """The scan's arrays in one .npz, atomically; returns the file's stamp, which the cache entry records."""
    with atomic_file(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    return _file_stamp(path)


def _read_scan(path: Path, stamp: dict | None) -> dict[str, np.ndarray] | None:
    """The cached scan when its file is the one the entry recorded and its arrays fit together, else None
    (the corpus is then scanned again)."""
    if not isinstance(stamp, dict) or not path.is_file() or _file_stamp(path) != stamp:
        return None
    try:
        with np.load(path) as data:
            scan = {name: data[name] for name in data.files}
    except (OSError, ValueError, KeyError):
        return None
    n = len(scan.get("line_numbers", ()))
    sizes = {"offsets": n + 1, "id_offsets": n + 1, "order": n, "sorted_hashes": n}
    if any(len(scan.get(name, ())) != size for name, size in sizes.items()) or "id_blob" not in scan:
        return None
    return scan


# `_file_stamp` hashes this many blocks of this many bytes, spread over the file from its first to its last.
STAMP_BLOCKS, STAMP_BLOCK_BYTES = 16, 4096


def _file_stamp(path: Path) -> dict[str, int | str]:
    """What a cache entry of `path` is trusted for: size, mtime and ctime (ns), and a hash of `STAMP_BLOCKS`
    blocks spread over the file. An edit can keep the size and restore the mtime (`touch -d`, `os.utime`,
    `rsync -t`), but not the ctime, which the kernel sets at every change and no call sets back; the sampled
    blocks also catch an edit there where the ctime is not kept (some network and FUSE file systems). 64 KiB
    read, not the 13 GB the fingerprint hashes."""
    st = path.stat()
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        span = max(st.st_size - STAMP_BLOCK_BYTES, 0)
        for block in range(STAMP_BLOCKS):
            f.seek(span * block // (STAMP_BLOCKS - 1))
            digest.update(f.read(STAMP_BLOCK_BYTES))
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "sampled_blake2b": digest.hexdigest(),
    }


def _read_fingerprint_cache(cache: Path) -> dict:
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or unreadable: start afresh
        return {}
    corpora = data.get("corpora") if isinstance(data, dict) else None
    return corpora if isinstance(corpora, dict) else {}


class CorpusSubset(Sequence[Passage]):
    """A subset of a corpus's rows (e.g. a hard subcorpus) with the same interface as `Corpus`."""

    def __init__(self, corpus: Corpus | CorpusSubset, rows: Sequence[int]):
        self.corpus = corpus
        self.rows = np.asarray(rows, dtype=np.int64)
        self.path = corpus.path
        self.fmt = corpus.fmt
        # The parent's file fingerprint and the rows identify the subset's passages exactly.
        rows_digest = hashlib.sha256(f"{corpus.fingerprint}\n".encode())
        rows_digest.update(self.rows.astype("<i8").tobytes())
        self.fingerprint: str = f"subset:sha256:{rows_digest.hexdigest()}"
        self.ids: Sequence[str] = [corpus.ids[int(r)] for r in self.rows]
        self._index = {pid: i for i, pid in enumerate(self.ids)}
        if len(self._index) != len(self.ids):
            raise ValueError("CorpusSubset: rows contain duplicates")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.corpus[int(self.rows[i])]

    def index_of(self, passage_id: str) -> int:
        """Row of a passage id within the subset; `UnknownPassageError` (a KeyError) when absent."""
        if passage_id not in self._index:
            raise UnknownPassageError(f"passage id {passage_id!r} not in this subset of {self.path}")
        return self._index[passage_id]

    def retrieval_texts(self) -> Sequence[str]:
        """Lazy sequence of the strings the retriever encodes."""
        return RetrievalTexts(self)
