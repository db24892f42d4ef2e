"""In-training validation with the live towers (the corrector plays no part at prediction time).

The corpus (or the hard subcorpus H_k, Kim et al., when `data.dev_subcorpus` names its ids file or is `build`)
is embedded with the current passage tower, each dev question retrieves its top passages by exact inner
product, and the reader answers from the top `reader.num_passages` (Algorithm 2). With several processes the
work is sharded: each embeds and searches 1/W of the passages (the top-k lists are merged across processes,
as in training's selection) and reads 1/W of the questions, so no process waits for another's whole corpus.
Every process returns the same figures. The metrics are those of `rlm evaluate`, so the figures agree.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlm.evaluation import RECALL_KS, Retrieved, evaluate_reader, read, retrieval_metrics
from rlm.strategies import Processes, ShardedRows

SUBCORPUS_FILE = "dev_subcorpus.txt"


def subcorpus_path(cfg) -> Path | None:
    """The ids file of the hard subcorpus the run validates on during training, or None (the whole corpus)."""
    value = cfg.data.dev_subcorpus
    if not value:
        return None
    return Path(cfg.output_dir) / SUBCORPUS_FILE if value == "build" else Path(value)


def sharded_retrieve(
    retriever, corpus, questions, k: int, procs: Processes, device=None, batch_size: int = 64
) -> Retrieved:
    """Exact top-k passages per question, this process embedding and scanning only its share of the corpus."""
    start, stop = procs.part(len(corpus))
    texts = corpus.retrieval_texts()
    passages = retriever.passage_tower.encode([texts[i] for i in range(start, stop)], batch_size=batch_size)
    queries = retriever.query_tower.encode(list(questions), batch_size=batch_size)
    if device is not None:
        queries = queries.to(device)
    top = ShardedRows(passages, torch.arange(start, stop), procs).topk(queries, None, k, chunk_size=65536)
    ids = [[corpus.ids[r] for r in row if r >= 0] for row in top.indices.tolist()]
    scores = [row[: len(i)] for row, i in zip(top.scores.tolist(), ids)]
    return Retrieved(ids=ids, scores=scores)


@torch.no_grad()
def validate(
    model,
    corpus,
    dev_examples,
    cfg,
    batch_size: int = 32,
    procs: Processes | None = None,
    device: torch.device | None = None,
    subcorpus: bool = True,
) -> dict[str, float]:
    """Dev metrics (`dev_` + EM, F1, answer and gold recall@k); `subcorpus=False` ignores the hard subcorpus."""
    procs = procs or Processes()
    path = subcorpus_path(cfg) if subcorpus else None
    if path is not None:
        from rlm.hard_subcorpus import load_subcorpus

        corpus = load_subcorpus(corpus, path)
    metrics: dict[str, float] = {}
    retrieved = None
    if cfg.strategy.name != "closed_book":
        ks = [k for k in RECALL_KS if k <= len(corpus)] or [len(corpus)]
        questions = [ex.question for ex in dev_examples]
        retrieved = sharded_retrieve(
            model.retriever, corpus, questions, max(ks), procs, device, cfg.buffer.batch_size
        )
        metrics.update(retrieval_metrics(corpus, dev_examples, retrieved, ks))
    if model.reader is not None:
        n = cfg.reader.num_passages or cfg.strategy.k
        first, last = procs.part(len(dev_examples))
        mine = (
            None if retrieved is None else Retrieved(retrieved.ids[first:last], retrieved.scores[first:last])
        )
        answers = read(
            model.reader, dev_examples[first:last], corpus, mine, num_passages=n, batch_size=batch_size
        )
        metrics.update(evaluate_reader(procs.gather_object(answers), dev_examples))
    return {f"dev_{key}": round(value, 4) for key, value in metrics.items()}
