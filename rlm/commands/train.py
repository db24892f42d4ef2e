"""`rlm train`: joint training from a YAML config (also `accelerate launch -m rlm.train ...`)."""

from rlm.train import add_arguments, run

HELP = "Train reader + retriever jointly (Algorithm 2) or the retriever alone (Algorithm 1)."

__all__ = ["HELP", "add_arguments", "run"]
