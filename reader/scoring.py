"""Per-passage answer likelihoods: the reader's soft relevance labels for perplexity distillation (Eq. 8)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from evalmode import eval_mode
from reader.fid import FiDReader
from reader.formatting import Passages

REDUCTIONS = ("sum", "mean")


@torch.no_grad()
def score_passages(
    reader: FiDReader,
    questions: Sequence[str],
    passages: Passages,
    answers: Sequence[str],
    reduction: str = "sum",
    batch_size: int | None = None,
) -> torch.Tensor:
    """`log P(answer | question, passage alone)` for every passage, `[B, K]` float32 on the reader's device.

    Each (question, passage) pair is read on its own: one encoder pass over the `[B*K, L]` pairs and one
    teacher-forced decoder pass with each answer repeated for its K passages. `reduction="sum"` gives the
    answer's total log-likelihood (the paper's P(a|y,x)); `"mean"` divides by the number of answer tokens.
    Questions with fewer than K passages get `-inf` in the missing slots (zero probability after a
    softmax). `batch_size` bounds the pairs per pass, to cap memory; `None` runs all pairs at once. Dropout is
    off while scoring (eval mode), and the reader's mode is restored afterwards. The scores stay on the
    reader's device because they meet the retriever's logits there (the distillation loss); `.cpu()` them
    for logging or numpy.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; choose one of {REDUCTIONS}")
    if not (len(questions) == len(passages) == len(answers)):
        raise ValueError(
            f"{len(questions)} questions, {len(passages)} passage lists and {len(answers)} answers"
        )
    num_slots = max([len(p) for p in passages] + [0])
    device = reader.device
    scores = torch.full((len(questions), num_slots), float("-inf"), device=device)
    pairs = [(b, k) for b, plist in enumerate(passages) for k in range(len(plist))]
    if not pairs:
        return scores
    step = batch_size or len(pairs)
    if step < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")

    with eval_mode(reader):
        for start in range(0, len(pairs), step):
            chunk = pairs[start : start + step]
            batch = reader.collator(
                [questions[b] for b, _ in chunk],
                [[passages[b][k]] for b, k in chunk],
                [answers[b] for b, _ in chunk],
            )
            labels = batch["labels"].to(device)  # answer_token_log_probs reads them next to the logits
            logits = reader(batch["input_ids"], batch["attention_mask"], labels=labels).logits
            token_logp = answer_token_log_probs(logits, labels)
            total = token_logp.sum(dim=1)
            if reduction == "mean":
                total = total / (labels != -100).sum(dim=1).clamp(min=1)
            rows = torch.tensor([b for b, _ in chunk], device=device)
            cols = torch.tensor([k for _, k in chunk], device=device)
            scores[rows, cols] = total.float()
    return scores


def answer_token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label token, `[B, T]`, zero where the label is -100 (padding)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))
