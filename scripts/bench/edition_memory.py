"""Does the quickstart's reader answer a changed fact from memory? (Knowledge conflicts, Longpre et al. 2021.)

The toy world's next edition draws every change from the dev split, so no changed fact is about a subject the
training questions asked about, and the ones it gets wrong are of question types the world never trains
(`rlm quickstart`'s last stage, `rlm.quickstart.living_corpus`). This probe asks what the edition cannot: it
changes facts of question types the run trained on (an organisation's city, a person's occupation) for
subjects of the train split, whose old facts the reader was trained to answer for hundreds of steps, and for
subjects of the dev split alike; applies them with one corpus update to the run's index of the base corpus
(the quickstart's `edition/embeddings`, or embedded here); and counts, per group, how often the reader says
the new value, the old one, or something else, and what the answer policy lets through. It also counts the
reader's tokens per subject name: the world's names and the edition's new people's.

    python scripts/bench/edition_memory.py --run runs/quickstart   # a run of `rlm quickstart` (its last stage on)
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

from lab import reporting

from rlm.data.toy_world_edition import _asked, _EditionWriter, _fact_text, _world_as_written
from rlm.quickstart import living_corpus
from rlm.quickstart.living_corpus import LivingCorpus

CHANGED = {"located_in": "moved", "occupation": "changed_occupation"}  # the relation each change rewrites
READ = 4  # passages the quickstart's reader reads


def write_probe(world: Path, out: Path, per_group: int, seed: int) -> None:
    """An edition in `living_corpus`'s layout: `per_group` organisations moved and persons given another
    occupation, of the train split and of the dev split each; each question's meta names its split, whether
    training asked about its subject, and the old value."""
    config, cities, occupations, persons, orgs = _world_as_written(world)
    rng = random.Random(f"edition-memory-{seed}")
    trained = {
        json.loads(line)["meta"]["subject"] for line in (world / "train.jsonl").read_text().splitlines()
    }
    out.mkdir(parents=True)
    questions = []
    with open(out / "add.jsonl", "w") as f:
        writer = _EditionWriter(f, "probe-")
        for split in ("train", "dev"):
            for relation, entities, values in (
                ("located_in", orgs, cities),
                ("occupation", persons, occupations),
            ):
                chosen = [e for e in entities if e.split == split]
                rng.shuffle(chosen)
                for entity in chosen[:per_group]:
                    old = getattr(entity, relation)
                    new = rng.choice([v for v in values if v != old])
                    text = _fact_text(
                        rng, relation, entity.name, new, getattr(entity, "gender", None), config.filler_rate
                    )
                    pid = writer.replace(entity.passage_ids[relation], entity.name, text)
                    question = _asked(rng, relation, entity.name, new, [pid], CHANGED[relation])
                    question["meta"] |= {
                        "split": split,
                        "subject_trained": entity.name in trained,
                        "old": old,
                    }
                    questions.append(question)
    with open(out / "dev.jsonl", "w") as f:
        f.writelines(json.dumps(q | {"id": f"probe-{n:04d}"}) + "\n" for n, q in enumerate(questions))
    (out / "delete.txt").write_text("")
    (out / "unchanged_dev.jsonl").write_text("")


def tally(records: list[dict]) -> list[dict]:
    """Per (change, subject asked about in training): questions, new passage among the `READ` read, what the
    reader said, what the answer policy let through."""
    counts: dict[tuple, Counter] = {}
    for r in records:
        key = (r["meta"]["change"], r["meta"]["subject_trained"])
        c = counts.setdefault(key, Counter())
        c["questions"] += 1
        c["read"] += r["gold_passage_ids"][0] in r["retrieved_ids"][:READ]
        c["says_new"] += r["prediction"] == r["answers"][0]
        c["says_old"] += r["prediction"] == r["meta"]["old"]
        c["answered_right"] += (not r["abstained"]) and bool(r["exact_match"])
        c["abstained"] += r["abstained"]
    return [{"change": k[0], "subject_trained": k[1], **c} for k, c in sorted(counts.items())]


def name_tokens(run: Path) -> list[dict]:
    """Mean reader tokens per subject name: the world's names (asked about in training or not) and the
    edition's new people (from `<run>/edition/update`, when the run's last stage wrote it)."""
    from rlm.reader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(run / "final" / "reader")
    world = run / "toy_world"
    groups = {}
    for split in ("train", "dev"):
        lines = (world / f"{split}.jsonl").read_text().splitlines()
        groups[f"the world's people and organisations, {split} split"] = {
            json.loads(x)["meta"]["subject"] for x in lines
        }
    edition = run / "edition" / "update" / "dev.jsonl"
    if edition.is_file():
        rows = [json.loads(x) for x in edition.read_text().splitlines()]
        groups["the edition's new people"] = {
            r["meta"]["subject"] for r in rows if r["meta"]["change"] == "new"
        }
    return [
        {
            "names": name,
            "count": len(subjects),
            "tokens": sum(len(tokenizer.tokenize(" " + s)) for s in subjects) / len(subjects),
        }
        for name, subjects in groups.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--run", required=True, help="a `rlm quickstart` run folder (final/, toy_world/)")
    parser.add_argument("--per-group", type=int, default=20, help="changes per (split, relation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=reporting.results_path("edition_memory"))
    args = parser.parse_args(argv)
    run = Path(args.run)
    living = LivingCorpus(run / "edition_memory", run / "toy_world", run / "final", args.per_group)
    shutil.rmtree(living.root, ignore_errors=True)
    write_probe(living.world, living.update.root, args.per_group, args.seed)
    if (run / "edition" / "embeddings").is_dir():  # the quickstart's: the same tower, the same corpus
        shutil.copytree(run / "edition" / "embeddings", living.embeddings)
    living_corpus._index_base_corpus(living, None)
    measured = living_corpus.measure_living_corpus(living, num_passages=READ)
    after = (living.root / "after" / "predictions.jsonl").read_text().splitlines()
    results = {
        "command": reporting.command("edition_memory.py", argv),
        "machine": reporting.machine(),
        "run": str(run),
        "groups": tally([json.loads(line) for line in after]),
        "names": name_tokens(run),
        "retired_shown": measured["retired_shown"],
    }
    columns = [
        ("change", "change", ""),
        ("subject asked about in training", lambda r: "yes" if r["subject_trained"] else "no", ""),
        ("questions", "questions", "d"),
        ("new passage read", "read", "d"),
        ("reader says the new value", "says_new", "d"),
        ("reader says the old value", "says_old", "d"),
        ("answered right (policy)", "answered_right", "d"),
        ("abstained", "abstained", "d"),
    ]
    names = [("names", "names", ""), ("how many", "count", "d"), ("reader tokens per name", "tokens", ".2f")]
    text = (
        "# Does the reader answer a changed fact from memory?\n\n"
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; run `{run}`; facts of "
        "trained question types changed for train-split and dev-split subjects, one corpus update, nothing "
        f"retrained.\n\n{reporting.table(results['groups'], columns)}\n\n{reporting.table(results['names'], names)}\n"
    )
    reporting.write_report(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
