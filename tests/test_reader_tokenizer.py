"""Offline tokenizers for the reader: corpus-trained BPE and the packaged MiniLM WordPiece."""

import pytest

from reader.tokenizer import load_tokenizer, train_tokenizer

TEXTS = [
    "Alice Moreau was born in Lyon and works as a painter.",
    "Bob Tanaka was born in Osaka; he is a chemist.",
    "The city of Lyon lies on the Rhone.",
    "Osaka is a port city in Japan.",
] * 20


def test_bpe_special_tokens_eos_and_lossless_decoding(tmp_path):
    tok = train_tokenizer(TEXTS, vocab_size=400, save_dir=tmp_path / "tok")
    ids = {tok.pad_token_id, tok.eos_token_id, tok.unk_token_id}
    assert None not in ids and len(ids) == 3
    assert [tok.pad_token, tok.eos_token, tok.unk_token] == ["<pad>", "</s>", "<unk>"]
    enc = tok("Alice was born in Osaka.")["input_ids"]
    assert enc[-1] == tok.eos_token_id and enc.count(tok.eos_token_id) == 1
    assert tok.decode(enc, skip_special_tokens=True).strip() == "Alice was born in Osaka."
    # A word is the same tokens at the start of an answer and inside a passage, so it can be copied.
    alone = tok("Lyon", add_special_tokens=False)["input_ids"]
    inside = tok("born in Lyon", add_special_tokens=False)["input_ids"]
    assert inside[-len(alone) :] == alone

    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded("Bob is a chemist in Lyon")["input_ids"] == tok("Bob is a chemist in Lyon")["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_bpe_vocab_size_is_respected_and_too_small_refused():
    tok = train_tokenizer(TEXTS, vocab_size=300, min_frequency=1)
    assert len(tok) <= 300
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TEXTS, vocab_size=50)


def test_packaged_wordpiece_gets_sep_as_eos(minilm_path):
    tok = load_tokenizer(minilm_path)
    assert tok.eos_token == "[SEP]" and tok.eos_token_id == tok.sep_token_id
    assert tok.pad_token_id == 0
    assert (
        tok.decode(tok("where was alice born?")["input_ids"], skip_special_tokens=True)
        == "where was alice born?"
    )
