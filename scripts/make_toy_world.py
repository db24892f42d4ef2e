"""Generate the offline toy world; the same options as `rlm toy-world`."""

import sys

from rlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["toy-world", *sys.argv[1:]]))
