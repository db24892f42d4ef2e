"""A strategy comparison's table and plots (`scripts/bench/compare_strategies.py` describes them), made from its JSON
alone, so that `--render <out>.json` redoes them without training.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lab.reporting import figure, table, write_report

# Columns every table has after its metrics: the cost axis and the drift that explains it.
DRIFT_KEYS = ("drift", "kl_fresh_stale", "kl_fresh_corrected")
HEADERS = {
    "dev_exact_match": "EM",
    "dev_gold_passage_exact_match": "EM with gold passages",
    "dev_selection_exact_match": "EM own selection",
    "dev_selection_gold_recall@1": "gold R@1 own selection",
    "kl_fresh_stale": "KL(P~‖P_stale)",
    "kl_fresh_corrected": "KL(P~‖P_h)",
}


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


def mean_spread(key: str, scale: float, digits: int):
    def cell(row: dict) -> str | None:
        if key not in row:
            return None
        value, spread = row[key] * scale, row.get(key + "_std", 0.0) * scale
        return f"{value:.{digits}f} ± {spread:.{digits}f}" if row["seeds"] > 1 else f"{value:.{digits}f}"

    return cell


def report_markdown(report: dict, rows: list[dict], metrics: list[str]) -> str:
    """The whole `<out>.md` of a comparison JSON (its `summarise`d rows given): the table, the dropout floor,
    the settings, the precision."""
    args, name = report["args"], lambda m: HEADERS.get(m, m.replace("dev_gold_recall@", "gold R@"))
    columns = [("strategy", "strategy", ""), *((name(m), mean_spread(m, 100, 1), "") for m in metrics)]
    columns.append(("re-embedded", lambda r: f"{r.get('reembedded', 0):.0f}", ""))
    columns += [(name(k), mean_spread(k, 1, 3), "") for k in DRIFT_KEYS]
    columns.append(("wall (s)", lambda r: f"{r.get('wall_s', 0):.0f}", ""))
    text = (
        f"## Algorithm {args['algorithm']}, {args['data']}, start {args['start']}: {args['steps']} steps, seeds "
        f"{args['seeds']} (R={args['refresh_every']}, SNM M={args['snm_size']}, regression "
        f"s'={args.get('regression_samples', 200)})\n\n{table(rows, columns)}\n\nDropout floor of `drift` "
        "(train-mode g(y) vs eval-mode g(y) of the starting passage tower, no update): "
        f"{report['dropout_floor']:.3f}. Settings: {' '.join(args['overrides']) or 'defaults'}."
    )
    if (precision := report.get("precision")) not in (None, report.get("mixed_precision")):
        text += f" Trained with mixed_precision={precision}: this CPU has no native bf16 (`rlm.precision`)."
    return text


def drift_log(log_file: Path) -> list[dict]:
    """The drift and KL figures a run logged over training (the `drift_log` of its JSON record)."""
    rows = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    return [{k: r[k] for k in ("step", *DRIFT_KEYS) if k in r} for r in rows if "drift" in r]


def plot_quality(rows: list[dict], metric: str, title: str):
    fig, ax = figure()
    for row in (r for r in rows if metric in r):
        x, y = row.get("reembedded", 0) + 1, row[metric] * 100  # log axis: 0 re-embedded plots at 1
        ax.errorbar(x, y, yerr=row.get(metric + "_std", 0) * 100, fmt="o", capsize=3)
        ax.annotate(row["strategy"], (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set(xscale="log", xlabel="passages re-embedded during training (+1, log scale)", title=title)
    ax.set_ylabel(metric.replace("dev_", "") + " (%)")
    ax.grid(alpha=0.3)
    return fig


def plot_drift(runs: list[dict], title: str):
    """Drift over training, per strategy (first seed): ||g(y) - B_y|| and KL(P~ || P_stale / P_h) on S_x; None
    (an existing plot left as it is) when no run carries a drift log (a JSON from before they did)."""
    runs = [r for r in runs if r["seed"] is not None and r.get("drift_log")]  # "start" did not train
    if not runs:
        return None
    fig, (ax_norm, ax_kl) = figure(2, (11, 4))
    first_seed = min(r["seed"] for r in runs)
    for run in (r for r in runs if r["seed"] == first_seed):
        log, steps = run["drift_log"], [r["step"] for r in run["drift_log"]]
        (line,) = ax_norm.plot(steps, _smooth(log, "drift"), label=run["strategy"])
        ax_kl.plot(steps, _smooth(log, "kl_fresh_stale"), color=line.get_color())
        if "kl_fresh_corrected" in log[0]:
            corrected, label = _smooth(log, "kl_fresh_corrected"), f"{run['strategy']}: P_h"
            ax_kl.plot(steps, corrected, "--", color=line.get_color(), label=label)
    ax_norm.set(xlabel="step", ylabel="mean ||g(y) - B_y|| on S_x")
    ax_kl.set(xlabel="step", ylabel="KL(P~ || P_stale) (solid), KL(P~ || P_h) (dashed)")
    for ax in (ax_norm, ax_kl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: drift of the fixed buffer over training (seed {first_seed}, 10-step mean)")
    return fig


def _smooth(log: list[dict], key: str, window: int = 10) -> list[float]:
    return [statistics.fmean(r[key] for r in log[max(0, i - window + 1) : i + 1]) for i in range(len(log))]


def render(json_path: str | Path) -> str:
    """Write `<stem>.md`, `<stem>.png` and `<stem>_drift.png` next to a comparison JSON; return the markdown."""
    json_path = Path(json_path)
    report = json.loads(json_path.read_text())
    args, runs = report["args"], report["runs"]
    metrics = table_metrics(args["algorithm"], runs)
    rows = summarise(runs, metrics)
    short = f"Algorithm {args['algorithm']}, {args['data']}, start {args['start']}"
    plots = {
        ".png": lambda: plot_quality(rows, metrics[0], short),
        "_drift.png": lambda: plot_drift(runs, short),
    }
    text = report_markdown(report, rows, metrics)
    write_report(json_path.with_suffix(""), text, plots=plots, echo=False)
    return text
