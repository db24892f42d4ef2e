"""In-training validation with the live towers, and (`eval_selection`) from the training strategy's own selection.

The corpus (or the hard subcorpus H_k, Kim et al., when `data.dev_subcorpus` names its ids file or is `build`)
is embedded with the current passage tower, each dev question retrieves its top passages by exact inner
product, and the reader answers from the top `reader.num_passages` (Algorithm 2). With several processes the
work is sharded: each embeds and searches 1/W of the passages (the top-k lists are merged across processes,
as in training's selection), brings 1/W of the questions to that search and reads them, so no process waits
for another's whole corpus. The per-question results are gathered, and every process returns the same
figures. The metrics are those of `rlm evaluate`, so the figures agree.
With the training strategy, the passages come from its top-k instead (h(B) for the corrector, as `rlm
evaluate --index corrected` reads them), reported as `dev_selection_*`.

A `PassageEmbeddingCache` keeps this process's passage embeddings from the last validation, keyed by the
passage tower's fingerprint: while the tower has not moved (Algorithm 2's reader-only warm-up, a frozen
retriever, the final validation right after a periodic one) validation embeds nothing again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rlm.errors import check_output_folder
from rlm.inference.evaluation import RECALL_KS, evaluate_reader, retrieval_metrics
from rlm.inference.reading import read
from rlm.inference.retrieval import Retrieved
from rlm.retriever.alignment import alignment_metrics
from rlm.retriever.buffer import (
    BUFFER_FILES,
    build_settings,
    embed_passages,
    finalize_buffer,
    resolve_precision,
    write_shard,
)
from rlm.retriever.distributed import Processes, ShardedRows
from rlm.retriever.search import TopK
from rlm.training.strategies import strategy_class

SUBCORPUS_FILE = "dev_subcorpus.txt"


def subcorpus_path(cfg) -> Path | None:
    """The ids file of the hard subcorpus the run validates on during training, or None (the whole corpus)."""
    value = cfg.data.dev_subcorpus
    if not value:
        return None
    return Path(cfg.output_dir) / SUBCORPUS_FILE if value == "build" else Path(value)


class PassageEmbeddingCache:
    """The passage embeddings of the last validation on this process (one entry: the rows it embedded, which
    corpus, which tower weights, which autocast). `hits` and `misses` count the validations served and
    embedded."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.vectors: torch.Tensor | None = None
        self.hits = 0
        self.misses = 0

    def get(self, tower, corpus_key: str, start: int, stop: int, embed) -> torch.Tensor:
        autocast = [torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        key = (tower.fingerprint(), corpus_key, start, stop, str(autocast))
        if key == self.key and self.vectors is not None:
            self.hits += 1
            return self.vectors
        self.key, self.vectors = None, None  # never hold two shards' worth at once
        vectors = embed()
        self.key, self.vectors = key, vectors
        self.misses += 1
        return vectors


def sharded_retrieve(
    retriever,
    corpus,
    questions,
    k: int,
    procs: Processes,
    device=None,
    batch_size: int = 64,
    cache: PassageEmbeddingCache | None = None,
    corpus_key: str = "corpus",
    queries: torch.Tensor | None = None,
) -> Retrieved:
    """Exact top-k passages per question, this process embedding and scanning only its share of the corpus
    (or taking it from `cache` when the passage tower is the one that embedded it; `corpus_key` names which
    corpus or subcorpus `corpus` is). `queries`: the questions' embeddings when the caller has them. Every
    process gets every question's passages, never one of a corpus edition's removed rows."""
    start, stop = procs.part(len(corpus))
    passages = _passage_share(retriever.passage_tower, corpus, start, stop, batch_size, cache, corpus_key)
    if queries is None:
        queries = retriever.query_tower.encode(list(questions), batch_size=batch_size)
    if device is not None:
        queries = queries.to(device)
    rows = ShardedRows(passages, torch.arange(start, stop), procs)
    # A corpus update's removed passages (`CorpusEdition.removed`, sorted) are never retrieved.
    removed = torch.as_tensor(getattr(corpus, "removed", np.zeros(0, np.int64)))
    mine = removed[(removed >= start) & (removed < stop)] - start
    top = _per_question(queries, procs, lambda q: rows.topk(q, None, k, chunk_size=65536, excluded=mine))
    return _as_retrieved(top, corpus)


def _share_precision(tower) -> str:
    """What the passage tower computes in when validation embeds: bf16 under the run's autocast (or on a CUDA
    GPU: `resolve_precision`'s "auto"), else float32."""
    return resolve_precision("bf16" if torch.is_autocast_enabled(tower.device.type) else "auto", tower.device)


def _passage_share(
    tower, corpus, start: int, stop: int, batch_size: int, cache, corpus_key: str
) -> torch.Tensor:
    """Rows [start, stop) of `corpus` embedded by `tower` (float16), or from `cache` when `tower` embedded them
    last (`corpus_key` names the corpus)."""

    def embed() -> torch.Tensor:
        # The buffer's path: sorted full batches, a block of texts at a time, float16 rows (half of float32's
        # memory for this process's share, which the cache keeps), bf16 on an accelerator or under autocast.
        texts = corpus.retrieval_texts()
        return torch.from_numpy(
            embed_passages(tower, texts, start, stop, batch_size, precision=_share_precision(tower))
        )

    return embed() if cache is None else cache.get(tower, corpus_key, start, stop, embed)


def embedded_corpus_key(corpus, subcorpus: Path | None = None) -> str:
    """What names the passages validation embedded in a `PassageEmbeddingCache`: the corpus (or its hard
    subcorpus, `subcorpus`) and its size."""
    return f"{getattr(corpus, 'fingerprint', '')}:{subcorpus or 'all'}:{len(corpus)}"


def check_kept_embeddings_folder(cfg) -> None:
    """Refuse, before a run starts, a `final_embeddings` folder that holds anything but a buffer's files."""
    if cfg.final_embeddings:
        check_output_folder(cfg.final_embeddings, BUFFER_FILES, "rlm train", option="final_embeddings")


def keep_passage_embeddings(
    retriever,
    corpus,
    folder,
    procs: Processes,
    batch_size: int = 64,
    cache: PassageEmbeddingCache | None = None,
) -> None:
    """The whole corpus as `retriever`'s passage tower embeds it, written to `folder` as a buffer in `rlm embed`'s
    format (its fingerprints, max length and precision), so that `rlm index --buffer folder` builds the
    inference index without embedding the corpus again. Every process must call it.

    Each process writes the share the final validation embedded (`Processes.part`, from `cache` when that
    validation held it, else embedded now) as one shard: shard r is process r's rows, so the shard size is the
    share's. The folder is replaced: its old buffer's files go first, `meta.json` is written last (until then
    it reads as unfinished)."""
    n = len(corpus)
    start, stop = procs.part(n)
    tower = retriever.passage_tower
    rows = _passage_share(tower, corpus, start, stop, batch_size, cache, embedded_corpus_key(corpus)).numpy()
    settings = build_settings(
        corpus.ids,
        corpus.retrieval_texts(),
        tower,
        "float16",
        shard_size=-(-n // procs.world),
        corpus_fingerprint=getattr(corpus, "fingerprint", None),
        precision=_share_precision(tower),
    )
    folder = Path(folder)
    if procs.rank == 0:
        check_output_folder(folder, BUFFER_FILES, "rlm train", option="final_embeddings")
        for own in BUFFER_FILES:  # meta.json first: a reader never sees an old one beside new shards
            for old in folder.glob(own):
                old.unlink()
        folder.mkdir(parents=True, exist_ok=True)
    procs.barrier()
    if stop > start:
        write_shard(folder, procs.rank, rows)
    procs.barrier()
    if procs.rank == 0:
        finalize_buffer(folder, corpus.ids, settings)
    procs.barrier()


def selection_retrieve(
    strategy, corrector, corpus, queries: torch.Tensor, k: int, procs: Processes | None = None
) -> Retrieved:
    """Top-k passages per query by the training strategy's own scoring (h(B) for the corrector, the buffer as
    last refreshed for the others): nothing re-embedded. Every process gets every query's passages; with
    `procs`, each brings only its share of the queries to the strategy's search."""
    top = _per_question(queries, procs or Processes(), lambda mine: strategy.select(mine, corrector, k=k))
    return _as_retrieved(top, corpus)


def _per_question(queries: torch.Tensor, procs: Processes, search) -> TopK:
    """`search` (collective) on this process's share of the queries, the shares gathered back in order.

    A sharded top-k all-gathers the queries it is given: were every process to pass every query, each would
    score all of them W times over (at a 21M-passage validation, gigabytes of transient scores per process).
    The shares are padded to one length because the gathers need the same shape on every process."""
    if procs.world == 1:
        return search(queries)
    n = queries.shape[0]
    first, last = procs.part(n)
    per = -(-n // procs.world)
    mine = queries[first:last]
    if last - first < per:
        mine = torch.cat([mine, mine.new_zeros(per - (last - first), *queries.shape[1:])])
    top = search(mine)
    # Process r's share is questions [r * per, (r + 1) * per): in process order, the first n rows are all.
    scores = procs.gather(top.scores.contiguous())[:n]
    indices = procs.gather(top.indices.contiguous())[:n]
    return TopK(scores, indices)


def _as_retrieved(top, corpus) -> Retrieved:
    """Corpus ids and scores of a top-k over corpus rows (-1 padding dropped)."""
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
    cache: PassageEmbeddingCache | None = None,
    strategy=None,
) -> dict[str, float]:
    """Dev metrics (`dev_` + EM, F1, answer and gold recall@k); `subcorpus=False` ignores the hard subcorpus;
    `cache` reuses the last validation's passage embeddings while the passage tower is unchanged. With the
    training `strategy`: the passages come from its selection over the whole corpus (`dev_selection_` +
    EM, F1, recall@k; `selection_retrieve`) instead of the re-embedded corpus."""
    procs = procs or Processes()
    path = subcorpus_path(cfg) if subcorpus and strategy is None else None
    if path is not None:
        from rlm.training.hard_subcorpus import load_subcorpus

        corpus = load_subcorpus(corpus, path)
    metrics: dict[str, float] = {}
    retrieved = None
    if strategy_class(cfg.strategy.name).uses_passages:
        # Recall at the reader's K too: the share of questions whose passages can answer them at all.
        read_k = (cfg.reader_passages,) if model.reader is not None else ()
        ks = sorted({k for k in (*RECALL_KS, *read_k) if k <= len(corpus)}) or [len(corpus)]
        questions = [ex.question for ex in dev_examples]
        queries = model.retriever.query_tower.encode(questions, batch_size=cfg.buffer.batch_size)
        if strategy is not None:
            queries = queries.to(device) if device is not None else queries
            h = model.corrector if strategy.uses_corrector else None
            retrieved = selection_retrieve(strategy, h, corpus, queries, max(ks), procs)
            metrics.update(retrieval_metrics(corpus, dev_examples, retrieved, ks))
            return _prefixed(
                _read(model, corpus, dev_examples, cfg, retrieved, procs, batch_size, metrics),
                "dev_selection_",
            )
        retrieved = sharded_retrieve(
            model.retriever,
            corpus,
            questions,
            max(ks),
            procs,
            device,
            cfg.buffer.batch_size,
            cache=cache,
            corpus_key=embedded_corpus_key(corpus, path),
            queries=queries,
        )
        metrics.update(retrieval_metrics(corpus, dev_examples, retrieved, ks))
        # DAFT's watch on the towers: query_mean_cosine (-> 1 when the query tower collapses) and the kNN KL
        # between the passage and query towers' embeddings of the dev questions (how aligned they are).
        metrics.update(alignment_metrics(model.retriever, questions, cfg.buffer.batch_size, queries=queries))
    return _prefixed(_read(model, corpus, dev_examples, cfg, retrieved, procs, batch_size, metrics), "dev_")


def _read(model, corpus, dev_examples, cfg, retrieved, procs, batch_size, metrics) -> dict[str, float]:
    """`metrics` plus EM/F1 of the reader (when there is one) on `retrieved`, each process reading 1/W."""
    if model.reader is not None:
        n = cfg.reader_passages
        first, last = procs.part(len(dev_examples))
        mine = (
            None if retrieved is None else Retrieved(retrieved.ids[first:last], retrieved.scores[first:last])
        )
        answers = read(
            model.reader, dev_examples[first:last], corpus, mine, num_passages=n, batch_size=batch_size
        )
        metrics.update(evaluate_reader(procs.gather_object(answers), dev_examples))
    return metrics


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{key}": round(value, 4) for key, value in metrics.items()}
