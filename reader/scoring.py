"""Per-passage answer likelihoods: the reader's soft relevance labels for perplexity distillation (Eq. 8)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlm.base.evalmode import eval_mode
from rlm.reader.fid import FiDReader
from rlm.reader.formatting import FiDCollator, Passages

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
    step = batch_size or max(1, sum(len(plist) for plist in passages))
    if step < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    parts = [
        scoring_inputs(reader.collator, questions, passages, answers, start, step)
        for start in range(0, max(1, sum(len(plist) for plist in passages)), step)
    ]
    return score_inputs(reader, parts, reduction)


@dataclass
class ScoringInputs:
    """One pass of `score_passages`, made on the host: the collated pairs (each passage alone with its question
    and answer), the [B, K] slot each pair's score goes to, and the shape of the scores."""

    batch: dict[str, torch.Tensor]  # the collator's input_ids, attention_mask [P, 1, L] and labels [P, T]
    rows: torch.Tensor  # [P] question of each pair
    cols: torch.Tensor  # [P] its slot
    shape: tuple[int, int]  # [B, K]: K the most passages of any question

    def pinned(self, pin: bool = True) -> ScoringInputs:
        """In page-locked memory (when `pin`), so that copying it to a GPU does not wait for the GPU."""
        if not pin:
            return self
        batch = {key: value.pin_memory() for key, value in self.batch.items()}
        return ScoringInputs(batch, self.rows.pin_memory(), self.cols.pin_memory(), self.shape)


def scoring_inputs(
    collator: FiDCollator,
    questions: Sequence[str],
    passages: Passages,
    answers: Sequence[str],
    start: int = 0,
    count: int | None = None,
) -> ScoringInputs:
    """The pairs `start` to `start + count` (all: None) of `score_passages`, tokenized by `collator`: the host
    half of scoring, which another thread can do ahead of the reader's pass (with its own collator)."""
    shape = (len(questions), max([len(p) for p in passages] + [0]))
    pairs = [(b, k) for b, plist in enumerate(passages) for k in range(len(plist))]
    chunk = pairs[start : None if count is None else start + count]
    batch = {}
    if chunk:
        collated = collator(
            [questions[b] for b, _ in chunk],
            [[passages[b][k]] for b, k in chunk],
            [answers[b] for b, _ in chunk],
        )
        batch = {key: collated[key] for key in ("input_ids", "attention_mask", "labels")}
    rows = torch.tensor([b for b, _ in chunk], dtype=torch.long)
    cols = torch.tensor([k for _, k in chunk], dtype=torch.long)
    return ScoringInputs(batch, rows, cols, shape)


def scoring_inputs_from_reader(collated: dict[str, torch.Tensor], passages: Passages) -> ScoringInputs | None:
    """`scoring_inputs` of every pair, cut from the FiD reader's collation of the same passages by the same
    collator: one tokenization for both passes. The same tensors exactly when the template does not name
    `{rank}` (each pair's text is then its slot's) and every question has a passage (so both pad to the same
    longest text and answer); None otherwise."""
    if any(not plist for plist in passages):
        return None
    pairs = [(b, k) for b, plist in enumerate(passages) for k in range(len(plist))]
    rows = torch.tensor([b for b, _ in pairs], dtype=torch.long)
    cols = torch.tensor([k for _, k in pairs], dtype=torch.long)
    batch = {
        "input_ids": collated["input_ids"][rows, cols].unsqueeze(1),
        "attention_mask": collated["attention_mask"][rows, cols].unsqueeze(1),
        "labels": collated["labels"][rows],
    }
    return ScoringInputs(batch, rows, cols, (len(passages), max(len(plist) for plist in passages)))


@torch.no_grad()
def score_inputs(reader: FiDReader, parts: Sequence[ScoringInputs], reduction: str = "sum") -> torch.Tensor:
    """The device half of `score_passages`: `log P(answer | question, passage alone)` [B, K] from the pairs
    `scoring_inputs` made (moved to the reader's device without waiting when pinned); -inf where a question
    has no passage."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; choose one of {REDUCTIONS}")
    device = reader.device
    scores = torch.full(parts[0].shape, float("-inf"), device=device)
    with eval_mode(reader):
        for part in parts:
            if not part.batch:
                continue
            # The reader moves its inputs itself (and reads which slots hold text from the host's copy); the
            # labels are read next to the logits by answer_token_log_probs.
            labels = part.batch["labels"].to(device, non_blocking=True)
            logits = reader(part.batch["input_ids"], part.batch["attention_mask"], labels=labels).logits
            token_logp = answer_token_log_probs(logits, labels)
            total = token_logp.sum(dim=1)
            if reduction == "mean":
                total = total / (labels != -100).sum(dim=1).clamp(min=1)
            rows = part.rows.to(device, non_blocking=True)
            cols = part.cols.to(device, non_blocking=True)
            scores[rows, cols] = total.float()
    return scores


def answer_token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label token, `[B, T]`, zero where the label is -100 (padding)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))
