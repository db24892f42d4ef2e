"""Where `rlm` keeps what it can rebuild: corpus fingerprints and scans, and the indexes the demo embeds.

`cache_dir(folder)` is `folder` when a command is given one (`--cache-dir`), else `$RLM_CACHE_DIR`, else
`$XDG_CACHE_HOME/rlm`, else `~/.cache/rlm` (where Hugging Face keeps its own). Never inside a checkpoint: a
`final/` folder stays as training wrote it, one a user copies, publishes or mounts read-only. Every entry is
keyed by what it was made from (a corpus file's path and stamp; a passage tower's and a corpus's fingerprints),
so runs, checkpoints and commands share one cache safely, and deleting it costs only the time to rebuild.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "RLM_CACHE_DIR"
CORPUS_FINGERPRINTS = Path("corpora") / "fingerprints.json"  # `rlm.data.corpus.load_corpus`'s cache file


def cache_dir(folder: str | os.PathLike | None = None) -> Path:
    """The cache folder: `folder`, else `$RLM_CACHE_DIR`, else `$XDG_CACHE_HOME/rlm`, else `~/.cache/rlm`."""
    if folder:
        return Path(folder)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlm"


def corpus_fingerprint_cache(folder: str | os.PathLike | None = None) -> Path:
    """The file `load_corpus(fingerprint_cache=...)` remembers corpus fingerprints and scans in, under
    `cache_dir(folder)`."""
    return cache_dir(folder) / CORPUS_FINGERPRINTS
