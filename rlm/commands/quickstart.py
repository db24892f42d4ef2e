"""`rlm quickstart` (what `make demo` runs): toy world, buffer, corrector training, dev EM table, the world's next
edition taken by the index (a living corpus), demo."""

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
    parser.add_argument(
        "--no-edition",
        dest="edition",
        action="store_false",
        help="skip the last stage, a living corpus: the toy world's next edition (new people, moved, renamed and "
        "removed entities) taken by the trained run's index with `rlm corpus update`, its questions answered "
        "before and after (the demo then serves the corpus as trained, and follows no update)",
    )
    parser.add_argument(
        "--no-serve", action="store_true", help="stop after the tables; do not serve the demo"
    )
    parser.add_argument("--host", default="127.0.0.1", help="demo interface (0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=7860, help="demo port")


def run(args: argparse.Namespace) -> int:
    """Train, evaluate, print the table, then the living corpus's (unless --no-edition), write metrics.json;
    serve the demo (unless --no-serve) as soon as the corrector run is trained, while the baselines still train,
    over the index the edition's update then changes live."""
    from rlm.quickstart.pipeline import living_corpus_stage, quickstart_config, run_quickstart

    cfg = quickstart_config(args.config, args.output_dir, args.overrides)
    demo = None

    def ready(checkpoint, living) -> None:
        nonlocal demo
        calibrate(checkpoint)
        if not args.no_serve:
            from rlm.commands.demo import start_demo

            demo = start_demo(checkpoint, options=demo_options(living), host=args.host, port=args.port)
            print(
                f"\ndemo on http://{args.host}:{args.port} (the rest of the runs go on beside it)\n",
                flush=True,
            )

    result = run_quickstart(
        cfg, baselines=args.baselines, jobs=args.jobs, on_checkpoint=ready, edition=args.edition
    )
    print("\n" + result.table)
    if args.edition:
        print("\n" + living_corpus_stage(result))
    print(f"\nwrote {result.metrics_path}; checkpoint {result.checkpoint}")
    example = (result.metrics.get("edition") or {}).get("example")
    if demo is None:
        index = "" if result.living is None else f" --index {result.living.index}"
        print(f"serve it later with: rlm demo --checkpoint {result.checkpoint}{index}")
        if example:
            print(f"and ask it about a person the update added: {describe_example(example)}")
        return 0
    if example:
        print(
            f"the demo serves the updated corpus; ask it about a person it added: {describe_example(example)}"
        )
    print(f"demo on http://{args.host}:{args.port}  (Ctrl-C stops it)", flush=True)
    demo.block_thread()
    return 0


def demo_options(living):
    """The demo's options: over the living corpus's index, following its updates, when there is one."""
    from rlm.app.service import ServiceOptions

    if living is None:
        return ServiceOptions(show_progress=True)
    return ServiceOptions(show_progress=True, index_path=str(living.index))


def describe_example(example: dict) -> str:
    """A question about a new person and what the checkpoint made of it before and after the update."""
    after = example["after"]
    if after != "abstained":
        after = f'"{example["prediction_after"]}", {after}'
    return f'"{example["question"]}" (before the update: {example["before"]}; after: {after})'


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
