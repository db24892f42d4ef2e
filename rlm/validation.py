"""In-training validation with the live towers (the corrector plays no part at prediction time).

The corpus is embedded with the current passage tower, each dev question retrieves its top passages by exact
inner product, and the reader answers from the top `reader.num_passages` (Algorithm 2). Reported: EM/F1,
answer recall@k (DPR `has_answer`) and gold-passage recall@k where gold ids are known.
"""

from __future__ import annotations

import torch

from retriever.search import corrected_topk
from rlm.metrics import gold_recall_at_k, qa_scores, recall_at_k

KS = (1, 5, 20)


@torch.no_grad()
def validate(model, corpus, dev_examples, cfg, batch_size: int = 32) -> dict[str, float]:
    retriever, reader = model.retriever, model.reader
    questions = [ex.question for ex in dev_examples]
    answers = [ex.answers for ex in dev_examples]
    metrics: dict[str, float] = {}
    rows: list[list[int]] = [[] for _ in dev_examples]
    if cfg.strategy.name != "closed_book":
        passages = retriever.passage_tower.encode(corpus.retrieval_texts(), batch_size=cfg.buffer.batch_size)
        queries = retriever.query_tower.encode(questions, batch_size=batch_size)
        k = min(max(KS), len(corpus))
        rows = corrected_topk(queries, passages, None, k).indices.tolist()
        texts = corpus.retrieval_texts()
        metrics.update(recall_at_k([[texts[r] for r in row] for row in rows], answers, KS))
        ids = corpus.ids
        metrics.update(
            gold_recall_at_k(
                [[ids[r] for r in row] for row in rows], [ex.gold_passage_ids for ex in dev_examples], KS
            )
        )
    if reader is not None:
        n = cfg.reader.num_passages or cfg.strategy.k
        read = [[(corpus[r].title, corpus[r].text) for r in row[:n]] for row in rows]
        predictions = reader.answer(questions, read, batch_size=batch_size)
        metrics.update(qa_scores(predictions, answers))
    return {f"dev_{key}": round(value, 4) for key, value in metrics.items()}
