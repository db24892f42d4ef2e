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

from rlm.errors import user_errors

# name -> (module, one-line help). Order is the order `rlm --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("rlm.commands.quickstart", "Offline: toy world, train, dev EM vs baselines, then demo."),
    "embed": (
        "rlm.commands.embed",
        "Embed a corpus once into a fixed passage buffer (memory-mapped shards).",
    ),
    "index": ("rlm.commands.index", "Build a faiss index over passage embeddings for inference."),
    "toy-world": ("rlm.commands.toy_world", "Generate the offline toy world (corpus + held-out QA splits)."),
    "evaluate": ("rlm.commands.evaluate", "Evaluate a checkpoint: EM/F1, recall@k, predictions JSONL."),
    "train": ("rlm.commands.train", "Train reader + retriever jointly with a corrector over a fixed buffer."),
    "demo": ("rlm.commands.demo", "Serve the Gradio QA demo over a trained checkpoint."),
    "calibrate": (
        "rlm.commands.calibrate",
        "Fit a checkpoint's calibrated confidence and abstention rule on its dev split.",
    ),
    "bench": ("rlm.commands.bench", "Run a benchmark script: retrieval, reader or training."),
}


def _top_level_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: rlm <command> [options]",
        "",
        "Retrieval-augmented QA: FiD reader + dual-encoder retriever trained jointly, with a corrector network",
        "over a fixed passage buffer (Monath et al. 2024, Algorithm 2).",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `rlm <command> --help` for the options of one command."]
    return "\n".join(lines)


def main_process() -> bool:
    """Whether this is the process that speaks for a launched run (rank 0 of `accelerate launch` or torchrun;
    any process started on its own)."""
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"rlm {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except Exception as err:
        if os.environ.get("RLM_DEBUG") or not isinstance(err, user_errors()):
            raise
        if main_process():  # every process of a launched run fails alike; one says why
            print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
