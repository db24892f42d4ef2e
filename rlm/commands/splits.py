"""`rlm splits`: write a QA dataset's train, dev and test as the literature names them to a folder.

The folder is what a paper's reader needs to check its figures: the three JSONL files, `dev_ids.txt` (the
membership of the dev carve-out, `rlm.data.splits`) and `splits.json` (each split's size, source and the
carve-out's seed). Given back as `--data-path` (or `data.train_path` / `data.dev_path`), it loads as it is.
"""

from __future__ import annotations

import argparse
import json

from rlm.data.splits import LITERATURE_SPLITS
from rlm.errors import check_output_folder

OWN_FILES = ("train.jsonl", "dev.jsonl", "test.jsonl", "dev_ids.txt", "splits.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm splits`."""
    parser.add_argument(
        "--dataset",
        required=True,
        help="nq_open (nq), trivia_qa (tqa) or hotpot_qa (hotpotqa); any registry name",
    )
    parser.add_argument(
        "--data-path", help="a local copy in the dataset's layout (docs/data.md); default: the hub"
    )
    parser.add_argument(
        "--out", required=True, help="folder to write (a folder holding other files is refused)"
    )


def example_line(example) -> str:
    row = {"id": example.id, "question": example.question, "answers": example.answers}
    if example.gold_passage_ids:
        row["gold_passage_ids"] = example.gold_passage_ids
    return json.dumps({**row, **example.meta}, ensure_ascii=False) + "\n"


def run(args: argparse.Namespace) -> int:
    from rlm.base.atomicio import atomic_directory
    from rlm.data.qa import load_qa_split

    check_output_folder(args.out, OWN_FILES, "rlm splits")
    splits = {name: load_qa_split(args.dataset, name, args.data_path) for name in LITERATURE_SPLITS}
    with atomic_directory(args.out) as tmp:
        for name, split in splits.items():
            (tmp / f"{name}.jsonl").write_text(
                "".join(example_line(ex) for ex in split.examples), encoding="utf-8"
            )
        (tmp / "dev_ids.txt").write_text("".join(f"{ex.id}\n" for ex in splits["dev"].examples))
        records = {name: split.record() for name, split in splits.items()}
        (tmp / "splits.json").write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
    for split in splits.values():
        print(split.describe())
    print(f"wrote {args.out}: {', '.join(OWN_FILES)}")
    return 0
