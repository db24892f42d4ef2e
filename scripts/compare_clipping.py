"""Per-component clipping (DDP) against DeepSpeed ZeRO-2's one global norm, on the tiny toy-world run: how often
each clips and where the losses end. Two CPU processes each (gloo), fp32, the same seed and data.

    python scripts/compare_clipping.py [--steps 40] [--out docs/results/deepspeed_clipping/deepspeed_clipping]

Prints a table and writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny run the tests share

from tiny_run import as_set_args, tiny_overrides  # noqa: E402

from rlm.experiments.reporting import command, machine, machine_line, results_path, table, write_report  # noqa: E402

LAUNCHERS = {
    "DDP, per component": ("cpu_2proc.yaml", []),
    "ZeRO-2, one global norm": ("deepspeed_zero2.yaml", ["--num_processes", "2"]),
}


def run(work: Path, name: str, config: str, flags: list[str], steps: int, max_norm: float) -> list[dict]:
    extra = ["cpu=true", f"optim.max_steps={steps}", "optim.warmup_steps=4", "log_every=1", "save_every=0"]
    extra += ["optim.questions_per_step=8", "mixed_precision=no", f"optim.max_grad_norm={max_norm}"]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs" / "accelerate" / config),
    ]
    cmd += [*flags, "-m", "rlm.train", "--overwrite", *as_set_args(tiny_overrides(work, name, *extra))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in (work / name / "log.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=results_path("deepspeed_clipping"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (config, flags)) in enumerate(LAUNCHERS.items()):
            log = run(Path(tmp), f"run{i}", config, flags, args.steps, args.max_grad_norm)
            last = log[-10:]
            row = {
                "launcher": label,
                **{
                    k: statistics.mean(r[k] for r in last)
                    for k in ("loss", "reader_loss", "retriever_loss", "corrector_loss")
                },
            }
            for key in sorted(k for k in log[0] if k.startswith("grad_norm")):
                values = [r[key] for r in log]
                row[key] = {
                    "median": statistics.median(values),
                    "clipped_steps": sum(v > args.max_grad_norm for v in values),
                }
            rows.append(row)

    def norms(row):
        return ", ".join(
            f"{k[len('grad_norm_') :]} {v['median']:.3f} ({v['clipped_steps']}/{args.steps})"
            for k, v in row.items()
            if k.startswith("grad_norm")
        )

    columns = [("launcher", "launcher", ""), ("loss", "loss", ".4f"), ("reader", "reader_loss", ".4f")]
    columns += [("retriever", "retriever_loss", ".4f"), ("corrector", "corrector_loss", ".4f")]
    columns.append(("gradient norms: median (steps clipped)", norms, ""))
    results = {
        "command": command("compare_clipping.py", argv),
        "machine": machine(),
        "steps": args.steps,
        "rows": rows,
    }
    text = (
        f"# Gradient clipping: DDP per component vs DeepSpeed ZeRO-2 global\n\n`{results['command']}`; "
        f"{machine_line(results['machine'])}; {args.steps} steps, 2 processes each, max_grad_norm "
        f"{args.max_grad_norm}; losses: mean of the last 10 steps.\n\n{table(rows, columns)}"
    )
    write_report(args.out, text, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
