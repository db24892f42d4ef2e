"""Re-render a strategy comparison's table and plots from its JSON, without training anything.

    python scripts/comparison_table.py docs/results/compare_alg2_toy_random_gtr.json

writes `<stem>.md`, `<stem>.png` and `<stem>_drift.png` next to it (`rlm.experiments.comparison`) and prints the table.
`scripts/compare_strategies.py` trains the runs and calls the same code. A JSON written before the runs carried
their drift logs leaves `<stem>_drift.png` as it is.
"""

from __future__ import annotations

import argparse

from rlm.experiments.comparison import render


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", nargs="+", help="<out>.json written by scripts/compare_strategies.py")
    for path in parser.parse_args().json:
        print(render(path))


if __name__ == "__main__":
    main()
