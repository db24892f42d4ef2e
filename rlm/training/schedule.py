"""Which questions and which phase each optimizer step trains: the data order, the gold-passage curriculum,
Algorithm 2's reader-only phases and the learning-rate schedule.

Data order is a pure function of (seed, micro-step): each epoch is a seeded permutation of the training set,
and process r of W takes its slice of every global batch. Resuming at micro-step m therefore sees exactly the
batches an uninterrupted run would, with no dataloader state to restore.
"""

from __future__ import annotations

import functools

import torch

from rlm.config import TrainConfig
from rlm.errors import UserError
from rlm.training.batch import Batch


def batch_indices(micro_step: int, num_examples: int, batch_size: int, rank: int, world: int, seed: int):
    """Example indices of process `rank` at `micro_step`: epoch = seeded permutation, drop the last partial batch."""
    global_batch = batch_size * world
    per_epoch = num_examples // global_batch
    if per_epoch == 0:
        raise UserError(
            f"{num_examples} training examples cannot fill one global batch of {global_batch}; "
            "lower optim.batch_size or use more data"
        )
    epoch, pos = divmod(micro_step, per_epoch)
    start = pos * global_batch + rank * batch_size
    return list(epoch_order(num_examples, seed, epoch)[start : start + batch_size])


@functools.lru_cache(maxsize=2)
def epoch_order(num_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """Epoch `epoch`'s seeded permutation of the examples, drawn and read into Python once per epoch (per
    micro-step, the draw over a paper-sized train set costs a millisecond and the read a tensor conversion)."""
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return tuple(order.tolist())


def make_batch(examples, indices, corpus, algorithm: int, gold_passages: bool = False) -> Batch:
    """The questions at `indices`; `gold_passages`: the reader reads each question's gold passages only."""
    chosen = [examples[i] for i in indices]
    gold = others = None
    if algorithm == 1:
        # The first gold passage is the label; a multi-hop question's other gold passages are relevant too,
        # so they are kept out of its negatives (as DPR keeps positives out of its hard negatives).
        golds = [[corpus.index_of(pid) for pid in ex.gold_passage_ids] for ex in chosen]
        gold = torch.tensor([g[0] for g in golds], dtype=torch.long)
        others = torch.full((len(golds), max(len(g) for g in golds) - 1), -1, dtype=torch.long)
        for i, g in enumerate(golds):
            others[i, : len(g) - 1] = torch.tensor(g[1:], dtype=torch.long)
    given = None
    if gold_passages:
        given = [
            [(corpus[r].title, corpus[r].text) for r in map(corpus.index_of, ex.gold_passage_ids)]
            for ex in chosen
        ]
    return Batch(
        [ex.question for ex in chosen], [ex.answers[0] for ex in chosen], gold, given, other_gold_rows=others
    )


def reader_only_step(cfg: TrainConfig, step: int) -> bool:
    """Whether optimizer step `step` (0-based) trains the reader alone: the first `schedule.reader_only_steps`
    and the last `schedule.final_reader_only_steps` of the run, outside [retriever_start, retriever_stop)."""
    return not retriever_start(cfg) <= step < retriever_stop(cfg)


def retriever_start(cfg: TrainConfig) -> int:
    """The first optimizer step that trains the retriever (Algorithm 2's reader-only warm-up comes first)."""
    return cfg.schedule.reader_only_steps if cfg.algorithm == 2 else 0


def retriever_stop(cfg: TrainConfig) -> int:
    """The step after the retriever's last update (Algorithm 2's final reader-only phase follows it)."""
    final = cfg.schedule.final_reader_only_steps if cfg.algorithm == 2 else 0
    return cfg.optim.max_steps - final


def check_gold_passages(examples, corpus) -> None:
    """The gold-passage curriculum needs every training question's gold passages in the corpus."""
    for ex in examples:
        if not ex.gold_passage_ids:
            raise UserError(
                f"schedule.gold_passage_steps needs gold_passage_ids on every training question; {ex.id} has "
                "none (set schedule.gold_passage_steps=0 for data without gold passages)"
            )
        for gid in ex.gold_passage_ids:
            try:
                corpus.index_of(gid)
            except KeyError:
                raise UserError(
                    f"schedule.gold_passage_steps: gold passage {gid!r} of {ex.id} is not in the corpus "
                    "(set schedule.gold_passage_steps=0)"
                ) from None


def lr_lambda(warmup: int, total: int):
    """Linear warm-up, then linear decay to 10% of the peak."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        frac = (step - warmup) / max(1, total - warmup)
        return max(0.1, 1.0 - 0.9 * frac)

    return fn
