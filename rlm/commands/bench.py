"""`rlm bench retrieval|reader|training|paper-step|index|demo-scale|demo-reader|two-stage|rescoring|strategies|synthetic`: run a benchmark
script in scripts/ with its own options."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
BENCHMARKS = {
    "retrieval": "bench_retrieval.py",
    "reader": "bench_reader.py",
    "training": "bench_training.py",
    "paper-step": "bench_paper_step.py",
    "index": "bench_index.py",
    "demo-scale": "bench_demo_scale.py",
    "demo-reader": "bench_demo_reader.py",
    "two-stage": "bench_two_stage.py",
    "rescoring": "bench_rescoring.py",
    "strategies": "compare_strategies.py",
    "synthetic": "synthetic_corrector.py",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm bench`: the benchmark's name, then that script's own options."""
    parser.add_argument(
        "benchmark",
        choices=sorted(BENCHMARKS),
        metavar="benchmark",
        help="retrieval (corrected top-k, two-stage search), reader (FiD train step and scoring), training "
        "(per-strategy step time), paper-step (one Algorithm 2 step per strategy at the paper's shapes, random "
        "T5-base/GTR-base weights, and the 8-GPU projection), index (faiss factories: bytes, recall, latency, "
        "projected to 21M passages), demo-scale (the demo's service over 1M passages), demo-reader (the demo's answer "
        "with a T5-base-shaped reader against its FLOP bound, 1 and 8 users), rescoring (an index's candidates re-scored from rows on "
        "disk, cached or not), two-stage (faiss candidates re-scored with h against the exact top-k at "
        "1M-4M rows), strategies (the paper's Tables 1 and 3 at CPU scale), synthetic (its Section 5.3 study)",
    )
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="passed on to the benchmark's script in scripts/ (bench_<name>.py; compare_strategies.py for "
        "strategies, synthetic_corrector.py for synthetic); `rlm bench <name> --help` shows its options",
    )


def script_path(name: str) -> Path:
    """The benchmark script of `name`; FileNotFoundError when this install has no scripts/ folder."""
    path = SCRIPTS_DIR / BENCHMARKS[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark script {path} not found: the benchmarks run from a source checkout "
            "(git clone, then `pip install -e .`)"
        )
    return path


def run(args: argparse.Namespace) -> int:
    """Run the script in a child process (its own threads and memory figures) and return its exit code."""
    path = script_path(args.benchmark)
    return subprocess.call([sys.executable, str(path), *args.script_args])
