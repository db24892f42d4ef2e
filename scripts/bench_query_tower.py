"""Query encoding latency of a light query tower (`retriever.query_path: layers:N`, DAFT's efficient query
encoder) against the full one, measured side by side in one run.

    python scripts/bench_query_tower.py                       # the packaged MiniLM, 6 -> 4, 2, 1 layers
    python scripts/bench_query_tower.py --layers 2 --threads 1
    python scripts/bench_query_tower.py --layers 2 --max-length 64 --questions ../shared/data/multihop200/qa.jsonl \
        --out docs/results/bench_query_tower/bench_query_tower_multihop200

For each tower: one question at a time (an interactive demo's latency, tokenizer included) and a batch of
`--batch` questions (throughput), best of `--reps`, on toy-world questions (or `--questions FILE`). Prints a table and writes
`<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rlm.experiments import reporting
from rlm.experiments.benchmarking import best_of

COLUMNS = [
    ("query tower", "tower", ""),
    ("layers", "layers", "d"),
    ("parameters (M)", "params_m", ".1f"),
    ("one question (ms)", "single_ms", ".2f"),
    ("speed-up", lambda r: f"{r['single_speedup']:.2f}x", ""),
    ("batch, per question (ms)", "batch_ms_per_query", ".3f"),
    ("speed-up", lambda r: f"{r['batch_speedup']:.2f}x", ""),
]


def questions(count: int, path: Path | None = None) -> list[str]:
    """`count` questions from a QA JSONL (`path`), else toy-world train questions (generated into a temporary
    folder); cycled when there are fewer."""
    import tempfile

    from rlm.data.qa import load_qa_dataset, read_qa_jsonl
    from rlm.data.toy_world import build_toy_world

    if path is not None:
        found = [ex.question for ex in read_qa_jsonl(path)]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            found = [
                ex.question
                for ex in load_qa_dataset("toy", "train", build_toy_world(tmp, num_passages=200).root)
            ]
    return (found * (count // max(1, len(found)) + 1))[:count]


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument(
        "--path", default=None, help="sentence-transformers folder (default: packaged MiniLM)"
    )
    parser.add_argument("--layers", default="4,2,1", help="comma-separated light query tower depths")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--singles", type=int, default=32, help="questions encoded one at a time per rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument(
        "--questions", type=Path, help="a QA JSONL to take questions from (default: toy world)"
    )
    parser.add_argument("--out", type=Path, default=reporting.results_path("bench_query_tower"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from retriever.encoder import SentenceEncoder, default_retriever_path

    full = SentenceEncoder.from_pretrained(args.path or default_retriever_path(), max_length=args.max_length)
    towers = {f"full ({full.num_layers} layers)": full.eval()}
    towers |= {f"layers:{n}": full.truncated(int(n)).eval() for n in args.layers.split(",") if n}
    batch = questions(args.batch, args.questions)
    singles = batch[: args.singles]
    rows = []
    with torch.inference_mode():
        for tower in towers.values():  # warm-up: first calls pay for allocations and kernel selection
            tower.encode(batch[:8])
        for name, tower in towers.items():
            single_s, _ = best_of(args.reps, lambda t=tower: [t.encode([q]) for q in singles])
            batch_s, _ = best_of(args.reps, lambda t=tower: t.encode(batch, batch_size=args.batch))
            params = sum(p.numel() for p in tower.parameters()) / 1e6
            rows.append({"tower": name, "layers": tower.num_layers, "params_m": params})
            rows[-1] |= {
                "single_ms": 1000 * single_s / len(singles),
                "batch_ms_per_query": 1000 * batch_s / len(batch),
            }
    for row in rows:
        row["single_speedup"] = rows[0]["single_ms"] / row["single_ms"]
        row["batch_speedup"] = rows[0]["batch_ms_per_query"] / row["batch_ms_per_query"]
    results = {
        "command": reporting.command("bench_query_tower.py", argv),
        "machine": reporting.machine(),
        "rows": rows,
    }
    results["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    source = f"Questions from {args.questions}" if args.questions else "Toy-world questions"
    text = (
        "# Query encoding latency: light query towers (`retriever.query_path: layers:N`) against the full one\n\n"
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}. {source}, max length "
        f"{args.max_length} tokens; one question at a time ({len(singles)} per rep, tokenizer included) and "
        f"batches of {args.batch}; best of {args.reps}. Speed-ups are against the full tower in the same run.\n\n"
        + reporting.table(rows, COLUMNS)
    )
    reporting.write_report(args.out, text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
