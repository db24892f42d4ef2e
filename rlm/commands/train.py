"""`rlm train`: joint training from a YAML config (also `python -m rlm.train` and `accelerate launch -m rlm.train`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from rlm.config import add_override_argument, dump_config, load_config
from rlm.errors import main_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML run config (configs/*.yaml); defaults when omitted")
    add_override_argument(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in output_dir (with the same settings)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an output_dir that holds a run (its checkpoints, log and final models are deleted)",
    )
    parser.add_argument(
        "--allow-changed",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: accept this setting differing from the checkpoint's (e.g. optim.max_steps to "
        "train longer); repeat for several",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (the file, the defaults and every --set) as YAML and exit",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    # Only now the training code (torch, transformers): a config error above took no imports to find.
    from rlm.training.alignment_stage import RepresentationCollapseError
    from rlm.training.loop import train
    from rlm.training.preemption import EXIT_PREEMPTED, Preempted
    from rlm.training.run import NonFiniteLossError

    try:
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite, allow_changed=args.allow_changed)
    except Preempted as err:
        if main_process():
            print(f"rlm train: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except Exception as err:
        record_failure(cfg.output_dir, err)
        if not isinstance(err, NonFiniteLossError | RepresentationCollapseError):
            raise
        if main_process():
            print(f"error: {err}", file=sys.stderr)
        return 1
    if main_process():
        print(json.dumps(summary, indent=2))
    return 0 if all(not isinstance(v, float) or math.isfinite(v) for v in summary.values()) else 1


def record_failure(output_dir: str, err: BaseException) -> None:
    """This process's line in the attempt's records (`rlm.training.attempt`), when a launcher asked for them
    (`$RLM_ATTEMPT_DIR`: the sbatch script, which prints the first failure's line last). Not in `output_dir`
    otherwise: a run refused there (a folder that holds a run) leaves it as it was."""
    from rlm.training.attempt import ATTEMPT_DIR_ENV, attempt_folder, write_failure

    if not os.environ.get(ATTEMPT_DIR_ENV):
        return
    try:
        write_failure(attempt_folder(output_dir), int(os.environ.get("RANK", "0")), err)
    except OSError as io_err:  # the failure itself is what must be told
        print(f"rlm train: no failure record written ({io_err})", file=sys.stderr)
