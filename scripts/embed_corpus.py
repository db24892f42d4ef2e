"""Embed a corpus into a fixed passage buffer: the same as `rlm embed` (see `--help`).

Data-parallel: `accelerate launch scripts/embed_corpus.py --corpus ... --out ...`.
"""

import sys

from rlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["embed", *sys.argv[1:]]))
