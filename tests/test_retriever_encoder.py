"""Dual encoder: the sentence-transformers layout is real (sentence-transformers itself reads our folders)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from rlm.retriever.encoder import DualEncoder, SentenceEncoder, default_retriever_path

TEXTS = [
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest.",
    "a",
    "Photosynthesis converts light energy into chemical energy in plants.",
]


@pytest.fixture(scope="module")
def tiny_gtr(minilm_path) -> SentenceEncoder:
    """A random-init GTR: T5 encoder + Dense (no bias, identity), with MiniLM's tokenizer for its vocabulary."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0
    )
    model = T5EncoderModel(config).eval()
    dense = nn.Linear(32, 24, bias=False)
    return SentenceEncoder(model, tokenizer, dense=dense, dense_activation="Identity", max_length=64)


def test_tiny_gtr_roundtrip_and_sentence_transformers_reads_it(tiny_gtr, tmp_path):
    out = tmp_path / "gtr"
    tiny_gtr.save_pretrained(out)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Dense", "3_Normalize"]
    assert (out / "2_Dense" / "model.safetensors").exists() and (out / "model.safetensors").exists()

    expected = tiny_gtr.encode(TEXTS)
    assert expected.shape == (4, 24)
    torch.testing.assert_close(expected.norm(dim=-1), torch.ones(4))

    reloaded = SentenceEncoder.from_pretrained(str(out), max_length=64)
    assert type(reloaded.model).__name__ == "T5EncoderModel"
    assert reloaded.dim == 24 and reloaded.fingerprint() == tiny_gtr.fingerprint()
    torch.testing.assert_close(reloaded.encode(TEXTS), expected, atol=1e-6, rtol=0)

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(out), device="cpu")
    theirs = torch.from_numpy(st.encode(TEXTS, normalize_embeddings=True))
    torch.testing.assert_close(theirs, expected, atol=1e-5, rtol=0)


def test_packaged_minilm_matches_sentence_transformers(minilm_path):
    ours = SentenceEncoder.from_pretrained(minilm_path)
    assert ours.dim == 384 and ours.dense is None
    mine = ours.encode(TEXTS, batch_size=3)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_path, device="cpu")
    theirs = torch.from_numpy(st.encode(TEXTS, normalize_embeddings=True))
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert default_retriever_path() == minilm_path


def test_encode_matches_forward_with_grad_and_keeps_mode(tiny_gtr):
    tiny_gtr.train()
    no_grad = tiny_gtr.encode(TEXTS)
    assert tiny_gtr.training, "encode must restore train mode"
    tiny_gtr.eval()
    with_grad = tiny_gtr.embed_texts(TEXTS)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad.detach(), no_grad, atol=1e-6, rtol=0)


def test_length_buckets_give_the_one_pass_embeddings_and_gradients(tiny_gtr):
    """Training encodes S_x in length buckets; the result and the gradient must be those of one padded pass."""
    texts = [TEXTS[i % len(TEXTS)] + " more" * (i % 5) for i in range(11)]  # mixed lengths, unsorted
    tiny_gtr.eval()

    def run(bucket_size):
        tiny_gtr.zero_grad(set_to_none=True)
        out = tiny_gtr.embed_texts(texts, bucket_size=bucket_size)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), tiny_gtr.dense.weight.grad.clone()

    one_pass, grad_one = run(None)
    bucketed, grad_bucketed = run(3)
    torch.testing.assert_close(bucketed, one_pass, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_bucketed, grad_one, atol=1e-5, rtol=1e-4)
    tiny_gtr.zero_grad(set_to_none=True)


def test_unpadded_token_rows_pad_back_to_what_tokenize_gives(tiny_gtr):
    """The buffer build tokenizes a shard once and pads each batch itself: it must feed the tower exactly the
    ids and mask `tokenize` would, on either padding side, for any subset of rows."""
    import copy

    long_text = " ".join(["word"] * 200)  # truncated to max_length
    texts = [*TEXTS, long_text, ""]
    rows = tiny_gtr.tokenize_unpadded(texts)
    assert [r.dtype for r in rows] == [np.int32] * len(texts) and len(rows[-2]) == tiny_gtr.max_length
    for side in ("right", "left"):
        tower = copy.copy(tiny_gtr)
        tower.tokenizer = copy.deepcopy(tiny_gtr.tokenizer)
        tower.tokenizer.padding_side = side
        for subset in ([0, 1, 2, 3, 4, 5], [2, 5], [1]):
            ours = tower.pad_token_rows([rows[i] for i in subset])
            theirs = tower.tokenize([texts[i] for i in subset])
            assert ours.keys() == theirs.keys()
            for key in ours:
                assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), (
                    side,
                    key,
                )


def test_fingerprint_changes_with_weights(tiny_gtr, tmp_path):
    tiny_gtr.save_pretrained(tmp_path / "a")
    other = SentenceEncoder.from_pretrained(str(tmp_path / "a"), max_length=64)
    before = other.fingerprint()
    with torch.no_grad():
        other.dense.weight[0, 0] += 1.0
    assert other.fingerprint() != before
    assert SentenceEncoder.from_pretrained(str(tmp_path / "a"), max_length=32).fingerprint() != before


def test_dual_encoder_separate_shared_and_saved(tiny_gtr, tmp_path):
    tiny_gtr.save_pretrained(tmp_path / "tower")
    dual = DualEncoder.from_pretrained(str(tmp_path / "tower"), max_length=64)
    assert not dual.shared and dual.query_tower is not dual.passage_tower
    q = dual.encode_queries(TEXTS[:2])
    p = dual.encode_passages(TEXTS[:2])
    assert q.requires_grad and p.requires_grad
    torch.testing.assert_close(q, p)  # same start, separate parameters
    (q * p).sum().backward()
    assert dual.query_tower.dense.weight.grad is not dual.passage_tower.dense.weight.grad

    with torch.no_grad():
        dual.passage_tower.dense.weight.mul_(2.0)
    dual.save_pretrained(tmp_path / "dual")
    again = DualEncoder.from_pretrained(str(tmp_path / "dual"), max_length=64)
    assert again.passage_tower.fingerprint() == dual.passage_tower.fingerprint()
    assert again.query_tower.fingerprint() == dual.query_tower.fingerprint()

    shared = DualEncoder.from_pretrained(str(tmp_path / "tower"), shared=True, max_length=64)
    assert shared.shared
    shared.save_pretrained(tmp_path / "shared")
    assert DualEncoder.from_pretrained(str(tmp_path / "shared")).shared
    n_params = sum(p.numel() for p in shared.parameters())
    assert n_params == sum(p.numel() for p in shared.query_tower.parameters())


def test_hub_name_offline_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local sentence-transformers folder"):
        SentenceEncoder.from_pretrained("sentence-transformers/this-model-is-not-cached-xyz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentenceEncoder.from_pretrained("/no/such/folder")


def test_light_query_tower_is_the_first_layers_and_saves_and_loads_as_such(minilm_path, tiny_gtr, tmp_path):
    """`retriever.query_path: layers:N` (DAFT's light query tower): the passage model's first N layers, the
    same pooling and normalisation; sentence-transformers reads the saved tower; the dual encoder reloads
    with the light query tower and the full passage tower."""
    full = SentenceEncoder.from_pretrained(minilm_path, max_length=32).eval()
    light = full.truncated(2).eval()
    assert (full.num_layers, light.num_layers) == (6, 2) and light.model.config.num_hidden_layers == 2
    batch = full.tokenize(TEXTS)
    with torch.no_grad():
        hidden = full.model(**batch, output_hidden_states=True).hidden_states[2]  # after layer 2
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        torch.testing.assert_close(light(**batch), expected, atol=1e-5, rtol=0)
    assert full.num_layers == 6  # the passage tower is untouched

    retriever = DualEncoder.from_towers(minilm_path, query_path="layers:2", max_length=32)
    assert (retriever.query_tower.num_layers, retriever.passage_tower.num_layers) == (2, 6)
    retriever.save_pretrained(tmp_path / "dual")
    again = DualEncoder.from_pretrained(str(tmp_path / "dual"), max_length=32)
    assert (again.query_tower.num_layers, again.passage_tower.num_layers) == (2, 6)
    torch.testing.assert_close(again.query_tower.encode(TEXTS), light.encode(TEXTS), atol=1e-5, rtol=0)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tmp_path / "dual" / "query_tower"), device="cpu")
    theirs = torch.from_numpy(st.encode(TEXTS, normalize_embeddings=True))
    torch.testing.assert_close(theirs, light.encode(TEXTS), atol=1e-5, rtol=0)

    # A T5 encoder (GTR) truncates through its block list.
    assert tiny_gtr.truncated(1).num_layers == 1 and tiny_gtr.num_layers == 2
    # Errors name the setting.
    with pytest.raises(ValueError, match="layers:7"):
        DualEncoder.from_towers(minilm_path, query_path="layers:7")
    with pytest.raises(ValueError, match="layers:N"):
        DualEncoder.from_towers(minilm_path, query_path="layers:two")
    with pytest.raises(ValueError, match="shared_towers"):
        DualEncoder.from_towers(minilm_path, query_path="layers:2", shared=True)
    tiny_gtr.save_pretrained(tmp_path / "gtr24")
    with pytest.raises(ValueError, match="24-dim"):
        DualEncoder.from_towers(minilm_path, query_path=str(tmp_path / "gtr24"))
