"""`rlm toy-world`: generate the offline toy world (corpus + train/dev/test QA with gold passage ids)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlm.errors import check_output_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm toy-world`."""
    from rlm.data.toy_world import QUESTION_TYPES, ToyWorldConfig

    defaults = ToyWorldConfig()  # the generator's own defaults: the help shows what a bare run builds

    parser.add_argument(
        "--out",
        required=True,
        help="output folder (corpus.jsonl, train/dev/test.jsonl, world.json); a folder holding other files "
        "is refused",
    )
    parser.add_argument(
        "--num-passages", type=int, default=defaults.num_passages, help="exact corpus size (100 to millions)"
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="world seed: the same seed, the same world"
    )
    parser.add_argument(
        "--num-cities", type=int, default=defaults.num_cities, help="distinct city answers (closed-book ~1/N)"
    )
    parser.add_argument(
        "--num-occupations", type=int, default=defaults.num_occupations, help="distinct occupation answers"
    )
    add_difficulty_arguments(parser.add_argument_group("how hard the world is"), defaults)
    add_edition_arguments(parser.add_argument_group("the next edition of a world (a corpus update)"))
    parser.add_argument(
        "--question-types",
        default=",".join(defaults.question_types),
        help=f"comma-separated subset of {','.join(QUESTION_TYPES)}",
    )
    parser.add_argument(
        "--max-train-questions",
        type=int,
        default=defaults.max_questions["train"],
        help="cap on train questions (default: all)",
    )
    parser.add_argument(
        "--max-eval-questions",
        type=int,
        default=defaults.max_questions["dev"],
        help="cap on dev and on test questions",
    )


def add_difficulty_arguments(parser, defaults) -> None:
    """What makes retrieval in the toy world hard: near-duplicates, distractors, kin facts, filler."""
    parser.add_argument(
        "--twin-rate",
        type=float,
        default=defaults.twin_rate,
        help="share of people with a near-duplicate name",
    )
    parser.add_argument(
        "--mentions-per-person",
        type=int,
        default=defaults.mentions_per_person,
        help="distractor passages per person",
    )
    parser.add_argument(
        "--kin-facts",
        type=int,
        default=defaults.kin_facts,
        help="relatives' facts per entity and asked relation, worded like the questions (off-the-shelf "
        "retrievers rank them first; the quickstart's world uses 5)",
    )
    parser.add_argument(
        "--filler-rate",
        type=float,
        default=defaults.filler_rate,
        help="share of passages with a filler sentence",
    )


def add_edition_arguments(parser) -> None:
    """`--next-edition-of WORLD`: what changed in a world since its corpus was written, as an update."""
    from rlm.data.toy_world_edition import CHANGES

    parser.add_argument(
        "--next-edition-of",
        metavar="WORLD",
        default=None,
        help="write into --out the next edition of this toy world instead of a new world: add.jsonl and "
        f"delete.txt for `rlm corpus update`, dev.jsonl asking about each change ({', '.join(CHANGES)}), "
        "unchanged_dev.jsonl (the dev questions no change touches), edition.json; --seed draws the changes",
    )
    parser.add_argument(
        "--per-change",
        type=int,
        default=10,
        help="people new, with another occupation, with another employer and removed in the edition (a fifth as many "
        "organisations moved and renamed)",
    )


def run_edition(args: argparse.Namespace) -> int:
    """Write the next edition of `--next-edition-of` and print its counts."""
    from rlm.data.toy_world_edition import build_toy_world_edition, edition_paths

    own = [p.name for p in vars(edition_paths(args.out)).values() if isinstance(p, Path) and p.suffix]
    check_output_folder(args.out, own, "rlm toy-world --next-edition-of")
    paths = build_toy_world_edition(args.next_edition_of, args.out, args.per_change, args.seed)
    made = json.loads(paths.manifest.read_text())
    print(
        f"next edition of {args.next_edition_of} in {paths.root}: {made['added']} passages added, "
        f"{made['replaced']} replaced, {made['deleted']} deleted; questions {made['questions']}; "
        f"{made['unchanged_dev']} dev questions unchanged"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Build the world and print its counts."""
    from rlm.data.toy_world import SPLITS, build_toy_world

    if args.next_edition_of is not None:
        return run_edition(args)

    # Not its `<split>_unanswerable.jsonl` (made from a world later, and kept): a world rebuilt beside them
    # with other settings would leave them asking about the old one.
    own = ("corpus.jsonl", "world.json", *(f"{split}.jsonl" for split in SPLITS))
    check_output_folder(args.out, own, "rlm toy-world")
    paths = build_toy_world(
        args.out,
        num_passages=args.num_passages,
        seed=args.seed,
        num_cities=args.num_cities,
        num_occupations=args.num_occupations,
        twin_rate=args.twin_rate,
        mentions_per_person=args.mentions_per_person,
        kin_facts=args.kin_facts,
        filler_rate=args.filler_rate,
        question_types=tuple(t.strip() for t in args.question_types.split(",") if t.strip()),
        max_questions={
            "train": args.max_train_questions,
            "dev": args.max_eval_questions,
            "test": args.max_eval_questions,
        },
    )
    counts = json.loads(paths.manifest.read_text())["counts"]
    q = counts["questions"]
    print(
        f"toy world in {paths.root}: {counts['passages']} passages, {counts['persons']} people, "
        f"{counts['organisations']} organisations, {counts['cities']} cities; "
        f"questions train {q['train']}, dev {q['dev']}, test {q['test']}"
    )
    return 0
