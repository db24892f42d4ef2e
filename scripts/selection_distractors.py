"""What fills each quickstart run's top-K besides the gold passage, on the selection it answers from.

For a `rlm quickstart` output folder: the corrector run over h(B) and over the re-embedded corpus, the stale
run over B and over the re-embedded corpus, exhaustive over the re-embedded corpus (its last refresh), frozen
over B. Per dev question: gold@1, gold in the top-K, and the other K-1 passages split into the subject's
relatives' facts (the toy world's kin facts, worded like the question), the subject's other own facts, and
passages about other entities. Prints a markdown table, writes `<out>.json` and `<out>.md`.

    python scripts/selection_distractors.py runs/quickstart --out docs/results/selection_distractors

Or any runs over one toy world (a `scripts/compare_strategies.py --algorithm 2` work folder), each
`--run NAME=CHECKPOINT:INDEX` with INDEX one of B, h(B), re-embedded:

    W=runs/compare/alg2_notwins
    python scripts/selection_distractors.py --world $W/toy --buffer $W/buffer \
        --run frozen=$W/frozen_seed0/final:B --run corrector=$W/corrector_seed0/final:h(B) \
        --run corrector=$W/corrector_seed0/final:re-embedded --out /tmp/distractors
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from retriever.buffer import PassageBuffer
from retriever.corrector import CorrectorNetwork
from retriever.encoder import DualEncoder
from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.experiments.reporting import results_path, table, write_report

KIN = re.compile(
    r"\b(sister|brother|mother|father|aunt|uncle|grand\w+|cousin|son|daughter|wife|husband|niece|nephew)\b",
    re.I,
)
COLUMNS = ("gold@1", "gold in top-K", "relatives' facts", "subject's other facts", "other entities")
RUNS = (  # (row name, checkpoint under the quickstart folder, index it answers from)
    ("corrector", "final", "h(B)"),
    ("corrector", "final", "re-embedded"),
    ("stale", "baselines/stale/final", "B"),
    ("stale", "baselines/stale/final", "re-embedded"),
    ("exhaustive", "baselines/exhaustive/final", "re-embedded"),
    ("frozen", "baselines/frozen/final", "B"),
)


def composition(corpus, dev, top: list[list[int]]) -> dict[str, float]:
    """Per-question means of what the selected rows are."""
    counts = dict.fromkeys(COLUMNS, 0.0)
    for ex, row in zip(dev, top, strict=True):
        gold = {corpus.index_of(g) for g in ex.gold_passage_ids}
        counts["gold@1"] += row[0] in gold
        counts["gold in top-K"] += any(r in gold for r in row)
        subject = ex.meta["subject"]
        for r in row:
            if r in gold:
                continue
            passage = corpus[r]
            if subject in passage.text and KIN.search(passage.text):
                counts["relatives' facts"] += 1
            elif passage.title == subject:
                counts["subject's other facts"] += 1
            else:
                counts["other entities"] += 1
    return {key: round(value / len(dev), 3) for key, value in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "quickstart", type=Path, nargs="?", help="a `rlm quickstart --output-dir` folder (its five runs)"
    )
    parser.add_argument("--world", type=Path, help="instead: a toy-world folder (corpus.jsonl, dev.jsonl)")
    parser.add_argument("--buffer", type=Path, help="with --world: the runs' fixed buffer B")
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="NAME=CHECKPOINT:INDEX",
        help="with --world (repeatable)",
    )
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-questions", type=int, default=200)
    parser.add_argument("--out", default=results_path("quickstart", "selection_distractors"))
    args = parser.parse_args()
    if (args.quickstart is None) == (args.world is None) or (args.world and not (args.buffer and args.run)):
        parser.error("pass a quickstart folder, or --world with --buffer and at least one --run")
    if args.quickstart is not None:
        root = args.quickstart
        world, buffer_dir = root / "toy_world", root / "buffer"
        runs = [(name, root / folder, index) for name, folder, index in RUNS]
    else:
        root, world, buffer_dir = args.world, args.world, args.buffer
        runs = []
        for spec in args.run:
            name, _, rest = spec.partition("=")
            checkpoint, _, index = rest.rpartition(":")
            if not name or not checkpoint or index not in ("B", "h(B)", "re-embedded"):
                parser.error(
                    f"--run {spec!r}: expected NAME=CHECKPOINT:INDEX, INDEX one of B, h(B), re-embedded"
                )
            runs.append((name, Path(checkpoint), index))
    corpus = load_corpus(world / "corpus.jsonl")
    dev = load_qa_dataset("toy", "dev", world)[: args.max_questions]
    buffer = PassageBuffer.load(buffer_dir, corpus_fingerprint=corpus.fingerprint)
    stale = torch.cat([block.float() for _, block in buffer.iter_chunks(len(buffer))])
    rows = []
    loaded = {}  # a checkpoint read from two indexes is loaded, and its questions embedded, once
    for name, checkpoint, index in runs:
        if checkpoint not in loaded:
            retriever = DualEncoder.from_pretrained(str(checkpoint / "retriever")).eval()
            loaded[checkpoint] = retriever, retriever.query_tower.encode([ex.question for ex in dev])
        retriever, queries = loaded[checkpoint]
        if index == "B":
            passages = stale
        elif index == "h(B)":
            corrector = CorrectorNetwork.from_pretrained(checkpoint / "corrector").eval()
            with torch.no_grad():
                passages = corrector(stale)
        else:
            passages = retriever.passage_tower.encode(corpus.retrieval_texts())
        top = (queries @ passages.T).topk(args.k).indices.tolist()
        rows.append({"run": name, "index": index, **composition(corpus, dev, top)})
    columns = [("run", "run", ""), ("index", "index", "")]
    columns += [(c.replace("K", str(args.k)), c, ".2f") for c in COLUMNS]
    text = (
        f"{len(dev)} dev questions of {root}; passages per question among the top {args.k} (besides the gold)"
    )
    write_report(
        args.out, f"{text}\n\n{table(rows, columns)}", {"quickstart": str(root), "k": args.k, "rows": rows}
    )


if __name__ == "__main__":
    main()
