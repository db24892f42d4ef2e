"""The corrector network h: maps stale buffer embeddings to approximately fresh ones (paper, Section 3).

h(x) = x + W_out relu(... relu(W_1 x)), a residual MLP whose output layer starts at zero, so at step 0 it is
exactly the identity and corrected retrieval equals the stale baseline. `linear=True` adds a zero-initialised
linear term, h(x) = x + A x + W_out relu(...): a ReLU MLP can only approximate a general linear drift, which
this term expresses exactly (the synthetic study, scripts/bench/synthetic_corrector.py, finding 3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rlm.base.atomicio import atomic_directory, atomic_write_text

CONFIG_NAME = "corrector_config.json"
WEIGHTS_NAME = "model.safetensors"


class CorrectorNetwork(nn.Module):
    """Residual MLP [..., D] -> [..., D] with `num_hidden_layers` ReLU layers of width `hidden_dim`
    (0 hidden layers: the linear residual map x + W x + b)."""

    def __init__(self, dim: int, hidden_dim: int, num_hidden_layers: int = 1, linear: bool = False):
        super().__init__()
        if dim <= 0 or hidden_dim <= 0 or num_hidden_layers < 0:
            raise ValueError(
                f"CorrectorNetwork needs dim > 0, hidden_dim > 0, num_hidden_layers >= 0; "
                f"got dim={dim}, hidden_dim={hidden_dim}, num_hidden_layers={num_hidden_layers}"
            )
        self.dim, self.hidden_dim, self.num_hidden_layers = dim, hidden_dim, num_hidden_layers
        self.linear = nn.Linear(dim, dim, bias=False) if linear else None
        if self.linear is not None:
            nn.init.zeros_(self.linear.weight)
        widths = [dim] + [hidden_dim] * num_hidden_layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.output = nn.Linear(widths[-1], dim)
        # Zero output layer: h is the identity at init, and the hidden layers still get gradient through
        # the output weights as soon as those move off zero.
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = x
        for layer in self.hidden:
            y = F.relu(layer(y))
        out = x + self.output(y)
        return out if self.linear is None else out + self.linear(x)

    def config(self) -> dict:
        return {
            "dim": self.dim,
            "hidden_dim": self.hidden_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "linear": self.linear is not None,
        }

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """`corrector_config.json` + `model.safetensors`, atomically replacing `out_dir`."""
        with atomic_directory(out_dir) as tmp:
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / WEIGHTS_NAME))
            atomic_write_text(tmp / CONFIG_NAME, json.dumps(self.config(), indent=2))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> CorrectorNetwork:
        """Load a folder written by `save_pretrained`."""
        folder = Path(path)
        config_file = folder / CONFIG_NAME
        if not config_file.exists():
            raise FileNotFoundError(
                f"{config_file} not found: not a corrector folder written by save_pretrained"
            )
        net = cls(**json.loads(config_file.read_text()))
        net.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
        return net


def corrector_ce_loss(
    target_scores: Tensor, corrected_scores: Tensor, beta: float = 1.0, mask: Tensor | None = None
) -> Tensor:
    """Eq. 6: cross-entropy of softmax(beta * corrected) against softmax(beta * target) over the top-k set.

    `target_scores` [B, K] are <q, g(y)> of the live passage tower (detached here, so this loss never moves
    f or g), `corrected_scores` [B, K] are <q, h(B_y)>. `mask` [B, K] (True = keep) drops padded entries.
    Returns the mean over the batch, on `corrected_scores`' device (targets and mask are moved there).
    """
    if target_scores.shape != corrected_scores.shape:
        raise ValueError(
            f"target {tuple(target_scores.shape)} and corrected {tuple(corrected_scores.shape)} differ"
        )
    # The corrected side carries h's graph, so the loss lives where h does; the targets (reader- or
    # tower-side, or built on the host) only need their values there.
    device = corrected_scores.device
    target = beta * target_scores.detach().to(device=device, dtype=torch.float32)
    corrected = beta * corrected_scores.float()
    if mask is not None:
        mask = mask.to(device)
        fill = torch.finfo(torch.float32).min
        target = target.masked_fill(~mask, fill)
        corrected = corrected.masked_fill(~mask, fill)
    p_target = target.softmax(dim=-1)
    log_p = corrected.log_softmax(dim=-1)
    if mask is not None:
        log_p = log_p.masked_fill(~mask, 0.0)
    return -(p_target * log_p).sum(dim=-1).mean()


def corrector_mse_loss(fresh: Tensor, corrected: Tensor) -> Tensor:
    """Eq. 5: mean over vectors of ||g(y) - h(B_y)||^2, with the fresh embeddings detached.

    Returns a scalar on `corrected`'s device (the fresh embeddings are moved there).
    """
    if fresh.shape != corrected.shape:
        raise ValueError(f"fresh {tuple(fresh.shape)} and corrected {tuple(corrected.shape)} differ")
    target = fresh.detach().to(device=corrected.device, dtype=torch.float32)
    return (target - corrected.float()).pow(2).sum(dim=-1).mean()
