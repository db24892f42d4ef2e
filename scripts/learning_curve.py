"""Plot dev EM against optimizer steps and training wall time from one or more `rlm train` runs.

    python scripts/learning_curve.py runs/quickstart runs/quickstart_closed_book \
        --labels corrector closed_book --out docs/results/reader_learning_curve

Reads each run's `log.jsonl` (periodic validation records carry `dev_exact_match` when `eval_every` > 0) and
`summary.json` (the final validation). Wall time is rebuilt from the logged `steps_per_s`, which the trainer
measures over each logging interval including any validation done in it, so the x axis is the time the run
had spent training when it reached that EM (the buffer build before step 1 is not counted). Writes
`<out>.json` (the curves, with the command that made them) and `<out>.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atomicio import atomic_file, atomic_write_json


def load_curve(run_dir: Path) -> dict:
    """The (step, wall seconds, dev EM) points of one run, plus its final summary."""
    log_path = run_dir / "log.jsonl"
    if not log_path.is_file():
        raise FileNotFoundError(f"{log_path} not found: pass the output_dir of an `rlm train` run")
    wall, last_step, points = 0.0, 0, []
    for line_no, line in enumerate(log_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{log_path}:{line_no}: not JSON ({err})") from None
        if record.get("steps_per_s"):
            wall += (record["step"] - last_step) / record["steps_per_s"]
            last_step = record["step"]
        if "dev_exact_match" in record:
            points.append(
                {"step": record["step"], "wall_s": round(wall, 1), "dev_em": record["dev_exact_match"]}
            )
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if "dev_exact_match" in summary and (not points or points[-1]["step"] != summary.get("steps")):
        points.append(
            {"step": summary["steps"], "wall_s": round(wall, 1), "dev_em": summary["dev_exact_match"]}
        )
    if not points:
        raise ValueError(f"{run_dir}: no dev EM in log.jsonl or summary.json (train with data.dev set)")
    return {"run": str(run_dir), "points": points, "summary": summary}


def plot(curves: list[dict], labels: list[str], out_png: Path, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for curve, label in zip(curves, labels):
        steps = [p["step"] for p in curve["points"]]
        minutes = [p["wall_s"] / 60 for p in curve["points"]]
        em = [p["dev_em"] for p in curve["points"]]
        axes[0].plot(steps, em, marker="o", label=label)
        axes[1].plot(minutes, em, marker="o", label=label)
    for ax, xlabel in zip(axes, ("optimizer steps", "training wall time (minutes)")):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    axes[0].set_ylabel("dev exact match")
    axes[0].legend()
    fig.suptitle("Toy-world dev EM (held-out entities)")
    fig.tight_layout()
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output_dir of each `rlm train` run")
    parser.add_argument("--labels", nargs="+", help="legend label per run (default: folder names)")
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix (.json, .png)")
    parser.add_argument("--target", type=float, default=0.6, help="horizontal goal line (EM)")
    args = parser.parse_args(argv)
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    curves = [load_curve(run) for run in args.runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python scripts/learning_curve.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "curves": [{"label": label, **curve} for label, curve in zip(labels, curves)],
    }
    json_path = args.out.with_suffix(".json")
    atomic_write_json(json_path, payload)
    plot(curves, labels, args.out.with_suffix(".png"), args.target)
    print(f"wrote {json_path} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
