"""Evaluate a checkpoint (EM/F1, recall@k); the same options as `rlm evaluate`."""

import sys

from rlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
