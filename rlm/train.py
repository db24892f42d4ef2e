"""`python -m rlm.train` is `rlm train` (each process of `accelerate launch -m rlm.train --config ...`).

The command line and the config are read and checked by `rlm.cli` before the training code (torch, transformers'
model code: seconds of CPU a process) is imported, so a bad setting is one line from every rank at once, not
after the imports. The training loop is `rlm.training.loop`.
"""

from __future__ import annotations

import sys

from rlm.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    """`rlm train ARGV` (default: this process's arguments), with its error handling."""
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
