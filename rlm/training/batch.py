"""What one micro-step of training is given and what it returns: the questions of a micro-batch (`Batch`, a pure
function of the seed, the window and the micro-step: `rlm.training.schedule.make_batch`) and the loss with its
figures (`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    questions: list[str]
    answers: list[str]  # the target answer string of each question
    gold_rows: torch.Tensor | None = None  # [B] corpus row of the gold passage (Algorithm 1)
    # (title, text) passages the reader reads instead of the strategy's selection (the gold-passage
    # curriculum, `schedule.gold_passage_steps`); such a step trains the reader alone.
    reader_passages: list[list[tuple[str, str]]] | None = None
    # [B, G] corpus rows of each question's other gold passages, -1 padded (Algorithm 1): relevant passages
    # that are not the label, so they are left out of the softmax rather than pushed down as negatives.
    other_gold_rows: torch.Tensor | None = None


@dataclass
class StepOutput:
    loss: torch.Tensor  # what to backpropagate
    # Detached 0-d tensors, for logging: left on the device, read at the log step (`rlm.training.loop.host_record`).
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # each loss with its graph (tests, analysis)
