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

from reader.errors import InputError as ReaderInputError
from retriever.errors import InputError as RetrieverInputError


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


def user_errors() -> tuple[type[BaseException], ...]:
    """What the command line reports as one line: our user errors, missing or unreadable files, and an
    unknown passage id in the user's data (`UnknownPassageError`). Any other exception is a bug."""
    from rlm.data.corpus import UnknownPassageError

    return (
        UserError,
        ReaderInputError,
        RetrieverInputError,
        UnknownPassageError,
        FileNotFoundError,
        PermissionError,
    )
