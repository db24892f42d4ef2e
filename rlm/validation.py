"""In-training validation with the live towers (the corrector plays no part at prediction time).

The corpus (or the hard subcorpus H_k when `data.dev_subcorpus` names its ids file, Kim et al.) is embedded
with the current passage tower, each dev question retrieves its top passages, and the reader answers from the
top `reader.num_passages` (Algorithm 2). The same functions as `rlm evaluate`, so the figures agree.
"""

from __future__ import annotations

import torch

from rlm.evaluation import (
    RECALL_KS,
    build_index,
    embed_corpus,
    evaluate_reader,
    read,
    retrieval_metrics,
    retrieve,
)


@torch.no_grad()
def validate(model, corpus, dev_examples, cfg, batch_size: int = 32) -> dict[str, float]:
    if cfg.data.dev_subcorpus:
        from rlm.hard_subcorpus import load_subcorpus

        corpus = load_subcorpus(corpus, cfg.data.dev_subcorpus)
    metrics: dict[str, float] = {}
    retrieved = None
    if cfg.strategy.name != "closed_book":
        tower = model.retriever.passage_tower
        embeddings = embed_corpus(tower, corpus.retrieval_texts(), batch_size=cfg.buffer.batch_size)
        index = build_index(embeddings, list(corpus.ids))
        questions = [ex.question for ex in dev_examples]
        ks = [k for k in RECALL_KS if k <= len(corpus)] or [len(corpus)]
        retrieved = retrieve(model.retriever.query_tower, index, questions, k=max(ks))
        metrics.update(retrieval_metrics(corpus, dev_examples, retrieved, ks))
    if model.reader is not None:
        n = cfg.reader.num_passages or cfg.strategy.k
        predictions = read(
            model.reader, dev_examples, corpus, retrieved, num_passages=n, batch_size=batch_size
        )
        metrics.update(evaluate_reader(predictions, dev_examples))
    return {f"dev_{key}": round(value, 4) for key, value in metrics.items()}
