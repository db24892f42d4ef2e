"""Start-up cost: the corpus fingerprint comes from the corpus scan, so a training start or a demo start
reads no passage for it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from rlm.data import corpus as corpus_module
from rlm.data.corpus import load_corpus
from rlm.retriever.encoder import SentenceEncoder
from rlm.retriever.ids import IdSequence

N = 30


@pytest.fixture(scope="module")
def tower(minilm_path, tmp_path_factory) -> SentenceEncoder:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    encoder = SentenceEncoder(
        T5EncoderModel(config), tokenizer, dense=nn.Linear(32, 16, bias=False), max_length=32
    )
    folder = tmp_path_factory.mktemp("tower") / "t"
    encoder.save_pretrained(folder)
    return SentenceEncoder.from_pretrained(str(folder), max_length=32)


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"passage {i} " * (1 + i % 5)}) for i in range(N)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def passage_reads(monkeypatch):
    """How many passages were read from a corpus file after the scan (the old fingerprint reads all)."""
    reads = []
    original = corpus_module.Corpus.__getitem__

    def counting(self, i):
        reads.append(i)
        return original(self, i)

    monkeypatch.setattr(corpus_module.Corpus, "__getitem__", counting)
    return reads


def _cfg(tmp_path):
    buffer = SimpleNamespace(dir=str(tmp_path / "buffer"), batch_size=8, dtype="float16")
    return SimpleNamespace(buffer=buffer, output_dir=str(tmp_path / "run"))


def test_training_start_reads_no_passage_for_the_fingerprint(tower, corpus_file, tmp_path, passage_reads):
    from rlm.components import load_or_build_buffer

    cfg, retriever = _cfg(tmp_path), SimpleNamespace(passage_tower=tower)
    built = load_or_build_buffer(cfg, retriever, load_corpus(corpus_file))
    assert len(passage_reads) == N, "building embeds each passage once and hashes none"
    assert built.meta["corpus_fingerprint"] == load_corpus(corpus_file).fingerprint
    passage_reads.clear()
    loaded = load_or_build_buffer(cfg, retriever, load_corpus(corpus_file))
    assert passage_reads == [] and isinstance(loaded.ids, IdSequence)
    # An edited corpus (one byte of one text) is refused without reading its passages either.
    corpus_file.write_text(corpus_file.read_text().replace("passage 7 ", "passage 8 ", 1))
    with pytest.raises(ValueError, match="corpus fingerprint"):
        load_or_build_buffer(cfg, retriever, load_corpus(corpus_file))
    assert passage_reads == []


def test_demo_index_key_uses_the_file_fingerprint(tower, corpus_file, tmp_path, monkeypatch):
    from rlm.inference import indexing
    from rlm.inference.index_cache import INDEX_CACHE, cached_index, index_key

    corpus = load_corpus(corpus_file)
    root = tmp_path / "ckpt"
    built = cached_index(root, tower, corpus)
    key = index_key(tower.fingerprint(), corpus.fingerprint)
    assert [p.name for p in (root / INDEX_CACHE).iterdir()] == [key]

    def no_embedding(*args, **kwargs):
        raise AssertionError("the cached index must be reused, not rebuilt")

    monkeypatch.setattr(indexing, "index_corpus", no_embedding)
    index = cached_index(root, tower, load_corpus(corpus_file))
    assert index.ids == corpus.ids and isinstance(index.ids, IdSequence) and index.ntotal == N
    np.testing.assert_allclose(index.index.reconstruct(3), built.index.reconstruct(3))
