"""Passage ids held compactly: one UTF-8 blob of newline-terminated ids plus an int64 offset per id.

A Python list of 21M id strings costs about 1.5 GB (a str object and a list slot per id); the blob and the
offsets of the same ids cost about 0.35 GB, and the blob is byte for byte the `ids.txt` that buffers and
indexes store (plus a final newline), so writing, reading and comparing id lists is a single bytes operation
instead of a loop over 21M strings. numpy only, so `rlm.data.corpus` can use it without importing torch.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from rlm.retriever.errors import InputError

_CHUNK = 65_536


class IdSequence(Sequence[str]):
    """Read-only sequence of ids: id i is `blob[offsets[i] : offsets[i + 1] - 1]` (each id ends with a byte
    `\\n` in the blob, so the offsets stay exact even for an id that itself contains a line break)."""

    def __init__(self, blob: bytes, offsets: np.ndarray):
        self._blob = blob
        self._offsets = np.asarray(offsets, dtype=np.int64)

    @classmethod
    def from_strings(cls, ids: Iterable[str]) -> IdSequence:
        blob, ends = bytearray(), [0]
        for pid in ids:
            blob += str(pid).encode("utf-8") + b"\n"
            ends.append(len(blob))
        return cls(bytes(blob), np.asarray(ends, dtype=np.int64))

    @classmethod
    def from_lines(cls, data: bytes, count: int | None = None) -> IdSequence:
        """The ids of an `ids.txt`, exactly as `data.decode().split("\\n")[:count]` reads them (the first
        `count` when given; a ValueError when there are fewer)."""
        # Always terminate: "a\n" is the two ids "a" and "" for split("\n"), and the blob needs a "\n" per id.
        blob = data + b"\n"
        ends = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == 0x0A) + 1
        if count is not None:
            if len(ends) < count:
                raise InputError(f"{len(ends)} ids, expected {count}")
            ends = ends[:count]
            blob = blob[: int(ends[-1])] if count else b""
        offsets = np.zeros(len(ends) + 1, dtype=np.int64)
        offsets[1:] = ends
        return cls(blob, offsets)

    @classmethod
    def joined(cls, parts: Iterable[Sequence[str]]) -> IdSequence:
        """The ids of `parts` one after another, as one blob (an index's ids, then the ids corpus updates
        appended); an IdSequence part is copied as bytes, not read id by id."""
        parts = [part for part in parts if len(part)]
        return cls.from_lines(b"\n".join(id_lines(part) for part in parts), sum(len(part) for part in parts))

    def head(self, count: int) -> IdSequence:
        """The first `count` ids, as an IdSequence (a list slice would be 21M strings)."""
        return IdSequence(self._blob[: int(self._offsets[count])], self._offsets[: count + 1])

    @property
    def offsets(self) -> np.ndarray:
        """The int64 offset of each id in the blob, and the blob's end: id i is `blob[offsets[i]:offsets[i+1]-1]`."""
        return self._offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"id index {i} out of range for {n} ids")
        return self._blob[self._offsets[i] : self._offsets[i + 1] - 1].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        # Offsets converted a chunk at a time: one Python int list of 21M offsets would defeat the purpose.
        blob, n = self._blob, len(self)
        for lo in range(0, n, _CHUNK):
            bounds = self._offsets[lo : min(lo + _CHUNK, n) + 1].tolist()
            for s, e in zip(bounds[:-1], bounds[1:]):
                yield blob[s : e - 1].decode("utf-8")

    def __eq__(self, other) -> bool:
        if isinstance(other, IdSequence):
            return self.to_bytes() == other.to_bytes() and np.array_equal(self._offsets, other._offsets)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # mutable-looking sequence semantics, like list

    def to_bytes(self) -> bytes:
        """The newline-terminated ids, `"".join(f"{id}\\n" ...)`, without copying when nothing was sliced."""
        lo, hi = int(self._offsets[0]), int(self._offsets[-1])
        return self._blob if (lo, hi) == (0, len(self._blob)) else self._blob[lo:hi]

    def nbytes(self) -> int:
        """Bytes held by the blob and the offsets."""
        return len(self._blob) + self._offsets.nbytes

    def __repr__(self) -> str:
        return f"IdSequence({len(self)} ids)"


def id_lines(ids: Sequence[str]) -> bytes:
    """The `ids.txt` bytes (`"\\n".join(ids)`, UTF-8); a ValueError naming the row of an id with a line break,
    which would shift every later row when read back."""
    if isinstance(ids, IdSequence):
        data = ids.to_bytes()
        # One newline per id and no carriage return means no id holds a line break: two C-speed scans.
        if data.count(b"\n") == len(ids) and b"\r" not in data:
            return data[:-1]
    bad = next((i for i, pid in enumerate(ids) if "\n" in str(pid) or "\r" in str(pid)), None)
    if bad is not None:
        raise InputError(f"passage id at row {bad} contains a line break: {ids[bad]!r}")
    return "\n".join(str(pid) for pid in ids).encode("utf-8")


def first_mismatch(a: Sequence[str], b: Sequence[str]) -> int | None:
    """The first row where two equally long id sequences differ, or None; a bytes comparison when both are
    IdSequences (the usual case: an index's ids against the corpus's), a loop otherwise."""
    if isinstance(a, IdSequence) and isinstance(b, IdSequence) and a == b:
        return None
    return next((row for row, (x, y) in enumerate(zip(a, b)) if x != y), None)
