"""Efficient validation on a hard subcorpus (Kim et al., "Bridging the Training-Inference Gap for Dense Phrase
Retrieval", Section 2).

H_k = the gold passages of the dev questions (where known) + the top-k passages the *initial* retriever
returns for them. Retrieval over H_k is far cheaper than over the full corpus, yet it keeps the passages a
retriever is most likely to confuse, so the ranking of checkpoints by H_k metrics tracks their ranking by
full-corpus metrics. `track_checkpoints` measures that agreement (Spearman and Kendall rank correlation).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from rlm.base.atomicio import atomic_write_text
from rlm.data.corpus import CorpusSubset
from rlm.data.qa import QAExample
from rlm.errors import UserError


def build_hard_subcorpus(
    corpus, examples: Sequence[QAExample], retriever, k: int = 100, index=None, batch_size: int = 64
) -> list[str]:
    """Passage ids of H_k (gold passages + the initial retriever's top-k per question), in corpus order.

    `retriever` is a DualEncoder (the initial one); `index` reuses an index of the corpus built with it.
    Gold ids absent from the corpus raise a ValueError naming the question.
    """
    from rlm.inference.indexing import build_index, embed_corpus
    from rlm.inference.retrieval import retrieve

    rows = gold_rows(corpus, examples)
    if index is None:
        embeddings = embed_corpus(retriever.passage_tower, corpus.retrieval_texts(), batch_size)
        index = build_index(embeddings, corpus.ids)
    retrieved = retrieve(retriever.query_tower, index, [ex.question for ex in examples], k, batch_size)
    for ids in retrieved.ids:
        rows.update(corpus.index_of(pid) for pid in ids)
    return [corpus.ids[r] for r in sorted(rows)]


def gold_rows(corpus, examples: Sequence[QAExample]) -> set[int]:
    """The corpus rows of the questions' gold passages; an id absent from the corpus names its question."""
    rows: set[int] = set()
    for ex in examples:
        for pid in ex.gold_passage_ids:
            try:
                rows.add(corpus.index_of(pid))
            except KeyError:
                raise UserError(f"question {ex.id}: gold passage {pid!r} is not in {corpus.path}") from None
    return rows


def hard_subcorpus_from_buffer(
    corpus, examples: Sequence[QAExample], query_tower, buffer, k: int, procs=None, device=None
) -> list[str]:
    """H_k from the fixed buffer B, which already holds the initial passage tower's embeddings: the dev
    questions' gold passages + their top-k rows of B by <f_0(x), B_y>, with no corpus pass of its own.

    With several processes (`rlm.retriever.distributed.Processes`) each embeds its share of the questions and scans
    its share of B; a question's top-k is merged on the process that asked it, which then shares only the rows
    found. Every question is embedded once and gathered once (when every process asked every question, each
    was embedded W times and every process received W x W top-k lists of it). All return the same ids.
    """
    import torch

    from rlm.retriever.distributed import Processes, ShardedRows, slice_rows

    procs = procs or Processes()
    rows = gold_rows(corpus, examples)
    questions = [ex.question for ex in examples]
    per = -(-len(questions) // procs.world)  # the same on every process: the merge gathers equal shapes
    mine = questions[procs.rank * per : (procs.rank + 1) * per]
    queries = query_tower.encode(mine) if mine else torch.zeros(0, query_tower.dim)
    queries = torch.cat([queries, queries.new_zeros(per - len(mine), queries.shape[1])])  # padding: ignored
    if device is not None:
        queries = queries.to(device)
    start, stop = procs.part(len(buffer))
    shard = ShardedRows(slice_rows(buffer, start, stop), torch.arange(start, stop), procs)
    top = shard.topk(queries, None, min(k, len(buffer)), chunk_size=65536)
    found = sorted({r for r in top.indices[: len(mine)].reshape(-1).tolist() if r >= 0})
    rows.update(r for part in procs.gather_object([found]) for r in part)
    return [corpus.ids[r] for r in sorted(rows)]


def save_subcorpus_ids(ids: Sequence[str], path: str | os.PathLike) -> None:
    """Write the ids one per line, atomically."""
    atomic_write_text(path, "".join(f"{pid}\n" for pid in ids))


def load_subcorpus(corpus, ids_path: str | os.PathLike) -> CorpusSubset:
    """The subset of `corpus` named by an ids file; an unknown or repeated id is an error naming its line. An id
    a corpus update deleted since the file was written is left out (`CorpusEdition.was_deleted`)."""
    ids_path = Path(ids_path)
    if not ids_path.is_file():
        raise FileNotFoundError(f"subcorpus ids file not found: {ids_path}")
    rows, seen = [], {}
    for line_no, line in enumerate(ids_path.read_text(encoding="utf-8").splitlines(), start=1):
        pid = line.strip()
        if not pid:
            continue
        if pid in seen:
            raise UserError(f"{ids_path}:{line_no}: passage id {pid!r} repeats line {seen[pid]}")
        seen[pid] = line_no
        try:
            rows.append(corpus.index_of(pid))
        except KeyError:
            if getattr(corpus, "was_deleted", lambda _: False)(pid):
                continue
            raise UserError(f"{ids_path}:{line_no}: passage id {pid!r} is not in {corpus.path}") from None
    if not rows:
        raise UserError(f"{ids_path}: no passage ids")
    return CorpusSubset(corpus, rows)


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Spearman's rho and Kendall's tau between two metric series (NaN when either is constant)."""
    from scipy import stats

    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(
            f"rank correlation needs two equally long series of >= 2 values, got {len(xs)}, {len(ys)}"
        )
    with warnings.catch_warnings():
        # A constant series (e.g. every checkpoint at recall 1.0) has no ranking: NaN is the honest answer.
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        rho = stats.spearmanr(xs, ys).statistic
        tau = stats.kendalltau(xs, ys).statistic
    return {"spearman": float(rho), "kendall": float(tau)}


def track_checkpoints(
    checkpoints: Sequence[str | os.PathLike],
    examples: Sequence[QAExample],
    corpus,
    subcorpus: CorpusSubset,
    retrieval_only: bool = False,
    k: int = 100,
    num_passages: int | None = None,
    batch_size: int = 16,
) -> dict:
    """Evaluate each checkpoint on H_k and on the full corpus; rank-correlate every shared metric.

    Returns {"checkpoints": [{"checkpoint", "hard": metrics, "full": metrics}], "correlation": {metric:
    {"spearman", "kendall"}}, "subcorpus_size", "corpus_size"}.
    """
    from rlm.inference.checkpoint import load_checkpoint, reader_passages_from_config
    from rlm.inference.evaluation import run_evaluation

    rows = []
    for ckpt in checkpoints:
        retriever, reader, config = load_checkpoint(ckpt, need_reader=not retrieval_only)
        n = num_passages or reader_passages_from_config(config)
        entry = {"checkpoint": str(ckpt)}
        for name, passages in (("hard", subcorpus), ("full", corpus)):
            result = run_evaluation(
                examples,
                corpus=passages,
                retriever=retriever,
                reader=reader,
                k=min(k, len(passages)),
                num_passages=n,
                batch_size=batch_size,
            )
            entry[name] = {
                key: value
                for key, value in result.metrics.items()
                if key.startswith(("recall@", "gold_recall@")) or key in ("exact_match", "f1")
            }
        rows.append(entry)
    correlation = {}
    if len(rows) >= 2:
        for metric in rows[0]["hard"]:
            if all(metric in r["full"] for r in rows):
                correlation[metric] = rank_correlation(
                    [r["hard"][metric] for r in rows], [r["full"][metric] for r in rows]
                )
    return {
        "checkpoints": rows,
        "correlation": correlation,
        "subcorpus_size": len(subcorpus),
        "corpus_size": len(corpus),
    }
