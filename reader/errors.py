"""The reader's user-facing error: what a caller gave it is wrong, not our code.

A tokenizer or model folder it cannot use, a reader config with unknown keys or invalid JSON, a setting out of
range. Command lines report it as one readable line; every other exception from this package is a bug and
keeps its traceback. A `ValueError`, so callers that catch `ValueError` keep working.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input to the reader (a folder, a file, a setting); the message says what to change."""
