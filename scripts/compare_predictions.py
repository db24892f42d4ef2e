"""Compare two `rlm evaluate` runs question by question: where their answers differ, and whether the
reader's input (the top-k passage set) differed too.

    python scripts/compare_predictions.py A/predictions.jsonl B/predictions.jsonl --k 4 --examples 2

Prints a markdown table: EM of each, questions right in A and wrong in B (and the reverse), split by whether
the top-k set changed; with the same top-k set in a different order, how many answers changed (a FiD reader
should be order-invariant); then `--examples` flipped questions with both top-k lists.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict[str, dict]:
    rows = {}
    with open(path) as fh:
        for line_no, line in enumerate(fh, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SystemExit(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
            rows[row["id"]] = row
    return rows


def compare(a: dict[str, dict], b: dict[str, dict], k: int) -> dict:
    shared = [q for q in a if q in b]
    if not shared:
        raise SystemExit("the two files have no question id in common")

    def top(row):
        return row["retrieved_ids"][:k]

    same_set = [q for q in shared if set(top(a[q])) == set(top(b[q]))]
    reordered = [q for q in same_set if top(a[q]) != top(b[q])]
    flips = {"right_to_wrong": [], "wrong_to_right": []}
    for q in shared:
        ra, rb = a[q]["exact_match"], b[q]["exact_match"]
        if ra and not rb:
            flips["right_to_wrong"].append(q)
        elif rb and not ra:
            flips["wrong_to_right"].append(q)
    changed = set(shared) - set(same_set)

    def em_gold_first(rows):  # (EM, count) over questions whose first passage is a gold one
        hits = [
            rows[q]["exact_match"]
            for q in shared
            if top(rows[q])[:1] and top(rows[q])[0] in rows[q].get("gold_passage_ids", [])
        ]
        return (sum(hits) / len(hits) if hits else float("nan")), len(hits)

    return {
        "em_gold_first_a": em_gold_first(a),
        "em_gold_first_b": em_gold_first(b),
        "questions": len(shared),
        "em_a": sum(a[q]["exact_match"] for q in shared) / len(shared),
        "em_b": sum(b[q]["exact_match"] for q in shared) / len(shared),
        "same_topk_set": len(same_set),
        "same_set_reordered": len(reordered),
        "same_set_answer_changed": sum(a[q]["prediction"] != b[q]["prediction"] for q in same_set),
        "right_to_wrong": len(flips["right_to_wrong"]),
        "right_to_wrong_topk_changed": sum(q in changed for q in flips["right_to_wrong"]),
        "wrong_to_right": len(flips["wrong_to_right"]),
        "wrong_to_right_topk_changed": sum(q in changed for q in flips["wrong_to_right"]),
        "flipped_ids": flips,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="predictions.jsonl of run A")
    parser.add_argument("b", type=Path, help="predictions.jsonl of run B")
    parser.add_argument("--k", type=int, default=4, help="passages the reader read")
    parser.add_argument("--examples", type=int, default=0, help="right-in-A, wrong-in-B questions to print")
    parser.add_argument("--corpus", type=Path, help="corpus JSONL, to print passage texts in the examples")
    args = parser.parse_args(argv)

    a, b = load(args.a), load(args.b)
    report = compare(a, b, args.k)
    rows = [
        ("questions in both", report["questions"]),
        ("EM of A / B", f"{100 * report['em_a']:.1f} / {100 * report['em_b']:.1f}"),
        (
            "EM when a gold passage is ranked first: A / B (questions)",
            "{:.1f} ({}) / {:.1f} ({})".format(
                100 * report["em_gold_first_a"][0],
                report["em_gold_first_a"][1],
                100 * report["em_gold_first_b"][0],
                report["em_gold_first_b"][1],
            ),
        ),
        (f"same top-{args.k} set", report["same_topk_set"]),
        ("... of which reordered", report["same_set_reordered"]),
        ("... of which the answer changed", report["same_set_answer_changed"]),
        (
            "right in A, wrong in B (top-k changed)",
            f"{report['right_to_wrong']} ({report['right_to_wrong_topk_changed']})",
        ),
        (
            "wrong in A, right in B (top-k changed)",
            f"{report['wrong_to_right']} ({report['wrong_to_right_topk_changed']})",
        ),
    ]
    print("| measure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    texts = {}
    if args.corpus:
        with open(args.corpus) as fh:
            texts = {row["id"]: row["text"] for row in map(json.loads, fh)}
    for q in report["flipped_ids"]["right_to_wrong"][: args.examples]:
        print(
            f"\n{a[q]['question']}  gold {a[q]['answers']}: A {a[q]['prediction']!r}, B {b[q]['prediction']!r}"
        )
        for name, row in (("A", a[q]), ("B", b[q])):
            print(f"  {name}: " + " | ".join(texts.get(pid, pid) for pid in row["retrieved_ids"][: args.k]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
