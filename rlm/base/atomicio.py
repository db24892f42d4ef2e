"""Atomic writes: a crash or a concurrent reader never sees a half-written file or folder.

The one implementation every package uses (`reader`, `retriever`, `rlm`, `app` and the scripts); it imports
nothing of theirs, so `reader` and `retriever` stay independent of each other. Every helper writes next to the
destination (same filesystem, so the final `os.replace` is atomic), fsyncs files before the rename, and
removes its temporary on failure. `foreign_entries` tells a folder's files from those a writer calls its own,
its leftover temporaries included (their names are made here).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_directory",
    "atomic_file",
    "atomic_open",
    "atomic_save_torch",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "foreign_entries",
]


def _umask() -> int:
    # No call reads the umask without setting it; it is put back at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_path(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    # mkstemp makes the file 0600; the renamed result gets the mode a plain open() would give it.
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on normal exit it is fsynced and renamed onto `path`."""
    final = Path(path)
    tmp = _temp_path(final)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """`open(path, mode)` for writing, atomically: the file appears under `path` complete or not at all."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a new file: mode must start with 'w', got {mode!r}")
    with atomic_file(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else encoding) as fh:
        yield fh


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` atomically."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2, sort_keys: bool = False) -> None:
    """Write `obj` as JSON (and a final newline) to `path` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def atomic_save_torch(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)`, atomically."""
    import torch

    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


@contextlib.contextmanager
def atomic_directory(final_dir: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder; on normal exit it replaces `final_dir`.

    An existing `final_dir` is moved aside first and deleted only after the new folder is in place, so at
    every instant either the old or the new complete folder sits at `final_dir`. With `overwrite=False`
    an existing folder is an error. Whatever `final_dir` held is deleted: a command that takes the folder from
    its user checks it with `foreign_entries` before its work starts (a refusal at the rename would come
    after the work, an index built for an hour).
    """
    final = Path(final_dir)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists; choose another output folder or remove it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the result gets the mode os.mkdir would give it
    try:
        yield tmp
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.replace(final, old / "dir")
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def foreign_entries(folder: str | os.PathLike, own: Iterable[str]) -> list[str]:
    """The names in `folder` that match none of the glob patterns `own`, sorted; none when it does not exist.

    A temporary that an interrupted write of an owned name left behind (`.NAME.<random>.tmp`, killed before
    its cleanup could run) counts as owned: it is the writer's own leftover, and a rerun writes NAME anew.
    """
    root = Path(folder)
    if not root.exists():
        return []
    patterns = list(own)

    def owned(name: str) -> bool:
        if name.startswith(".") and name.endswith(".tmp"):
            name = name[1:].rsplit(".", 2)[0]
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    return sorted(entry.name for entry in root.iterdir() if not owned(entry.name))
