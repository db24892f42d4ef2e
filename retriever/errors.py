"""The retriever's user-facing error: what a caller gave it is wrong, not our code.

A model folder it cannot load, a buffer or index built from another corpus or encoder, a file on disk that
disagrees with its metadata, a setting out of range. Command lines report it as one readable line; every other
exception from this package is a bug and keeps its traceback. A `ValueError`, so callers that catch
`ValueError` keep working.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input to the retriever (a folder, a file, a setting); the message says what to change."""
