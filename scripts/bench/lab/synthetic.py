"""The paper's Section 5.3 synthetic study: how well a corrector h(g') recovers the softmax of drifted targets.

Vectors stand in for the encoders: g'(y), the stale buffer, are targets drawn from a mixture of Gaussians
(paper: 4,096 targets, D = 8, 20 components); g(y) = m(g'(y)), the fresh targets, pass g' through a random
residual MLP m whose depth, width and init scale set how stale g' is; the queries f(x) come from the same
mixture (the paper does not say how it draws them; this keeps every query near some targets, so P is peaked
the way a retrieval softmax is). P(y|x) = softmax_y(beta <f(x), g(y)>) over all targets is the truth, P_g'
uses g' and P_h uses h(g'). h is trained alone (Adam, lr 0.03, at most 1,000 full-batch epochs, patience 100) on
the cross-entropy between the truncated softmaxes of g and h(g') over a sampled fraction of the targets (Eq. 6)
and judged by KL(P || P_h) over *all* targets on held-out queries, so targets it never saw count; so is its
rival at the same budget (`fit_regression`), Dynnibal's Nystrom kernel ridge regression from g' to g, fitted in
closed form on the same sampled targets.
"""

from __future__ import annotations

import math
import time
from collections import namedtuple
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.reencode import NystromRegression


def build_corrector(dim: int, hidden_dim: int, num_hidden_layers: int, seed: int = 0) -> nn.Module:
    """The corrector h, identity at init (0 hidden layers: the linear residual map x + W x + b)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CorrectorNetwork(dim, hidden_dim or dim, num_hidden_layers)


def parameter_count(module: nn.Module) -> int:
    """Number of trainable scalars, the paper's |Psi|."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def softmax_kl(queries: Tensor, true_targets: Tensor, approx_targets: Tensor, beta: float) -> float:
    """Mean over queries of KL(P || Q), P = softmax(beta <x, true>), Q = softmax(beta <x, approx>), all targets."""
    if true_targets.shape != approx_targets.shape:
        raise ValueError(f"true {tuple(true_targets.shape)} and approx {tuple(approx_targets.shape)} differ")
    log_p = (beta * queries @ true_targets.T).log_softmax(-1)
    log_q = (beta * queries @ approx_targets.T).log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


# How a corrector fit went: epochs run, the best one, its training loss and the truncated KL that loss is.
FitResult = namedtuple("FitResult", "epochs best_epoch train_ce train_kl seconds")


def train_corrector(
    corrector: nn.Module,
    stale: Tensor,
    fresh: Tensor,
    queries: Tensor,
    beta: float,
    lr: float = 0.03,
    max_epochs: int = 1000,
    patience: int = 100,
    min_delta: float = 1e-6,
) -> FitResult:
    """Fit h so that softmax(beta <x, h(stale)>) matches softmax(beta <x, fresh>) over given targets (Eq. 6):
    `stale`, `fresh` [M, D] are the sampled targets (the truncated set S(Y)), `queries` [Q, D]. One epoch is
    one full-batch Adam step. Stops when the loss has not improved by `min_delta` for `patience` epochs or
    after `max_epochs`; the corrector is left with its best-loss weights."""
    if stale.shape != fresh.shape:
        raise ValueError(f"stale {tuple(stale.shape)} and fresh {tuple(fresh.shape)} differ")
    start = time.perf_counter()
    p_target = (beta * queries @ fresh.T).softmax(-1)
    # The CE floor is the entropy of the target softmax; subtracting it reports the truncated KL.
    entropy = -(p_target * p_target.clamp_min(1e-30).log()).sum(-1).mean().item()
    optimizer = torch.optim.Adam(corrector.parameters(), lr=lr)
    best, best_epoch, best_state, epoch = math.inf, 0, None, 0
    for epoch in range(1, max_epochs + 1):
        loss = -(p_target * (beta * queries @ corrector(stale).T).log_softmax(-1)).sum(-1).mean()
        if (value := loss.item()) < best - min_delta:
            # The loss belongs to the weights before this step, so they are the ones kept.
            best, best_epoch = value, epoch
            best_state = {k: v.detach().clone() for k, v in corrector.state_dict().items()}
        if epoch - best_epoch >= patience:
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if best_state is not None:
        corrector.load_state_dict(best_state)
    return FitResult(epoch, best_epoch, best, best - entropy, time.perf_counter() - start)


@dataclass(frozen=True)
class DriftSpec:
    """A staleness setting: g = m(g') with m a random residual MLP of this shape and init scale."""

    num_hidden_layers: int
    width_mult: int
    init_scale: float
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.num_hidden_layers}x{self.width_mult}D@{self.init_scale:g}"


@dataclass(frozen=True)
class CorrectorSpec:
    """A corrector shape: residual MLP with `num_hidden_layers` ReLU layers of width `width_mult` * D."""

    num_hidden_layers: int
    width_mult: int

    @property
    def label(self) -> str:
        return "linear" if self.num_hidden_layers == 0 else f"{self.num_hidden_layers}x{self.width_mult}D"


@dataclass(frozen=True)
class SyntheticWorld:
    """Stale targets g' [N, D], training and held-out queries f(x), and the softmax temperature beta."""

    stale: Tensor
    train_queries: Tensor
    eval_queries: Tensor
    beta: float

    @property
    def dim(self) -> int:
        return self.stale.shape[1]

    @classmethod
    def generate(
        cls,
        num_targets: int = 4096,
        dim: int = 8,
        num_components: int = 20,
        num_train_queries: int = 128,
        num_eval_queries: int = 256,
        beta: float = 2.0,
        seed: int = 0,
    ) -> SyntheticWorld:
        """Targets and queries from one random isotropic Gaussian mixture with uniform weights (paper: 4,096
        targets, D = 8, 20 components): means ~ N(0, I), each component's std uniform in [0.1, 0.4]."""
        if dim <= 0 or num_components <= 0:
            raise ValueError(f"need dim > 0 and num_components > 0, got {dim} and {num_components}")
        generator = torch.Generator().manual_seed(seed)
        means = torch.randn(num_components, dim, generator=generator)
        stds = 0.1 + 0.3 * torch.rand(num_components, generator=generator)

        def sample(n: int) -> Tensor:  # pick a component uniformly, add its isotropic noise
            component = torch.randint(num_components, (n,), generator=generator)
            return means[component] + stds[component, None] * torch.randn(n, dim, generator=generator)

        stale = sample(num_targets)
        return cls(stale, sample(num_train_queries), sample(num_eval_queries), beta)

    def drifted(self, drift: DriftSpec) -> Tensor:
        """The fresh targets g = m(g'), m a frozen random residual MLP of the corrector's shape: weights
        N(0, 1 / fan_in), biases N(0, 1/4), the output layer then scaled by `init_scale` (0: no drift). The
        fan-in scaling keeps each layer's output on the scale of its input, so `init_scale` reads roughly as
        "how far, relative to |g'|, the targets move"."""
        if drift.init_scale < 0:
            raise ValueError(f"init_scale must be >= 0, got {drift.init_scale}")
        generator = torch.Generator().manual_seed(drift.seed)
        net = CorrectorNetwork(self.dim, drift.width_mult * self.dim, drift.num_hidden_layers)
        with torch.no_grad():
            for layer in [*net.hidden, net.output]:
                fan_in = layer.weight.shape[1]
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / math.sqrt(fan_in))
                layer.bias.copy_(0.5 * torch.randn(layer.bias.shape, generator=generator))
            # Only the output layer is scaled: the hidden ReLU features keep their shape and the size of the
            # residual update is set by one number.
            net.output.weight.mul_(drift.init_scale)
            net.output.bias.mul_(drift.init_scale)
            return net(self.stale)

    def kl(self, fresh: Tensor, approx: Tensor) -> float:
        """KL(P || P_approx) on the held-out queries, over all targets."""
        return softmax_kl(self.eval_queries, fresh, approx, self.beta)

    def stale_kl(self, fresh: Tensor) -> float:
        """KL(P || P_g') on the held-out queries: how stale the buffer is."""
        return self.kl(fresh, self.stale)


def sample_targets(num_targets: int, fraction: float, seed: int) -> Tensor:
    """The targets whose fresh embeddings a method may see (the re-embedding budget): a uniform sample of
    `fraction` of them, the same for every method fitted with this seed."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_targets, generator=generator)[: max(2, round(fraction * num_targets))]


def fit_corrector(
    world: SyntheticWorld, fresh: Tensor, corrector: CorrectorSpec, fraction: float, seed: int = 0, **train
) -> dict:
    """Train one corrector on a uniform sample of `fraction` of the targets; score it on all of them: a flat
    record of the corrector's shape and parameter count, the number of sampled targets, the held-out
    KL(P || P_h) over all targets, and the fit (epochs, truncated training KL, seconds)."""
    sampled = sample_targets(len(world.stale), fraction, seed)
    h = build_corrector(world.dim, corrector.width_mult * world.dim, corrector.num_hidden_layers, seed=seed)
    fit = train_corrector(h, world.stale[sampled], fresh[sampled], world.train_queries, world.beta, **train)
    with torch.no_grad():
        kl = world.kl(fresh, h(world.stale))
    record = {"corrector": corrector.label, "corrector_layers": corrector.num_hidden_layers}
    record |= {"corrector_width_mult": corrector.width_mult, "params": parameter_count(h)}
    record |= {"fraction": fraction, "sampled_targets": len(sampled), "corrected_kl": kl}
    return record | {f"fit_{k}": v for k, v in fit._asdict().items()}


def fit_regression(
    world: SyntheticWorld, fresh: Tensor, fraction: float, kernel: str, landmarks: int = 128, seed: int = 0
) -> dict:
    """Dynnibal's approximate re-encoding at the corrector's re-embedding budget: a Nystrom kernel ridge
    regression (`rlm.retriever.reencode`) fitted on the same sampled targets `fit_corrector` sees, applied to all
    targets, scored by the same held-out KL. Landmarks are `landmarks` random stale targets; the ridge is
    chosen on a held-out fifth of the samples, as training does."""
    sampled = sample_targets(len(world.stale), fraction, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    chosen = torch.randperm(len(world.stale), generator=generator)[:landmarks]
    start = time.perf_counter()
    stale, target, landmarks = world.stale[sampled], fresh[sampled], world.stale[chosen]
    model, scores = NystromRegression.fit_validated(stale, target, landmarks, kernel=kernel, seed=seed)
    record = {"method": f"nystrom-{kernel}", "kernel": kernel, "landmarks": len(chosen)}
    record |= {"ridge": min(scores, key=scores.get) if scores else None, "fraction": fraction}
    record |= {"sampled_targets": len(sampled), "regression_kl": world.kl(fresh, model(world.stale))}
    return record | {"seconds": time.perf_counter() - start}
