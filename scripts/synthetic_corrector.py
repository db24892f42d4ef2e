"""The paper's Section 5.3 synthetic study (Figures 3 and 4) at its own sizes, on one CPU thread.

    python scripts/synthetic_corrector.py            # full study, ~15 min on one thread
    python scripts/synthetic_corrector.py --quick    # smaller grid and sizes, well under a minute

4,096 stale targets g' in D = 8 from a mixture of 20 Gaussians; fresh targets g = m(g') for a range of random
residual MLPs m (0-2 hidden layers of width D..8D, several init scales); correctors h with 0-2 hidden layers of
width D..8D trained alone on a sampled fraction of the targets (Adam lr 0.03, <= 1,000 epochs, patience 100).
See `rlm/experiments/synthetic.py` for the exact set-up.

* Fig. 4 analogue: KL(P || P_g') against KL(P || P_h), one point per staleness setting x corrector, all at
  `--fig4-fraction` of the targets sampled.
* Fig. 3 analogue: KL(P || P_h) against the corrector's parameter count, one line per sampled fraction, for a
  mildly and a strongly stale setting.

Writes `<out>.json` (every fit), `<out>.md` (tables; a hand-written section between the findings markers of
an existing `<out>.md` is kept), `<out>_fig3.png` and `<out>_fig4.png`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from atomicio import atomic_file, atomic_write_text
from rlm.experiments.benchmarking import cpu_name
from rlm.experiments.synthetic import CorrectorSpec, DriftSpec, SyntheticWorld, fit_corrector, fit_regression

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "results" / "synthetic_corrector"
NUM_COMPONENTS = 20
DEPTH_MARKERS = {0: "s", 1: "o", 2: "^"}  # corrector hidden layers -> marker, in both plots
REGRESSION_KERNELS = ("rbf", "linear")  # Dynnibal's approximate re-encoding, beside the correctors
REGRESSION_MARKERS = {"rbf": ("X", "black"), "linear": ("P", "grey")}
LANDMARKS = 128  # the paper's d'
RIDGE = None  # chosen per fit on a held-out fifth of the samples, as training does
KL_PLOT_FLOOR = 1e-4
FINDINGS_START, FINDINGS_END = "<!-- findings:start -->", "<!-- findings:end -->"

# (hidden layers, width / D, init scale): ordered by the stale KL they give in the default world (beta 2),
# from about 0.02 to 5 nats.
FULL_DRIFTS = [
    (0, 1, 0.1),
    (2, 2, 0.5),
    (1, 1, 0.25),
    (0, 1, 0.25),
    (1, 8, 0.5),
    (2, 2, 1.0),
    (2, 8, 1.0),
    (1, 1, 0.5),
    (0, 1, 0.5),
    (1, 8, 1.0),
    (2, 8, 2.0),
    (0, 1, 1.0),
    (1, 8, 2.0),
    (2, 8, 3.0),
]
FULL_FIG3_DRIFTS = [(1, 8, 0.5), (2, 8, 3.0)]  # "somewhat stale" and "significantly stale" panes
FULL_CORRECTORS = [(0, 1)] + [(layers, mult) for layers in (1, 2) for mult in (1, 2, 4, 8)]
FULL_FRACTIONS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0]

QUICK_DRIFTS = [(0, 1, 0.25), (1, 8, 1.0), (2, 8, 3.0)]
QUICK_FIG3_DRIFTS = [(2, 8, 3.0)]
QUICK_CORRECTORS = [(0, 1), (1, 2), (2, 8)]
QUICK_FRACTIONS = [0.05, 1.0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small grid and sizes (a smoke run, < 1 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output path prefix (no extension)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3; quick: 1)")
    parser.add_argument("--beta", type=float, default=2.0, help="softmax temperature of P, P_g', P_h")
    parser.add_argument("--fig4-fraction", type=float, default=0.1, help="sampled fraction for Fig. 4")
    parser.add_argument("--max-epochs", type=int, default=None, help="default 1000 (quick: 150)")
    parser.add_argument("--patience", type=int, default=None, help="default 100 (quick: 30)")
    parser.add_argument(
        "--replot", action="store_true", help="re-render the report and plots from <out>.json, no fitting"
    )
    parser.add_argument(
        "--regression-only",
        action="store_true",
        help="keep the corrector fits of <out>.json and (re)fit only the Nystrom regressions (seconds)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (others share this CPU)")
    args = parser.parse_args(argv)
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    return args


def grid(args: argparse.Namespace):
    """(drift shapes, Fig. 3 drift shapes, corrector specs, sampled fractions) of this run."""
    quick = args.quick
    drift_grid = QUICK_DRIFTS if quick else FULL_DRIFTS
    fig3_drifts = QUICK_FIG3_DRIFTS if quick else FULL_FIG3_DRIFTS
    correctors = [CorrectorSpec(*c) for c in (QUICK_CORRECTORS if quick else FULL_CORRECTORS)]
    fractions = QUICK_FRACTIONS if quick else FULL_FRACTIONS
    if args.fig4_fraction not in fractions:
        fractions = sorted({*fractions, args.fig4_fraction})
    return drift_grid, fig3_drifts, correctors, fractions


def fit_jobs(args: argparse.Namespace) -> list[tuple[int, DriftSpec, CorrectorSpec, float]]:
    """Every (seed, drift, corrector, fraction) fit of both figures, grouped by seed and drift."""
    drift_grid, fig3_drifts, correctors, fractions = grid(args)
    jobs = []
    for seed in range(args.seed, args.seed + args.seeds):
        for i, shape in enumerate(drift_grid):
            drift = DriftSpec(*shape, seed=1000 * seed + i)
            for fraction in fractions if shape in fig3_drifts else [args.fig4_fraction]:
                jobs += [(seed, drift, corrector, fraction) for corrector in correctors]
    return jobs


def run_study(args: argparse.Namespace, previous: dict | None = None) -> dict:
    """Every fit of both figures for every seed; fits shared by the two figures are run once. With `previous`
    (an earlier run's results, whose grid `args` repeats), its corrector fits are kept and only the
    regressions are fitted.

    Each seed draws its own world (mixture, targets, queries), its own drift MLPs, target samples and corrector
    inits, so the spread over seeds covers all of the set-up's randomness.
    """
    quick = args.quick
    train_kwargs = {
        "lr": 0.03,
        "max_epochs": args.max_epochs or (150 if quick else 1000),
        "patience": args.patience or (30 if quick else 100),
    }
    drift_grid, fig3_drifts, _, _ = grid(args)
    missing = set(fig3_drifts) - set(drift_grid)
    if missing:
        raise ValueError(f"Fig. 3 drifts {sorted(missing)} are not in the drift grid")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")

    jobs = fit_jobs(args)

    if previous is not None:
        jobs = []  # the corrector fits are kept; only the regressions below are run

    worlds, stale_kls, fresh_cache, fits = {}, {}, {}, []

    def world_and_fresh(seed: int, drift: DriftSpec) -> tuple[SyntheticWorld, Tensor]:
        nonlocal worlds, fresh_cache
        if seed not in worlds:
            worlds = {
                seed: SyntheticWorld.generate(
                    num_targets=1024 if quick else 4096,
                    num_components=NUM_COMPONENTS,
                    num_train_queries=64 if quick else 128,
                    num_eval_queries=128 if quick else 256,
                    beta=args.beta,
                    seed=seed,
                )
            }
        if drift not in fresh_cache:
            # jobs are grouped by seed and drift: keep one
            fresh_cache = {drift: worlds[seed].drifted(drift)}
            stale_kls[drift] = worlds[seed].stale_kl(fresh_cache[drift])
        return worlds[seed], fresh_cache[drift]

    start = time.perf_counter()
    for seed, drift, corrector, fraction in tqdm(jobs, desc="corrector fits", unit="fit"):
        world, fresh = world_and_fresh(seed, drift)
        record = fit_corrector(world, fresh, corrector, fraction, seed=seed, **train_kwargs)
        fits.append({"seed": seed, "drift": drift.label, "stale_kl": stale_kls[drift], **record})

    # Dynnibal's regression on the same sampled targets (the same re-embedding budget), once per setting.
    regressions = []
    settings = sorted(
        {(seed, drift, fraction) for seed, drift, _, fraction in fit_jobs(args)},
        key=lambda x: (x[0], x[1].seed, x[2]),
    )
    for seed, drift, fraction in tqdm(settings, desc="regression fits", unit="setting"):
        world, fresh = world_and_fresh(seed, drift)
        for kernel in REGRESSION_KERNELS:
            record = fit_regression(
                world, fresh, fraction, kernel=kernel, landmarks=LANDMARKS, ridge=RIDGE, seed=seed
            )
            regressions.append({"seed": seed, "drift": drift.label, "stale_kl": stale_kls[drift], **record})
    if previous is not None:
        # The worlds are regenerated from their seeds: they must be the ones the kept fits were scored on.
        kept = {(d["label"], d["seed"]): d["stale_kl"] for d in previous["drifts"]}
        for drift, kl in stale_kls.items():
            if abs(kept[(drift.label, drift.seed)] - kl) > 1e-6 * max(1.0, kl):
                raise ValueError(f"drift {drift.label} seed {drift.seed}: {kl} here, {kept} in the kept fits")
        previous["regressions"] = regressions
        previous["regression"] = {"landmarks": LANDMARKS, "ridge": RIDGE, "kernels": list(REGRESSION_KERNELS)}
        previous["regression_seconds"] = time.perf_counter() - start
        return previous
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "world": {
            "num_targets": len(world.stale),
            "dim": world.dim,
            "num_components": NUM_COMPONENTS,
            "num_train_queries": len(world.train_queries),
            "num_eval_queries": len(world.eval_queries),
            "beta": world.beta,
        },
        "train": train_kwargs,
        "seeds": list(range(args.seed, args.seed + args.seeds)),
        "fig4_fraction": args.fig4_fraction,
        "fig3_drifts": [DriftSpec(*d).label for d in fig3_drifts],
        "drifts": [{"label": d.label, "seed": d.seed, "stale_kl": kl} for d, kl in stale_kls.items()],
        "fits": fits,
        "regressions": regressions,
        "regression": {"landmarks": LANDMARKS, "ridge": RIDGE, "kernels": list(REGRESSION_KERNELS)},
        "seconds": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "machine": f"{cpu_name()}, torch {torch.__version__}",
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _fmt(values: list[float]) -> str:
    mean, std = _mean_std(values)
    return f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ± {std:.4f}"


def drift_order(results: dict) -> list[str]:
    """Drift labels from least to most stale (mean stale KL over seeds)."""
    by_label: dict[str, list[float]] = {}
    for d in results["drifts"]:
        by_label.setdefault(d["label"], []).append(d["stale_kl"])
    return sorted(by_label, key=lambda label: statistics.fmean(by_label[label]))


def _depth_label(layers: int) -> str:
    return f"{layers} hidden layer{'s' if layers != 1 else ''}"


def plot_fig4(results: dict, path: Path) -> None:
    """Stale KL (x) against corrected KL (y), log-log, colour = parameter count, parity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    rows = [f for f in results["fits"] if f["fraction"] == results["fig4_fraction"]]
    # A corrector of the drift's own form recovers it to float precision (~1e-6); drawing those at the floor
    # keeps the axis on the range where the settings differ.
    floor = KL_PLOT_FLOOR
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    norm = LogNorm(min(r["params"] for r in rows), max(r["params"] for r in rows))
    for layers, marker in DEPTH_MARKERS.items():
        sub = [r for r in rows if r["corrector_layers"] == layers]
        if not sub:
            continue
        points = ax.scatter(
            [r["stale_kl"] for r in sub],
            [max(r["corrected_kl"], floor) for r in sub],
            c=[r["params"] for r in sub],
            cmap="viridis",
            norm=norm,
            marker=marker,
            s=36,
            edgecolors="k",
            linewidths=0.4,
            label=_depth_label(layers),
        )
    for kernel, (marker, colour) in REGRESSION_MARKERS.items():
        sub = [
            r
            for r in results.get("regressions", [])
            if r["kernel"] == kernel and r["fraction"] == results["fig4_fraction"]
        ]
        if sub:
            ax.scatter(
                [r["stale_kl"] for r in sub],
                [max(r["regression_kl"], floor) for r in sub],
                marker=marker,
                color=colour,
                s=40,
                linewidths=0.4,
                label=f"Nystrom regression ({kernel})",
            )
    lo = max(floor, min(min(r["corrected_kl"] for r in rows), min(r["stale_kl"] for r in rows))) * 0.5
    hi = max(r["stale_kl"] for r in rows) * 2
    ax.plot([lo, hi], [lo, hi], "r--", lw=1, label="parity (no correction)")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set_xlabel("stale KL(P || P_g')")
    ax.set_ylabel(f"corrected KL(P || P_h)  (values < {floor:g} drawn at {floor:g})")
    pct = f"{100 * results['fig4_fraction']:g}%"
    ax.set_title(f"Corrector vs stale buffer (h trained on {pct} of targets)")
    fig.colorbar(points, ax=ax, label="corrector parameters |Psi|")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    _save(fig, path)


def plot_fig3(results: dict, path: Path) -> None:
    """Per Fig. 3 drift: corrected KL (y) against parameter count (x), one line per sampled fraction.

    Lines are the mean over seeds, the band their min-max.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panes = results["fig3_drifts"]
    fig, axes = plt.subplots(1, len(panes), figsize=(5.6 * len(panes), 4.6), squeeze=False)
    fractions = sorted({f["fraction"] for f in results["fits"] if f["drift"] in panes})
    colours = plt.cm.plasma([i / max(1, len(fractions)) for i in range(len(fractions))])
    for ax, label in zip(axes[0], panes):
        rows = [f for f in results["fits"] if f["drift"] == label]
        for fraction, colour in zip(fractions, colours):
            # Grouped by corrector, not by parameter count: 1x4D and 2x2D both have 552 parameters.
            by_corrector: dict[tuple[int, int], list[dict]] = {}
            for r in rows:
                if r["fraction"] == fraction:
                    by_corrector.setdefault((r["params"], r["corrector_layers"]), []).append(r)
            keys = sorted(by_corrector)
            params = [k[0] for k in keys]
            kls = [[r["corrected_kl"] for r in by_corrector[k]] for k in keys]
            means = [statistics.fmean(k) for k in kls]
            targets = by_corrector[keys[0]][0]["sampled_targets"]
            ax.plot(
                params, means, "-", color=colour, lw=1.2, label=f"{100 * fraction:g}% ({targets} targets)"
            )
            for layers, marker in DEPTH_MARKERS.items():
                at = [i for i, k in enumerate(keys) if k[1] == layers]
                ax.plot(
                    [params[i] for i in at], [means[i] for i in at], marker, color=colour, ms=4, ls="none"
                )
            if len(kls[0]) > 1:
                ax.fill_between(
                    params, [min(k) for k in kls], [max(k) for k in kls], color=colour, alpha=0.15
                )
        stale = statistics.fmean(r["stale_kl"] for r in rows)  # every seed has the same number of rows
        ax.axhline(stale, color="r", ls="--", lw=1, label="stale (no corrector)")
        ax.set(xscale="log", yscale="log")
        ax.set_xlabel("corrector parameters |Psi|")
        ax.set_ylabel("KL(P || P_h), held-out queries")
        ax.set_title(f"drift {label}: stale KL(P || P_g') = {stale:.3g}")
        ax.grid(True, which="major", alpha=0.3)
    seeds = len(results["seeds"])
    if seeds > 1:
        fig.suptitle(f"mean over {seeds} seeds, band = min-max", fontsize=9)
    from matplotlib.lines import Line2D

    depth = [
        Line2D([], [], marker=m, color="k", ls="none", ms=4, label=_depth_label(n))
        for n, m in DEPTH_MARKERS.items()
    ]
    handles, _ = axes[0][0].get_legend_handles_labels()
    if len(panes) > 1:
        axes[0][0].legend(handles=handles, title="targets sampled", fontsize=8)
        axes[0][-1].legend(handles=depth, title="corrector", fontsize=8)
    else:
        axes[0][0].legend(handles=handles + depth, title="targets sampled / corrector", fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def render_markdown(results: dict, previous: str | None) -> str:
    """Tables of both figures; keeps the findings section of `previous` (the existing report) if it has one."""
    world, train, seeds = results["world"], results["train"], results["seeds"]
    fits = results["fits"]
    spread = f"mean ± std over {len(seeds)} seeds" if len(seeds) > 1 else "one seed"
    capped = sum(f["fit_epochs"] >= train["max_epochs"] for f in fits)
    lines = [
        "# Synthetic corrector study (paper Section 5.3, Figures 3 and 4)",
        "",
        f"Command: `{results['command']}` ({results['seconds'] / 60:.1f} min, {results['threads']} thread(s), "
        f"{results['machine']}; {len(fits)} corrector fits, {capped} of them stopped by the "
        f"{train['max_epochs']}-epoch cap rather than by patience).",
        "",
        f"Set-up: {world['num_targets']} stale targets g' in D = {world['dim']} from a mixture of "
        f"{world['num_components']} Gaussians; fresh g = m(g') with m a random residual MLP (label "
        "`hidden layers x width @ init scale`, see `rlm/experiments/synthetic.py`); queries from the same mixture "
        f"({world['num_train_queries']} to train h, {world['num_eval_queries']} held out to score it); "
        f"beta = {world['beta']:g}. Correctors (label `hidden layers x width`, `linear` = 0 hidden layers) "
        "trained alone with the cross-entropy between the truncated softmaxes of g and h(g') over the sampled "
        f"targets, Adam lr {train['lr']}, at most {train['max_epochs']} full-batch epochs, patience "
        f"{train['patience']}. KL in nats, over all targets, on the held-out queries; {spread} "
        f"(seeds {', '.join(map(str, seeds))}: each draws its own world, drifts, samples and inits).",
        "",
    ]
    regressions = results.get("regressions", [])
    if regressions:
        reg = results["regression"]
        how = (
            f" (added to the kept corrector fits by `{results['regression_command']}`)"
            if "regression_command" in results
            else ""
        )
        lines += [
            "Beside the correctors, Dynnibal's approximate re-encoding (`retriever/reencode.py`) at the same "
            "re-embedding budget: a Nystrom kernel ridge regression g' -> g fitted in closed form on the same "
            f"sampled targets, {reg['landmarks']} random stale targets as landmarks, "
            + (
                f"ridge {reg['ridge']:g}, "
                if reg["ridge"] is not None
                else "ridge chosen per fit on a held-out fifth of the samples (as in training), "
            )
            + "kernels `rbf` (median-heuristic width) and `linear`, applied to all targets and scored by the "
            f"same held-out KL{how}.",
            "",
        ]
    previous_findings = None
    if previous:
        match = re.search(re.escape(FINDINGS_START) + r".*?" + re.escape(FINDINGS_END), previous, re.S)
        previous_findings = match.group(0) if match else None
    lines += [previous_findings or f"{FINDINGS_START}\n(findings not written yet)\n{FINDINGS_END}", ""]

    def cell(rows: list[dict], key: str = "corrected_kl") -> str:
        return _fmt([r[key] for r in rows])

    order = drift_order(results)
    fig4 = [f for f in fits if f["fraction"] == results["fig4_fraction"]]
    correctors = sorted(
        {(f["corrector_layers"], f["corrector_width_mult"], f["corrector"], f["params"]) for f in fig4}
    )
    pct = f"{100 * results['fig4_fraction']:g}%"
    kernels = sorted({r["kernel"] for r in regressions}, key=REGRESSION_KERNELS.index)
    lines += [
        f"## Fig. 4 analogue: KL(P || P_h) per staleness setting and corrector ({pct} of targets sampled)",
        "",
        f"![Fig. 4 analogue]({results['png_fig4']})",
        "",
        "Rows from least to most stale. Columns: corrector (parameter count)"
        + (", then the Nystrom regressions at the same budget." if kernels else "."),
        "",
        "| drift | stale KL | "
        + " | ".join([*(f"{c[2]} ({c[3]})" for c in correctors), *(f"Nystrom {k}" for k in kernels)])
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in [*correctors, *kernels]) + " |",
    ]
    for label in order:
        rows = [f for f in fig4 if f["drift"] == label]
        stale = [d["stale_kl"] for d in results["drifts"] if d["label"] == label]
        cells = [cell([r for r in rows if r["corrector"] == c[2]]) for c in correctors]
        at = [r for r in regressions if r["drift"] == label and r["fraction"] == results["fig4_fraction"]]
        cells += [cell([r for r in at if r["kernel"] == k], "regression_kl") for k in kernels]
        lines.append(f"| {label} | {_fmt(stale)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"![Fig. 3 analogue]({results['png_fig3']})", ""]
    for label in results["fig3_drifts"]:
        rows = [f for f in fits if f["drift"] == label]
        stale = [d["stale_kl"] for d in results["drifts"] if d["label"] == label]
        fractions = sorted({f["fraction"] for f in rows})
        lines += [
            f"## Fig. 3 analogue, drift {label} (stale KL {_fmt(stale)}): KL(P || P_h) by sampled fraction",
            "",
            "Held-out KL over all targets; below it, in brackets, the truncated training KL over the sampled "
            "targets (a small training KL with a large held-out KL is overfitting to the sample).",
            "",
            "| corrector | params | " + " | ".join(f"{100 * x:g}%" for x in fractions) + " |",
            "| --- | ---: | " + " | ".join("---:" for _ in fractions) + " |",
        ]
        for corrector in sorted({(f["corrector_layers"], f["corrector_width_mult"]) for f in rows}):
            sub = [f for f in rows if (f["corrector_layers"], f["corrector_width_mult"]) == corrector]
            cells = []
            for x in fractions:
                at = [f for f in sub if f["fraction"] == x]
                cells.append(f"{cell(at)}<br>({statistics.fmean(f['fit_train_kl'] for f in at):.4f})")
            lines.append(f"| {sub[0]['corrector']} | {sub[0]['params']} | " + " | ".join(cells) + " |")
        for kernel in kernels:
            sub = [r for r in regressions if r["drift"] == label and r["kernel"] == kernel]
            cells = [cell([r for r in sub if r["fraction"] == x], "regression_kl") for x in fractions]
            size = f"{sub[0]['landmarks']} x {world['dim']}" if sub else ""
            lines.append(f"| Nystrom {kernel} | {size} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out: Path = args.out
    if args.replot:
        json_path = out.with_suffix(".json")
        if not json_path.exists():
            raise FileNotFoundError(f"{json_path} not found: run the study first (without --replot)")
        results = json.loads(json_path.read_text())
    elif args.regression_only:
        json_path = out.with_suffix(".json")
        if not json_path.exists():
            raise FileNotFoundError(f"{json_path} not found: run the study first (without --regression-only)")
        previous = json.loads(json_path.read_text())
        for key in ("quick", "seed", "seeds", "beta", "fig4_fraction"):  # the grid of the kept fits
            setattr(args, key, previous["args"][key])
        results = run_study(args, previous)
        given = sys.argv[1:] if argv is None else argv
        results["regression_command"] = shlex.join(["python", "scripts/synthetic_corrector.py", *given])
    else:
        results = run_study(args)
        given = sys.argv[1:] if argv is None else argv
        results["command"] = shlex.join(["python", "scripts/synthetic_corrector.py", *given])
    # Names relative to the report, which sits next to the plots.
    results["png_fig3"], results["png_fig4"] = f"{out.name}_fig3.png", f"{out.name}_fig4.png"
    plot_fig3(results, out.with_name(results["png_fig3"]))
    plot_fig4(results, out.with_name(results["png_fig4"]))
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2) + "\n")
    md_path = out.with_suffix(".md")
    previous = md_path.read_text() if md_path.exists() else None
    atomic_write_text(md_path, render_markdown(results, previous) + "\n")
    print(f"wrote {md_path}, {out.with_suffix('.json')} and the two plots next to them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
