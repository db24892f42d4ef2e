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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rlm.errors import UserError

CORRECTED_INDEX_CACHE = "corrected_index"


@dataclass
class CorrectedIndex:
    """The index over h(B) and what it took: rows corrected, seconds for h and for the index."""

    index: object  # retriever.index.PassageIndex
    buffer_dir: Path
    rows: int
    correct_s: float
    index_s: float


def run_buffer_dir(checkpoint: str | Path, buffer_dir: str | Path | None = None) -> Path:
    """The fixed buffer of the run that wrote `checkpoint`: `buffer_dir`, else its config's `buffer.dir`, else
    `<output_dir>/buffer` (as training placed it)."""
    if buffer_dir is not None:
        return Path(buffer_dir)
    from rlm.config import load_config

    cfg = load_config(Path(checkpoint) / "config.yaml")
    return Path(cfg.buffer.dir or Path(cfg.output_dir) / "buffer")


def corrected_rows(corrector, buffer, chunk_size: int = 65536, show_progress: bool = False) -> np.ndarray:
    """h(B) [N, D] float32 on the host, chunk by chunk on the corrector's device (the buffer stays
    memory-mapped; extra memory O(chunk x hidden))."""
    out = np.empty((len(buffer), buffer.dim), dtype=np.float32)
    weight = next(corrector.parameters())
    with torch.no_grad(), tqdm(total=len(buffer), desc="h(B)", unit="psg", disable=not show_progress) as bar:
        for offset, block in buffer.iter_chunks(chunk_size):
            rows = corrector(block.to(weight.device, weight.dtype))
            out[offset : offset + block.shape[0]] = rows.float().cpu().numpy()
            bar.update(block.shape[0])
    return out


def corrected_index(
    checkpoint: str | Path,
    corpus,
    buffer_dir: str | Path | None = None,
    factory: str = "Flat",
    verify_encoder: bool = True,
    device=None,
    show_progress: bool = False,
) -> CorrectedIndex:
    """A faiss index over h(B) for `corpus`, from the run of `checkpoint` (its `corrector/` and its buffer).

    `verify_encoder` rebuilds the run's starting retriever from its config to check B's encoder fingerprint
    (a few seconds for a base-size tower); the corpus fingerprint is always checked. h runs on `device` (None:
    the accelerator when there is one) and the index goes to the GPU with it (`rlm.inference.indexing.index_on_gpu`).
    """
    from retriever.buffer import PassageBuffer
    from retriever.corrector import CorrectorNetwork
    from retriever.index import PassageIndex
    from rlm.inference.evaluation import inference_device
    from rlm.inference.indexing import index_on_gpu

    root = Path(checkpoint)
    if not (root / "corrector").is_dir():
        raise FileNotFoundError(
            f"{root / 'corrector'} not found: answering from h(B) needs a run trained with a corrector "
            "(strategy.name=corrector); other runs answer from the re-embedded corpus"
        )
    folder = run_buffer_dir(root, buffer_dir)
    encoder = None
    if verify_encoder:
        from rlm.components import build_retriever
        from rlm.config import load_config

        encoder = build_retriever(load_config(root / "config.yaml")).passage_tower.fingerprint()
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
    device = inference_device(device)
    corrector = CorrectorNetwork.from_pretrained(root / "corrector").eval().to(device)
    if corrector.dim != buffer.dim:
        raise UserError(f"corrector of dimension {corrector.dim} does not fit buffer rows of {buffer.dim}")
    start = time.perf_counter()
    vectors = corrected_rows(corrector, buffer, show_progress=show_progress)
    correct_s = time.perf_counter() - start
    start = time.perf_counter()
    index = PassageIndex.build(
        vectors, corpus.ids, factory=factory, use_gpu=index_on_gpu(device), show_progress=show_progress
    )
    return CorrectedIndex(index, folder, len(buffer), correct_s, time.perf_counter() - start)


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
