"""Answering from h(B): retrieval over the fixed buffer through the trained corrector, nothing re-embedded.

The paper re-embeds the corpus with the trained passage tower for inference. A run with a corrector already
has what selection used during training: the buffer B (the starting passage tower's embeddings, built once)
and h, trained so that <q, h(b_y)> tracks <q, g(y)> of the moving tower. `corrected_index` builds the faiss
index over h(B) instead: one pass of a small MLP over stored vectors in place of a pass of the passage tower
over every text. The query tower is the trained one, as during training.

The buffer is verified against the corpus (fingerprint: its rows are the corpus's passages, row for row) and
against the starting passage tower the run's config names (the one B was embedded with): a buffer from another
corpus or encoder is refused, not silently used.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlm.errors import UserError
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.index_spec import IndexSpec

CORRECTED_INDEX_CACHE = "corrected_index"


@dataclass
class CorrectedIndex:
    """The index over h(B) and what it took: rows corrected, seconds for h and for the index."""

    index: object  # rlm.retriever.index.PassageIndex
    buffer_dir: Path
    rows: int
    correct_s: float
    index_s: float


def run_buffer_dir(checkpoint: str | Path, buffer_dir: str | Path | None = None) -> Path:
    """The fixed buffer of the run that wrote `checkpoint`: `buffer_dir`, else its config's `buffer.dir`, else
    `<output_dir>/buffer` (as training placed it)."""
    if buffer_dir is not None:
        return Path(buffer_dir)
    from rlm.components import buffer_folder
    from rlm.config import load_config

    return buffer_folder(load_config(Path(checkpoint) / "config.yaml"))


class CorrectedRows(PassageBuffer):
    """h(B) read like a buffer and never held whole: every block `iter_chunks` yields and every row `rows`
    gathers goes through the corrector on its device when read, and lands on the host as float32. An index is
    built (`PassageIndex.from_buffer`: trained on a sample, added chunk by chunk) and tuned (`tune`: exact top-k
    by streaming) from it with the extra memory of one chunk, not 21M x D float32.

    Its `meta` keeps the buffer's corpus fingerprint only: the rows are not the stale encoder's, and an index of
    them must not claim to be. `correct_seconds` adds up the time spent in h."""

    def __init__(self, buffer: PassageBuffer, corrector):
        blocks = [block for _, block in buffer.iter_chunks(max(len(buffer), 1))]  # one view per shard
        meta = {key: buffer.meta[key] for key in ("count", "dim", "corpus_fingerprint") if key in buffer.meta}
        super().__init__(buffer.ids, blocks, meta)
        self.stale, self.corrector = buffer, corrector
        self.correct_seconds = 0.0

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def _corrected(self, block: torch.Tensor) -> torch.Tensor:
        weight = next(self.corrector.parameters())
        start = time.perf_counter()
        with torch.no_grad():
            out = self.corrector(block.to(weight.device, weight.dtype)).float().cpu()
        self.correct_seconds += time.perf_counter() - start
        return out

    @property
    def embeddings(self) -> torch.Tensor:
        raise TypeError("h(B) is never held whole: read it with iter_chunks or rows")

    def to(self, device, dtype=None) -> PassageBuffer:
        raise TypeError("h(B) runs on the corrector's device: move the corrector, not the rows")

    def iter_chunks(self, chunk_size: int):
        for offset, block in self.stale.iter_chunks(chunk_size):
            yield offset, self._corrected(block)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        return self._corrected(self.stale.rows(indices))


def corrected_index(
    checkpoint: str | Path,
    corpus,
    buffer_dir: str | Path | None = None,
    spec: IndexSpec | None = None,
    verify_encoder: bool = True,
    device=None,
    show_progress: bool = False,
    tune_k: int | None = None,
) -> CorrectedIndex:
    """A faiss index over h(B) for `corpus`, from the run of `checkpoint` (its `corrector/` and its buffer).

    `verify_encoder` rebuilds the run's starting retriever from its config to check B's encoder fingerprint
    (a few seconds for a base-size tower); the corpus fingerprint is always checked. h runs on `device` (None:
    the accelerator when there is one) and the index goes to the GPU with it (`rlm.inference.device.index_on_gpu`).
    `spec` (None: `IndexSpec()`, the one default): the index built from h(B) a chunk at a time (`CorrectedRows`),
    its search fixed or tuned for the spec's target recall against the exact top-k over h(B), at k = `tune_k`
    (None: the spec's; give the k the index will be searched at); on the device `spec.device` says (auto: with h).
    """
    from rlm.inference.device import index_on_gpu, inference_device
    from rlm.retriever.corrector import CorrectorNetwork
    from rlm.retriever.index import PROVENANCE_KEYS, PassageIndex

    spec = spec or IndexSpec()
    root = Path(checkpoint)
    if not (root / "corrector").is_dir():
        raise FileNotFoundError(
            f"{root / 'corrector'} not found: answering from h(B) needs a run trained with a corrector "
            "(strategy.name=corrector); other runs answer from the re-embedded corpus"
        )
    folder = run_buffer_dir(root, buffer_dir)
    encoder = _start_fingerprint(root) if verify_encoder else None
    try:
        buffer = PassageBuffer.load(
            folder, encoder_fingerprint=encoder, corpus_fingerprint=corpus.fingerprint
        )
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{err}; answering from h(B) reads the run's fixed buffer: pass its folder (--buffer DIR)"
        ) from None
    if len(buffer) != len(corpus):
        raise UserError(f"buffer {folder} has {len(buffer)} rows but the corpus has {len(corpus)}")
    _say_base_only(folder)
    device = inference_device(device)
    corrector = CorrectorNetwork.from_pretrained(root / "corrector").eval().to(device)
    if corrector.dim != buffer.dim:
        raise UserError(f"corrector of dimension {corrector.dim} does not fit buffer rows of {buffer.dim}")
    start = time.perf_counter()
    rows = CorrectedRows(buffer, corrector)
    use_gpu = index_on_gpu(device, spec.device)
    index = PassageIndex.from_buffer(rows, spec.factory, use_gpu=use_gpu, show_progress=show_progress)
    index.provenance = {k: buffer.meta[k] for k in PROVENANCE_KEYS if k in buffer.meta}  # g0's rows, then:
    index.provenance["corrector_fingerprint"], index.built_from = corrector_fingerprint(root), {}  # h; not B
    index.apply_search(spec, rows, k=tune_k)
    seconds = time.perf_counter() - start
    return CorrectedIndex(index, folder, len(buffer), rows.correct_seconds, seconds - rows.correct_seconds)


def _start_fingerprint(checkpoint: Path) -> str:
    """The fingerprint of the passage tower the run of `checkpoint` started from (rebuilt from its config)."""
    from rlm.components import starting_passage_tower

    return starting_passage_tower(checkpoint).fingerprint()


def _say_base_only(folder: Path) -> None:
    """Warn that the h(B) index answers from the base corpus when the buffer in `folder` holds corpus updates
    (`rlm corpus update --buffer`, for training): the index takes them by the same update of its own."""
    from rlm.data.buffer_edition import read_record

    record = read_record(folder)
    if record and record["updates"]:
        warnings.warn(
            f"buffer {folder} holds {len(record['updates'])} corpus update(s) applied for training; this index over "
            "h(B) answers from the base corpus: apply the same update to it with `rlm corpus update --index DIR "
            "--checkpoint ...` (after `--save-index DIR`)",
            stacklevel=3,
        )


def corrector_fingerprint(checkpoint: str | Path) -> str:
    """sha256 over the files of a checkpoint's corrector/ (its weights and config)."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in (Path(checkpoint) / "corrector").iterdir()):
        digest.update(name.encode())
        digest.update((Path(checkpoint) / "corrector" / name).read_bytes())
    return "corrector:sha256:" + digest.hexdigest()


def corrected_index_key(checkpoint: str | Path, buffer_meta: dict) -> str:
    """Cache key of an h(B) index: the corrector's weights and the buffer's encoder and corpus fingerprints."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in (Path(checkpoint) / "corrector").iterdir()):
        digest.update(name.encode())
        digest.update((Path(checkpoint) / "corrector" / name).read_bytes())
    digest.update(
        f"{buffer_meta.get('encoder_fingerprint')}:{buffer_meta.get('corpus_fingerprint')}".encode()
    )
    return digest.hexdigest()[:16]
