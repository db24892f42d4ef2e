"""User mistakes, told apart from bugs.

`UserError` is what `rlm`'s own code raises when the user's config, data, files or command-line options are
wrong; `reader` and `retriever` each raise their own `InputError` (they do not import `rlm`). The command line
(`rlm.cli`) prints any of `user_errors()` (these three, a missing or unreadable file, an unknown passage id) as one
`error: ...` line and exits 2; every other exception is a bug in our code and keeps its traceback (RLM_DEBUG=1
shows the traceback of user errors too). The three types are `ValueError`s, so callers that catch
`ValueError` keep working.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from rlm.base.atomicio import foreign_entries
from rlm.reader.errors import InputError as ReaderInputError
from rlm.retriever.errors import InputError as RetrieverInputError


class UserError(ValueError):
    """Bad config, data, file or option; the message names it and says what to change."""


def read_json_file(path: str | os.PathLike, remedy: str):
    """The JSON in a file the run wrote; a torn or hand-edited one is a UserError naming file and line, then
    `remedy` (what to do about it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); {remedy}") from None


def check_output_folder(
    folder: str | os.PathLike, own: Iterable[str], command: str, option: str = "--out"
) -> None:
    """Refuse an output folder that holds anything but `command`'s own files (glob patterns `own`).

    The command replaces or adds to what is there, so a folder of something else (a run, a checkpoint) would
    lose files or get ours mixed into it. Its own earlier output, an unfinished one included, is accepted:
    rebuilt, or resumed where the command resumes. Checked before the work starts."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path} is a file; `{command}` writes a folder: choose another path")
    foreign = [name + "/" if (path / name).is_dir() else name for name in foreign_entries(path, own)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(
            f"{option} {path} holds files `{command}` did not write ({shown}); choose a new or empty folder, "
            "or remove this one first"
        )


def not_utf8(path: str | os.PathLike, line_no: int, line: bytes) -> UserError:
    """The error for a line of a data file that is not UTF-8, naming the first bad byte and where it is."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"byte 0x{line[err.start]:02x} at offset {err.start} of the line"
    else:  # valid UTF-8 that json.loads took for UTF-16 or UTF-32 from its NUL bytes
        where = "NUL bytes: UTF-16 or UTF-32?"
    return UserError(
        f"{path}:{line_no}: not UTF-8 ({where}); convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`"
    )


def user_errors() -> tuple[type[BaseException], ...]:
    """What the command line reports as one line: our user errors, missing or unreadable files, and an
    unknown passage id in the user's data (`UnknownPassageError`). Any other exception is a bug."""
    return (
        UserError,
        ReaderInputError,
        RetrieverInputError,
        UnknownPassageError,
        FileNotFoundError,
        PermissionError,
    )


class UnknownPassageError(KeyError):
    """A passage id the corpus does not hold: a mistake in the user's data (a gold id, an ids file), reported
    by the CLI as one line, unlike any other KeyError, which is a bug and keeps its traceback."""

    def __str__(self) -> str:  # KeyError's str() quotes its message
        return str(self.args[0]) if self.args else ""


def main_process() -> bool:
    """Whether this is the process that speaks for a launched run (rank 0 of `accelerate launch` or torchrun;
    any process started on its own)."""
    return os.environ.get("RANK", "0") == "0"
