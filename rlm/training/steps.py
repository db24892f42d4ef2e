"""One training step of each algorithm, written in the order of the paper's pseudo-code.

Algorithm 2 (retrieval-augmented LM) and Algorithm 1 (supervised retrieval) of Monath et al. 2024. Each returns
one scalar to backpropagate, `(L + L') / 2 + w * l`, whose gradients are separated exactly by stop-gradients:
the corrector loss `l` only sees detached queries and detached targets, so it moves only the corrector; the
task losses never touch the corrector, whose only other use (selecting S_x) runs without gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlm.reader.scoring import score_inputs
from rlm.retriever.corrector import corrector_ce_loss, corrector_mse_loss
from rlm.retriever.search import full_precision
from rlm.training.batch import Batch, StepOutput
from rlm.training.losses import masked_log_softmax, perplexity_distillation_loss, supervised_retrieval_loss
from rlm.training.selection import Selection, StepModel, drawing_from

if TYPE_CHECKING:
    from rlm.config import TrainConfig
    from rlm.data.corpus import Corpus
    from rlm.retriever.corrector import CorrectorNetwork
    from rlm.training.strategies.base import SelectionStrategy


def _scores(queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
    """<q_b, p_bk> for queries [B, D] and passages [B, K, D] -> [B, K] float32, whatever the autocast: the
    towers and h may run in bf16, but beta * s rounded to bf16 would move the losses in steps of 0.125."""
    with full_precision(queries.device):
        return torch.einsum("bd,bkd->bk", queries.float(), passages.float())


def _rows_or_zero(rows: torch.Tensor) -> torch.Tensor:
    return rows.clamp_min(0)  # padding slots (-1) read row 0; their scores are masked out


def _ranks(logits: torch.Tensor) -> torch.Tensor:
    """Each slot's place [B, K] in its row's descending order (0: the best; ties by slot)."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def corrector_quality(
    fresh_logits: torch.Tensor, other_logits: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How well another scoring of S_x matches the fresh one: KL(P~ || P_other) and the overlap of their top m
    (m = a quarter of K, at most the fewest real slots of a row), as 0-d tensors left on the device."""
    with torch.no_grad():
        logp = masked_log_softmax(fresh_logits, mask)
        logq = masked_log_softmax(other_logits, mask)
        kl = (logp.exp() * (logp - logq)).masked_fill(~mask, 0).sum(-1).mean()
        # m and the top-m sets by ranks, on the device: reading m back would wait for it.
        m = mask.sum(-1).min().clamp(min=1, max=max(1, mask.shape[1] // 4))
        fresh_top = _ranks(fresh_logits.masked_fill(~mask, float("-inf"))) < m
        other_top = _ranks(other_logits.masked_fill(~mask, float("-inf"))) < m
        overlap = ((fresh_top & other_top).sum(-1) / m).mean()
    return {"kl": kl, "overlap": overlap}


def corrector_step_loss(
    corrector: CorrectorNetwork | None,
    queries: torch.Tensor,
    stale: torch.Tensor,
    fresh: torch.Tensor,
    fresh_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    loss_kind: str,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Step 7 on S_x: the corrector's loss l from detached queries and detached targets (None without a
    corrector to train), and how far the fixed rows `stale` = B_y have drifted from the fresh ones `fresh` =
    g(y). `fresh_logits` = beta <q, g(y)>; `loss_kind`: "ce" (the paper's CE(P~, P~_h)) or "mse" (Eq. 5)."""
    stale_logits = beta * _scores(queries.detach(), stale)
    # Averaged over the real slots by weights, not by picking them out: a boolean index waits for the device.
    drift = ((fresh.detach().float() - stale.float()).norm(dim=-1) * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "drift": drift,  # mean ||g(y) - B_y|| over S_x: how stale the buffer has become
        "kl_fresh_stale": corrector_quality(fresh_logits.detach(), stale_logits, mask)["kl"],
    }
    if corrector is None:
        return None, metrics
    # In h's own dtype: DeepSpeed casts its parameters to bf16, while B and the queries may be float32.
    corrected = corrector(stale.to(next(corrector.parameters()).dtype))
    corrected_logits = beta * _scores(queries.detach(), corrected)
    quality = corrector_quality(fresh_logits.detach(), corrected_logits, mask)
    metrics.update(kl_fresh_corrected=quality["kl"], overlap_corrected_fresh=quality["overlap"])
    if loss_kind == "ce":
        loss = corrector_ce_loss(fresh_logits.detach() / beta, corrected_logits / beta, beta=beta, mask=mask)
    else:
        loss = corrector_mse_loss(fresh.detach()[mask], corrected[mask])
    return loss, metrics


def algorithm2_step(
    model: StepModel,
    batch: Batch,
    selection: Selection,
    strategy: SelectionStrategy,
    cfg: TrainConfig,
    reader_only: bool = False,
) -> StepOutput:
    """Algorithm 2: train reader and retriever jointly on the passages S_x the window's selection chose for
    `batch` (`rlm.training.selection.select_window`; the corrector strategy: top-k of <q, h(B)>).

    `reader_only` (the `schedule.reader_only_steps` warm-up) keeps the selection but trains the reader alone:
    steps 1, 3-5 and 7 are skipped, so neither the retriever nor the corrector moves.
    """
    beta = cfg.beta
    trains_retriever = strategy.trains_retriever and not reader_only
    h = model.corrector if strategy.uses_corrector else None

    # 1. q = f(x), with gradient, drawing the dropout the window's selection drew: the very q that selected S_x.
    # A step that leaves the retriever as it is needs q only to select.
    if trains_retriever:
        with drawing_from(selection.query_rng):
            queries = model.retriever.encode_queries(batch.questions)

    # 2. S_x = top-k_y <q, h(B_y)> over every passage in the buffer, without gradient: selected for the whole
    # accumulation window before its first micro-step, its passages read and tokenized for steps 3-7 on a
    # background thread since.
    rows, passages = selection.rows, selection.passages
    mask = rows >= 0

    metrics: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}
    if trains_retriever:
        # 3. p_y = g(y) for y in S_x, with gradient; P~(y|x) = softmax(beta <q, p_y>) over S_x.
        fresh = model.retriever.passage_tower.embed_tokenized(passages.tower())
        fresh = fresh.view(*rows.shape, -1)  # padding slots (-1) read row 0; their scores are masked out
        retriever_logits = beta * _scores(queries, fresh)

        # 4. The reader scores each passage alone, without gradient: log P(a | y, x).
        scores = score_inputs(model.reader, [passages.scoring()], reduction=cfg.reader.score_reduction)
        answer_logprobs = _pad_scores(scores, rows.shape)

        # 5. Retriever loss L = KL(P_a || P~) (perplexity distillation, Eq. 8).
        terms["retriever"] = perplexity_distillation_loss(
            retriever_logits, answer_logprobs, mask, cfg.reader_temperature
        )

    # 6. Reader loss L' = NLL of the answer from the FiD reader over the selected passages (the first
    # `reader.num_passages` of each).
    terms["reader"] = model.reader(**passages.reader()).loss

    if trains_retriever:
        # 7. Corrector loss l = CE(P~ (detached), P~_h), P~_h from <q (detached), h(B_y)>; B_y read from
        # wherever the fixed buffer lives (host memory) onto the step's device.
        stale = passages.stale().to(device=queries.device, dtype=torch.float32, non_blocking=True)
        corrector_loss, quality = corrector_step_loss(
            h, queries, stale, fresh, retriever_logits, mask, beta, cfg.corrector.loss
        )
        metrics.update(quality)
        if corrector_loss is not None:
            terms["corrector"] = corrector_loss

    # 8. Retriever and reader on (L + L') / 2, the corrector on w * l; stop-gradients keep them apart.
    loss = terms["reader"] if "retriever" not in terms else (terms["retriever"] + terms["reader"]) / 2
    if "corrector" in terms:
        loss = loss + cfg.corrector.weight * terms["corrector"]
    metrics.update({f"{name}_loss": term.detach() for name, term in terms.items()})
    return StepOutput(loss, metrics, terms)


def reader_alone_step(model: StepModel, batch: Batch, strategy: SelectionStrategy) -> StepOutput:
    """Closed book (no passages), or the curriculum's given passages: the reader alone, answer NLL only."""
    given = batch.reader_passages if strategy.uses_passages else None
    inputs = model.collator(batch.questions, given or [[] for _ in batch.questions], batch.answers)
    reader_loss = model.reader(**_reader_inputs(inputs)).loss
    return StepOutput(reader_loss, {"reader_loss": reader_loss.detach()}, {"reader": reader_loss})


def algorithm1_step(
    model: StepModel,
    batch: Batch,
    strategy: SelectionStrategy,
    corpus: Corpus,
    cfg: TrainConfig,
) -> StepOutput:
    """Algorithm 1: supervised dense retrieval; the gold passage is always in S_x, plus uniform negatives."""
    beta = cfg.beta
    h = model.corrector if strategy.uses_corrector else None

    # 1. q = f(x), with gradient.
    queries = model.retriever.encode_queries(batch.questions)
    gold = batch.gold_rows.to(queries.device)

    # 2. S_x: top-k by the strategy, the label always included, plus uniform negatives shared by the batch.
    top = strategy.select(queries.detach(), h, include=gold[:, None], num_random=cfg.strategy.num_random)
    rows = top.indices

    # 3. p_y = g(y) for y in S_x, with gradient.
    texts = corpus.retrieval_texts()
    if cfg.strategy.share_across_batch or strategy.shares_batch:
        # Appendix B.1: every question scores the union of the batch's S_x; g runs once per distinct passage.
        union = torch.unique(rows[rows >= 0])
        fresh = model.retriever.encode_passages([texts[r] for r in union.tolist()])
        rows, fresh = union.expand(len(gold), -1), fresh.expand(len(gold), -1, -1)
    else:
        flat = [texts[r] for r in _rows_or_zero(rows).reshape(-1).tolist()]
        fresh = model.retriever.encode_passages(flat).view(*rows.shape, -1)
    mask = rows >= 0
    if batch.other_gold_rows is not None and batch.other_gold_rows.numel():
        other_gold = batch.other_gold_rows.to(rows.device)
        other = (rows.unsqueeze(-1) == other_gold.unsqueeze(1)).any(-1)
        mask = mask & ~(other & (rows != gold[:, None]))

    # P~ = softmax(beta <q, p_y>) over S_x.
    logits = beta * _scores(queries, fresh)

    # Task loss: cross-entropy against the one-hot label P*.
    label_pos = ((rows == gold[:, None]) & mask).float().argmax(-1)
    terms = {"retriever": supervised_retrieval_loss(logits, label_pos, mask)}
    metrics = {"train_acc": (logits.masked_fill(~mask, float("-inf")).argmax(-1) == label_pos).float().mean()}

    # Corrector loss on the same S_x.
    stale = strategy.buffer.rows(_rows_or_zero(rows)).to(device=queries.device, dtype=torch.float32)
    corrector_loss, quality = corrector_step_loss(
        h, queries, stale, fresh, logits, mask, beta, cfg.corrector.loss
    )
    metrics.update(quality)
    loss = terms["retriever"]
    if corrector_loss is not None:
        terms["corrector"] = corrector_loss
        loss = loss + cfg.corrector.weight * corrector_loss
    metrics.update({f"{name}_loss": term.detach() for name, term in terms.items()})
    return StepOutput(loss, metrics, terms)


def _reader_inputs(inputs: dict) -> dict:
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "labels")}


def _pad_scores(scores: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The scores pad to the longest row of the batch; pad to the selection's width."""
    if scores.shape == shape:
        return scores
    out = torch.full(shape, -1e4, dtype=scores.dtype, device=scores.device)
    out[:, : scores.shape[1]] = scores
    return out
