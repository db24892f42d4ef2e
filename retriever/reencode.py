"""Approximate re-encoding (Dynnibal, Monath et al. 2023, Section 4.2 and Appendix B): a Nystrom kernel ridge
regression from stale passage embeddings to the current passage tower's, fitted on a few re-embedded passages
and applied to every row of the buffer.

The corrector's closest rival. Both map the stale buffer B towards fresh embeddings; the corrector is trained
continuously by SGD on the passages each step selects, this map is refitted in closed form from `s'` passages
drawn uniformly at random and re-embedded for the purpose.

The model, for a stale row b (the fixed buffer, never re-embedded):

    R(b) = b + k(b, Z) @ alpha          k(b, Z) [d'] = kernel between b and the d' landmarks Z (rows of B)

fitted on pairs (b_i, f(y_i)) by kernel ridge regression with the Nystrom (subset-of-regressors) kernel
K ~ K_XZ K_ZZ^-1 K_ZX:

    alpha = (K_ZX K_XZ + ridge * s' * K_ZZ)^-1 K_ZX (F - X)

Two choices differ from the paper's, both because our input is the fixed buffer rather than the previous
approximation: the map is fitted from B each time (errors do not compound from one refit to the next), and it
regresses the *residual* f(y) - b, so with d' landmarks smaller than the embedding width the output keeps b's
full rank and only the correction is low-rank (the paper works in the d'-dimensional Nystrom space instead).

The ridge is chosen per refit on a held-out fifth of the samples (`fit_validated`), or fixed by the caller.

Kernels: `rbf` exp(-gamma |b - z|^2), with gamma from the median heuristic (sigma = the median distance between
the samples and the landmarks, gamma = 1 / (2 sigma^2)) unless given; `linear` <b, z> + 1 (the paper's inner-product similarity plus a
constant: a rank-d' affine correction).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from rlm.retriever.errors import InputError

KERNELS = ("rbf", "linear")


def kernel_matrix(x: Tensor, landmarks: Tensor, kernel: str, gamma: float) -> Tensor:
    """k(x_i, z_j) [n, d'] in x's dtype and device."""
    landmarks = landmarks.to(device=x.device, dtype=x.dtype)
    dots = x @ landmarks.T
    if kernel == "linear":
        return dots + 1  # the constant makes the correction affine: drifts that shift every row are in reach
    if kernel == "rbf":
        squared = (x * x).sum(-1, keepdim=True) + (landmarks * landmarks).sum(-1) - 2 * dots
        return torch.exp(-gamma * squared.clamp_min(0))
    raise InputError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def median_gamma(x: Tensor, landmarks: Tensor) -> float:
    """The median heuristic: 1 / (2 sigma^2), sigma the median distance between `x` and the landmarks."""
    squared = torch.cdist(x.double(), landmarks.double()).square()
    median = float(squared[squared > 0].median()) if bool((squared > 0).any()) else 1.0
    return 0.5 / median


RIDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)  # the grid `fit_validated` chooses from


def residual(mapped: Tensor, stale: Tensor, fresh: Tensor) -> float:
    """The share of the drift a map leaves: |R(b) - f|^2 / |b - f|^2 (0: all of it explained; 1: none)."""
    mapped, stale, fresh = mapped.double(), stale.double(), fresh.double()
    return float((mapped - fresh).square().sum() / (stale - fresh).square().sum().clamp_min(1e-24))


@dataclass
class NystromRegression:
    """R(b) = b + k(b, Z) alpha, fitted by `fit`; call it on rows of any size (or `apply_chunks`)."""

    landmarks: Tensor  # [d', D] rows of the stale buffer
    alpha: Tensor  # [d', D]
    kernel: str
    gamma: float

    @classmethod
    def fit(
        cls,
        stale: Tensor,
        fresh: Tensor,
        landmarks: Tensor,
        kernel: str = "rbf",
        ridge: float = 1e-5,
        gamma: float | None = None,
    ) -> NystromRegression:
        """Fit on `s'` pairs: `stale` [s', D] rows of B, `fresh` [s', D] the same passages re-embedded now.

        Solved in float64 on the CPU (the system is d' x d'). `ridge` is per sample (the penalty is
        `ridge * s' * alpha^T K_ZZ alpha`), so its scale does not change with s'.
        """
        if stale.shape != fresh.shape:
            raise ValueError(f"stale {tuple(stale.shape)} and fresh {tuple(fresh.shape)} differ")
        if landmarks.ndim != 2 or landmarks.shape[1] != stale.shape[1]:
            raise ValueError(
                f"landmarks {tuple(landmarks.shape)} do not match rows of width {stale.shape[1]}"
            )
        if ridge <= 0:
            raise ValueError(f"ridge must be > 0, got {ridge}")
        x = stale.detach().double().cpu()
        y = fresh.detach().double().cpu()
        z = landmarks.detach().double().cpu()
        if gamma is None:
            gamma = median_gamma(x, z) if kernel == "rbf" else 1.0
        k_xz = kernel_matrix(x, z, kernel, gamma)  # [s', d']
        k_zz = kernel_matrix(z, z, kernel, gamma)  # [d', d']
        system = k_xz.T @ k_xz + ridge * len(x) * k_zz
        # Duplicate landmarks (a corpus with repeated passages) make the system singular: a jitter on the
        # diagonal, tiny against its scale, keeps the solve defined without changing a well-posed answer.
        scale = float(system.diagonal().mean()) or 1.0
        system = system + 1e-10 * scale * torch.eye(len(z), dtype=system.dtype)
        alpha = torch.linalg.solve(system, k_xz.T @ (y - x))
        return cls(z.float(), alpha.float(), kernel, float(gamma))

    @classmethod
    def fit_validated(
        cls,
        stale: Tensor,
        fresh: Tensor,
        landmarks: Tensor,
        kernel: str = "rbf",
        gamma: float | None = None,
        ridges: tuple[float, ...] = RIDGES,
        holdout: float = 0.2,
        seed: int = 0,
    ) -> tuple[NystromRegression, dict[float, float]]:
        """The ridge chosen on the samples themselves: fit each of `ridges` on (1 - holdout) of the pairs,
        score it on the rest (the share of their drift it leaves, `residual`), refit the best on all pairs.

        A fixed ridge does not carry from one regime to another (a few hundred samples in 384 dimensions
        overfit at the 1e-5 that suits thousands in 8), and every fit is a d' x d' solve, so choosing costs
        nothing next to re-embedding the samples. Returns the model and the held-out residual per ridge.
        """
        count = len(stale)
        if count < 5:  # too few to hold any out: the middle of the grid
            return cls.fit(stale, fresh, landmarks, kernel, ridges[len(ridges) // 2], gamma), {}
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        held = order[: max(1, round(holdout * count))]
        kept = order[len(held) :]
        scores = {}
        for ridge in ridges:
            model = cls.fit(stale[kept], fresh[kept], landmarks, kernel, ridge, gamma)
            scores[ridge] = residual(model(stale[held]), stale[held], fresh[held])
        best = min(scores, key=scores.get)
        return cls.fit(stale, fresh, landmarks, kernel, best, gamma), scores

    def __call__(self, rows: Tensor) -> Tensor:
        """R(rows) [n, D] float32 on rows' device."""
        x = rows.float()
        features = kernel_matrix(x, self.landmarks, self.kernel, self.gamma)
        return x + features @ self.alpha.to(x.device)

    def apply_chunks(self, rows: Iterator[Tensor], device: torch.device | None = None) -> Tensor:
        """R applied to a stream of row blocks (the memory-mapped buffer's chunks), concatenated [n, D] float32
        on the CPU; each block is computed on `device` (None: where it is)."""
        out = [self(block if device is None else block.to(device)).cpu() for block in rows]
        return torch.cat(out) if out else self.alpha.new_empty(0, self.alpha.shape[1])
