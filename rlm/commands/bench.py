"""`rlm bench retrieval|reader|training|scale|two-stage|startup|bf16|strategies|synthetic`: run a benchmark
script in scripts/ with its own options."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HELP = (
    "Run a benchmark: retrieval (top-k, index), reader (FiD step), training (per-strategy step time), "
    "scale (sharded top-k on 1 and 2 processes, 21M-row projection), two-stage (faiss candidates re-scored "
    "with h vs exact at 1M-4M rows), startup (corpus scan and fingerprint at 5M passages), bf16 (is bf16 "
    "native on this CPU), strategies (the paper's Tables 1 and 3), "
    "synthetic (its Section 5.3 study)."
)

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
BENCHMARKS = {
    "retrieval": "bench_retrieval.py",
    "reader": "bench_reader.py",
    "training": "bench_training.py",
    "scale": "bench_scale.py",
    "two-stage": "bench_two_stage.py",
    "startup": "bench_startup.py",
    "bf16": "bench_bf16.py",
    "strategies": "compare_strategies.py",
    "synthetic": "synthetic_corrector.py",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm bench`: the benchmark's name, then that script's own options."""
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="passed on to scripts/bench_<name>.py (e.g. --quick; see `rlm bench <name> --help`)",
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
