"""The fixed, stale passage buffer B: a corpus embedded once by the initial passage tower, never recomputed.

On disk (one folder):

    meta.json            written last: its presence means the buffer is complete
    ids.txt              passage ids, one per line, in row order
    shard_00000.npy ...  rows [i * shard_size, (i + 1) * shard_size), float16 by default
    shard_00000.json     per-shard receipt (rows, dtype, sha256): a resumed build keeps verified shards
    build.json           the build's settings while it is in progress (removed when meta.json is written)

Shards are written atomically, so an interrupted build leaves only complete shards behind and a rerun with
the same corpus, encoder and settings embeds just the missing ones. The settings include the precision the
passage tower ran in (`float32`, or `bf16` autocast: the default on a CUDA GPU): a bf16 buffer holds other
values, so it is never resumed, reused or loaded as a float32 one. Under `accelerate launch` (or torchrun)
each process embeds shards rank, rank + world, ...; the main process verifies them all (checksums, and no
NaN or infinite row, which would rank first for every question) and writes meta.json.

meta.json's `corpus_fingerprint` is what the caller passes (`Corpus.fingerprint`: the sha256 of the corpus
file, computed during its scan); without one it is `corpus_fingerprint(ids, texts)`, a hash over every
(id, text) pair, which costs a pass over the whole corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from rlm.base.atomicio import atomic_file, atomic_write_bytes, atomic_write_text
from rlm.base.evalmode import eval_mode
from rlm.retriever.encoder import bucket_size_for
from rlm.retriever.errors import InputError
from rlm.retriever.ids import IdSequence, id_lines

META_NAME = "meta.json"
BUILD_NAME = "build.json"
IDS_NAME = "ids.txt"
BUFFER_FILES = (META_NAME, BUILD_NAME, IDS_NAME, "shard_*.npy", "shard_*.json")  # all a buffer folder holds
FORMAT_VERSION = 1
DTYPES = {"float16": np.float16, "float32": np.float32}
PRECISIONS = ("float32", "bf16")  # what the passage tower computes in while it builds a buffer
TOKENIZE_CHUNK = 4096  # texts per tokenizer call while a shard is read: bounds the Python lists' memory


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """The precision a build on `device` runs the passage tower in: `precision` itself, or for "auto" bf16
    autocast on a CUDA GPU that has it and float32 elsewhere.

    On CPU "auto" keeps float32: most CPUs emulate bf16, many times slower than float32 (docs/training.md,
    "Precision"), and `rlm/precision.py`, the module that tells, is `rlm`'s. A caller that knows its CPU runs
    bf16 natively passes "bf16"."""
    if precision not in ("auto", *PRECISIONS):
        raise InputError(f"precision must be auto or one of {list(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    device = torch.device(device)
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


def _precision_autocast(device: str | torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast, or autocast off for float32: a caller's own autocast must not change a buffer that
    records float32."""
    device_type = torch.device(device).type
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return torch.autocast(device_type, enabled=False)


def corpus_fingerprint(ids: Sequence[str], texts: Sequence[str]) -> str:
    """sha256 over the (id, text) pairs in order (32 hex digits); `ids`/`texts` may be lazy sequences (len and
    [i]). One pass over every passage: for corpora without a file (lists); a corpus file's own
    `Corpus.fingerprint` costs nothing extra."""
    if len(ids) != len(texts):
        raise ValueError(f"corpus has {len(ids)} ids but {len(texts)} texts")
    digest = hashlib.sha256(f"{len(ids)}\n".encode())
    for i in range(len(ids)):
        digest.update(str(ids[i]).encode())
        digest.update(b"\x00")
        digest.update(str(texts[i]).encode())
        digest.update(b"\x01")
    return digest.hexdigest()[:32]


_pairs_fingerprint = corpus_fingerprint  # for the functions whose `corpus_fingerprint` argument shadows it


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.npy"


def shards_for_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """The shards one process embeds: rank, rank + world_size, ... (round-robin keeps the loads even)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid process layout rank={rank}, world_size={world_size}")
    return list(range(rank, num_shards, world_size))


class PassageBuffer:
    """Passage ids and their stale embeddings [N, D], either in memory or memory-mapped shards from disk.

    `iter_chunks` streams row blocks without copying the whole buffer (chunks never span two shards);
    `.embeddings` is the whole matrix (memory-mapped for a single-shard buffer, concatenated into memory
    on first access otherwise); `.rows(indices)` gathers a few rows from anywhere.
    """

    def __init__(self, ids: Sequence[str], shards: list[Tensor], meta: dict[str, Any] | None = None):
        """`ids` in row order and the row blocks (`shards`) that together hold the [N, D] embeddings."""
        # Kept as is: a range (tensor buffers wrapped by search; listing 21M row numbers every step is waste)
        # or an IdSequence (one blob for all ids: a list of 21M str would cost ~1.5 GB at every start).
        self.ids = ids if isinstance(ids, list | range | IdSequence) else list(ids)
        self._shards = shards
        self._offsets = [0]
        for shard in shards:
            if shard.dim() != 2 or shard.shape[1] != shards[0].shape[1]:
                raise InputError(f"buffer shards must be [rows, D] with one D; got {tuple(shard.shape)}")
            self._offsets.append(self._offsets[-1] + shard.shape[0])
        if self._offsets[-1] != len(self.ids):
            raise InputError(f"buffer has {len(self.ids)} ids but {self._offsets[-1]} embedding rows")
        self.meta = dict(meta or {})
        # Rows no selection returns (sorted): those of passages a corpus update replaced or deleted
        # (`rlm.data.buffer_edition`); their rows stay, so row i is still corpus row i.
        self.removed = np.zeros(0, dtype=np.int64)
        self._row_of_id: dict[str, int] | None = None
        self._full: Tensor | None = shards[0] if len(shards) == 1 else None
        self.path: Path | None = None
        # Memory-mapped shards (`load`): each one's file and the byte offset of its rows, for `prefetch`.
        self._files: list[tuple[Path, int]] = []
        self._descriptors: dict[int, int] = {}  # shard -> open file descriptor, opened on first prefetch
        self._descriptors_lock = threading.Lock()  # the demo answers two batches at once

    @classmethod
    def from_embeddings(cls, ids: Sequence[str], embeddings: Tensor) -> PassageBuffer:
        """An in-memory buffer over `embeddings` [N, D] (not copied)."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be [N, D], got shape {tuple(embeddings.shape)}")
        meta = {"count": len(ids), "dim": int(embeddings.shape[1]), "dtype": str(embeddings.dtype)}
        return cls(ids, [embeddings], meta)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        encoder_fingerprint: str | None = None,
        corpus_fingerprint: str | None = None,
        device: str | torch.device = "cpu",
        precision: str | None = None,
    ) -> PassageBuffer:
        """Open a built buffer memory-mapped; refuse it when its fingerprints, or the `precision` its passage
        tower ran in ("float32" or "bf16"), differ from the given ones.

        With a non-CPU `device` the rows are copied onto it (one tensor); on CPU they stay memory-mapped.
        """
        folder = Path(path)
        meta_file = folder / META_NAME
        if not meta_file.exists():
            if (folder / BUILD_NAME).exists():
                raise FileNotFoundError(
                    f"{folder} holds an unfinished buffer build; rerun `rlm embed` with the same arguments to resume it"
                )
            raise FileNotFoundError(
                f"{meta_file} not found: build the buffer first with `rlm embed --out {folder}`"
            )
        meta = json.loads(meta_file.read_text())
        for kind, expected in (("encoder", encoder_fingerprint), ("corpus", corpus_fingerprint)):
            if expected is not None and meta[f"{kind}_fingerprint"] != expected:
                raise InputError(
                    f"buffer {folder} was built with {kind} fingerprint {meta[f'{kind}_fingerprint']}, "
                    f"but the {kind} given has fingerprint {expected}; rebuild it with `rlm embed` "
                    f"or point to the buffer of this {kind}"
                )
        if precision is not None and meta.get("precision") != precision:
            raise InputError(
                f"buffer {folder} was built with the passage tower in {meta.get('precision')}, not "
                f"{precision}; rebuild it with that precision or point to a buffer built in {precision}"
            )
        try:
            # One blob for all ids, not a list of str (21M ids: ~0.35 GB instead of ~1.5 GB).
            ids = IdSequence.from_lines((folder / IDS_NAME).read_bytes(), meta["count"])
        except ValueError as err:
            raise InputError(f"{folder / IDS_NAME} has {err}, meta.json says {meta['count']}") from None
        shards, files = [], []
        for name in meta["shards"]:
            # Copy-on-write map: read-only on disk like mode "r", but writable in memory, which torch wants.
            mapped = np.load(folder / name, mmap_mode="c")
            shards.append(torch.from_numpy(mapped))
            files.append((folder / name, int(mapped.offset)))
        buffer = cls(ids, shards, meta)
        buffer.path, buffer._files = folder, files
        return buffer if torch.device(device).type == "cpu" else buffer.to(device)

    def grown(self, appended: Sequence[str | os.PathLike], ids: Sequence[str]) -> PassageBuffer:
        """This buffer with rows appended after its own: each file of `appended` one `.npy` of [n, D] rows in
        this buffer's dtype (what `rlm corpus update` writes for the passages it adds), memory-mapped like the
        buffer's shards; `ids`: the ids of all rows, this buffer's first. Its meta, path and fingerprints stay
        this buffer's: the grown rows are checked by whoever appended them."""
        shards, files = list(self._shards), list(self._files)
        for path in appended:
            mapped = np.load(path, mmap_mode="c")
            if (
                mapped.ndim != 2
                or mapped.shape[1] != self.dim
                or str(mapped.dtype) != str(self.dtype).removeprefix("torch.")
            ):
                raise InputError(
                    f"{path} holds rows of shape {mapped.shape} {mapped.dtype}, not [n, {self.dim}] {self.dtype}"
                )
            shards.append(torch.from_numpy(mapped))
            files.append((Path(path), int(mapped.offset)))
        grown = type(self)(ids, shards, self.meta)
        grown.path, grown.removed = self.path, self.removed
        grown._files = files if len(files) == len(shards) else []
        return grown

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self._shards[0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self._shards[0].dtype

    @property
    def device(self) -> torch.device:
        return self._shards[0].device

    @property
    def embeddings(self) -> Tensor:
        """All rows [N, D] as one tensor (for a multi-shard buffer this copies into memory once)."""
        if self._full is None:
            self._full = torch.cat(self._shards, dim=0)
        return self._full

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> PassageBuffer:
        """A buffer with all rows in one tensor on `device` (and `dtype` when given)."""
        moved = PassageBuffer(self.ids, [self.embeddings.to(device=device, dtype=dtype)], self.meta)
        moved._row_of_id, moved.removed = self._row_of_id, self.removed
        return moved

    def index_of(self, passage_id: str) -> int:
        """Row of a passage id (KeyError when it is not in the buffer)."""
        if self._row_of_id is None:
            self._row_of_id = {pid: row for row, pid in enumerate(self.ids)}
        return self._row_of_id[passage_id]

    def iter_chunks(self, chunk_size: int) -> Iterator[tuple[int, Tensor]]:
        """(start row, rows [c, D]) blocks of at most `chunk_size` rows, in order, views (no copy)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        for offset, shard in zip(self._offsets, self._shards):
            for start in range(0, shard.shape[0], chunk_size):
                yield offset + start, shard[start : start + chunk_size]

    def prefetch(self, indices: Tensor) -> None:
        """Ask the kernel to read the rows `indices` (any shape; -1 ignored) of memory-mapped shards into the page
        cache, all at once (`posix_fadvise(WILLNEED)` on each row's bytes), so that `rows` then finds them there:
        touching rows that are on disk one at a time waits for one read after another (100 evicted rows: 330 ms
        read fault by fault, 2.0 ms prefetched; benchmark scripts/bench/bench_rescoring.py). Does nothing for a buffer in memory or
        where the OS has no `posix_fadvise`."""
        if not self._files or not hasattr(os, "posix_fadvise"):
            return
        flat = indices.reshape(-1).to("cpu")
        flat = flat[flat >= 0]
        shard_of = self._shard_of(flat)
        row_bytes = self.dim * self._shards[0].element_size()
        for s in shard_of.unique().tolist():
            descriptor, (_, data_offset) = self._descriptor(s), self._files[s]
            for row in (flat[shard_of == s] - self._offsets[s]).tolist():
                os.posix_fadvise(descriptor, data_offset + row * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)

    def _descriptor(self, shard: int) -> int:
        """An open read-only descriptor of shard `shard`'s file, opened once."""
        with self._descriptors_lock:
            if shard not in self._descriptors:
                self._descriptors[shard] = os.open(self._files[shard][0], os.O_RDONLY)
            return self._descriptors[shard]

    def _shard_of(self, flat: Tensor) -> Tensor:
        """The shard holding each row of `flat` (a 1-D LongTensor of rows)."""
        return torch.searchsorted(torch.tensor(self._offsets), flat, right=True) - 1

    def __del__(self):
        for descriptor in getattr(self, "_descriptors", {}).values():
            os.close(descriptor)

    def rows(self, indices: Tensor) -> Tensor:
        """Gather rows for a LongTensor of any shape -> [..., D] (stored dtype, on the buffer's device)."""
        flat = indices.reshape(-1).to("cpu")
        if len(self._shards) == 1:
            out = self._shards[0][flat.to(self.device)]
        else:
            out = torch.empty(flat.numel(), self.dim, dtype=self.dtype, device=self.device)
            shard_of = self._shard_of(flat)
            for s in shard_of.unique().tolist():
                where = (shard_of == s).nonzero().squeeze(1)
                out[where] = self._shards[s][flat[where] - self._offsets[s]]
        return out.reshape(*indices.shape, self.dim)


# A float is NaN or infinite exactly when its exponent bits are all ones. Testing those bits as integers
# converts nothing (np.isfinite converts every value; docs/retriever.md compares the two), so the check adds
# little to the sha256 verification it follows.
_EXPONENT_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000)}
FINITE_CHECK_ROWS = 4096


def nonfinite_rows(array: np.ndarray, chunk_rows: int = FINITE_CHECK_ROWS) -> np.ndarray:
    """Rows of the [N, D] `array` that hold a NaN or an infinity.

    Such a row scores NaN against every query, and a NaN ranks first in a top-k, so one bad row would be
    retrieved for every question. Checked `chunk_rows` rows at a time: a memory-mapped shard is read in
    blocks, and the temporary masks stay a few MB whatever the shard's size."""
    bad = []
    for start in range(0, array.shape[0], chunk_rows):
        block = array[start : start + chunk_rows]
        if block.dtype in _EXPONENT_BITS:
            as_int, exponent = _EXPONENT_BITS[block.dtype]
            flags = (block.view(as_int) & exponent) == exponent
        else:
            flags = ~np.isfinite(block)
        if flags.any():
            bad.append(start + np.flatnonzero(flags.any(axis=1)))
    return np.concatenate(bad) if bad else np.zeros(0, dtype=np.int64)


def _nonfinite_error(where: str, rows: np.ndarray, ids: Sequence[str], remedy: str) -> InputError:
    shown = ", ".join(f"{ids[int(r)]!r} (row {int(r)})" for r in rows[:5])
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    return InputError(
        f"{where}: {len(rows)} buffer row(s) hold NaN or infinite values, which would rank first for every "
        f"question: passages {shown}{more}. The passage tower's output is not finite there (a float16 "
        f"buffer also overflows beyond 65504: `rlm embed --dtype float32` keeps larger values); {remedy}"
    )


def _shard_receipt(array: np.ndarray) -> dict[str, Any]:
    # Hashed through a view of the rows, not `tobytes()`'s copy: a shard of a process's whole share (one
    # validation's 2.6M rows of 768 at 21M passages on 8 GPUs: 4 GB) would be held twice.
    contiguous = np.ascontiguousarray(array)
    return {
        "rows": int(array.shape[0]),
        "dim": int(array.shape[1]),
        "dtype": str(array.dtype),
        "sha256": hashlib.sha256(memoryview(contiguous.reshape(-1).view(np.uint8))).hexdigest(),
    }


def _shard_is_complete(folder: Path, index: int, rows: int, dim: int, dtype: str) -> bool:
    """True when shard `index` exists with the expected shape/dtype and matches its receipt's checksum."""
    receipt_file = folder / shard_name(index).replace(".npy", ".json")
    shard_file = folder / shard_name(index)
    if not (receipt_file.exists() and shard_file.exists()):
        return False
    try:
        receipt = json.loads(receipt_file.read_text())
        array = np.load(shard_file, mmap_mode="r")
    except (ValueError, OSError):
        return False
    return array.shape == (rows, dim) and str(array.dtype) == dtype and _shard_receipt(array) == receipt


def write_shard(folder: Path, index: int, array: np.ndarray) -> None:
    """Shard `index` of a buffer folder: the rows, then their receipt (size and checksum), each atomically."""
    with atomic_file(folder / shard_name(index)) as tmp, open(tmp, "wb") as fh:
        np.save(fh, array)
    # The receipt goes second: a shard without a receipt is re-embedded, never trusted.
    atomic_write_text(folder / shard_name(index).replace(".npy", ".json"), json.dumps(_shard_receipt(array)))


def build_settings(
    ids,
    texts,
    encoder,
    dtype: str = "float16",
    shard_size: int = 100_000,
    corpus_fingerprint: str | None = None,
    precision: str = "float32",
) -> dict[str, Any]:
    """What identifies a buffer build: fingerprints, count, dim, dtype, shard layout, and the `precision`
    the tower runs in ("float32" or "bf16"; `resolve_precision` turns "auto" into one of them).

    `corpus_fingerprint` is the corpus's own (`Corpus.fingerprint`); without it the (id, text) pairs are
    hashed, one pass over every passage."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    count = len(ids)
    return {
        "format_version": FORMAT_VERSION,
        "encoder_fingerprint": encoder.fingerprint(),
        "corpus_fingerprint": corpus_fingerprint or _pairs_fingerprint(ids, texts),
        "count": count,
        "dim": int(encoder.dim),
        "dtype": dtype,
        "shard_size": shard_size,
        "num_shards": max(1, -(-count // shard_size)),
        "max_length": int(encoder.max_length),
        "precision": precision,
    }


def _check_or_write_build(folder: Path, settings: dict[str, Any], write: bool) -> None:
    """Record the build's settings, or check that an unfinished build in `folder` had the same ones."""
    build_file = folder / BUILD_NAME
    if build_file.exists():
        previous = json.loads(build_file.read_text())
        diff = {k: (previous.get(k), v) for k, v in settings.items() if previous.get(k) != v}
        if diff:
            details = "; ".join(f"{k}: folder has {a}, this build {b}" for k, (a, b) in diff.items())
            raise InputError(
                f"{folder} holds an unfinished build with other settings ({details}); "
                "use another --out folder or delete this one"
            )
    elif write:
        atomic_write_text(build_file, json.dumps(settings, indent=2))


def _shard_rows(settings: dict[str, Any], s: int) -> int:
    return min(settings["shard_size"], settings["count"] - s * settings["shard_size"])


def _incomplete_shards(folder: Path, settings: dict[str, Any], shard_indices: Sequence[int]) -> list[int]:
    """The given shards without a complete file in `folder`, in the given order."""
    return [
        s
        for s in shard_indices
        if not _shard_is_complete(folder, s, _shard_rows(settings, s), settings["dim"], settings["dtype"])
    ]


def _tokenize_rows(
    encoder, texts: Sequence[str], start: int, stop: int, stopping: threading.Event
) -> list[np.ndarray]:
    """Rows [start, stop)'s texts tokenized unpadded, in corpus order; cut short once `stopping` is set."""
    tokens: list[np.ndarray] = []
    for first in range(start, stop, TOKENIZE_CHUNK):
        if stopping.is_set():  # the build stopped: no one will read these rows
            break
        chunk = [str(texts[i]) for i in range(first, min(first + TOKENIZE_CHUNK, stop))]
        tokens.extend(encoder.tokenize_unpadded(chunk))
    return tokens


def _embed_tokens(
    encoder,
    tokens: list[np.ndarray],
    out: np.ndarray,
    device: torch.device,
    precision: str,
    step: int,
    bar,
    check: Callable[[], None] | None,
) -> np.ndarray:
    """Fill `out` [len(tokens), D] in corpus order: forwards of `step` rows of similar length, longest first."""
    order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))
    for b in range(0, len(order), step):
        if check is not None:
            check()
        rows = order[b : b + step]
        batch = encoder.pad_token_rows([tokens[i] for i in rows])
        with torch.inference_mode(), _precision_autocast(device, precision):
            vectors = encoder(**{k: v.to(device) for k, v in batch.items()})
        out[rows] = vectors.float().cpu().numpy().astype(out.dtype)
        bar.update(len(rows))
    return out


def forward_rows(device: torch.device, batch_size: int) -> int:
    """Rows per forward on `device`: the whole batch on an accelerator, at most
    `rlm.retriever.encoder.CPU_BUCKET_SIZE` on a CPU, which runs forwards of about 16 rows fastest (figures in
    docs/retriever.md, "Full, length-sorted batches")."""
    return min(batch_size, bucket_size_for(device) or batch_size)


def embedded_blocks(
    encoder,
    texts: Sequence[str],
    blocks: Sequence[tuple[int, int]],
    dtype: str = "float16",
    precision: str = "float32",
    batch_size: int = 64,
    bar=None,
    check: Callable[[], None] | None = None,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, stop, rows [stop - start, D] in `dtype`) for each block of corpus rows [start, stop), in order:
    the one embedding path of the buffer build, `rlm embed`, evaluation and validation.

    A block is tokenized whole and sorted by token length, longest first (a batch that does not fit in memory
    fails at once), and every `batch_size` rows are one forward padded to their own longest row, which the sort
    makes barely longer than their shortest: forwards of a few rows leave a GPU idle. Rows come back in corpus
    order. The tower runs in `precision` ("float32" or "bf16" autocast). The next block is read and tokenized
    in a background thread meanwhile: a GPU embeds passages about as fast as several CPU cores tokenize them
    (figures for both in docs/retriever.md, "Full, length-sorted batches"). `check` is called before every
    forward and may raise to stop (a stop signal). Only one block's tokens and rows are held at a time, never
    the corpus's.
    """
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    device = encoder.device
    step = forward_rows(device, batch_size)
    stopping = threading.Event()
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-tokenize")
    own_bar = bar is None
    bar = bar if bar is not None else tqdm(disable=True)
    try:
        with eval_mode(encoder):
            pending = reader.submit(_tokenize_rows, encoder, texts, *blocks[0], stopping) if blocks else None
            for n, (start, stop) in enumerate(blocks):
                tokens = pending.result()
                if n + 1 < len(blocks):
                    pending = reader.submit(_tokenize_rows, encoder, texts, *blocks[n + 1], stopping)
                out = np.empty((stop - start, encoder.dim), dtype=DTYPES[dtype])
                yield start, stop, _embed_tokens(encoder, tokens, out, device, precision, step, bar, check)
    finally:
        # A stopped build must not wait for the next block's tokens (a stop signal has a grace period).
        stopping.set()
        reader.shutdown(wait=False, cancel_futures=True)
        if own_bar:
            bar.close()


EMBED_BLOCK_ROWS = 100_000  # rows tokenized and sorted together by `embed_passages` (as a buffer shard)


def embed_passages(
    encoder,
    texts: Sequence[str],
    start: int = 0,
    stop: int | None = None,
    batch_size: int = 64,
    dtype: str = "float16",
    precision: str = "auto",
    block_rows: int = EMBED_BLOCK_ROWS,
    show_progress: bool = False,
) -> np.ndarray:
    """Rows [start, stop) of `texts` embedded by `encoder` into one [n, D] array of `dtype` (float16 by
    default: half the memory of float32, and what a buffer stores), through `embedded_blocks`. `precision`:
    "float32", "bf16" or "auto" (`resolve_precision`: bf16 on a CUDA GPU)."""
    stop = len(texts) if stop is None else stop
    precision = resolve_precision(precision, encoder.device)
    out = np.empty((stop - start, encoder.dim), dtype=DTYPES.get(dtype, np.float16))
    blocks = [(b, min(b + block_rows, stop)) for b in range(start, stop, block_rows)]
    with tqdm(total=stop - start, unit="psg", desc="embed", disable=not show_progress) as bar:
        embedded = embedded_blocks(encoder, texts, blocks, dtype, precision, batch_size, bar)
        with contextlib.closing(embedded):
            for first, last, rows in embedded:
                out[first - start : last - start] = rows
    return out


def _refuse_nonfinite_shard(
    folder: Path, s: int, shard_size: int, out: np.ndarray, ids: Sequence[str]
) -> None:
    bad = nonfinite_rows(out)
    if len(bad):  # refused before it is written, so a rerun embeds this shard again
        raise _nonfinite_error(
            f"{folder}: shard {s}",
            s * shard_size + bad,
            ids,
            "fix the tower or the dtype and rerun the build",
        )


def embed_shards(
    ids: Sequence[str],
    texts: Sequence[str],
    encoder,
    out_dir: str | os.PathLike,
    settings: dict[str, Any],
    shard_indices: Sequence[int],
    batch_size: int = 64,
    show_progress: bool = True,
    check: Callable[[], None] | None = None,
) -> list[int]:
    """Embed the given shards that are not already complete (`embedded_blocks`, one block a shard); returns
    the indices it (re)embedded. Each shard is checked for non-finite rows and written atomically as soon as
    it is embedded. `check` is called before every batch and may raise to stop the build (a stop signal: the
    shards already written stay, and a rerun resumes)."""
    folder = Path(out_dir)
    todo = _incomplete_shards(folder, settings, shard_indices)
    total = sum(_shard_rows(settings, s) for s in todo)
    shard_size = settings["shard_size"]
    blocks = [(s * shard_size, s * shard_size + _shard_rows(settings, s)) for s in todo]
    with tqdm(total=total, unit="psg", desc="embed", disable=not show_progress) as bar:
        embedded = embedded_blocks(
            encoder, texts, blocks, settings["dtype"], settings["precision"], batch_size, bar, check
        )
        # closing: a refused shard stops the background tokenizer at once, not when the generator is collected
        with contextlib.closing(embedded):
            for s, (_, _, out) in zip(todo, embedded):
                _refuse_nonfinite_shard(folder, s, shard_size, out, ids)
                write_shard(folder, s, out)
    return todo


def finalize_buffer(out_dir: str | os.PathLike, ids: Sequence[str], settings: dict[str, Any]) -> None:
    """Verify every shard (its receipt, and that every row is finite), then write ids.txt and meta.json
    (last), and drop the build record."""
    folder = Path(out_dir)
    count, shard_size = settings["count"], settings["shard_size"]
    if len(ids) != count:
        raise ValueError(f"{len(ids)} ids for a buffer of {count} rows")
    missing = []
    for s in range(settings["num_shards"]):
        if not _shard_is_complete(
            folder, s, min(shard_size, count - s * shard_size), settings["dim"], settings["dtype"]
        ):
            missing.append(s)
            continue
        # Checked right after its receipt, while the shard is still in the page cache: no second read from
        # disk for a buffer larger than memory.
        bad = nonfinite_rows(np.load(folder / shard_name(s), mmap_mode="r"))
        if len(bad):
            raise _nonfinite_error(
                f"{folder}: {shard_name(s)}",
                s * shard_size + bad,
                ids,
                f"delete {shard_name(s)} and rerun the build once the tower is fixed",
            )
    if missing:
        raise InputError(f"{folder}: shards {missing} are missing or corrupt; rerun the build to embed them")
    atomic_write_bytes(folder / IDS_NAME, id_lines(ids))
    meta = dict(settings)
    meta["shards"] = [shard_name(s) for s in range(settings["num_shards"])]
    meta["ids_file"] = IDS_NAME
    atomic_write_text(folder / META_NAME, json.dumps(meta, indent=2))
    (folder / BUILD_NAME).unlink(missing_ok=True)


def _check_build_arguments(dtype: str, shard_size: int, batch_size: int, count: int) -> None:
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if shard_size < 1 or batch_size < 1:
        raise InputError(f"shard_size and batch_size must be >= 1, got {shard_size} and {batch_size}")
    if count == 0:
        raise InputError("cannot build a passage buffer from an empty corpus")


def _load_complete_buffer(folder: Path, settings: dict[str, Any]) -> PassageBuffer:
    """The complete buffer in `folder`, refused when it was built with other settings."""
    meta = json.loads((folder / META_NAME).read_text())
    diff = {k: (meta.get(k), v) for k, v in settings.items() if meta.get(k) != v}
    if diff:
        details = "; ".join(f"{k}: folder has {a}, this build {b}" for k, (a, b) in diff.items())
        raise InputError(
            f"{folder} already holds a complete buffer with other settings ({details}); "
            "use another --out folder"
        )
    return PassageBuffer.load(folder)


def _wait_for_everyone(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


class BuildStopped(Exception):
    """Raised by a build's `check` to stop it between two batches (a stop signal): the shards already written
    stay, and a rerun resumes. With several processes it is raised on every one of them at the build's meeting
    point (`build_passage_buffer`), so that they stop together: one that stopped alone would leave the others
    waiting there for it until the process group's timeout."""


def _stopped_anywhere(accelerator, stopped: bool) -> bool:
    """Whether any process stopped its share of the build (every process calls it: it is the build's meeting
    point, where the ones that finished wait for the others)."""
    if accelerator is None or accelerator.num_processes == 1:
        return stopped
    flag = torch.tensor([int(stopped)], device=accelerator.device)  # NCCL reduces tensors on the GPU only
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _embed_together(
    ids, texts, encoder, folder: Path, settings: dict, shards, accelerator, **options
) -> None:
    """This process's `shards` (`embed_shards`), then the build's meeting point: a `BuildStopped` raised on any
    process is raised on every one."""
    stopped = None
    try:
        embed_shards(ids, texts, encoder, folder, settings, shards, **options)
    except BuildStopped as err:
        stopped = err
    if _stopped_anywhere(accelerator, stopped is not None):
        raise stopped or BuildStopped("another process stopped the build")


def build_passage_buffer(
    ids: Sequence[str],
    texts: Sequence[str],
    encoder,
    out_dir: str | os.PathLike,
    batch_size: int = 64,
    dtype: str = "float16",
    shard_size: int = 100_000,
    accelerator=None,
    show_progress: bool = True,
    corpus_fingerprint: str | None = None,
    check: Callable[[], None] | None = None,
    precision: str = "auto",
) -> PassageBuffer:
    """Embed `texts` with `encoder` (a SentenceEncoder: the passage tower) into a buffer folder; resumable
    (`check`: see `embed_shards`; a `BuildStopped` it raises stops every process of `accelerator` alike).
    `precision`: "float32", "bf16" (autocast) or "auto" (`resolve_precision`: bf16 on a CUDA GPU, float32 on
    CPU), recorded with the buffer's settings.

    A complete buffer with the same fingerprints and settings is returned as is; an unfinished one is
    resumed. `accelerator` (an `accelerate.Accelerator` or `PartialState`) splits the shards over its
    processes; every process returns the loaded buffer. `corpus_fingerprint`: the corpus's own
    (`Corpus.fingerprint`), else the (id, text) pairs are hashed (a pass over every passage).
    """
    _check_build_arguments(dtype, shard_size, batch_size, len(ids))
    folder = Path(out_dir)
    precision = resolve_precision(precision, encoder.device if accelerator is None else accelerator.device)
    settings = build_settings(
        ids, texts, encoder, dtype, shard_size, corpus_fingerprint=corpus_fingerprint, precision=precision
    )
    rank, world = (0, 1) if accelerator is None else (accelerator.process_index, accelerator.num_processes)
    is_main = accelerator is None or accelerator.is_main_process
    if (folder / META_NAME).exists():
        return _load_complete_buffer(folder, settings)
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        _check_or_write_build(folder, settings, write=True)
    _wait_for_everyone(accelerator)
    _check_or_write_build(folder, settings, write=False)
    if accelerator is not None:
        encoder.to(accelerator.device)
    shards = shards_for_rank(settings["num_shards"], rank, world)
    options = {"batch_size": batch_size, "show_progress": show_progress and is_main, "check": check}
    _embed_together(ids, texts, encoder, folder, settings, shards, accelerator, **options)
    if is_main:
        finalize_buffer(folder, ids, settings)
    _wait_for_everyone(accelerator)
    return PassageBuffer.load(
        folder,
        encoder_fingerprint=settings["encoder_fingerprint"],
        corpus_fingerprint=settings["corpus_fingerprint"],
    )
