"""Atomic writes for reader folders, so a crash never leaves a half-written model behind.

`retriever.io` has the same helpers, but `reader` must not import `retriever`, so this small copy lives here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final_dir` in (almost) one rename.

    A folder cannot be `os.replace`d onto a non-empty folder, so an existing one is first renamed aside and
    deleted only after the new folder is in place. On error the temporary folder is removed and `final_dir`
    is left untouched.
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_json(path: str | os.PathLike, obj: object) -> None:
    """Write `obj` as indented JSON to `path` through a temporary file and `os.replace`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
