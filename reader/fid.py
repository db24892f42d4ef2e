"""Fusion-in-Decoder over any Hugging Face encoder-decoder (T5 by default).

The encoder reads each (question, passage) pair on its own, `[B*K, L]`; the encoded passages of a question
are concatenated to `[B, K*L]` and the decoder attends over all of them at once (Izacard & Grave, 2021).
The wrapped model is an ordinary HF seq2seq model: it is saved in the HF folder convention and opens with
`transformers.AutoModelForSeq2SeqLM.from_pretrained` alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from rlm.base.atomicio import atomic_directory, atomic_write_json
from rlm.base.evalmode import activation_checkpointing, eval_mode, set_activation_checkpointing
from rlm.reader.errors import InputError
from rlm.reader.formatting import DEFAULT_QUESTION_TEMPLATE, DEFAULT_TEMPLATE, FiDCollator, Passages
from rlm.reader.small_t5 import SmallT5Config, build_small_t5
from rlm.reader.tokenizer import load_tokenizer

FID_CONFIG_NAME = "fid_config.json"


@dataclass
class FiDConfig:
    """Our reader settings that the HF model config does not hold; saved as `fid_config.json`."""

    template: str = DEFAULT_TEMPLATE
    question_template: str = DEFAULT_QUESTION_TEMPLATE
    max_passage_length: int = 192
    max_answer_length: int = 32

    @classmethod
    def from_dict(cls, data: dict, source: str = "fid config") -> FiDConfig:
        """Build from a dict, refusing keys this version does not know (a typo must not pass silently)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{source}: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**data)


def _live_slots(flat_mask: torch.Tensor) -> torch.Tensor:
    """The indices of the rows of a `[N, L]` attention mask that attend to anything (slots holding text)."""
    return flat_mask.any(dim=1).nonzero().squeeze(1)


class FiDReader(torch.nn.Module):
    """A FiD reader: `.model` (any HF encoder-decoder), `.tokenizer` and `.config` (a `FiDConfig`).

    `gradient_checkpointing` trades compute for activation memory; `bf16` runs forward, generation and
    scoring under bfloat16 autocast (on CPU too). Both can be switched later with the methods of the same name.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: FiDConfig | None = None,
        gradient_checkpointing: bool = False,
        bf16: bool = False,
    ):
        super().__init__()
        if not model.config.is_encoder_decoder:
            raise InputError(f"FiD needs an encoder-decoder model, got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or FiDConfig()
        self.bf16 = bf16
        self.collator = FiDCollator(
            tokenizer,
            max_passage_length=self.config.max_passage_length,
            max_answer_length=self.config.max_answer_length,
            template=self.config.template,
            question_template=self.config.question_template,
        )
        if gradient_checkpointing:
            self.gradient_checkpointing_enable()

    # ---- construction and persistence -------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        dir_or_name: str | os.PathLike,
        gradient_checkpointing: bool = False,
        bf16: bool = False,
        **config_overrides,
    ) -> FiDReader:
        """Load a folder written by `save_pretrained`, or any HF seq2seq model name/folder (e.g. `t5-base`).

        `fid_config.json` is read when present; `config_overrides` (e.g. `max_passage_length=256`) win over it.
        """
        path = str(dir_or_name)
        model = AutoModelForSeq2SeqLM.from_pretrained(path)
        tokenizer = load_tokenizer(path)
        config = FiDConfig()
        cfg_file = Path(path) / FID_CONFIG_NAME
        if cfg_file.is_file():
            try:
                settings = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise InputError(f"{cfg_file}: not valid JSON ({e})") from e
            settings.pop("format_version", None)
            config = FiDConfig.from_dict(settings, source=str(cfg_file))
        if config_overrides:
            merged = {**dataclasses.asdict(config), **config_overrides}
            config = FiDConfig.from_dict(merged, source="FiDReader.from_pretrained overrides")
        return cls(model, tokenizer, config, gradient_checkpointing=gradient_checkpointing, bf16=bf16)

    @classmethod
    def from_config(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        model_config: SmallT5Config | None = None,
        fid_config: FiDConfig | None = None,
        seed: int | None = None,
        gradient_checkpointing: bool = False,
        bf16: bool = False,
        **t5_overrides,
    ) -> FiDReader:
        """A small random-init T5 reader for `tokenizer`; `t5_overrides` (e.g. `d_model=256`) adjust the config."""
        model_config = dataclasses.replace(model_config or SmallT5Config(), **t5_overrides)
        model = build_small_t5(tokenizer, model_config, seed=seed)
        return cls(model, tokenizer, fid_config, gradient_checkpointing=gradient_checkpointing, bf16=bf16)

    def save_pretrained(self, save_dir: str | os.PathLike) -> None:
        """Write model (safetensors), tokenizer and `fid_config.json` to `save_dir`, atomically."""
        with atomic_directory(save_dir) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            atomic_write_json(
                tmp / FID_CONFIG_NAME,
                {"format_version": 1, **dataclasses.asdict(self.config)},
                sort_keys=True,
            )

    # ---- switches ----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    def gradient_checkpointing_enable(self) -> None:
        """Recompute activations in the backward pass (HF gradient checkpointing, non-reentrant)."""
        set_activation_checkpointing(self.model, True)

    def gradient_checkpointing_disable(self) -> None:
        """Keep activations for the backward pass (the default)."""
        set_activation_checkpointing(self.model, False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether activations are recomputed in the backward pass."""
        return activation_checkpointing(self.model)

    def autocast(self, enabled: bool | None = None) -> contextlib.AbstractContextManager:
        """A bfloat16 autocast context on the model's device (CPU included); `enabled=None` follows `.bf16`.

        When disabled it is a no-op rather than `autocast(enabled=False)`, so an autocast opened by the caller
        (e.g. accelerate's `mixed_precision="bf16"`) stays in force.
        """
        enabled = self.bf16 if enabled is None else enabled
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # ---- the model -----------------------------------------------------------------------------------------

    def _on_device(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # One move per entry point (as HF's Trainer does): callers hand in CPU batches from the collator,
        # and a CPU tensor meeting GPU weights fails deep inside the model.
        # Without waiting when the collator's tensors are in page-locked memory (a background thread pins them).
        device = self.device
        return tuple(None if t is None else t.to(device, non_blocking=True) for t in tensors)

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, live_slots: torch.Tensor | None = None
    ) -> tuple[BaseModelOutput, torch.Tensor]:
        """Encode `[B, K, L]` pairs one by one and fuse them: returns hidden states `[B, K*L, H]` and mask `[B, K*L]`.

        Fully masked slots (missing passages) are not run through the encoder; their states are zeros and
        their mask is zero, so they influence nothing. `live_slots`: the flat indices of the other slots, found
        where the mask was made (`forward` finds them in the host's copy); None: found here, which reads the
        device.
        """
        if input_ids.dim() != 3 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"expected input_ids and attention_mask of shape [B, K, L], got {tuple(input_ids.shape)} "
                f"and {tuple(attention_mask.shape)}"
            )
        batch, slots, length = input_ids.shape
        flat_ids = input_ids.reshape(batch * slots, length)
        flat_mask = attention_mask.reshape(batch * slots, length)
        if live_slots is None:
            live_slots = _live_slots(flat_mask)
        encoder = self.model.get_encoder()
        if live_slots.numel() == batch * slots:
            hidden = encoder(input_ids=flat_ids, attention_mask=flat_mask, return_dict=True).last_hidden_state
        else:
            live = live_slots.to(flat_ids.device, non_blocking=True)
            states = encoder(input_ids=flat_ids[live], attention_mask=flat_mask[live], return_dict=True)
            live_hidden = states.last_hidden_state
            hidden = live_hidden.new_zeros(batch * slots, length, live_hidden.shape[-1])
            hidden[live] = live_hidden
        hidden = hidden.reshape(batch, slots * length, -1)
        return BaseModelOutput(last_hidden_state=hidden), attention_mask.reshape(batch, slots * length)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
        passage_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
    ) -> Seq2SeqLMOutput:
        """Teacher-forced FiD pass; `.loss` is the mean answer-token NLL when `labels [B, T]` are given.

        `passage_mask` is accepted so a collated batch can be passed as `reader(**batch)`; the attention mask
        already carries it. Tensors may come from anywhere (the collator makes them on CPU); they are moved to
        the reader's device here.
        """
        # Which slots hold text, from the mask where it was made (a CPU tensor: nothing waits for the GPU).
        live_slots = _live_slots(attention_mask.reshape(-1, attention_mask.shape[-1]))
        input_ids, attention_mask, labels, decoder_input_ids = self._on_device(
            input_ids, attention_mask, labels, decoder_input_ids
        )
        with self.autocast():
            encoder_outputs, fused_mask = self.encode(input_ids, attention_mask, live_slots)
            return self.model(
                encoder_outputs=encoder_outputs,
                attention_mask=fused_mask,
                labels=labels,
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
                return_dict=True,
            )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        **generate_kwargs,
    ) -> torch.LongTensor:
        """Batched HF generation (greedy, or beam search with `num_beams > 1`) over the fused passages.

        The inputs are moved to the reader's device; the returned token ids are on it.
        """
        live_slots = _live_slots(attention_mask.reshape(-1, attention_mask.shape[-1]))
        input_ids, attention_mask = self._on_device(input_ids, attention_mask)
        with self.autocast():
            encoder_outputs, fused_mask = self.encode(input_ids, attention_mask, live_slots)
            return self.model.generate(
                encoder_outputs=encoder_outputs,
                attention_mask=fused_mask,
                max_new_tokens=max_new_tokens or self.config.max_answer_length,
                num_beams=num_beams,
                **generate_kwargs,
            )

    def answer(
        self,
        questions: Sequence[str],
        passages: Passages,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        batch_size: int | None = None,
    ) -> list[str]:
        """Answer each question from its (title, text) passages; empty passage lists answer closed book."""
        return [a for a, _ in self._answer(questions, passages, max_new_tokens, num_beams, batch_size, False)]

    def answer_with_confidence(
        self,
        questions: Sequence[str],
        passages: Passages,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        batch_size: int | None = None,
    ) -> list[tuple[str, float]]:
        """`answer`, each with the reader's probability of the answer it generated: prod_t P(a_t | a_<t, x, S_x)
        over the answer's tokens and its end-of-sequence token (the sequence probability; low means the reader
        itself doubts the answer)."""
        return self._answer(questions, passages, max_new_tokens, num_beams, batch_size, True)

    def _answer(self, questions, passages, max_new_tokens, num_beams, batch_size, confidence: bool):
        with eval_mode(self):
            step = batch_size or max(len(questions), 1)
            answers: list[tuple[str, float]] = []
            for start in range(0, len(questions), step):
                batch = self.collator(questions[start : start + step], passages[start : start + step])
                out = self.generate(
                    batch["input_ids"],
                    batch["attention_mask"],
                    max_new_tokens=max_new_tokens,
                    num_beams=num_beams,
                    output_scores=confidence,
                    return_dict_in_generate=True,
                )
                texts = [
                    t.strip() for t in self.tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
                ]
                probs = self._sequence_probabilities(out) if confidence else [float("nan")] * len(texts)
                answers.extend(zip(texts, probs, strict=True))
            return answers

    def _sequence_probabilities(self, out) -> list[float]:
        """exp(sum of the generated tokens' log-probabilities up to and including the first end-of-sequence)."""
        beams = getattr(out, "beam_indices", None)
        logp = self.model.compute_transition_scores(
            out.sequences, out.scores, beams, normalize_logits=beams is None
        ).float()
        generated = out.sequences[:, -logp.shape[1] :]
        eos_ids = self.model.generation_config.eos_token_id
        eos_ids = torch.tensor(eos_ids if isinstance(eos_ids, list) else [eos_ids], device=generated.device)
        eos = torch.isin(generated, eos_ids).int()
        upto_eos = (eos.cumsum(dim=1) - eos) == 0  # tokens before the first EOS, and the EOS itself
        if beams is not None:
            upto_eos &= beams[:, : logp.shape[1]] >= 0  # beam search pads finished hypotheses with -1
        logp = torch.where(upto_eos & torch.isfinite(logp), logp, torch.zeros_like(logp))
        return logp.sum(dim=1).exp().tolist()
