"""One training step of each algorithm, written in the order of the paper's pseudo-code.

Algorithm 2 (retrieval-augmented LM) and Algorithm 1 (supervised retrieval) of Monath et al. 2024. Each returns
one scalar to backpropagate, `(L + L') / 2 + w * l`, whose gradients are separated exactly by stop-gradients:
the corrector loss `l` only sees detached queries and detached targets, so it moves only the corrector; the
task losses never touch the corrector, whose only other use (selecting S_x) runs without gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlm.reader.scoring import score_inputs
from rlm.retriever.corrector import corrector_ce_loss, corrector_mse_loss
from rlm.retriever.search import TopK, full_precision
from rlm.training.losses import masked_log_softmax, perplexity_distillation_loss, supervised_retrieval_loss

if TYPE_CHECKING:
    from rlm.config import TrainConfig
    from rlm.data.corpus import Corpus
    from rlm.retriever.corrector import CorrectorNetwork
    from rlm.training.model import RetrievalAugmentedModel
    from rlm.training.step_inputs import PreparedPassages
    from rlm.training.strategies.base import SelectionStrategy


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
    # S_x, when an earlier micro-batch of the same accumulation window selected it, and what a background
    # thread makes of it for steps 3-7 (`rlm.training.step_inputs`).
    selected: TopK | None = None
    prepared: PreparedPassages | None = None
    # The random state that earlier micro-batch embedded this batch's questions from (for its selection): step 1
    # embeds them from it again, so the q its loss uses is the q S_x was selected with (the same dropout).
    query_rng: tuple | None = None


@dataclass
class StepOutput:
    loss: torch.Tensor  # what to backpropagate
    # Detached 0-d tensors, for logging: left on the device, read at the log step (`rlm.train.host_record`).
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # each loss with its graph (tests, analysis)


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
    model: RetrievalAugmentedModel,
    batch: Batch,
    strategy: SelectionStrategy,
    corpus: Corpus,
    cfg: TrainConfig,
    reader_only: bool = False,
    later: Sequence[Batch] = (),
) -> StepOutput:
    """Algorithm 2: train reader and retriever jointly; S_x chosen by the strategy (corrector: <q, h(B)>).

    `reader_only` (the `schedule.reader_only_steps` warm-up) keeps the selection but trains the reader alone:
    steps 3-5 and 7 are skipped, so neither the retriever nor the corrector moves. `later`: the micro-batches
    that follow this one in its accumulation window, selected for here too. `model.timer` laps each phase.
    """
    if not strategy.uses_passages or batch.reader_passages is not None:
        return reader_alone_step(model, batch, strategy)
    timer, beta = model.timer, cfg.beta
    trains_retriever = strategy.trains_retriever and not reader_only
    h = model.corrector if strategy.uses_corrector else None  # the strategy says whether S_x comes through h
    timer.start()

    # 1. q = f(x), with gradient. A step that leaves the retriever as it is (reader-only, frozen) needs q only
    # to select S_x: as at prediction time (eval mode), each question embedded once while f does not move.
    if trains_retriever:
        model.query_cache.clear()  # f moves at this step
    queries = _embed_questions(model, batch, trains_retriever)
    timer.lap("retriever")

    # 2. S_x = top-k_y <q, h(B_y)> over every passage in the buffer, without gradient. f and h change only when
    # the optimizer steps, so the first micro-batch of an accumulation window selects for all of them: one scan
    # of h(B) per optimizer step, however many micro-batches accumulate. A batch's selection is used once. As
    # soon as it is made, a background thread reads each batch's passages and tokenizes them for steps 3-7.
    if batch.selected is None:
        window = [batch, *(b for b in later if b.reader_passages is None and b.selected is None)]
        with torch.no_grad():
            more = [_embed_questions(model, b, trains_retriever, for_selection=True) for b in window[1:]]
        top = strategy.select(torch.cat([queries.detach(), *(q.to(queries) for q in more)]), h)
        for each, selected in zip(window, _split_for_window(top, window)):
            each.selected = selected
            each.prepared = model.inputs.prepare_passages(
                model,
                corpus,
                strategy.buffer,
                each,
                selected.indices,
                cfg.reader.num_passages,
                trains_retriever,
            )
    rows, prepared = batch.selected.indices, batch.prepared
    batch.selected = batch.prepared = None
    mask = rows >= 0
    timer.lap("select")

    metrics: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}
    if trains_retriever:
        # 3. p_y = g(y) for y in S_x, with gradient; P~(y|x) = softmax(beta <q, p_y>) over S_x.
        fresh = model.retriever.passage_tower.embed_tokenized(prepared.tower())
        fresh = fresh.view(*rows.shape, -1)  # padding slots (-1) read row 0; their scores are masked out
        retriever_logits = beta * _scores(queries, fresh)
        timer.lap("retriever")

        # 4. The reader scores each passage alone, without gradient: log P(a | y, x).
        scores = score_inputs(model.reader, [prepared.scoring()], reduction=cfg.reader.score_reduction)
        answer_logprobs = _pad_scores(scores, rows.shape)
        timer.lap("reader_scoring")

        # 5. Retriever loss L = KL(P_a || P~) (perplexity distillation, Eq. 8).
        terms["retriever"] = perplexity_distillation_loss(
            retriever_logits, answer_logprobs, mask, cfg.reader_temperature
        )

    # 6. Reader loss L' = NLL of the answer from the FiD reader over the selected passages (the first
    # `reader.num_passages` of each).
    terms["reader"] = model.reader(**prepared.reader()).loss
    timer.lap("reader")

    if trains_retriever:
        # 7. Corrector loss l = CE(P~ (detached), P~_h), P~_h from <q (detached), h(B_y)>; B_y read from
        # wherever the fixed buffer lives (host memory) onto the step's device.
        stale = prepared.stale().to(device=queries.device, dtype=torch.float32, non_blocking=True)
        corrector_loss, quality = corrector_step_loss(
            h, queries, stale, fresh, retriever_logits, mask, beta, cfg.corrector.loss
        )
        metrics.update(quality)
        if corrector_loss is not None:
            terms["corrector"] = corrector_loss
        timer.lap("corrector")

    # 8. Retriever and reader on (L + L') / 2, the corrector on w * l; stop-gradients keep them apart.
    loss = terms["reader"] if "retriever" not in terms else (terms["retriever"] + terms["reader"]) / 2
    if "corrector" in terms:
        loss = loss + cfg.corrector.weight * terms["corrector"]
    metrics.update({f"{name}_loss": term.detach() for name, term in terms.items()})
    return StepOutput(loss, metrics, terms)


def _embed_questions(
    model: RetrievalAugmentedModel, batch: Batch, trains_retriever: bool, for_selection: bool = False
) -> torch.Tensor:
    """f(x): with gradient while the retriever trains, else from the query cache (eval mode, no gradient).

    `for_selection`: an earlier micro-batch embeds this one's questions to select its S_x, and keeps the random
    state it starts from (`batch.query_rng`); the batch's own step 1 embeds them from that state again, so its
    loss uses the very q (the same dropout mask) its S_x was selected with."""
    if not trains_retriever:
        return model.query_cache.encode(model.retriever.query_tower, batch.questions)
    if for_selection:
        batch.query_rng = _rng_state(model.retriever.query_tower.device)
        return model.retriever.encode_queries(batch.questions)
    if batch.query_rng is None:
        return model.retriever.encode_queries(batch.questions)
    state, batch.query_rng = batch.query_rng, None
    with _random_state(state):
        return model.retriever.encode_queries(batch.questions)


def _rng_state(device: torch.device) -> tuple:
    """The random state dropout on `device` draws from: the CPU generator's, and the GPU's on a GPU."""
    gpu = device.type == "cuda" and torch.cuda.is_available()
    return torch.get_rng_state(), (device, torch.cuda.get_rng_state(device)) if gpu else None


@contextlib.contextmanager
def _random_state(state: tuple) -> Iterator[None]:
    """A block that draws from `state` (`_rng_state`); the state from before the block is back after it."""
    cpu, gpu = state
    with torch.random.fork_rng(devices=[] if gpu is None else [gpu[0]]):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu[1], gpu[0])
        yield


def _split_for_window(top: TopK, window: Sequence[Batch]) -> list[TopK]:
    """One top-k over the window's questions, cut into each batch's."""
    cuts, start = [], 0
    for each in window:
        stop = start + len(each.questions)
        cuts.append(TopK(top.scores[start:stop], top.indices[start:stop]))
        start = stop
    return cuts


def reader_alone_step(
    model: RetrievalAugmentedModel, batch: Batch, strategy: SelectionStrategy
) -> StepOutput:
    """Closed book (no passages), or the curriculum's given passages: the reader alone, answer NLL only."""
    model.timer.start()
    given = batch.reader_passages if strategy.uses_passages else None
    inputs = model.collator(batch.questions, given or [[] for _ in batch.questions], batch.answers)
    reader_loss = model.reader(**_reader_inputs(inputs)).loss
    model.timer.lap("reader")
    return StepOutput(reader_loss, {"reader_loss": reader_loss.detach()}, {"reader": reader_loss})


def algorithm1_step(
    model: RetrievalAugmentedModel,
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
