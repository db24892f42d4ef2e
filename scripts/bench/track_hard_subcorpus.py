"""Validate on a hard subcorpus H_k and check that it tracks full-corpus metrics across checkpoints.

    python scripts/bench/track_hard_subcorpus.py --data-path runs/toy_world --checkpoints runs/a/final runs/b/final \
        --hard-k 20 --out runs/hard_subcorpus

Builds H_k (dev gold passages + the initial retriever's top-k; saved as `<out>/hard_subcorpus.txt`, or reused
with --subcorpus), evaluates every checkpoint on H_k and on the full corpus, and reports the Spearman and
Kendall rank correlation of each metric between the two (`<out>/tracking.json` and a table).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lab.reporting import table

from rlm.base.atomicio import atomic_write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoints", nargs="*", default=[], help="checkpoint folders (retriever/ + reader/)"
    )
    parser.add_argument("--dataset", default="toy")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--data-path", help="local dataset file or folder (a toy world folder for 'toy')")
    parser.add_argument("--corpus", help="corpus file; default: corpus.jsonl in --data-path")
    parser.add_argument("--subcorpus", help="reuse an ids file instead of building H_k")
    parser.add_argument("--initial-retriever", help="retriever that defines H_k (default: packaged MiniLM)")
    parser.add_argument("--hard-k", type=int, default=100, help="top-k of the initial retriever kept in H_k")
    parser.add_argument("--k", type=int, default=100, help="passages retrieved per question when evaluating")
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--retrieval-only", action="store_true", help="recall only (no reader needed)")
    parser.add_argument("--out", required=True, help="output folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.training.hard_subcorpus import (
        build_hard_subcorpus,
        load_subcorpus,
        save_subcorpus_ids,
        track_checkpoints,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_qa_dataset(args.dataset, args.split, args.data_path)[: args.max_examples]
    corpus_path = args.corpus or (Path(args.data_path) / "corpus.jsonl" if args.data_path else None)
    if corpus_path is None:
        raise ValueError("no corpus: pass --corpus FILE or a --data-path folder holding corpus.jsonl")
    corpus = load_corpus(corpus_path)
    ids_path = Path(args.subcorpus) if args.subcorpus else out / "hard_subcorpus.txt"
    if not args.subcorpus:
        from rlm.retriever.encoder import DualEncoder, default_retriever_path

        start = time.perf_counter()
        initial = DualEncoder.from_pretrained(args.initial_retriever or default_retriever_path())
        save_subcorpus_ids(build_hard_subcorpus(corpus, examples, initial, k=args.hard_k), ids_path)
        print(f"built H_{args.hard_k} in {time.perf_counter() - start:.1f}s -> {ids_path}")
    subcorpus = load_subcorpus(corpus, ids_path)
    print(f"H_k: {len(subcorpus)} of {len(corpus)} passages ({100 * len(subcorpus) / len(corpus):.1f}%)")
    if len(args.checkpoints) < 2:
        print("pass two or more --checkpoints to measure how H_k metrics track full-corpus metrics")
        return 0
    report = track_checkpoints(
        args.checkpoints, examples, corpus, subcorpus, retrieval_only=args.retrieval_only, k=args.k
    )
    atomic_write_json(out / "tracking.json", report)
    rows = [{"metric": metric, **corr} for metric, corr in report["correlation"].items()]
    print(table(rows, [("metric", "metric", ""), *((name, name, ".3f") for name in ("spearman", "kendall"))]))
    print(f"\nwrote {out / 'tracking.json'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
