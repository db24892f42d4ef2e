"""A FiD reader whose encoder starts from pretrained weights (e.g. the packaged MiniLM) and whose small
decoder is trained from scratch: a cheap way to a reader that reads, offline, when no pretrained T5 exists.

The result is a plain `transformers.EncoderDecoderModel` (BERT-style encoder + BERT decoder with
cross-attention), so it saves and loads with `AutoModelForSeq2SeqLM` like any HF seq2seq model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoModel, BertConfig, BertLMHeadModel, EncoderDecoderModel, PreTrainedTokenizerBase

from rlm.reader.errors import InputError
from rlm.reader.tokenizer import load_tokenizer


@dataclass
class WarmStartConfig:
    """How much of the pretrained encoder to keep and how big the fresh decoder is.

    `encoder_layers=None` keeps every pretrained layer; a smaller number keeps the first ones only (cheaper
    per passage). Decoder sizes default to the encoder's width, heads and feed-forward size.
    """

    encoder_layers: int | None = None
    decoder_layers: int = 2
    decoder_heads: int | None = None
    decoder_ff: int | None = None
    decoder_dropout: float = 0.1
    copy_word_embeddings: bool = True  # start the decoder's token embeddings from the encoder's
    # Keep the pretrained token embeddings fixed, in the encoder and (when copied) in the decoder, whose
    # output layer is tied to them: the answer is then scored against the pretrained vectors of the tokens
    # the encoder read, and the optimizer skips the two vocabulary-sized matrices (most of the parameters).
    freeze_embeddings: bool = False


def build_warm_started_encoder_decoder(
    encoder_path: str | os.PathLike,
    config: WarmStartConfig | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int | None = None,
) -> tuple[EncoderDecoderModel, PreTrainedTokenizerBase]:
    """Pretrained encoder from `encoder_path` (a BERT-family folder or name) + a randomly initialised decoder.

    Returns the model and the encoder's tokenizer (its `[CLS]` starts decoding, `[SEP]` ends answers).
    Wrap with `rlm.reader.fid.FiDReader(model, tokenizer)`.
    """
    config = config or WarmStartConfig()
    tokenizer = tokenizer or load_tokenizer(encoder_path)
    start_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.pad_token_id
    encoder = AutoModel.from_pretrained(str(encoder_path))
    enc_cfg = encoder.config
    if config.encoder_layers is not None:
        total = len(encoder.encoder.layer)
        if not 1 <= config.encoder_layers <= total:
            raise InputError(f"encoder_layers={config.encoder_layers}; {encoder_path} has {total} layers")
        encoder.encoder.layer = encoder.encoder.layer[: config.encoder_layers]
        enc_cfg.num_hidden_layers = config.encoder_layers

    decoder_cfg = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=enc_cfg.hidden_size,
        num_hidden_layers=config.decoder_layers,
        num_attention_heads=config.decoder_heads or enc_cfg.num_attention_heads,
        intermediate_size=config.decoder_ff or enc_cfg.intermediate_size,
        hidden_dropout_prob=config.decoder_dropout,
        attention_probs_dropout_prob=config.decoder_dropout,
        max_position_embeddings=enc_cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        is_decoder=True,
        add_cross_attention=True,
    )
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        decoder = BertLMHeadModel(decoder_cfg)
    if config.copy_word_embeddings:
        source = encoder.get_input_embeddings().weight
        if source.shape == decoder.get_input_embeddings().weight.shape:
            with torch.no_grad():
                decoder.get_input_embeddings().weight.copy_(source)

    if config.freeze_embeddings:
        encoder.get_input_embeddings().weight.requires_grad_(False)
        if config.copy_word_embeddings:
            decoder.get_input_embeddings().weight.requires_grad_(False)

    model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
    for cfg in (model.config, model.generation_config):
        cfg.decoder_start_token_id = start_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
