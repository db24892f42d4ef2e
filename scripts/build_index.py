"""Build a faiss inference index: the same as `rlm index` (see `--help`)."""

import sys

from rlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["index", *sys.argv[1:]]))
