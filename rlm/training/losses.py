"""Task losses of the two algorithms (the corrector's own losses live in rlm.retriever.corrector).

All take scores over the selected subset S_x as [B, K] tensors with an optional boolean `mask` [B, K] (False for
padding slots, which then carry no probability mass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = -1e4  # large but finite: keeps softmax and its gradient NaN-free in fp16/bf16


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    logits = logits.float()
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    return F.log_softmax(logits, dim=-1)


def perplexity_distillation_loss(
    retriever_logits: torch.Tensor,
    answer_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL(P_a || P~) averaged over the batch (Izacard et al. 2022; Eq. 8 of Monath et al. 2024).

    `retriever_logits` = beta * <f(x), g(y)> over S_x (with gradient); `answer_logprobs` = log P(a | y, x) from
    the reader scoring each passage alone. P_a(y|x) = P(a|y,x) / sum_y' P(a|y',x) is the softmax of the log
    likelihoods (temperature 1 is the paper's form); it is a fixed target, so no gradient reaches the reader.
    """
    target_logp = masked_log_softmax(answer_logprobs.detach().float() / temperature, mask)
    retriever_logp = masked_log_softmax(retriever_logits, mask)
    target_p = target_logp.exp()
    kl = target_p * (target_logp - retriever_logp)
    if mask is not None:
        kl = kl.masked_fill(~mask, 0.0)
    return kl.sum(-1).mean()


def supervised_retrieval_loss(
    logits: torch.Tensor, label_positions: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the truncated softmax against the gold passage (Algorithm 1's task loss)."""
    return F.nll_loss(masked_log_softmax(logits, mask), label_positions)
