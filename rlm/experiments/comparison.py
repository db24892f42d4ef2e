"""A strategy comparison's table and plots, made from its JSON alone.

`scripts/compare_strategies.py` trains the runs and writes `<out>.json`: every run's figures (and its drift and
KL over training), the table's settings, the dropout floor. Everything a reader looks at is made from that file
here, so a table can be re-rendered or re-plotted without training anything
(`python scripts/comparison_table.py <out>.json`):

* `<out>.md`: one row per strategy, mean ± spread (population std) over the seeds;
* `<out>.png`: quality against passages re-embedded during training (the paper's Fig. 2);
* `<out>_drift.png`: mean ||g(y) - B_y|| and KL(P~ || P_stale), KL(P~ || P_h) over training (first seed).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from atomicio import atomic_file, atomic_write_text

# Columns every table has after its metrics: the cost axis and the drift that explains it.
DRIFT_KEYS = ("drift", "kl_fresh_stale", "kl_fresh_corrected")


def table_metrics(algorithm: int, runs: list[dict]) -> list[str]:
    """The quality columns: gold recall for Algorithm 1; EM (and the own-selection figures when the runs
    validated from their strategy's selection) for Algorithm 2."""
    if algorithm == 1:
        return ["dev_gold_recall@1", "dev_gold_recall@5", "dev_gold_recall@20", "dev_gold_recall@100"]
    metrics = ["dev_exact_match", "dev_gold_passage_exact_match", "dev_gold_recall@1", "dev_gold_recall@5"]
    if any("dev_selection_exact_match" in r for r in runs):  # `--set eval_selection=true`
        metrics[1:1] = ["dev_selection_exact_match", "dev_selection_gold_recall@1"]
    return metrics


def summarise(runs: list[dict], metrics: list[str]) -> list[dict]:
    """One row per strategy, in the order the runs list them: mean and population std over its seeds."""
    rows = []
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == strategy]
        row: dict[str, Any] = {"strategy": strategy, "seeds": len(mine)}
        for key in [*metrics, "reembedded", "wall_s", *DRIFT_KEYS]:
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                row[key] = statistics.fmean(values)
                row[key + "_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def header(metric: str) -> str:
    """Column name of a metric: dev_gold_recall@5 -> gold R@5, dev_exact_match -> EM."""
    names = {
        "dev_exact_match": "EM",
        "dev_gold_passage_exact_match": "EM with gold passages",
        "dev_selection_exact_match": "EM own selection",
        "dev_selection_gold_recall@1": "gold R@1 own selection",
    }
    return names.get(metric, metric.replace("dev_gold_recall@", "gold R@").replace("dev_recall@", "R@"))


def to_markdown(rows: list[dict], metrics: list[str], title: str) -> str:
    def cell(row, key, scale=100.0, digits=1):
        if key not in row:
            return "-"
        value, spread = row[key] * scale, row.get(key + "_std", 0.0) * scale
        return f"{value:.{digits}f} ± {spread:.{digits}f}" if row["seeds"] > 1 else f"{value:.{digits}f}"

    head = ["strategy", *(header(m) for m in metrics), "re-embedded", "drift", "KL(P~‖P_stale)", "KL(P~‖P_h)"]
    head.append("wall (s)")
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = [row["strategy"], *(cell(row, m) for m in metrics)]
        cells += [f"{row.get('reembedded', 0):.0f}", *(cell(row, key, 1, 3) for key in DRIFT_KEYS)]
        cells.append(f"{row.get('wall_s', 0):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def title_of(args: dict) -> str:
    return (
        f"Algorithm {args['algorithm']}, {args['data']}, start {args['start']}: {args['steps']} steps, seeds "
        f"{args['seeds']} (R={args['refresh_every']}, SNM M={args['snm_size']}, regression "
        f"s'={args.get('regression_samples', 200)})"
    )


def report_markdown(report: dict, rows: list[dict], metrics: list[str]) -> str:
    """The whole `<out>.md` of a comparison JSON (its `summarise`d rows given): the table, the dropout floor,
    the settings, the precision."""
    args = report["args"]
    table = to_markdown(rows, metrics, title_of(args))
    table += (
        f"\n\nDropout floor of `drift` (train-mode g(y) vs eval-mode g(y) of the starting passage tower, no "
        f"update): {report['dropout_floor']:.3f}. Settings: {' '.join(args['overrides']) or 'defaults'}."
    )
    precision, configured = report.get("precision"), report.get("mixed_precision")
    if precision is not None and precision != configured:
        table += f" Trained with mixed_precision={precision}: this CPU has no native bf16 (`rlm.precision`)."
    return table


def drift_log(log_file: Path) -> list[dict]:
    """The drift and KL figures a run logged over training (the `drift_log` of its JSON record)."""
    if not log_file.exists():
        return []
    rows = [json.loads(line) for line in log_file.read_text().splitlines()]
    return [{k: r[k] for k in ("step", *DRIFT_KEYS) if k in r} for r in rows if "drift" in r]


def plot_quality(rows: list[dict], metric: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        if metric not in row:
            continue
        x = row.get("reembedded", 0) + 1  # log axis: 0 re-embedded plots at 1
        ax.errorbar(x, row[metric] * 100, yerr=row.get(metric + "_std", 0) * 100, fmt="o", capsize=3)
        ax.annotate(row["strategy"], (x, row[metric] * 100), textcoords="offset points", xytext=(5, 5))
    ax.set_xscale("log")
    ax.set_xlabel("passages re-embedded during training (+1, log scale)")
    ax.set_ylabel(metric.replace("dev_", "") + " (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_drift(runs: list[dict], path: Path, title: str) -> None:
    """Drift over training, per strategy (first seed): ||g(y) - B_y|| and KL(P~ || P_stale / P_h) on S_x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The "start" row did not train; a JSON from before the runs carried their logs has nothing to draw, and
    # an existing plot is left as it is.
    runs = [r for r in runs if r["seed"] is not None and r.get("drift_log")]
    if not runs:
        return
    fig, (ax_norm, ax_kl) = plt.subplots(1, 2, figsize=(11, 4))
    first_seed = min(r["seed"] for r in runs)
    for run in runs:
        log = run["drift_log"]
        if run["seed"] != first_seed:
            continue
        steps = [r["step"] for r in log]
        (line,) = ax_norm.plot(steps, _smooth([r["drift"] for r in log]), label=run["strategy"])
        ax_kl.plot(steps, _smooth([r["kl_fresh_stale"] for r in log]), color=line.get_color())
        if "kl_fresh_corrected" in log[0]:
            corrected = _smooth([r["kl_fresh_corrected"] for r in log])
            ax_kl.plot(steps, corrected, "--", color=line.get_color(), label=f"{run['strategy']}: P_h")
    ax_norm.set_ylabel("mean ||g(y) - B_y|| on S_x")
    ax_kl.set_ylabel("KL(P~ || P_stale) (solid), KL(P~ || P_h) (dashed)")
    for ax in (ax_norm, ax_kl):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: drift of the fixed buffer over training (seed {first_seed}, 10-step mean)")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def render(json_path: str | Path) -> str:
    """Write `<stem>.md`, `<stem>.png` and `<stem>_drift.png` next to a comparison JSON; return the markdown."""
    json_path = Path(json_path)
    report = json.loads(json_path.read_text())
    args, runs = report["args"], report["runs"]
    metrics = table_metrics(args["algorithm"], runs)
    rows = summarise(runs, metrics)
    table = report_markdown(report, rows, metrics)
    atomic_write_text(json_path.with_suffix(".md"), table + "\n")
    short = title_of(args).split(":")[0]
    plot_quality(rows, metrics[0], json_path.with_suffix(".png"), short)
    plot_drift(runs, json_path.with_name(json_path.stem + "_drift.png"), short)
    return table
