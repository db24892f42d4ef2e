"""A corpus embedded and indexed for answering, or a prebuilt index checked against the checkpoint.

`index_corpus` is how `rlm evaluate` and the demo embed a corpus they are given no index for: the buffer's one
embedding path (`rlm.retriever.buffer.build_passage_buffer`: sorted full batches, bf16 on an accelerator, float16
shards streamed to disk, each process of an `accelerate launch` its share, resumable in a kept folder), then a
faiss index built from those shards a chunk at a time (`PassageIndex.from_buffer`: no whole-corpus float32
array besides what the index type itself stores) with its search parameters tuned for a target recall.
`load_index_for` / `prebuilt_index` open an index built earlier (`rlm embed` then `rlm index`) and refuse one
of another encoder, max length or corpus.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from rlm.base.atomicio import atomic_write_text
from rlm.errors import UserError
from rlm.retriever.index_spec import IndexSpec

INDEX_SUBFOLDER = "index"  # where the main process saves the index the other processes load
# Under `accelerate launch` the other processes wait for that index on disk, not at a collective: building and
# tuning one at 21M passages takes hours, longer than any process group's timeout should be. The main process
# proves it is alive meanwhile (a counter rewritten every `HEARTBEAT_S` seconds), and leaves its error there when
# the build fails; a waiter that sees neither the index nor a new beat for `SILENT_AFTER_S` seconds stops.
INDEX_HEARTBEAT, INDEX_FAILED = "index.heartbeat", "index.failed"
HANDOFF_NAMES = (INDEX_SUBFOLDER, INDEX_HEARTBEAT, INDEX_FAILED)  # what it writes beside the shards
HEARTBEAT_S, SILENT_AFTER_S, POLL_S = 30.0, 600.0, 1.0
# Above this many passages `rlm evaluate` and `rlm demo` do not embed and index a corpus themselves unless told
# to (`check_embed_limit`): DPR's 21M would be hours of embedding at every start and then an exact index of
# every float32 row in RAM (64 GB at 768 dimensions). Such a corpus is embedded once (`rlm embed`, a share per
# GPU) and indexed with compressed codes (`rlm index`). 2M: the 1M-passage demo study's corpus, with room.
EMBED_LIMIT = 2_000_000
LARGE_CORPUS_INDEX = (
    "--factory IVF16384,PQ256np --rescore 5"  # README's 21M recommendation, named by the error
)


def check_embed_limit(corpus, limit: int, encoder: str, command: str) -> None:
    """Refuse to embed and index `corpus` at `command`'s start when it holds more than `limit` passages (0: no
    limit), in one line that names the commands that build its index once instead (`EMBED_LIMIT`); `encoder`:
    the trained retriever folder those commands embed with."""
    if not limit or len(corpus) <= limit:
        return
    raise UserError(
        f"{corpus.path} holds {len(corpus):,} passages, more than the {limit:,} `{command}` embeds and indexes "
        "itself (hours of embedding, then an exact index of every row in RAM); build its index once: `rlm embed "
        f"--corpus {corpus.path} --encoder {encoder} --out EMBEDDINGS`, then `rlm index --buffer EMBEDDINGS "
        f"--out INDEX {LARGE_CORPUS_INDEX}`, and pass --index INDEX (--embed-limit 0 embeds it here anyway)"
    )


def embed_corpus(
    passage_tower, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False
) -> np.ndarray:
    """Passage embeddings [N, D] float32 in memory (`rlm.retriever.buffer.embed_passages`), under bf16 when the
    caller's autocast is on: for corpora small enough to hold; `index_corpus` streams any size to disk."""
    import torch

    from rlm.retriever.buffer import embed_passages

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
    """A `rlm.retriever.index.PassageIndex` over the embeddings (inner product); `use_gpu`:
    `rlm.inference.device.index_on_gpu`."""
    from rlm.retriever.index import PassageIndex

    # The ids as they are (a corpus's IdSequence stays one blob): no list of every id string.
    return PassageIndex.build(embeddings, ids, factory=factory, use_gpu=use_gpu, show_progress=show_progress)


def load_index_for(
    index_dir: str | os.PathLike,
    corpus_ids: Sequence[str],
    use_gpu: bool | None = None,
    search_params: dict[str, int] | None = None,
    passage_tower=None,
    corpus_fingerprint: str | None = None,
    rescore_rows: str | os.PathLike | None = None,
    mmap: bool = False,
):
    """Load a saved `PassageIndex` and refuse it when its passage ids are not the corpus's, row for row, or
    when it records (built from a buffer: `rlm embed` then `rlm index --buffer`) another encoder than
    `passage_tower` (weights and max length) or another corpus than `corpus_fingerprint`. An index built from
    bare embeddings records neither, and only its ids are compared.
    `use_gpu`: as for `build_index`; `search_params` (e.g. {"nprobe": 64}) over the ones saved with it;
    `rescore_rows`: the buffer folder an index that re-scores its candidates reads them from, when it is not
    beside the index as it was built nor where it was (`PassageIndex.load`); `mmap`: map the index file where
    faiss can instead of reading it (the processes of a launch then share one copy).
    """
    from rlm.retriever.index import PassageIndex

    index = PassageIndex.load(
        index_dir, use_gpu=use_gpu, search_params=search_params, rescore_rows=rescore_rows, mmap=mmap
    )
    check_index_for(index, index_dir, corpus_ids, passage_tower, corpus_fingerprint)
    return index


def check_index_for(index, index_dir, corpus_ids: Sequence[str], passage_tower=None, corpus_fingerprint=None):
    """`load_index_for`'s checks of a loaded `index` (from `index_dir`); on success the index holds the
    corpus's ids (one copy of them)."""
    from rlm.retriever.ids import first_mismatch

    recorded = index.provenance
    # A tower on the meta device (the device-placement tests load one there) has no weights to hash.
    weighed = passage_tower is not None and not any(p.is_meta for p in passage_tower.parameters())
    tower = passage_tower.fingerprint() if weighed else None
    if recorded.get(
        "corrector_fingerprint"
    ):  # rows of h(B): the starting encoder's, corrected, not the tower's
        tower = None
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
    if index.edition:  # corpus updates: the base part checked here, the updates by `served_corpus`
        _check_base_of_edition(index_dir, index, corpus_ids, corpus_fingerprint)
        return
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


def _check_base_of_edition(index_dir, index, corpus_ids, corpus_fingerprint: str | None) -> None:
    """Refuse `corpus_ids` unless they are the base corpus `index`'s corpus updates started from, row for row."""
    from rlm.retriever.ids import IdSequence, first_mismatch

    edition = index.edition
    base_rows, base = edition["base_rows"], edition["base_corpus"]
    if corpus_fingerprint is not None and corpus_fingerprint != base:
        raise UserError(
            f"index {index_dir} holds corpus updates of the corpus {base}, not of this one ({corpus_fingerprint}): "
            "give the corpus file it was built for (the updates are in the index folder)"
        )
    if len(corpus_ids) != base_rows:
        raise UserError(
            f"index {index_dir} was built for a corpus of {base_rows} passages (then updated), not {len(corpus_ids)}"
        )
    ids = index.ids
    mismatch = first_mismatch(
        ids.head(base_rows) if isinstance(ids, IdSequence) else ids[:base_rows], corpus_ids
    )
    if mismatch is not None:
        raise UserError(
            f"index {index_dir} row {mismatch} is passage {ids[mismatch]!r} but the corpus has "
            f"{corpus_ids[mismatch]!r}; it was built for another corpus"
        )


def served_corpus(index, corpus, index_dir):
    """The corpus `index` (loaded from `index_dir`) answers from: `corpus` itself, or, for an index that corpus
    updates changed, its `CorpusEdition`: `corpus` and the updates' passages kept in `index_dir`, each update
    checked against the fingerprint it was applied with (an edited store is refused)."""
    if not index.edition:
        return corpus
    from rlm.data.corpus_edition import open_edition_record

    return open_edition_record(index_dir, index.edition, corpus, index.removed)


def prebuilt_index(
    index_dir,
    retriever,
    corpus,
    use_gpu: bool | None,
    search_params: dict[str, int] | None,
    rescore_rows: str | os.PathLike | None = None,
    mmap: bool = False,
):
    """`load_index_for` a checkpoint's `retriever` and `corpus`: its ids, passage tower and corpus checked."""
    fingerprint = getattr(corpus, "fingerprint", None)  # a subcorpus has none of its own
    tower = retriever.passage_tower
    return load_index_for(
        index_dir, corpus.ids, use_gpu, search_params, tower, fingerprint, rescore_rows, mmap=mmap
    )


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
    spec: IndexSpec | None = None,
    use_gpu: bool | None = None,
    batch_size: int = 64,
    precision: str = "auto",
    accelerator=None,
    tune_queries: np.ndarray | None = None,
    show_progress: bool = False,
    tune_k: int | None = None,
):
    """A `rlm.retriever.index.PassageIndex` of `corpus` under `passage_tower`: the corpus embedded into float16
    shards in `embeddings_dir` (a temporary folder when None; a kept one is resumed, or reused when complete),
    then indexed from the shards as `spec` says (None: `IndexSpec()`, the one default): its type, and its search
    parameter fixed or tuned for the spec's target recall against exact search (`PassageIndex.apply_search`),
    on `tune_queries` (query-tower embeddings of questions: what the index will be asked) when given, else on
    indexed rows made question-like, at recall@`tune_k` (None: the spec's; give the k the index will be searched
    at). The index records the tower's and corpus's fingerprints.

    `precision`: "float32", "bf16" or "auto" (bf16 on a CUDA GPU). `accelerator` (an accelerate
    `PartialState`/`Accelerator`): each process embeds its share of the shards, the main process builds, tunes
    and saves the index under `<embeddings_dir>/index` (`handing_over_index`), and the others wait for it there
    without a collective and map it (`await_index`); every process returns it."""
    from rlm.retriever.buffer import build_passage_buffer
    from rlm.retriever.index import PassageIndex

    spec = spec or IndexSpec()

    is_main = accelerator is None or accelerator.is_main_process
    several = accelerator is not None and accelerator.num_processes > 1
    with _embeddings_folder(embeddings_dir, accelerator) as folder:
        if several:
            _clear_handoff(folder, accelerator)
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
        if not is_main:
            # Built and tuned once, by the main process; mapped here, so the processes share one copy in RAM.
            return await_index(folder, use_gpu)
        with handing_over_index(folder) if several else contextlib.nullcontext():
            index = PassageIndex.from_buffer(
                buffer, spec.factory, use_gpu=use_gpu, show_progress=show_progress
            )
            asked = tune_queries if tune_queries is not None and len(tune_queries) else None
            index.apply_search(spec, buffer, query_vectors=asked, k=tune_k)
            if several:
                index.save(folder / INDEX_SUBFOLDER)
        return index


def _clear_handoff(folder: Path, accelerator) -> None:
    """The main process removes an earlier run's index and signs from `folder`, then every process meets: a
    waiter never takes the last run's index for this one's."""
    if accelerator.is_main_process:
        shutil.rmtree(folder / INDEX_SUBFOLDER, ignore_errors=True)
        for name in (INDEX_HEARTBEAT, INDEX_FAILED):
            (folder / name).unlink(missing_ok=True)
    accelerator.wait_for_everyone()


@contextlib.contextmanager
def handing_over_index(folder: Path, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """The main process's side of the hand-over (`await_index` is the others'): while the block builds and saves
    the index into `folder / INDEX_SUBFOLDER`, a heartbeat; when it fails, its error in one line for them."""
    beat, stop = folder / INDEX_HEARTBEAT, threading.Event()

    def beating() -> None:
        count = 0
        while True:  # faiss releases the GIL while it trains and adds: the beat goes on during a long build
            atomic_write_text(beat, str(count))
            count += 1
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=beating, name="index-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    except BaseException as err:
        atomic_write_text(folder / INDEX_FAILED, " ".join(f"{type(err).__name__}: {err}".split()))
        raise
    finally:
        stop.set()
        thread.join()
        beat.unlink(missing_ok=True)


def await_index(
    folder: Path, use_gpu: bool | None, silent_after_s: float = SILENT_AFTER_S, poll_s: float = POLL_S
):
    """The index the main process saves into `folder / INDEX_SUBFOLDER` (`handing_over_index`), waited for
    without a collective and loaded memory-mapped where faiss can (`rlm.retriever.index.mmap_flag`). Refused with
    the main process's error when its build failed, or when it shows no sign of life for `silent_after_s`."""
    from rlm.retriever.index import PassageIndex

    saved, failed, beat = folder / INDEX_SUBFOLDER, folder / INDEX_FAILED, folder / INDEX_HEARTBEAT
    last, heard = None, time.monotonic()
    while not saved.is_dir():  # `save` moves the complete folder into place at once
        if failed.is_file():
            raise UserError(f"the main process could not build the index: {failed.read_text().strip()}")
        with contextlib.suppress(FileNotFoundError):  # not written yet, or just removed by a finished build
            count = beat.read_text()
            if count != last:
                last, heard = count, time.monotonic()
        if time.monotonic() - heard > silent_after_s:
            raise UserError(
                f"the main process has shown no sign of building the index in {folder} for "
                f"{silent_after_s:.0f} s (it stopped, or this process cannot see its files): run again"
            )
        time.sleep(poll_s)
    return PassageIndex.load(saved, use_gpu=use_gpu, mmap=True)
