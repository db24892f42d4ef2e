"""A small randomly initialised T5 for the offline reader, sized by a plain dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedTokenizerBase, T5Config, T5ForConditionalGeneration

from rlm.reader.errors import InputError


@dataclass
class SmallT5Config:
    """Architecture of the offline reader; the vocabulary and special-token ids come from the tokenizer.

    The default (d_model 192, 3+3 layers, ~2.9M parameters without the embeddings) trains from scratch on a
    2-core CPU; see docs/reader.md for its speed and memory.
    """

    d_model: int = 192
    d_ff: int = 768
    num_layers: int = 3
    num_decoder_layers: int | None = None
    num_heads: int = 4
    d_kv: int | None = None  # None: d_model // num_heads
    dropout_rate: float = 0.1
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward_proj: str = "relu"

    def to_t5_config(self, tokenizer: PreTrainedTokenizerBase) -> T5Config:
        """The transformers `T5Config`, with vocabulary size and pad/eos/decoder-start ids from `tokenizer`."""
        if self.d_kv is None and self.d_model % self.num_heads:
            raise InputError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; set d_kv"
            )
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer needs pad and eos tokens; load it with rlm.reader.tokenizer.load_tokenizer"
            )
        fields = dataclasses.asdict(self)
        fields["d_kv"] = self.d_kv or self.d_model // self.num_heads
        return T5Config(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            # T5 convention: the decoder starts from the pad token.
            decoder_start_token_id=tokenizer.pad_token_id,
            **fields,
        )


def build_small_t5(
    tokenizer: PreTrainedTokenizerBase, config: SmallT5Config | None = None, seed: int | None = None
) -> T5ForConditionalGeneration:
    """A randomly initialised `T5ForConditionalGeneration` matching `tokenizer`, ready for HF `generate`."""
    import torch

    t5_config = (config or SmallT5Config()).to_t5_config(tokenizer)
    # A private RNG stream when seeded, so building a reader does not reset the caller's global seed.
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = T5ForConditionalGeneration(t5_config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=t5_config.decoder_start_token_id,
        pad_token_id=t5_config.pad_token_id,
        eos_token_id=t5_config.eos_token_id,
    )
    return model
