"""The `rlm` command line: `rlm <command> [options]`.

Commands are registered by module name and imported lazily; a user-facing error (`rlm.errors`: bad input,
missing checkpoint, mismatched buffer, a hub model requested offline) prints one readable line (on the main
process of a launched run) and exits 2.
Any other exception is a bug in our code and keeps its traceback. Set RLM_DEBUG=1 to see the traceback of
user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from types import ModuleType

from rlm.errors import main_process, user_errors

# How long a process other than the main one waits before it exits with a user error (`main`).
QUIET_RANK_GRACE_S = 10.0

# name -> (module, one-line help). The one-line help lives here, not in the modules, because `rlm --help`
# lists every command without importing any (some import torch). Order is the order `rlm --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": (
        "rlm.commands.quickstart",
        "Offline end to end: toy world, buffer, Algorithm 2 training, dev EM vs four baselines, the demo.",
    ),
    "embed": (
        "rlm.commands.embed",
        "Embed a corpus once into a fixed passage buffer (memory-mapped shards).",
    ),
    "index": ("rlm.commands.index", "Build a faiss index over passage embeddings for inference."),
    "toy-world": (
        "rlm.commands.toy_world",
        "Generate the offline toy world: a corpus of invented facts and held-out QA splits.",
    ),
    "splits": (
        "rlm.commands.splits",
        "Write a QA dataset's train, dev and test as the literature names them, with dev's ids, to a folder.",
    ),
    "evaluate": (
        "rlm.commands.evaluate",
        "Evaluate a checkpoint: EM/F1, recall@k, predictions JSONL (with its answer policy).",
    ),
    "train": (
        "rlm.commands.train",
        "Train reader + retriever jointly (Algorithm 2) or the retriever alone (Algorithm 1).",
    ),
    "demo": (
        "rlm.commands.demo",
        "Serve the Gradio QA demo over a trained checkpoint (reader + retriever + faiss index).",
    ),
    "corpus": (
        "rlm.commands.corpus",
        "Change an indexed corpus in place: `rlm corpus update` adds, replaces and deletes passages, embedding "
        "only those.",
    ),
    "calibrate": (
        "rlm.commands.calibrate",
        "Fit a checkpoint's calibrated confidence and abstention rule on its dev split.",
    ),
}

DISTRIBUTION = "rlm-corrector"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, except where there is nothing to show: a flag (its default is
    off), a default of None or an empty list (the help says what happens then), or a help that already says
    its default in words ("default: the checkpoint's")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or action.default == [] or "default" in text:
            return text
        return super()._get_help_string(action)


def version() -> str:
    """The installed distribution's version; a source tree run without `pip install` has none."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _top_level_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: rlm <command> [options]",
        "       rlm --version",
        "",
        "Retrieval-augmented QA: FiD reader + dual-encoder retriever trained jointly, with a corrector network",
        "over a fixed passage buffer (Monath et al. 2024, Algorithm 2).",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `rlm <command> --help` for the options of one command."]
    return "\n".join(lines)


def build_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """The parser of `rlm <name>` and the module that runs it (imported here, not before)."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"rlm {name}", description=help_, formatter_class=HelpFormatter)
    module.add_arguments(parser)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"rlm {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    parser, module = build_parser(name)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except Exception as err:
        if os.environ.get("RLM_DEBUG") or not isinstance(err, user_errors()):
            raise
        if main_process():  # every process of a launched run fails alike; one says why
            print(f"error: {err}", file=sys.stderr)
        else:
            # The launcher ends every process once one has failed: a process that exited first could take
            # the main one down before it said why. The main one's exit ends this wait.
            time.sleep(QUIET_RANK_GRACE_S)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
