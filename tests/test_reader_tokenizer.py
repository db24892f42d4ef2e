"""Offline tokenizers for the reader: corpus-trained BPE and the packaged MiniLM WordPiece."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlm.reader.tokenizer import load_tokenizer, train_tokenizer

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


def test_a_save_that_fails_half_way_leaves_no_tokenizer_folder(tmp_path, monkeypatch):
    """A run finds its tokenizer by `tokenizer.json`: a half-written folder must never sit at `save_dir`."""
    from transformers import PreTrainedTokenizerFast

    def save_then_crash(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        train_tokenizer(TEXTS, vocab_size=400, save_dir=tmp_path / "tok")
    assert list(tmp_path.iterdir()) == []


class ThreadProcess:
    """One process of a run, played by a thread: accelerate's `is_main_process` and `wait_for_everyone`."""

    def __init__(self, index: int, barrier: threading.Barrier):
        self.is_main_process, self.barrier = index == 0, barrier

    def wait_for_everyone(self) -> None:
        self.barrier.wait(timeout=120)


def test_the_runs_tokenizer_is_trained_and_written_by_the_main_process_alone(tmp_path, monkeypatch):
    from rlm import components as setup
    from rlm.config import load_config
    from rlm.data.qa import QAExample

    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "reader.vocab_size=400"])
    corpus = [SimpleNamespace(title=text.split()[0], text=text) for text in TEXTS]
    examples = [QAExample("q0", "Where was Alice Moreau born?", ["Lyon"], [])]
    trained_by = []

    def train_slowly(*args, **kwargs):
        trained_by.append(threading.current_thread().name)
        time.sleep(0.5)  # the others start before it is written: they must wait, not read half a folder
        return train_tokenizer(*args, **kwargs)

    monkeypatch.setattr(setup, "train_tokenizer", train_slowly)
    barrier = threading.Barrier(3)

    def process(index: int):
        threading.current_thread().name = f"rank{index}"
        return setup.reader_tokenizer(cfg, corpus, examples, ThreadProcess(index, barrier))

    with ThreadPoolExecutor(3) as pool:
        tokenizers = list(pool.map(process, range(3)))
    assert trained_by == ["rank0"]
    assert all(tok.get_vocab() == tokenizers[0].get_vocab() for tok in tokenizers)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["tokenizer"]  # no temporary left beside it
    # A resumed run (any process) loads it and trains nothing.
    again = setup.reader_tokenizer(cfg, corpus, examples)
    assert trained_by == ["rank0"] and again.get_vocab() == tokenizers[0].get_vocab()
