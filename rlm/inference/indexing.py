"""A corpus embedded and indexed for answering, or a prebuilt index checked against the checkpoint.

`index_corpus` is how `rlm evaluate` and the demo embed a corpus they are given no index for: the buffer's one
embedding path (`retriever.buffer.build_passage_buffer`: sorted full batches, bf16 on an accelerator, float16
shards streamed to disk, each process of an `accelerate launch` its share, resumable in a kept folder), then a
faiss index built from those shards a chunk at a time (`PassageIndex.from_buffer`: no whole-corpus float32
array besides what the index type itself stores) with its search parameters tuned for a target recall.
`load_index_for` / `prebuilt_index` open an index built earlier (`rlm embed` then `rlm index`) and refuse one
of another encoder, max length or corpus.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from rlm.errors import UserError

INDEX_SUBFOLDER = "index"  # where the main process saves the index the other processes load


def embed_corpus(
    passage_tower, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False
) -> np.ndarray:
    """Passage embeddings [N, D] float32 in memory (`retriever.buffer.embed_passages`), under bf16 when the
    caller's autocast is on: for corpora small enough to hold; `index_corpus` streams any size to disk."""
    import torch

    from retriever.buffer import embed_passages

    precision = "bf16" if torch.is_autocast_enabled(passage_tower.device.type) else "float32"
    return embed_passages(
        passage_tower,
        texts,
        batch_size=batch_size,
        dtype="float32",
        precision=precision,
        show_progress=show_progress,
    )


def build_index(
    embeddings: np.ndarray,
    ids: Sequence[str],
    factory: str = "Flat",
    use_gpu: bool | None = None,
    show_progress: bool = False,
):
    """A `retriever.index.PassageIndex` over the embeddings (inner product); `use_gpu`:
    `rlm.inference.device.index_on_gpu`."""
    from retriever.index import PassageIndex

    # The ids as they are (a corpus's IdSequence stays one blob): no list of every id string.
    return PassageIndex.build(embeddings, ids, factory=factory, use_gpu=use_gpu, show_progress=show_progress)


def load_index_for(
    index_dir: str | os.PathLike,
    corpus_ids: Sequence[str],
    use_gpu: bool | None = None,
    search_params: dict[str, int] | None = None,
    passage_tower=None,
    corpus_fingerprint: str | None = None,
):
    """Load a saved `PassageIndex` and refuse it when its passage ids are not the corpus's, row for row, or
    when it records (built from a buffer: `rlm embed` then `rlm index --buffer`) another encoder than
    `passage_tower` (weights and max length) or another corpus than `corpus_fingerprint`. An index built from
    bare embeddings records neither, and only its ids are compared.
    `use_gpu`: as for `build_index`; `search_params` (e.g. {"nprobe": 64}) over the ones saved with it.
    """
    from retriever.ids import first_mismatch
    from retriever.index import PassageIndex

    index = PassageIndex.load(index_dir, use_gpu=use_gpu, search_params=search_params)
    recorded = index.provenance
    # A tower on the meta device (the device-placement tests load one there) has no weights to hash.
    weighed = passage_tower is not None and not any(p.is_meta for p in passage_tower.parameters())
    tower = passage_tower.fingerprint() if weighed else None
    if tower is not None and recorded.get("encoder_fingerprint") not in (None, tower):
        raise UserError(
            f"index {index_dir} was built from embeddings of another encoder (fingerprint "
            f"{recorded['encoder_fingerprint']}, max length {recorded.get('max_length')}) than this "
            f"checkpoint's passage tower ({tower}, max length {passage_tower.max_length}): embed the corpus "
            "with `rlm embed --encoder <checkpoint>/retriever` and index that"
        )
    if corpus_fingerprint is not None and recorded.get("corpus_fingerprint") not in (
        None,
        corpus_fingerprint,
    ):
        raise UserError(
            f"index {index_dir} was built for corpus {recorded['corpus_fingerprint']}, not this one "
            f"({corpus_fingerprint}); rebuild it for this corpus"
        )
    if index.ntotal != len(corpus_ids):
        raise UserError(
            f"index {index_dir} holds {index.ntotal} passages but the corpus has {len(corpus_ids)}; "
            "rebuild it for this corpus (omit --index)"
        )
    # One bytes comparison when both are IdSequences (a loaded index and a Corpus), not a 21M-string loop.
    mismatch = first_mismatch(index.ids, corpus_ids)
    if mismatch is not None:
        raise UserError(
            f"index {index_dir} row {mismatch} is passage {index.ids[mismatch]!r} but the corpus has "
            f"{corpus_ids[mismatch]!r}; it was built for another corpus"
        )
    index.ids = corpus_ids  # the same ids row for row: hold them once (21M ids: ~0.35 GB)
    return index


def prebuilt_index(index_dir, retriever, corpus, use_gpu: bool | None, search_params: dict[str, int] | None):
    """`load_index_for` a checkpoint's `retriever` and `corpus`: its ids, passage tower and corpus checked."""
    fingerprint = getattr(corpus, "fingerprint", None)  # a subcorpus has none of its own
    return load_index_for(index_dir, corpus.ids, use_gpu, search_params, retriever.passage_tower, fingerprint)


@contextlib.contextmanager
def _embeddings_folder(embeddings_dir, accelerator) -> Iterator[Path]:
    """`embeddings_dir`, or a temporary folder removed afterwards (one process only: the processes of an
    `accelerate launch` must write their shares into one folder they all reach)."""
    if embeddings_dir is not None:
        yield Path(embeddings_dir)
        return
    if accelerator is not None and accelerator.num_processes > 1:
        raise UserError(
            "embedding the corpus with several processes needs a folder they all reach: pass --embeddings DIR"
        )
    with tempfile.TemporaryDirectory(prefix="rlm-embeddings-") as tmp:
        yield Path(tmp)


def index_corpus(
    passage_tower,
    corpus,
    embeddings_dir: str | os.PathLike | None = None,
    factory: str = "Flat",
    use_gpu: bool | None = None,
    batch_size: int = 64,
    precision: str = "auto",
    accelerator=None,
    target_recall: float | None = None,
    tune_queries: np.ndarray | None = None,
    show_progress: bool = False,
):
    """A `retriever.index.PassageIndex` of `corpus` under `passage_tower`: the corpus embedded into float16
    shards in `embeddings_dir` (a temporary folder when None; a kept one is resumed, or reused when complete),
    then indexed with `factory` from the shards, its search parameter tuned for `target_recall` (None: the
    index's default) against exact search, on `tune_queries` (query-tower embeddings of questions: what the
    index will be asked) when given, else on indexed rows made question-like. The index records the tower's and corpus's
    fingerprints.

    `precision`: "float32", "bf16" or "auto" (bf16 on a CUDA GPU). `accelerator` (an accelerate
    `PartialState`/`Accelerator`): each process embeds its share of the shards, the main process builds and
    saves the index under `<embeddings_dir>/index`, and the others load it; every process returns it."""
    from retriever.buffer import build_passage_buffer
    from retriever.index import DEFAULT_TARGET_RECALL, PassageIndex

    is_main = accelerator is None or accelerator.is_main_process
    with _embeddings_folder(embeddings_dir, accelerator) as folder:
        buffer = build_passage_buffer(
            corpus.ids,
            corpus.retrieval_texts(),
            passage_tower,
            folder,
            batch_size=batch_size,
            accelerator=accelerator,
            show_progress=show_progress,
            corpus_fingerprint=getattr(corpus, "fingerprint", None),  # a subcorpus has none: hashed
            precision=precision,
        )
        index = None
        if is_main:
            index = PassageIndex.from_buffer(buffer, factory, use_gpu=use_gpu, show_progress=show_progress)
            if index.tunable_parameter() is not None:
                asked = tune_queries if tune_queries is not None and len(tune_queries) else None
                index.tune(buffer, target_recall or DEFAULT_TARGET_RECALL, query_vectors=asked)
        if accelerator is not None and accelerator.num_processes > 1:
            if is_main:
                index.save(folder / INDEX_SUBFOLDER)
            accelerator.wait_for_everyone()
            if not is_main:
                index = PassageIndex.load(folder / INDEX_SUBFOLDER, use_gpu=use_gpu)
        return index
