"""`rlm quickstart` (what `make demo` runs): toy world, buffer, corrector training, dev EM table, demo."""

from __future__ import annotations

import argparse

from rlm.config import add_override_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm quickstart`."""
    parser.add_argument("--config", default=None, help="run config (default: configs/quickstart.yaml)")
    parser.add_argument(
        "--output-dir", default=None, help="run folder (default: the config's, runs/quickstart)"
    )
    add_override_argument(parser, example="optim.max_steps=50")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--baselines",
        dest="baselines",
        action="store_const",
        const="always",
        default="missing",
        help="retrain all four baselines (exhaustive, stale, frozen, closed book: the same config and budget, "
        "only strategy.name changed) even when cached; by default a baseline is trained only when "
        "<output-dir>/baselines.json has no figure for it under these settings, and reused otherwise",
    )
    which.add_argument(
        "--no-baselines",
        dest="baselines",
        action="store_const",
        const="never",
        help="train the corrector run alone; show the baselines' cached figures, if any, labelled with their "
        "date (and 'other settings' when they were measured under another config)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained at a time, each on one torch thread (default: one per CPU core)",
    )
    parser.add_argument("--no-serve", action="store_true", help="stop after the table; do not serve the demo")
    parser.add_argument("--host", default="127.0.0.1", help="demo interface (0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=7860, help="demo port")


def run(args: argparse.Namespace) -> int:
    """Train, evaluate, print the table, write metrics.json; serve the demo (unless --no-serve) as soon as the
    corrector run is trained, while the baselines still train."""
    from rlm.quickstart.pipeline import quickstart_config, run_quickstart

    cfg = quickstart_config(args.config, args.output_dir, args.overrides)
    demo = None

    def ready(checkpoint) -> None:
        nonlocal demo
        calibrate(checkpoint)
        if not args.no_serve:
            from rlm.commands.demo import start_demo

            demo = start_demo(checkpoint, host=args.host, port=args.port)
            print(
                f"\ndemo on http://{args.host}:{args.port} (the rest of the runs go on beside it)\n",
                flush=True,
            )

    result = run_quickstart(cfg, baselines=args.baselines, jobs=args.jobs, on_checkpoint=ready)
    print("\n" + result.table)
    print(f"\nwrote {result.metrics_path}; checkpoint {result.checkpoint}")
    if demo is None:
        print(f"serve it later with: rlm demo --checkpoint {result.checkpoint}")
        return 0
    print(f"demo on http://{args.host}:{args.port}  (Ctrl-C stops it)", flush=True)
    demo.block_thread()
    return 0


def calibrate(checkpoint) -> None:
    """Fit the checkpoint's answer policy (calibrated confidence, abstention) on dev and its generated
    unanswerable questions, so the demo says when its corpus does not answer a question."""
    from rlm.commands.calibrate import calibrate_checkpoint, describe, fit_questions
    from rlm.errors import UserError

    examples, extra, source = fit_questions(checkpoint, "toy", "dev", None, "auto", None)
    try:
        policy = calibrate_checkpoint(checkpoint, examples, extra, fitted_on={"source": source})
    except UserError as err:  # e.g. a run too short to answer any dev question right
        print(f"\nwarning: no answer policy fitted ({err}); the demo answers everything, uncalibrated")
    else:
        print("\n" + describe(policy))
