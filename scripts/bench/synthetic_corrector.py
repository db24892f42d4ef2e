"""The paper's Section 5.3 synthetic study (Figures 3 and 4) at its own sizes, on one CPU thread.

    python scripts/bench/synthetic_corrector.py            # full study, ~15 min on one thread
    python scripts/bench/synthetic_corrector.py --quick    # smaller grid and sizes, well under a minute

4,096 stale targets g' in D = 8 from a mixture of 20 Gaussians; fresh targets g = m(g') for a range of random
residual MLPs m (0-2 hidden layers of width D..8D, several init scales); correctors h of the same family trained
alone on a sampled fraction of the targets (Adam lr 0.03, <= 1,000 epochs, patience 100). See
`scripts/bench/lab/synthetic.py` for the exact set-up.

* Fig. 4 analogue: KL(P || P_g') against KL(P || P_h), one point per staleness setting x corrector, all at
  `--fig4-fraction` of the targets sampled.
* Fig. 3 analogue: KL(P || P_h) against the corrector's parameter count, one line per sampled fraction, for a
  mildly and a strongly stale setting.

Writes `<out>.json` (every fit), `<out>.md` (tables; the findings section of an existing `<out>.md` is kept),
`<out>_fig3.png` and `<out>_fig4.png`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import fmean, stdev

import torch
from lab import reporting
from lab.synthetic import CorrectorSpec, DriftSpec, SyntheticWorld, fit_corrector, fit_regression
from tqdm.auto import tqdm

DEPTH_MARKERS = {0: "s", 1: "o", 2: "^"}  # corrector hidden layers -> marker, in both plots
REGRESSION = {"rbf": ("X", "black"), "linear": ("P", "grey")}  # Dynnibal's regression beside the correctors
LANDMARKS = 128  # the paper's d'
KL_PLOT_FLOOR = 1e-4

# (hidden layers, width / D, init scale): ordered by the stale KL they give in the default world (beta 2),
# from about 0.02 to 5 nats.
FULL = {
    "drifts": [(0, 1, 0.1), (2, 2, 0.5), (1, 1, 0.25), (0, 1, 0.25), (1, 8, 0.5), (2, 2, 1.0), (2, 8, 1.0)]
    + [(1, 1, 0.5), (0, 1, 0.5), (1, 8, 1.0), (2, 8, 2.0), (0, 1, 1.0), (1, 8, 2.0), (2, 8, 3.0)],
    "fig3": [(1, 8, 0.5), (2, 8, 3.0)],  # "somewhat stale" and "significantly stale" panes
    "correctors": [(0, 1)] + [(layers, mult) for layers in (1, 2) for mult in (1, 2, 4, 8)],
    "fractions": [0.01, 0.05, 0.1, 0.25, 0.5, 1.0],
}
QUICK = {"drifts": [(0, 1, 0.25), (1, 8, 1.0), (2, 8, 3.0)], "fig3": [(2, 8, 3.0)]}
QUICK |= {"correctors": [(0, 1), (1, 2), (2, 8)], "fractions": [0.05, 1.0]}


def pick(records: list[dict], **match) -> list[dict]:
    """The records whose fields have the values of `match`."""
    return [r for r in records if all(r[k] == v for k, v in match.items())]


def settings(args) -> list[tuple[int, DriftSpec, float]]:
    """Every (seed, drift, sampled fraction) of both figures, grouped by seed and drift: Fig. 3's drifts at
    every fraction, the others at Fig. 4's."""
    grid = QUICK if args.quick else FULL
    fractions = sorted({*grid["fractions"], args.fig4_fraction})
    return [
        (seed, DriftSpec(*shape, seed=1000 * seed + i), fraction)
        for seed in range(args.seed, args.seed + args.seeds)
        for i, shape in enumerate(grid["drifts"])
        for fraction in (fractions if shape in grid["fig3"] else [args.fig4_fraction])
    ]


def run_study(args, previous: dict | None = None) -> dict:
    """Every fit of both figures for every seed, and Dynnibal's regression on the same sampled targets (the same
    re-embedding budget). Each seed draws its own world, drifts, samples and inits, so the spread over seeds
    covers all of the set-up's randomness. With `previous` (an earlier run of the same grid) its corrector fits
    are kept and only the regressions are fitted."""
    quick, grid = args.quick, QUICK if args.quick else FULL
    train = {"lr": 0.03, "max_epochs": args.max_epochs or (150 if quick else 1000)}
    train["patience"] = args.patience or (30 if quick else 100)
    sizes = {"num_targets": 1024, "num_train_queries": 64, "num_eval_queries": 128} if quick else {}
    fits, regressions, stale_kls, worlds, fresh = [], [], {}, {}, {}
    start = time.perf_counter()
    for seed, drift, fraction in tqdm(settings(args), desc="settings", unit="setting"):
        if seed not in worlds:  # settings come grouped by seed and drift: keep one world and one drift
            worlds = {seed: SyntheticWorld.generate(beta=args.beta, seed=seed, **sizes)}
        world = worlds[seed]
        if drift not in fresh:
            fresh = {drift: world.drifted(drift)}
            stale_kls[drift] = world.stale_kl(fresh[drift])
        common, g = {"seed": seed, "drift": drift.label, "stale_kl": stale_kls[drift]}, fresh[drift]
        for spec in [] if previous else grid["correctors"]:
            fits.append(common | fit_corrector(world, g, CorrectorSpec(*spec), fraction, seed=seed, **train))
        for kernel in REGRESSION:
            regressions.append(common | fit_regression(world, g, fraction, kernel, LANDMARKS, seed=seed))
    regression = {"landmarks": LANDMARKS, "ridge": None, "kernels": list(REGRESSION)}
    if previous is not None:
        # The worlds are regenerated from their seeds: they must be the ones the kept fits were scored on.
        kept = {(d["label"], d["seed"]): d["stale_kl"] for d in previous["drifts"]}
        for drift, kl in stale_kls.items():
            if abs((was := kept[(drift.label, drift.seed)]) - kl) > 1e-6 * max(1.0, kl):
                raise ValueError(f"drift {drift.label} seed {drift.seed}: {kl} here, {was} in the kept fits")
        return previous | {"regressions": regressions, "regression": regression}
    shape = {"num_targets": len(world.stale), "dim": world.dim, "num_components": 20}
    shape |= {"num_train_queries": len(world.train_queries), "num_eval_queries": len(world.eval_queries)}
    results = {"args": vars(args), "world": shape | {"beta": world.beta}, "train": train}
    results |= {"seeds": list(range(args.seed, args.seed + args.seeds)), "fig4_fraction": args.fig4_fraction}
    results["fig3_drifts"] = [DriftSpec(*d).label for d in grid["fig3"]]
    results["drifts"] = [{"label": d.label, "seed": d.seed, "stale_kl": kl} for d, kl in stale_kls.items()]
    results |= {"fits": fits, "regressions": regressions, "regression": regression}
    results |= {"seconds": time.perf_counter() - start, "threads": torch.get_num_threads()}
    return results | {"machine": f"{reporting.cpu_name()}, torch {torch.__version__}"}


def mean_std(rows: list[dict], key: str) -> str | None:
    values = [r[key] for r in rows]
    if len(values) < 2:
        return f"{values[0]:.4f}" if values else None
    return f"{fmean(values):.4f} ± {stdev(values):.4f}"


def plot_fig4(results: dict):
    """Stale KL (x) against corrected KL (y), log-log, colour = parameter count, parity line. A corrector of
    the drift's own form recovers it to float precision (~1e-6): those are drawn at the floor."""
    from matplotlib.colors import LogNorm

    at = results["fig4_fraction"]
    rows = pick(results["fits"], fraction=at)
    fig, ax = reporting.figure(1, (6.4, 5.2))
    norm = LogNorm(min(r["params"] for r in rows), max(r["params"] for r in rows))
    for layers, marker in DEPTH_MARKERS.items():
        sub = pick(rows, corrector_layers=layers)
        x, y = [r["stale_kl"] for r in sub], [max(r["corrected_kl"], KL_PLOT_FLOOR) for r in sub]
        style = {"norm": norm, "marker": marker, "edgecolors": "k", "linewidths": 0.4}
        points = ax.scatter(x, y, c=[r["params"] for r in sub], **style, label=f"{layers} hidden layer(s)")
    for kernel, (marker, colour) in REGRESSION.items():
        sub = pick(results.get("regressions", []), kernel=kernel, fraction=at)
        x, y = [r["stale_kl"] for r in sub], [max(r["regression_kl"], KL_PLOT_FLOOR) for r in sub]
        ax.scatter(x, y, marker=marker, color=colour, label=f"Nystrom ({kernel})")
    lo = max(KL_PLOT_FLOOR, min(min(r["corrected_kl"], r["stale_kl"]) for r in rows)) * 0.5
    hi = max(r["stale_kl"] for r in rows) * 2
    ax.plot([lo, hi], [lo, hi], "r--", lw=1, label="parity (no correction)")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="stale KL(P || P_g')")
    ax.set(ylabel=f"corrected KL(P || P_h) (< {KL_PLOT_FLOOR:g} drawn at it)")
    ax.set_title(f"Corrector vs stale buffer (h trained on {100 * at:g}% of targets)")
    fig.colorbar(points, ax=ax, label="corrector parameters |Psi|")
    ax.legend(loc="upper left", fontsize=8)
    return fig


def plot_fig3(results: dict):
    """Per Fig. 3 drift: corrected KL against parameter count, one line per sampled fraction (mean over seeds;
    correctors grouped by shape, not parameter count: 1x4D and 2x2D both have 552)."""
    import matplotlib.pyplot as plt

    panes = results["fig3_drifts"]
    fig, axes = reporting.figure(len(panes), (5.6 * len(panes), 4.6), squeeze=False)
    fractions = sorted({f["fraction"] for f in results["fits"] if f["drift"] in panes})
    colours = plt.cm.plasma([i / len(fractions) for i in range(len(fractions))])
    for ax, label in zip(axes[0], panes):
        rows = pick(results["fits"], drift=label)
        for fraction, colour in zip(fractions, colours):
            at = pick(rows, fraction=fraction)
            shapes = sorted({(r["params"], r["corrector_layers"]) for r in at})
            kl = [fmean(r["corrected_kl"] for r in pick(at, params=p, corrector_layers=d)) for p, d in shapes]
            ax.plot([s[0] for s in shapes], kl, "-o", color=colour, ms=4, label=f"{100 * fraction:g}%")
        stale = fmean(r["stale_kl"] for r in rows)
        ax.axhline(stale, color="r", ls="--", lw=1, label="stale (no corrector)")
        ax.set(xscale="log", yscale="log", xlabel="corrector parameters |Psi|")
        ax.set(ylabel="KL(P || P_h), held-out", title=f"drift {label}: stale KL(P || P_g') = {stale:.3g}")
        ax.legend(title="targets sampled", fontsize=8)
    return fig


def text_table(rows: list[dict]) -> str:
    """A table of cells already formatted, its columns the first row's keys."""
    return reporting.table(rows, [(key, key, "") for key in rows[0]])


def markdown(results: dict, out: Path) -> str:
    world, train, fits, regressions = (results[k] for k in ("world", "train", "fits", "regressions"))
    seeds, at, drifts = results["seeds"], results["fig4_fraction"], results["drifts"]
    stale = {x: mean_std(pick(drifts, label=x), "stale_kl") for x in {d["label"] for d in drifts}}
    order = sorted(stale, key=lambda x: fmean(d["stale_kl"] for d in pick(drifts, label=x)))
    shape = ("corrector_layers", "corrector_width_mult", "corrector", "params")  # sorted by depth, then width
    shapes = sorted({tuple(f[k] for k in shape) for f in fits})
    kernels = [k for k in REGRESSION if pick(regressions, kernel=k)]

    def nystrom(label: str, kernel: str, fraction: float) -> str | None:
        return mean_std(pick(regressions, drift=label, kernel=kernel, fraction=fraction), "regression_kl")

    fig4 = []
    for label in order:
        row = {"drift": label, "stale KL": stale[label]}
        for *_, c, n in shapes:
            row[f"{c} ({n})"] = mean_std(pick(fits, drift=label, corrector=c, fraction=at), "corrected_kl")
        fig4.append(row | {f"Nystrom {k}": nystrom(label, k, at) for k in kernels})
    capped = sum(f["fit_epochs"] >= train["max_epochs"] for f in fits)
    parts = [
        "# Synthetic corrector study (paper Section 5.3, Figures 3 and 4)",
        f"Command: `{results['command']}` ({results['seconds'] / 60:.1f} min, {results['threads']} thread(s), "
        f"{results['machine']}; {len(fits)} corrector fits, {capped} stopped by the {train['max_epochs']}-epoch cap).",
        f"Set-up: {world['num_targets']} stale targets g' in D = {world['dim']} from a mixture of {world['num_components']} "
        "Gaussians; fresh g = m(g') with m a random residual MLP (label `hidden layers x width @ init scale`, "
        f"`scripts/bench/lab/synthetic.py`); {world['num_train_queries']} queries to train h, {world['num_eval_queries']} "
        f"held out to score it; beta = {world['beta']:g}. Correctors (`hidden layers x width`, `linear` = 0 hidden "
        f"layers) fit the truncated softmax of g over the sampled targets, Adam lr {train['lr']}, at most "
        f"{train['max_epochs']} epochs, patience {train['patience']}. KL in nats over all targets, held-out queries; "
        f"{'mean ± std over ' + str(len(seeds)) + ' seeds' if len(seeds) > 1 else 'one seed'}. Beside them, Dynnibal's "
        f"Nystrom regression g' -> g (`retriever/reencode.py`) on the same samples, {LANDMARKS} landmarks, ridge chosen "
        "on a held-out fifth of the samples, kernels `rbf` and `linear`.",
        f"{reporting.FINDINGS_START}\n(findings not written yet)\n{reporting.FINDINGS_END}",
        f"## Fig. 4 analogue: KL(P || P_h) per staleness setting and corrector ({100 * at:g}% of targets sampled)",
        f"![Fig. 4 analogue]({out.name}_fig4.png)",
        text_table(fig4),
        f"![Fig. 3 analogue]({out.name}_fig3.png)",
    ]
    for label in results["fig3_drifts"]:
        rows, fig3 = pick(fits, drift=label), []
        cols = {f"{100 * x:g}%": x for x in sorted({f["fraction"] for f in rows})}
        for *_, c, n in shapes:
            row = {"corrector": c, "params": n}
            fig3.append(row | {k: fit_cell(pick(rows, corrector=c, fraction=x)) for k, x in cols.items()})
        for kernel in kernels:
            row = {"corrector": f"Nystrom {kernel}", "params": f"{LANDMARKS} x {world['dim']}"}
            fig3.append(row | {k: nystrom(label, kernel, x) for k, x in cols.items()})
        parts += [
            f"## Fig. 3 analogue, drift {label} (stale KL {stale[label]}): KL(P || P_h) by sampled fraction",
            "Held-out KL over all targets; in brackets the truncated training KL over the sampled targets (small "
            "training KL with large held-out KL is overfitting to the sample).",
            text_table(fig3),
        ]
    return "\n\n".join(parts)


def fit_cell(fits: list[dict]) -> str:
    """Held-out KL of some corrector fits, their mean training KL in brackets."""
    return f"{mean_std(fits, 'corrected_kl')}<br>({fmean(f['fit_train_kl'] for f in fits):.4f})"


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="small grid and sizes (a smoke run, < 1 min)")
    add("--out", type=Path, default=reporting.results_path("synthetic_corrector"), help="output stem")
    add("--seed", type=int, default=0, help="first seed")
    add("--seeds", type=int, default=None, help="number of seeds (default 3; quick: 1)")
    add("--beta", type=float, default=2.0, help="softmax temperature of P, P_g', P_h")
    add("--fig4-fraction", type=float, default=0.1, help="sampled fraction for Fig. 4")
    add("--max-epochs", type=int, default=None, help="default 1000 (quick: 150)")
    add("--patience", type=int, default=None, help="default 100 (quick: 30)")
    add("--replot", action="store_true", help="re-render the report and plots from <out>.json")
    add("--regression-only", action="store_true", help="keep <out>.json's corrector fits; refit regressions")
    add("--threads", type=int, default=1, help="torch threads (others share this CPU)")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    json_path = args.out.with_suffix(".json")
    if (args.replot or args.regression_only) and not json_path.exists():
        raise FileNotFoundError(f"{json_path} not found: run the study first (no --replot/--regression-only)")
    previous = json.loads(json_path.read_text()) if args.replot or args.regression_only else None
    for key in ("quick", "seed", "seeds", "beta", "fig4_fraction") if args.regression_only else ():
        setattr(args, key, previous["args"][key])  # the grid of the kept fits
    command = reporting.command("synthetic_corrector.py", argv)
    stamp = {"regression_command" if previous else "command": command}
    results = previous if args.replot else run_study(args, previous) | stamp
    plots = {"_fig3.png": lambda: plot_fig3(results), "_fig4.png": lambda: plot_fig4(results)}
    reporting.write_report(args.out, markdown(results, args.out), results, plots, echo=False)
    print(f"wrote {args.out}.md, .json and the two plots next to them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
