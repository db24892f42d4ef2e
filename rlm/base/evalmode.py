"""How a model computes, switched the same way by both model packages: `eval_mode(module)`, a module in eval
mode (no dropout) for a block, then back in the mode it was in; `set_activation_checkpointing(model, on)` and
`activation_checkpointing(model)`, a Hugging Face model's activation checkpointing on transformers 4 and 5.

Encoding, buffer building, answering and passage scoring run in eval mode even in the middle of training, and
must hand the module back in train mode, also when they raise. Like `atomicio`, a package of its own that
imports nothing of ours, so `reader` and `retriever` share it and stay independent of each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["activation_checkpointing", "eval_mode", "set_activation_checkpointing"]


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module.eval()` inside the block; its own earlier mode (train or eval) restored after, even on error."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute a Hugging Face `model`'s activations in the backward pass (non-reentrant), or keep them (the
    default). transformers 5 renamed the methods (and their keyword); 4.x only has the old names."""
    if not enabled:
        disable = (
            getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        )
        disable()
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def activation_checkpointing(model: nn.Module) -> bool:
    """Whether a Hugging Face `model` recomputes its activations in the backward pass."""
    flag = getattr(type(model), "is_activation_checkpointing", None) or type(model).is_gradient_checkpointing
    return bool(flag.fget(model))
