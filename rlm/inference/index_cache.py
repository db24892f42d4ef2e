"""The indexes a checkpoint answers from when it is given none, kept between starts in the cache folder.

`cached_index` is the index of a corpus under a checkpoint's passage tower, `cached_corrected_index` the one
over h(B) (the run's fixed buffer through its trained corrector); each is built once, as an `IndexSpec` says
(the one default every command shares), and saved in `<cache>/demo_index/<key>` (`rlm.cache`), never in the
checkpoint. The demo serves from them (`rlm.app.service.QAService`), and so does `rlm calibrate` through it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.inference.indexing import EMBED_LIMIT
from rlm.retriever.index_spec import IndexSpec

if TYPE_CHECKING:  # torch, transformers and faiss load with the checkpoint, not with this module
    from rlm.data.corpus import Corpus
    from rlm.retriever.encoder import SentenceEncoder
    from rlm.retriever.index import PassageIndex

# The cached indexes, in the cache folder; where earlier versions kept them inside the checkpoint, they are still
# read from there, never written.
INDEX_CACHE = "demo_index"


def index_key(
    tower_fingerprint: str, corpus_fingerprint: str, spec: IndexSpec | None = None, rows: int = 0
) -> str:
    """The cache key of the index of a corpus under a passage tower, as `spec` builds it over `rows` rows: the
    two fingerprints hashed, and, for a type other than Flat (the key earlier versions had), the type and
    how its search is tuned."""
    key = hashlib.sha256(f"{tower_fingerprint}:{corpus_fingerprint}".encode()).hexdigest()[:16]
    spec = spec or IndexSpec()
    factory = spec.factory_for(rows)
    if factory == "Flat":
        return key
    built = f"{factory}:{spec.target_recall}:{spec.tune_k}"
    return f"{key}-{hashlib.sha256(built.encode()).hexdigest()[:8]}"


def cached_index(
    cache: Path,
    passage_tower: SentenceEncoder,
    corpus: Corpus,
    show_progress: bool = False,
    bf16: bool = False,
    embed_limit: int = EMBED_LIMIT,
    checkpoint: Path | None = None,
    spec: IndexSpec | None = None,
) -> PassageIndex:
    """The faiss index of `corpus` under `passage_tower`, cached in `cache/demo_index/<key>` (atomic save), on
    the GPU when the tower is on one and faiss sees one (`spec.device` auto).

    Built by `rlm.inference.indexing.index_corpus` as `spec` says (None: `IndexSpec()`): the corpus embedded
    into float16 shards in a temporary folder, then indexed from them a chunk at a time, so no float32 copy of the
    corpus is held beside the index. The key (`index_key`) hashes the tower's fingerprint, `corpus.fingerprint`
    (the file's, from its scan) and, for an approximate type, the spec's; an index of passages embedded under
    bf16 (`bf16`) has a key of its own, since its rows differ. A spec's fixed search parameters apply to a
    cached index too. A corpus of more than `embed_limit` passages is refused before it is embedded
    (`check_embed_limit`): it gets a prebuilt index instead (`--index`). `checkpoint`: where an earlier version
    cached the index (its `demo_index/`), read when the cache has none, never written; and the folder the
    refusal's commands name."""
    from rlm.inference import indexing
    from rlm.inference.device import index_on_gpu

    spec = spec or IndexSpec()
    key = index_key(passage_tower.fingerprint(), corpus.fingerprint, spec, len(corpus))
    key += "-bf16" if bf16 else ""
    folder = cache / INDEX_CACHE / key
    use_gpu = index_on_gpu(passage_tower.device, spec.device)
    for cached in (folder, None if checkpoint is None else checkpoint / INDEX_CACHE / key):
        if cached is not None and (cached / "index.faiss").is_file():
            index = indexing.load_index_for(cached, corpus.ids, use_gpu=use_gpu)
            if spec.search_params:
                index.apply_search(spec, None)
            return index
    encoder = str(checkpoint / "retriever") if checkpoint is not None else "<checkpoint>/retriever"
    indexing.check_embed_limit(corpus, embed_limit, encoder, "rlm demo")
    precision = "bf16" if bf16 else "float32"
    index = indexing.index_corpus(
        passage_tower, corpus, spec=spec, use_gpu=use_gpu, precision=precision, show_progress=show_progress
    )
    _save_cached(index, folder)
    return index


def _save_cached(index: PassageIndex, folder: Path) -> None:
    """`index` saved in the cache `folder`; a cache that cannot be written is a warning, not an error: the
    demo still serves, and embeds again at its next start."""
    try:
        index.save(folder)
    except OSError as err:
        print(f"warning: could not cache the index in {folder} ({err}); it will be rebuilt on the next start")


def cached_corrected_index(
    root: Path,
    corpus: Corpus,
    buffer_path=None,
    device=None,
    show_progress: bool = False,
    cache: Path | None = None,
    spec: IndexSpec | None = None,
) -> PassageIndex:
    """The h(B) index of the run of checkpoint `root`, cached in `<cache>/demo_index/corrected-<key>` (None:
    `rlm.cache.cache_dir()`; an earlier version's in `root/demo_index/` is read, never written); h runs on
    `device` and the index goes to the GPU with it (`rlm.inference.corrected_index.corrected_index`), built as
    `spec` says (None: `IndexSpec()`)."""
    from rlm.cache import cache_dir
    from rlm.inference import indexing
    from rlm.inference.corrected_index import corrected_index, corrected_index_key, run_buffer_dir
    from rlm.inference.device import index_on_gpu

    spec = spec or IndexSpec()
    meta_file = run_buffer_dir(root, buffer_path) / "meta.json"
    folder = None
    if (root / "corrector").is_dir() and meta_file.is_file():
        name = f"corrected-{corrected_index_key(root, json.loads(meta_file.read_text()))}"
        name += index_key("", "", spec, len(corpus))[16:]  # the spec's part, for an approximate type
        folder = cache_dir(cache) / INDEX_CACHE / name
        for cached in (folder, root / INDEX_CACHE / name):
            if (cached / "index.faiss").is_file():
                return indexing.load_index_for(cached, corpus.ids, use_gpu=index_on_gpu(device, spec.device))
    # Verifies the buffer (and says what is missing).
    built = corrected_index(root, corpus, buffer_path, spec=spec, device=device, show_progress=show_progress)
    print(
        f"index over h(B): {built.rows:,} rows through the corrector in {built.correct_s:.2f} s, none re-embedded"
    )
    if folder is not None:
        _save_cached(built.index, folder)
    return built.index
