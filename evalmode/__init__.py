"""`eval_mode(module)`: a module in eval mode (no dropout) for a block, then back in the mode it was in.

Encoding, buffer building, answering and passage scoring run in eval mode even in the middle of training, and
must hand the module back in train mode, also when they raise. Like `atomicio`, a package of its own that
imports nothing of ours, so `reader` and `retriever` share it and stay independent of each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module.eval()` inside the block; its own earlier mode (train or eval) restored after, even on error."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
