"""Answering from h(B) against the re-embedded corpus (issue 16, beyond the paper): one trained checkpoint, three
indexes for the same trained query tower and reader, side by side.

- fresh: the corpus re-embedded with the trained passage tower (what the paper does for inference);
- h(B): the run's fixed buffer through its trained corrector (`rlm evaluate --index corrected`);
- B: the fixed buffer as it is (the starting passage tower's embeddings; what h corrects).

Prints a table (EM/F1 when the checkpoint has a reader, answer and gold recall@k, seconds to build the index),
writes `<out>.json` and `<out>.md`.

    python scripts/bench/answer_from_hb.py --checkpoint runs/quickstart/final --data-path runs/quickstart/toy_world
    python scripts/bench/answer_from_hb.py --checkpoint RUN/final --dataset jsonl --data-path dev.jsonl \
        --corpus ../shared/data/multihop200/corpus.jsonl --retrieval-only
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lab import reporting

from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.inference import evaluation, indexing
from rlm.inference.checkpoint import load_checkpoint, reader_passages_from_config
from rlm.inference.corrected_index import corrected_index, run_buffer_dir

METRICS = ("exact_match", "f1", "recall@1", "recall@5", "recall@20", "gold_recall@1", "gold_recall@5")


def indexes(args, corpus, retriever):
    """(name, index, seconds to build it, what building it cost) for fresh, h(B) and B."""
    from rlm.retriever.buffer import PassageBuffer

    start = time.perf_counter()
    fresh = indexing.build_index(
        indexing.embed_corpus(retriever.passage_tower, corpus.retrieval_texts()), corpus.ids
    )
    yield "fresh (re-embedded)", fresh, time.perf_counter() - start, f"{len(corpus):,} passages re-embedded"
    built = corrected_index(args.checkpoint, corpus, args.buffer)
    yield "h(B) (corrected)", built.index, built.correct_s + built.index_s, "0 re-embedded"
    start = time.perf_counter()
    buffer = PassageBuffer.load(
        run_buffer_dir(args.checkpoint, args.buffer), corpus_fingerprint=corpus.fingerprint
    )
    stale = indexing.build_index(buffer.embeddings.float().numpy(), corpus.ids)
    yield "B (stale)", stale, time.perf_counter() - start, "0 re-embedded"


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--checkpoint", required=True, help="final/ folder of a corrector run")
    parser.add_argument("--dataset", default="toy")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--corpus", help="default: corpus.jsonl in --data-path")
    parser.add_argument("--buffer", help="the run's buffer folder (default: from its config.yaml)")
    parser.add_argument("--retrieval-only", action="store_true", help="recall only (e.g. an Algorithm 1 run)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--out", default=reporting.results_path("answer_from_hb"))
    args = parser.parse_args(argv)

    corpus = load_corpus(args.corpus or Path(args.data_path) / "corpus.jsonl")
    examples = load_qa_dataset(args.dataset, args.split, args.data_path)
    retriever, reader, config = load_checkpoint(args.checkpoint, need_reader=not args.retrieval_only)
    retriever.eval()
    k, num_passages = min(args.k, len(corpus)), reader_passages_from_config(config)
    rows = []
    for name, index, seconds, cost in indexes(args, corpus, retriever):
        result = evaluation.run_evaluation(
            examples, corpus, retriever, reader, index=index, k=k, num_passages=num_passages
        )
        rows.append({"name": name, "metrics": result.metrics, "index_seconds": seconds, "cost": cost})
        print(f"{name}: index {seconds:.2f} s, {result.metrics}", file=sys.stderr)
    results = {
        "command": reporting.command("answer_from_hb.py", argv),
        "machine": reporting.machine(),
        "checkpoint": str(args.checkpoint),
    }
    results |= {"questions": len(examples), "passages": len(corpus), "rows": rows}
    shown = [m for m in METRICS if m in rows[0]["metrics"]]
    columns = [("index", "name", ""), *((m, lambda r, m=m: 100 * r["metrics"][m], ".1f") for m in shown)]
    columns += [("index built in s", "index_seconds", ".2f"), ("cost", "cost", "")]
    text = (
        "# Answering from h(B): the fixed buffer through the trained corrector vs the re-embedded corpus\n\n"
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; {len(examples)} questions, corpus "
        f"of {len(corpus):,} passages; checkpoint `{args.checkpoint}`.\n\n{reporting.table(rows, columns)}"
    )
    reporting.write_report(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
