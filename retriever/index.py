"""Inference index: faiss inner-product search over freshly embedded passages, saved with the passage ids.

The index type is a faiss `index_factory` string (e.g. "Flat", "IVF1024,Flat", "HNSW32", "IVF4096,PQ64"), or
"auto" (`rlm.retriever.index_spec.auto_index_factory`: Flat below 100k rows); trainable types are trained on a
random sample. What an index is to be (type, search, re-scoring, device) is an `IndexSpec`
(`rlm.retriever.index_spec`); `apply_search` sets a built index's search as one says. An index is always built (trained and filled)
on the host. On a machine where faiss sees a GPU the complete index is then cloned there once: a lone process
shards its rows over every GPU (each holds 1/G of them, in float16), one rank of a multi-process (DDP) job
copies it whole onto its own; types faiss has no GPU version of (HNSW, bare PQ) stay on CPU with a warning.
Filling an index already on a GPU would grow its array a chunk at a time, old and new copies alive at each
step, running out of GPU memory long before the rows fill it (docs/retriever.md). Saving writes a CPU copy.

Approximate types are only as good as their search parameters, and faiss's defaults are the cheapest ones
(IVF probes 1 list, HNSW explores 16 candidates: an IVF256 index over the quickstart's corpus found the answering
passage for half the questions a Flat one found it for). So `tune` chooses them for a target recall against
exact search on real questions or on a sample of the indexed rows made question-like, `save` writes them to
`index.json`, `load` applies them, and a caller may override them (`search_params`). Searches of an index on
a GPU are serialised by a lock: faiss's `StandardGpuResources` are not thread-safe, and the demo answers two
batches at once. Compressed codes (PQ) cap recall; `rescore_from` re-scores a search's candidates exactly from
the float16 rows the index was built from, read from disk by offset (`Rescoring`).

faiss comes from an extra (`rlm-corrector[cpu]` or `[gpu]`: both provide the `faiss` module, so not a core
dependency) and is imported on first use, so the project imports without it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from rlm.base.atomicio import atomic_directory, atomic_file, atomic_write_bytes, atomic_write_text
from rlm.retriever.errors import InputError
from rlm.retriever.ids import IdSequence, id_lines
from rlm.retriever.index_spec import DEFAULT_TARGET_RECALL, TUNE_K, IndexSpec, resolve_factory

if TYPE_CHECKING:
    from torch import Tensor

    from rlm.retriever.buffer import PassageBuffer

INDEX_NAME = "index.faiss"
IDS_NAME = "ids.txt"
META_NAME = "index.json"
REMOVED_NAME = "removed.npy"  # the rows no search returns, when a corpus update deleted or replaced any
INDEX_FILES = (INDEX_NAME, IDS_NAME, META_NAME, REMOVED_NAME)  # all that `save` writes
# What a corpus update's generation writes beside index.json (`save_generation`), and the store of its passages.
GENERATION_FILES = ("index.*.faiss", "ids.*.txt", "removed.*.npy", "updates")
QUANTIZATION_SAMPLE = 16_384  # rows whose quantization error is the index's baseline (`quantization_error`)
ADD_ROWS = 65_536  # rows per `add`, so that building a 21M-passage index reports its progress
# What an index built from a buffer records of it, so that a consumer can refuse an index of another encoder or
# corpus (an index of the run's stale buffer is not the trained tower's).
# Saved with an index and read back; "corrector_fingerprint": its rows are h(B) (`rlm.inference.corrected_index`).
PROVENANCE_KEYS = (
    "encoder_fingerprint",
    "corpus_fingerprint",
    "max_length",
    "precision",
    "corrector_fingerprint",
)
# What `tune` aims for by default (`DEFAULT_TARGET_RECALL` at k = `TUNE_K`, from `rlm.retriever.index_spec`): on
# made questions (`question_like_rows`), the share of those whose source row exact search ranks in its top k that
# the index ranks in its top k too; on given questions, the share of exact search's top k the index finds.
EF_SEARCH_VALUES = (16, 32, 64, 128, 256, 512, 1024, 2048)
HNSW_QUANTIZER_EF_SEARCH = 16  # faiss's default efSearch, the least an HNSW coarse quantizer is given
# `tune` stops where doubling the search parameter gains less than this, in its recall and in the share of exact
# search's top k found: the codes' limit, not the search's.
RECALL_PLATEAU = 0.002
# `tune`'s queries when it is given none: rows made question-like (`question_like_rows`).
QUESTION_FOUND_WITHIN, QUESTION_FOUND_SHARE = 20, 0.8
QUESTION_CALIBRATION, QUESTION_SCALE_STEPS, QUESTION_SCALE_MAX = 128, 8, 8.0
TUNE_QUERIES = 1000  # queries `tune` measures recall on, at most: 1,000 measure the share kept to about 0.3%
RESCORE_QUERIES = 64  # queries whose candidates' rows are gathered at once when re-scoring
TRAIN_SAMPLE = 262_144  # rows an IVF or PQ index is trained on, at least
TRAIN_ROWS_PER_LIST = 40  # and this many per IVF list (faiss warns below 39: k-means needs them)


def training_rows(factory: str) -> int:
    """Rows to train an index of `factory` on: `TRAIN_SAMPLE`, or `TRAIN_ROWS_PER_LIST` per IVF list when more
    (IVF65536 at 21M passages: 2.6M rows)."""
    lists = re.search(r"IVF(\d+)", factory)
    return max(TRAIN_SAMPLE, TRAIN_ROWS_PER_LIST * int(lists.group(1))) if lists else TRAIN_SAMPLE


def _faiss():
    """The faiss module; a missing one is reported only here, when an index is actually used."""
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "faiss is not installed: pip install 'rlm-corrector[cpu]' (or 'rlm-corrector[gpu]' on a CUDA machine)"
        ) from err
    return faiss


def _gpu_count() -> int:
    faiss = _faiss()
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def _rank_device(ngpu: int) -> int | None:
    """This process's GPU when it is one rank of a multi-process (DDP) job, else None (a lone process uses all).

    Every rank replicating the index on every GPU would multiply its memory by the number of ranks.
    """
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Modulo: a rank shown only its own GPU (CUDA_VISIBLE_DEVICES per rank) sees it as device 0.
        return int(os.environ["LOCAL_RANK"]) % ngpu
    # Not imported yet means no process group can exist: no need to pay for importing torch here.
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A CPU build of torch (gloo) next to faiss-gpu has no current device: spread the ranks instead.
        return torch.cuda.current_device() if torch.cuda.is_available() else dist.get_rank() % ngpu
    return None


def mmap_flag(factory: str) -> str | None:
    """The faiss IO flag that memory-maps what an index of `factory` stores, or None where faiss reads it whole.

    IVF types: `IO_FLAG_MMAP`, their inverted lists (all but the centroids) mapped as `OnDiskInvertedLists`
    (every faiss version). Flat, SQ, PQ and HNSW: `IO_FLAG_MMAP_IFC` (faiss 1.15 maps their codes and an HNSW
    graph; a faiss without the flag reads them whole). Fast-scan codes (`x4fs`) are read whole by both."""
    if "x4fs" in factory:
        return None
    if "IVF" in factory:
        return "IO_FLAG_MMAP"
    return "IO_FLAG_MMAP_IFC" if hasattr(_faiss(), "IO_FLAG_MMAP_IFC") else None


def _stores_flat_vectors(index) -> bool:
    """Whether `index` keeps its rows as plain vectors (IndexFlat, possibly behind a transform such as PCA)."""
    faiss = _faiss()
    while isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return isinstance(index, faiss.IndexFlat)


def _clone_options(options, index, gpus: int):
    """`options` (faiss's GpuClonerOptions, or GpuMultipleClonerOptions for several GPUs) set for copying the
    complete host `index` onto `gpus` GPUs, each GPU allocating its share at once.

    Several GPUs: the rows are sharded (each GPU holds 1/G of them; replicas would need the whole index on
    every GPU) and kept in float16 (Flat: half the bytes; IVF-PQ: float16 lookup tables, which faiss needs for
    long codes). One GPU: IVF types get the same float16 lookup tables, but a Flat index is copied in float32,
    because faiss converts float32 rows to float16 on the device itself: a one-GPU float16 clone of a Flat
    index briefly holds the float32 rows, their float16 copy and the result (twice the float32 size), where a
    float32 clone is one copy into an array of the final size. `reserveVecs` (room for rows added later) stays
    0: nothing is added to a clone."""
    options.useFloat16 = gpus > 1 or not _stores_flat_vectors(index)
    if gpus > 1:
        options.shard = True
    return options


def _to_gpu(index, use_gpu: bool | None):
    """`(index, on_gpu)`: a GPU clone of the complete host `index` when wanted and possible, else `index`
    itself. Each GPU allocates the clone's final size at once (`_clone_options`)."""
    faiss = _faiss()
    ngpu = _gpu_count()
    if not (ngpu > 0 if use_gpu is None else use_gpu):
        return index, False
    if ngpu == 0:
        raise InputError("use_gpu=True but faiss sees no GPU (install rlm-corrector[gpu] on a CUDA machine)")
    device = _rank_device(ngpu)
    try:
        if device is None:
            options = _clone_options(faiss.GpuMultipleClonerOptions(), index, ngpu)
            return faiss.index_cpu_to_all_gpus(index, co=options), True
        options = _clone_options(faiss.GpuClonerOptions(), index, 1)
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), device, index, options), True
    except RuntimeError as err:
        # faiss throws for types without a GPU version (HNSW, bare PQ): they still work, on CPU.
        reason = " ".join(str(err).split())
        warnings.warn(f"faiss index {type(index).__name__} stays on CPU: {reason}", stacklevel=3)
        return index, False


def _as_float32(array, dim: int | None = None) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    if array.ndim != 2 or (dim is not None and array.shape[1] != dim):
        raise ValueError(f"expected a [n, {dim or 'D'}] array, got shape {array.shape}")
    return array


def _array_rows(array) -> PassageBuffer:
    """An [N, D] array as a `PassageBuffer` over it: a float16 or float32 array (a memory-mapped .npy too) is
    viewed, not copied, so exact search streams it a chunk at a time; other types are converted once."""
    import torch

    from rlm.retriever.buffer import PassageBuffer

    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"expected a [n, D] array, got shape {array.shape}")
    if array.dtype not in (np.float16, np.float32) or not array.flags.c_contiguous:
        array = _as_float32(array)
    with warnings.catch_warnings():
        # A read-only memmap: torch warns that writing would be undefined; nothing here writes to the rows.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return PassageBuffer(range(len(array)), [torch.from_numpy(array)])


def question_like_rows(
    rows: PassageBuffer, count: int, rng: np.random.Generator
) -> tuple[Tensor, np.ndarray, dict]:
    """`count` indexed rows (float32 [count, D]) each moved away from itself as far as a question is from the
    passage that answers it, the row each was made from (its source: the passage that answers it, int64
    [count]), and what was chosen: a row plus `noise_scale` times the difference of two random
    rows (noise with the corpus's own spread), unit length, the scale the largest (of `QUESTION_SCALE_STEPS`
    halvings of [0, `QUESTION_SCALE_MAX`]) at which exact search still ranks the row in its top
    `QUESTION_FOUND_WITHIN` for `QUESTION_FOUND_SHARE` of them, measured on `QUESTION_CALIBRATION` of them:
    a trained dense retriever's top-20 holds the answering passage for about 80% of NQ's questions (DPR: 79%).

    On MiniLM embeddings of real passages and questions these asked a little more of an IVF64 index than the
    questions did, on the synthetic vectors of scripts/bench/bench_index.py at 1M less than its held-out queries,
    far more than bare rows on both (docs/retriever.md). Costs `QUESTION_SCALE_STEPS` exact searches of
    `QUESTION_CALIBRATION` made questions over the rows."""
    import torch

    from rlm.retriever.search import corrected_topk

    count = min(count, len(rows))
    picked = torch.from_numpy(np.sort(rng.choice(len(rows), count, replace=False)))
    source = rows.rows(picked).float()
    pairs = torch.from_numpy(rng.integers(0, len(rows), (2, count)))
    spread = rows.rows(pairs[0]).float() - rows.rows(pairs[1]).float()

    def asked(scale: float, n: int) -> Tensor:
        return torch.nn.functional.normalize(source[:n] + scale * spread[:n], dim=-1)

    n = min(QUESTION_CALIBRATION, count)
    within = min(QUESTION_FOUND_WITHIN, len(rows))
    low, high = 0.0, QUESTION_SCALE_MAX
    for _ in range(QUESTION_SCALE_STEPS):
        middle = (low + high) / 2
        top = corrected_topk(asked(middle, n), rows, None, within).indices
        found = float((top == picked[:n, None]).any(-1).float().mean())
        low, high = (middle, high) if found >= QUESTION_FOUND_SHARE else (low, middle)
    return (
        asked(low, count),
        picked.numpy(),
        {
            "noise_scale": low,
            "found_within": within,
            "found_share": QUESTION_FOUND_SHARE,
        },
    )


def describe_tuning(tuning: dict) -> str:
    """One line of what `PassageIndex.tune` chose and measured (its `tuning`)."""
    if not tuning:
        return "search parameters not tuned"
    k, share, chosen = tuning["k"], f"{tuning['recall']:.1%}", f"{tuning['parameter']}={tuning['value']}"
    target = f"(target {tuning['target_recall']:g})"
    if tuning.get("measure") == "source rows kept":
        return (
            f"{chosen}: the index's top {k} holds the source row of {share} of the {tuning['queries']} "
            f"question-like rows whose source exact search ranks in its top {k} {target}"
        )
    asked = (
        "questions" if tuning.get("queries_from") == "query vectors" else tuning.get("queries_from", "rows")
    )
    return (
        f"{chosen}: the index's top {k} holds {share} of exact search's top {k} for {tuning['queries']} "
        f"{asked} {target}"
    )


def quantization_error(index, vectors: np.ndarray) -> float | None:
    """Mean squared distance between `vectors` [n, D] and what the codes of faiss `index` (a host index) make
    of them (`sa_encode` then `sa_decode`: PQ, SQ and IVF's coarse step alike), or None where the type has no
    standalone codec (HNSW's graph, a GPU clone)."""
    vectors = _as_float32(vectors, int(index.d))
    try:
        decoded = index.sa_decode(index.sa_encode(vectors))
    except RuntimeError:
        return None
    return float(np.mean(np.sum((decoded - vectors) ** 2, axis=1)))


def _held_out(n: int, trained_on: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Up to `QUANTIZATION_SAMPLE` rows the codebooks were not trained on, sorted; `trained_on` itself when
    every row was (a small index)."""
    rest = np.setdiff1d(np.arange(n), trained_on) if n <= 4 * QUANTIZATION_SAMPLE else None
    if rest is None:  # a large index: draw, and drop the few that were trained on
        rest = np.setdiff1d(rng.choice(n, 2 * QUANTIZATION_SAMPLE, replace=False), trained_on)
    if not len(rest):
        return trained_on
    return np.sort(rng.choice(rest, min(QUANTIZATION_SAMPLE, len(rest)), replace=False))


def _quantization(index, rows: np.ndarray, in_sample: bool) -> dict:
    """The baseline an update's rows are compared with: the quantization error on rows the codebooks were not
    trained on (`in_sample`: on the ones they were, every row of a small index, which flatters them)."""
    error = quantization_error(index, rows)
    return {} if error is None else {"mean_squared_error": error, "rows": len(rows), "in_sample": in_sample}


@dataclass
class Rescoring:
    """Exact re-scoring of an index's candidates from the vectors it was built from: `rows`, a `PassageBuffer`
    (memory-mapped float16 shards: on disk, read by offset), `k_factor` candidates per result kept (faiss's
    `IndexRefine` does the same from a second index held in memory: the float16 rows of 21M passages are 32
    GB)."""

    rows: PassageBuffer
    k_factor: int

    def best(self, queries: np.ndarray, found: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best of the candidate rows `found` [B, k'] (-1: none) by exact inner product with `queries`
        [B, D]: (scores [B, k] float32, rows [B, k] int64), ties by row; -1 and -inf where fewer were found."""
        import torch

        candidates = torch.from_numpy(found)
        exact = torch.empty(candidates.shape)
        for start in range(0, len(candidates), RESCORE_QUERIES):  # [64, k', D] float32 at a time
            part = slice(start, start + RESCORE_QUERIES)
            self.rows.prefetch(candidates[part])  # their rows read from disk at once, not one after another
            vectors = self.rows.rows(candidates[part].clamp(min=0)).float()
            exact[part] = torch.einsum("bd,bkd->bk", torch.from_numpy(queries[part]), vectors)
        exact = exact.masked_fill(candidates < 0, -math.inf)
        # Sorted by row first, then stably by score: equal scores stay in row order (the project's ordering).
        by_row = candidates.masked_fill(candidates < 0, torch.iinfo(torch.int64).max).argsort(dim=-1)
        exact, candidates = exact.gather(1, by_row), candidates.gather(1, by_row)
        order = exact.argsort(dim=-1, descending=True, stable=True)[:, :k]
        return exact.gather(1, order).numpy(), candidates.gather(1, order).numpy()

    def saved(self, index_dir: str | os.PathLike) -> dict:
        """What `index.json` in `index_dir` records: the buffer's folder relative to the index (an index copied or
        moved with its buffer finds it there) and absolute (one moved alone finds it where it was), and the k
        factor."""
        if self.rows.path is None:
            raise InputError(
                "an index re-scored from rows in memory cannot be saved: re-score from a buffer folder"
            )
        rows = Path(self.rows.path).resolve()
        try:
            relative = os.path.relpath(rows, Path(index_dir).resolve())
        except ValueError:  # another drive (Windows): there is no relative path
            relative = str(rows)
        return {"rows": relative, "rows_absolute": str(rows), "k_factor": self.k_factor}

    @staticmethod
    def candidate_folders(saved: dict, index_dir: Path) -> list[Path]:
        """Where an index's `saved` rescoring may find its buffer, in order: relative to the index (an index
        of an older version recorded only the absolute path, which this gives too), then absolute."""
        # Joined lexically to the index's resolved folder, as `saved` made it from resolved paths; an absolute
        # "rows" stays absolute.
        found = [Path(os.path.normpath(Path(index_dir).resolve() / saved["rows"]))]
        if saved.get("rows_absolute") and Path(saved["rows_absolute"]) != found[0]:
            found.append(Path(saved["rows_absolute"]))
        return found


# index.json's names of an index's files, and the names `save` gives them.
_FILE_KEYS = {"index_file": INDEX_NAME, "ids_file": IDS_NAME, "removed_file": REMOVED_NAME}


def orphans(folder: str | os.PathLike, meta: dict | None = None) -> list[Path]:
    """What a corpus update left in an index `folder` that its index.json (or `meta`) does not name: the files
    of a generation killed before its commit (and their temporaries), those of generations two or more back
    (`save_generation` keeps the one before), and update folders no update of its edition names. Deleting
    them loses nothing."""
    folder = Path(folder)
    if meta is None:
        meta = json.loads((folder / META_NAME).read_text())
    named = set(meta.get("previous_files", ())) | {
        meta.get(key, default) for key, default in _FILE_KEYS.items()
    }
    stores = {u["store"] for u in meta.get("edition", {}).get("updates", [])}
    found = list(folder.glob(".*.tmp"))  # an atomic write's temporary, its writer killed
    # Every generation's files, the first (`save`'s names) included, that index.json does not name.
    for pattern in (*GENERATION_FILES[:3], *_FILE_KEYS.values()):
        found += [p for p in folder.glob(pattern) if p.name not in named]
    if (folder / "updates").is_dir():
        found += [p for p in (folder / "updates").iterdir() if f"updates/{p.name}" not in stores]
    return sorted(found)


def _open_rows(folder: Path) -> PassageBuffer:
    """The buffer in `folder`, opened memory-mapped."""
    from rlm.retriever.buffer import PassageBuffer

    return PassageBuffer.load(folder)


class PassageIndex:
    """A faiss index (inner product) and the passage id of each of its rows.

    `on_gpu` says `index` is a GPU clone (one GPU, or an `IndexShards` over several).
    """

    def __init__(
        self,
        index,
        ids: Sequence[str],
        factory: str,
        on_gpu: bool = False,
        search_params: dict[str, int] | None = None,
        removed: np.ndarray | None = None,
    ):
        # An IVF index no longer holds the rows a corpus update removed from it (`remove_rows`); others do.
        removed = np.zeros(0, dtype=np.int64) if removed is None else np.asarray(removed, dtype=np.int64)
        if index.ntotal not in (len(ids), len(ids) - len(removed)):
            raise ValueError(f"index holds {index.ntotal} vectors but {len(ids)} ids were given")
        self.index = index
        # A list or an IdSequence (a corpus's or a loaded index's ids: one blob) is kept, not copied: a list
        # of 21M id strings would cost ~1.5 GB at every start.
        self.ids = ids if isinstance(ids, list | IdSequence) else list(ids)
        self.factory = factory
        self.on_gpu = on_gpu
        self.search_params: dict[str, int] = {}
        self.tuning: dict = {}  # how `tune` chose `search_params` (saved with them)
        self.provenance: dict = {}  # the buffer's encoder and corpus fingerprints (`from_buffer`), saved
        self.rescoring: Rescoring | None = None  # exact re-scoring of the candidates (`rescore_from`), saved
        self.mapped: str | None = None  # the faiss IO flag `load(mmap=True)` used (None: read whole)
        # Rows no search returns: passages a corpus update deleted or replaced (`remove_rows`), sorted; saved.
        self.removed = removed
        self.edition: dict = {}  # the corpus updates this index holds (`rlm corpus update`), saved
        # The mean squared error of the codes on a sample of the rows it was built from (`quantization_error`).
        self.quantization: dict = {}
        self.built_from: dict = {}  # the buffer folder `from_buffer` read (relative and absolute), saved
        self._gpu_lock = threading.Lock()
        if search_params:
            self.set_search_params(search_params)

    @property
    def ntotal(self) -> int:
        """Rows, numbered as `ids`: the removed ones included (an IVF index itself holds fewer)."""
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @classmethod
    def build(
        cls,
        embeddings: np.ndarray,
        ids: Sequence[str],
        factory: str = "Flat",
        use_gpu: bool | None = None,
        train_sample: int | None = None,
        seed: int = 0,
        show_progress: bool = False,
    ) -> PassageIndex:
        """Index `embeddings` [N, D] with `faiss.index_factory(D, factory, METRIC_INNER_PRODUCT)` (`auto`: as
        `resolve_factory` says for N rows), built on the host.

        `embeddings` may be any float array, a memory-mapped .npy too (`np.load(mmap_mode=...)`): it is read
        `ADD_ROWS` rows at a time (and the training sample's rows), each block converted to float32 on its own,
        so a float16 file of 21M rows never becomes a 64 GB float32 copy beside the index.
        `use_gpu`: None clones the built index to the GPU(s) when faiss sees any (faiss-gpu), True insists,
        False keeps it on the host."""
        embeddings = np.asarray(embeddings)  # a memmap stays one: nothing is read yet
        if embeddings.ndim != 2:
            raise ValueError(f"expected a [n, D] array, got shape {embeddings.shape}")
        n = embeddings.shape[0]
        if len(ids) != n:
            raise ValueError(f"{n} embeddings but {len(ids)} ids")
        factory = resolve_factory(factory, n)
        index = cls._empty(embeddings.shape[1], factory)
        baseline = {}
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            train_sample = train_sample or training_rows(factory)
            picked = np.sort(rng.choice(n, train_sample, replace=False)) if n > train_sample else np.arange(n)
            index.train(_as_float32(embeddings[picked]))
            rest = _held_out(n, picked, rng)
            baseline = _quantization(index, _as_float32(embeddings[rest]), in_sample=rest is picked)
        with tqdm(total=n, desc="index", unit="psg", disable=not show_progress) as bar:
            for start in range(0, n, ADD_ROWS):
                index.add(_as_float32(embeddings[start : start + ADD_ROWS]))
                bar.update(min(ADD_ROWS, n - start))
        index, on_gpu = _to_gpu(index, use_gpu)
        built = cls(index, ids, factory, on_gpu)
        built.quantization = baseline
        return built

    @classmethod
    def from_buffer(
        cls,
        buffer,
        factory: str = "Flat",
        use_gpu: bool | None = None,
        chunk_size: int = ADD_ROWS,
        train_sample: int | None = None,
        seed: int = 0,
        show_progress: bool = False,
    ) -> PassageIndex:
        """Index a `PassageBuffer`, streaming its shards into a host index (row i of the buffer is row i of the
        index), then cloned to the GPU(s) as in `build`."""
        factory = resolve_factory(factory, len(buffer))
        index = cls._empty(buffer.dim, factory)
        baseline = {}
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            n = len(buffer)
            rows = np.sort(rng.choice(n, min(n, train_sample or training_rows(factory)), replace=False))
            import torch

            index.train(_as_float32(buffer.rows(torch.from_numpy(rows)).float().cpu().numpy()))
            rest = _held_out(n, rows, rng)
            held_out = _as_float32(buffer.rows(torch.from_numpy(rest)).float().cpu().numpy())
            baseline = _quantization(index, held_out, in_sample=rest is rows)
        with tqdm(total=len(buffer), desc="index", unit="psg", disable=not show_progress) as bar:
            for _, chunk in buffer.iter_chunks(chunk_size):
                index.add(_as_float32(chunk.float().cpu().numpy()))
                bar.update(chunk.shape[0])
        index, on_gpu = _to_gpu(index, use_gpu)
        built = cls(index, buffer.ids, factory, on_gpu)
        built.provenance = {key: buffer.meta[key] for key in PROVENANCE_KEYS if key in buffer.meta}
        built.quantization = baseline
        if getattr(buffer, "path", None) is not None:
            built.built_from = {"rows_absolute": str(Path(buffer.path).resolve())}
        return built

    @staticmethod
    def _empty(dim: int, factory: str):
        """An empty host index of type `factory`."""
        faiss = _faiss()
        try:
            return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as err:
            raise InputError(f"faiss cannot build index type {factory!r} for dim {dim}: {err}") from err

    def tunable_parameter(self) -> str | None:
        """The search parameter that trades speed for recall in this index type: `nprobe` (IVF: lists
        probed), `efSearch` (HNSW: candidates explored), or None (exact or nothing to tune)."""
        if "IVF" in self.factory:
            return "nprobe"
        if "HNSW" in self.factory:
            return "efSearch"
        return None

    def set_search_params(self, params: dict[str, int]) -> None:
        """Apply faiss search parameters (e.g. {"nprobe": 32}); an unknown one for this index type is refused."""
        faiss = _faiss()
        # A GpuIndexIVF is no IndexIVF: only GpuParameterSpace (GPU builds) reaches its nprobe.
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        for name, value in params.items():
            try:
                space.set_index_parameter(self.index, name, int(value))
            except RuntimeError as err:
                raise InputError(f"faiss index {self.factory!r} has no search parameter {name!r}") from err
            self.search_params[name] = int(value)
            if name == "nprobe" and not self.on_gpu:
                self._widen_hnsw_quantizer(int(value))

    def _widen_hnsw_quantizer(self, nprobe: int) -> None:
        """An HNSW coarse quantizer (`IVF65536_HNSW32,...`) explores `efSearch` candidates and so finds at most
        that many lists, however many `nprobe` asks for: faiss leaves it at 16. It is set to 2 x nprobe, where
        the lists it finds match a flat quantizer's (synthetic 768-d, 62,500 rows, 1,024 lists: at nprobe 32,
        0.8 points of gold recall@20 lost against the flat quantizer's 0.7; 1.2 at 1 x nprobe; and at efSearch
        16 every list probed still lost 1.0 point)."""
        faiss = _faiss()
        ivf = faiss.try_extract_index_ivf(self.index)
        quantizer = None if ivf is None else faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = max(2 * nprobe, HNSW_QUANTIZER_EF_SEARCH)

    def apply_search(
        self,
        spec: IndexSpec,
        rows,
        query_vectors: np.ndarray | None = None,
        k: int | None = None,
        queries: int = TUNE_QUERIES,
    ) -> dict:
        """Set this index's search as `spec` says: its fixed parameters (`nprobe`, `ef_search`), else, for a
        type with one to tune, `tune` for `spec.target_recall` (0: faiss's defaults kept) at recall@`k` (None:
        `spec.tune_k`) against exact search over `rows`, on `query_vectors` when given (at most `queries`). Returns
        what `tune` measured ({} when nothing was tuned). With `factory: auto`, a fixed parameter the resolved type does not
        take (nprobe of a Flat index below 100k rows) is left aside; a named type refuses it."""
        params = spec.search_params
        if spec.factory == "auto":
            params = {name: value for name, value in params.items() if name == self.tunable_parameter()}
        if spec.search_params:
            self.set_search_params(params)
            return {}
        if self.tunable_parameter() is None or not spec.target_recall:
            return {}
        return self.tune(
            rows, spec.target_recall, k=k or spec.tune_k, queries=queries, query_vectors=query_vectors
        )

    def tune(
        self,
        rows,
        target_recall: float = DEFAULT_TARGET_RECALL,
        k: int = TUNE_K,
        queries: int = TUNE_QUERIES,
        seed: int = 0,
        query_vectors: np.ndarray | None = None,
    ) -> dict:
        """Choose the smallest value of `tunable_parameter` whose recall@k reaches `target_recall`, measured
        against exact search over `rows` (a `PassageBuffer` or an [N, D] array, the vectors this index holds).
        When none does, the value where recall stops growing (less than `RECALL_PLATEAU` more for a doubling,
        in recall@k and in the share of exact search's top k found: compressed codes cap both), else the
        largest tried, with a warning. Applies it and returns what was measured (also kept in `tuning`, saved with the index).

        The queries are `query_vectors` (at most `queries` of them: e.g. the query tower's embeddings of real
        questions, which is what the index will be asked), and recall@k is the share of exact search's top k the
        index's top k holds. Else they are `queries` indexed rows made question-like (`question_like_rows`),
        each with its source row, the passage that answers it, and recall@k is the share of the made questions
        whose source exact search ranks in its top k that the index ranks there too: the answers a reader
        loses, which is what "within 1 point of Flat" counts (why neither all top-k neighbours nor bare rows:
        docs/retriever.md, "Search parameters")."""
        from rlm.retriever.buffer import PassageBuffer
        from rlm.retriever.search import corrected_topk

        name = self.tunable_parameter()
        if name is None:
            return {}
        if not 0.0 < target_recall <= 1.0:
            raise InputError(f"target recall must be in (0, 1], got {target_recall}")
        if not isinstance(rows, PassageBuffer):
            rows = _array_rows(rows)
        sample, sources, made = self._tuning_queries(rows, queries, seed, query_vectors)
        k = min(k, self.ntotal)
        exact = corrected_topk(sample, rows, None, k).indices.numpy()
        if sources is not None and not (exact == sources[:, None]).any():
            sources = None  # no source in its exact top k (near-duplicate rows): count the neighbours found
        chosen, measured = self._smallest_reaching(name, sample.numpy(), exact, sources, target_recall)
        recall = {value: answers for value, (answers, _) in measured.items()}
        if recall[chosen] < target_recall:
            warnings.warn(
                f"{self.factory}: recall@{k} {recall[chosen]:.3f} at {name}={chosen} (searching more gained less "
                f"than {RECALL_PLATEAU}, or nothing more was tried) is below the target {target_recall}",
                stacklevel=2,
            )
        self.tuning = {
            "parameter": name,
            "value": chosen,
            "target_recall": target_recall,
            "k": k,
            "queries": len(sample),
            "queries_from": "question-like rows" if query_vectors is None else "query vectors",
            "measure": "source rows kept" if sources is not None else "exact top-k found",
            **made,
            "recall": recall[chosen],
            "tried": {str(v): r for v, r in recall.items()},
        }
        if sources is not None:  # the plateau's measure, beside the one chosen on
            self.tuning["tried_top_k_found"] = {str(v): found for v, (_, found) in measured.items()}
        return self.tuning

    def _tuning_queries(self, rows, queries: int, seed: int, query_vectors: np.ndarray | None):
        """`tune`'s queries [Q, D]: the first `queries` of `query_vectors`, else that many rows made question-like;
        with the made ones' source rows and how they were made (None and {} for given vectors)."""
        import torch

        if query_vectors is not None:
            return torch.from_numpy(_as_float32(query_vectors, self.dim)[:queries]), None, {}
        return question_like_rows(rows, queries, np.random.default_rng(seed))

    def _smallest_reaching(
        self, name: str, sample: np.ndarray, exact: np.ndarray, sources: np.ndarray | None, target: float
    ) -> tuple[int, dict[int, tuple[float, float]]]:
        """(the chosen value of search parameter `name`, {value: (recall@k, share of `exact`'s top k found)}),
        the values tried in increasing order until recall reaches `target` or neither measure grows;
        the chosen one applied. recall@k is the share found, or with `sources` [B] (the row answering each
        query) the share of the queries whose source is in `exact`'s row that have it in the index's top k."""
        answerable = None if sources is None else (exact == sources[:, None]).any(-1)
        measured, previous = {}, None
        for value in self._values(name):
            self.set_search_params({name: value})
            _, found = self.search_rows(sample, exact.shape[1])
            hits = (found[:, :, None] == exact[:, None, :]).any(-1) & (found >= 0)
            top_k_found = float(hits.sum(-1).mean() / exact.shape[1])
            recall = top_k_found
            if answerable is not None:
                kept = (found == sources[:, None]).any(-1) & answerable
                recall = float(kept.sum() / answerable.sum())
            measured[value] = (recall, top_k_found)
            if recall >= target:
                break
            if (
                previous is not None
                and max(np.subtract(measured[value], measured[previous])) < RECALL_PLATEAU
            ):
                # Compressed codes (PQ, SQ) cap recall below what probing more can reach: scanning every list
                # for the last few hundredths would cost a 21M-passage index seconds a query. Both measures:
                # codes can cap the neighbours found while the answers kept still grow (SQ8 in HNSW on real
                # text: 0.973 of them kept at efSearch 128, 0.991 at 256).
                value = previous
                break
            previous = value
        self.set_search_params({name: value})
        return value, measured

    def _values(self, name: str) -> list[int]:
        if name == "efSearch":
            return list(EF_SEARCH_VALUES)
        # From the factory string: a GPU clone (one GPU, replicas, shards) does not answer like an IndexIVF.
        lists = int(re.search(r"IVF(\d+)", self.factory).group(1))
        return [2**i for i in range(int(math.log2(max(1, lists))) + 1)] + (
            [lists] if lists & (lists - 1) else []
        )

    def search_rows(
        self, queries: np.ndarray, k: int, nprobe: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores [B, k] and row positions [B, k] (int64; -1 where the index found fewer than k). `nprobe`
        sets that search parameter first (kept for later searches). With `rescoring`, the codes' top
        `k_factor` x k are re-scored exactly and the best k of them returned. A removed row (`remove_rows`) is
        never returned: the search goes deeper until it has as many others as it can."""
        queries = _as_float32(queries, self.dim)
        if nprobe is not None:
            self.set_search_params({"nprobe": nprobe})
        depth = min(k if self.rescoring is None else k * self.rescoring.k_factor, self.ntotal)
        scores, rows = self._search(queries, depth)
        if len(self.removed):
            scores, rows = self._without_removed(queries, depth, scores, rows)
        if self.rescoring is None:
            return scores, rows
        return self.rescoring.best(queries, rows, min(k, self.ntotal))

    def _search(self, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.on_gpu:
            return self.index.search(queries, depth)
        with self._gpu_lock:
            return self.index.search(queries, depth)

    def _without_removed(self, queries, depth: int, scores, rows) -> tuple[np.ndarray, np.ndarray]:
        """The first `depth` results of each query that are not removed rows, searched deeper (twice as deep
        each time) while some query lost results to them; -1 and -inf where the index has no more."""
        searched = depth
        while True:
            kept = (rows >= 0) & ~np.isin(rows, self.removed)
            short = kept.sum(axis=1) < depth
            lost = (rows >= 0).sum(axis=1) > kept.sum(axis=1)
            if not (short & lost).any() or searched >= self.ntotal:
                break
            searched = min(2 * searched + len(self.removed), self.ntotal)
            scores, rows = self._search(queries, searched)
        order = np.argsort(~kept, axis=1, kind="stable")[:, :depth]  # the kept ones first, in their order
        rows = np.where(np.take_along_axis(kept, order, 1), np.take_along_axis(rows, order, 1), -1)
        scores = np.where(rows >= 0, np.take_along_axis(scores, order, 1), -np.inf).astype(np.float32)
        return scores, rows

    def add_rows(self, vectors: np.ndarray, ids: Sequence[str]) -> None:
        """Append `vectors` [n, D] as rows `ntotal`.. with passage `ids`, coded with the codebooks the index
        was trained with (an IVF list each by its nearest centroid; nothing is retrained). A GPU clone is
        refused: an update edits the host index it saves."""
        if self.on_gpu:
            raise InputError("rows are added to an index on the host: load it with use_gpu=False")
        if len(vectors) != len(ids):
            raise ValueError(f"{len(vectors)} vectors but {len(ids)} ids")
        if self.mapped:
            raise InputError("a memory-mapped index is read-only: load it whole (mmap=False) to add rows")
        for start in range(0, len(vectors), ADD_ROWS):
            self.index.add(_as_float32(vectors[start : start + ADD_ROWS], self.dim))
        self.ids = [*self.ids, *ids] if isinstance(self.ids, list) else IdSequence.joined([self.ids, ids])

    def remove_rows(self, rows: Sequence[int]) -> None:
        """Make `rows` unreachable: taken out of the index where its type allows (IVF: `remove_ids`, so no
        search spends time on them), and in every case kept in `removed`, which `search_rows` filters out
        before anything is returned (Flat and HNSW keep the vectors: removing would renumber Flat's rows, and
        HNSW's graph cannot lose a node). Row numbers stay those of `ids`."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if len(rows) and (rows[0] < 0 or rows[-1] >= self.ntotal):
            raise ValueError(f"rows to remove must be in [0, {self.ntotal}), got {rows[0]}..{rows[-1]}")
        faiss = _faiss()
        with contextlib.suppress(RuntimeError):  # not an IVF index: filtered at search
            faiss.extract_index_ivf(self.index).remove_ids(faiss.IDSelectorBatch(rows))
        self.removed = np.union1d(self.removed, rows)

    def rescore_from(self, rows, k_factor: int) -> None:
        """Re-score each search's top `k_factor` x k candidates exactly from `rows` (a `PassageBuffer` of the
        vectors this index holds, in its row order: the float16 shards it was built from, memory-mapped, so
        they stay on disk and each search reads its candidates' rows by offset). Lifts the recall that
        compressed codes (PQ) cap; `save` records the buffer's folder (relative to the index, and absolute) and
        `load` opens it again, wherever the two were moved together.
        `k_factor` 0 turns it off."""
        if k_factor == 0:
            self.rescoring = None
            return
        if k_factor < 1:
            raise InputError(f"the rescoring k_factor must be at least 1 (0: off), got {k_factor}")
        if rows.device.type != "cpu":  # faiss hands back host arrays; the rows are read where they lie
            raise InputError(
                f"rescoring rows on {rows.device}: re-scoring reads them on the host, from the buffer's "
                "memory-mapped shards (`PassageBuffer.load(folder)`), not a copy on an accelerator"
            )
        if self.provenance.get("corrector_fingerprint"):
            raise InputError(
                "an index over h(B) holds rows of the corrector, not the buffer's: it cannot be re-scored from "
                "the buffer (h corrects each row; build it without --rescore)"
            )
        if len(rows) != self.ntotal or rows.dim != self.dim:
            raise InputError(
                f"rescoring rows {getattr(rows, 'path', None) or ''} hold {len(rows)} x {rows.dim}, the index "
                f"{self.ntotal} x {self.dim}: re-score from the buffer the index was built from"
            )
        for key in ("encoder_fingerprint", "corpus_fingerprint"):
            if self.provenance.get(key) not in (None, rows.meta.get(key)):
                raise InputError(
                    f"rescoring rows {rows.path} were embedded with {key.replace('_', ' ')} "
                    f"{rows.meta.get(key)}, the index with {self.provenance[key]}: re-score from the buffer "
                    "the index was built from"
                )
        self.rescoring = Rescoring(rows, k_factor)

    def search(
        self, queries: np.ndarray, k: int, nprobe: int | None = None
    ) -> tuple[np.ndarray, list[list[str]]]:
        """Top-k by inner product: scores [B, k'] (k' = min(k, N)) and the passage ids per query.

        Positions the index could not fill (IVF with too few probes) have score -inf and are left out of ids.
        """
        scores, rows = self.search_rows(queries, k, nprobe)
        scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
        ids = [[self.ids[r] for r in row if r >= 0] for row in rows]
        return scores, ids

    def _meta(self, out_dir: str | os.PathLike) -> dict:
        """index.json's content for this index saved in `out_dir`."""
        meta = {"factory": self.factory, "dim": self.dim, "count": self.ntotal, "metric": "inner_product"}
        meta |= {"search_params": self.search_params, "tuning": self.tuning, **self.provenance}
        if self.rescoring is not None:
            meta["rescoring"] = self.rescoring.saved(out_dir)
        for key in ("quantization", "built_from", "edition"):
            if getattr(self, key):
                meta[key] = getattr(self, key)
        return meta

    def _host_index(self):
        # Only a GPU clone is copied: a CPU index (possibly large: HNSW) is written as it is.
        # index_gpu_to_cpu turns any clone into one CPU index (replicas: one copy; shards: merged).
        return _faiss().index_gpu_to_cpu(self.index) if self.on_gpu else self.index

    def save(self, out_dir: str | os.PathLike) -> None:
        """`index.faiss` + `ids.txt` + `index.json` (+ `removed.npy`), atomically replacing `out_dir`."""
        lines = id_lines(self.ids)  # a ValueError naming the row of an id with a line break
        index = self._host_index()
        with atomic_directory(out_dir) as tmp:
            _faiss().write_index(index, str(tmp / INDEX_NAME))
            atomic_write_bytes(tmp / IDS_NAME, lines)
            meta = self._meta(out_dir)
            if len(self.removed):
                with atomic_file(tmp / REMOVED_NAME) as path, open(path, "wb") as f:
                    np.save(f, self.removed)
                meta["removed_file"] = REMOVED_NAME
            atomic_write_text(tmp / META_NAME, json.dumps(meta, indent=2))

    def save_generation(self, folder: str | os.PathLike, generation: int) -> None:
        """Save into `folder`, beside what is there, as generation `generation`: `index.<g>.faiss`,
        `ids.<g>.txt`, `removed.<g>.npy`, then `index.json` naming them, replaced in one rename: the commit. A
        process killed before it leaves `folder` as it was (the new files unnamed, `orphans` finds them);
        after it, a reader of `index.json` gets the new generation. The generation before stays (a reader
        that read the old index.json may still be opening its files); older ones are deleted."""
        folder = Path(folder)
        names = {
            "index_file": f"index.{generation:04d}.faiss",
            "ids_file": f"ids.{generation:04d}.txt",
            "removed_file": f"removed.{generation:04d}.npy",
        }
        previous = json.loads((folder / META_NAME).read_text()) if (folder / META_NAME).exists() else {}
        with atomic_file(folder / names["index_file"]) as path:
            _faiss().write_index(self._host_index(), str(path))
        atomic_write_bytes(folder / names["ids_file"], id_lines(self.ids))
        with atomic_file(folder / names["removed_file"]) as path, open(path, "wb") as f:
            np.save(f, self.removed)
        kept = sorted({previous.get(key, default) for key, default in _FILE_KEYS.items()})
        meta = self._meta(folder) | names | {"generation": generation, "previous_files": kept}
        atomic_write_text(folder / META_NAME, json.dumps(meta, indent=2))
        for path in orphans(folder, meta):
            if path.is_file():
                path.unlink()

    def _with_appended(self, rows, folder: Path):
        """`rows` (the buffer this index was built from) and the rows its corpus updates appended."""
        stores = [folder / update["store"] / "rows.npy" for update in self.edition.get("updates", [])]
        return rows.grown(stores, self.ids) if stores else rows

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        use_gpu: bool | None = None,
        search_params: dict[str, int] | None = None,
        rescore_rows: str | os.PathLike | None = None,
        mmap: bool = False,
    ) -> PassageIndex:
        """Read a folder written by `save` (or a corpus update's `save_generation`: the files index.json
        names), with the search parameters saved there (`tune`'s) and then `search_params` over them. An index
        that re-scores its candidates finds its buffer relative to itself, else where it was built;
        `rescore_rows` names the buffer folder instead (checked like any).

        `mmap`: map the file read-only instead of reading it into this process's memory, where faiss can
        (`mmap_flag`) and the index stays on the host: processes that map one file share its pages."""
        folder = Path(path)
        if not (folder / META_NAME).exists():
            raise FileNotFoundError(f"{folder / META_NAME} not found: build the index first with `rlm index`")
        meta = json.loads((folder / META_NAME).read_text())
        files = {key: folder / meta.get(key, default) for key, default in _FILE_KEYS.items()}
        faiss = _faiss()
        # A GPU clone is a copy of its own: the host index it is made from is read whole.
        stays_on_host = not (_gpu_count() > 0 if use_gpu is None else use_gpu)
        mapped = mmap_flag(meta["factory"]) if mmap and stays_on_host else None
        io_flags = (getattr(faiss, mapped) | faiss.IO_FLAG_READ_ONLY) if mapped else 0
        index, on_gpu = _to_gpu(faiss.read_index(str(files["index_file"]), io_flags), use_gpu)
        try:
            ids = IdSequence.from_lines(files["ids_file"].read_bytes(), meta["count"])
        except ValueError as err:
            raise InputError(f"{files['ids_file']} has {err}, index.json says {meta['count']}") from None
        removed = np.load(files["removed_file"]) if "removed_file" in meta else None
        params = {**meta.get("search_params", {}), **(search_params or {})}
        loaded = cls(index, ids, meta["factory"], on_gpu, params, removed=removed)
        loaded.tuning = meta.get("tuning", {})
        loaded.provenance = {key: meta[key] for key in PROVENANCE_KEYS if key in meta}
        loaded.mapped = mapped
        for key in ("quantization", "built_from", "edition"):
            setattr(loaded, key, meta.get(key, {}))
        if "rescoring" in meta:
            loaded._rescore_from_saved(meta["rescoring"], folder, rescore_rows)
        return loaded

    def _rescore_from_saved(self, saved: dict, folder: Path, rescore_rows: str | os.PathLike | None) -> None:
        """Re-score from the buffer `saved` (index.json's `rescoring`) names, or from `rescore_rows` when given:
        the first of its folders that holds this index's rows (size, width, encoder and corpus), grown by the
        rows the corpus updates of its edition appended (each update's `rows.npy`)."""
        k_factor = saved["k_factor"]
        if rescore_rows is not None:
            self.rescore_from(self._with_appended(_open_rows(Path(rescore_rows)), folder), k_factor)
            return
        tried = []
        for candidate in Rescoring.candidate_folders(saved, folder):
            try:
                self.rescore_from(self._with_appended(_open_rows(candidate), folder), k_factor)
                return
            except (FileNotFoundError, InputError) as err:
                tried.append(f"{candidate} ({' '.join(str(err).split())})")
        raise InputError(
            f"index {folder} re-scores its candidates from a buffer found at none of: {'; '.join(tried)}; "
            "copy the buffer beside the index as it was, point to it (`--rescore-buffer DIR`), or rebuild the "
            "index (`rlm index --rescore 0` builds one without it)"
        )
