"""A trained checkpoint loaded for answering: its towers and reader on a device, and its config.

A checkpoint is a folder with `retriever/` (`DualEncoder.save_pretrained`) and `reader/`
(`FiDReader.save_pretrained`); `config.yaml` next to them (written by `rlm train`) supplies how many passages
the reader was trained to read. Its other parts load where they are used: `corrector/` with its h(B) index
(`rlm.inference.corrected_index`), `answer_policy.json` as an `AnswerPolicy` (`rlm.inference.answer_policy`).
`rlm evaluate`, the demo's `QAService`, `rlm calibrate` and the scripts all load through `load_checkpoint`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.errors import UserError
from rlm.inference.device import inference_device

if TYPE_CHECKING:
    from rlm.reader.fid import FiDReader
    from rlm.retriever.encoder import DualEncoder


def load_checkpoint(
    ckpt: str | os.PathLike | None,
    need_reader: bool = True,
    retriever_path: str | None = None,
    need_retriever: bool = True,
    device=None,
) -> tuple[DualEncoder | None, FiDReader | None, dict]:
    """(DualEncoder | None, FiDReader | None, config dict) from a checkpoint folder, the models on `device`
    (None: the accelerator when there is one, `inference_device`).

    `retriever_path` replaces `<ckpt>/retriever` (e.g. the packaged MiniLM, to evaluate the initial
    retriever); `ckpt` may then be None for retrieval-only runs. `need_retriever=False` skips loading it
    (closed-book or gold-passage reading).
    """
    import yaml

    from rlm.reader.fid import FiDReader
    from rlm.retriever.encoder import DualEncoder

    root = Path(ckpt) if ckpt is not None else None
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {root}")
    config = {}
    if root is not None and (root / "config.yaml").is_file():
        config = yaml.safe_load((root / "config.yaml").read_text()) or {}
    retriever = None
    if need_retriever and retriever_path is not None:
        retriever = DualEncoder.from_pretrained(str(retriever_path))
    elif need_retriever and root is not None:
        if not (root / "retriever").is_dir():
            raise FileNotFoundError(
                f"{root / 'retriever'} not found: a checkpoint holds retriever/ and reader/ "
                "(rlm train writes them); or pass --retriever PATH"
            )
        retriever = DualEncoder.from_pretrained(str(root / "retriever"))
    reader = None
    if need_reader:
        if root is None or not (root / "reader").is_dir():
            raise FileNotFoundError(
                f"{(root or Path('<ckpt>')) / 'reader'} not found: pass a checkpoint with a reader/ folder, "
                "or use --retrieval-only"
            )
        reader = FiDReader.from_pretrained(str(root / "reader"))
    device = inference_device(device)
    for model in (retriever, reader):
        if model is not None:
            model.to(device)
    return retriever, reader, config


def reader_passages_from_config(config: dict, default: int = 10) -> int:
    """How many retrieved passages the reader reads: `reader.num_passages`, else `strategy.k`, else default."""
    reader_cfg = config.get("reader") or {}
    strategy_cfg = config.get("strategy") or {}
    return int(reader_cfg.get("num_passages") or strategy_cfg.get("k") or default)


def corpus_from_config(config: dict, checkpoint: Path) -> Path:
    """The corpus a run trained on: `data.corpus`, else `<data.toy_world.dir>/corpus.jsonl`.

    A relative path (`runs/quickstart/toy_world`) is tried from the working directory, then from the run
    folder and each folder above it, so the demo also starts from outside the project root.
    """
    data = config.get("data") or {}
    if data.get("corpus"):
        raw = Path(data["corpus"])
    elif (data.get("toy_world") or {}).get("dir"):
        raw = Path(data["toy_world"]["dir"]) / "corpus.jsonl"
    else:
        raise UserError(
            f"{checkpoint / 'config.yaml'} names no corpus (data.corpus or data.toy_world.dir); pass --corpus PATH"
        )
    if raw.is_absolute() or raw.exists():
        return raw
    run_dir = checkpoint.resolve().parent
    for base in (run_dir, *run_dir.parents):
        if (base / raw).exists():
            return base / raw
    raise FileNotFoundError(
        f"corpus {raw} (from {checkpoint / 'config.yaml'}) not found from {Path.cwd()} or {run_dir}; "
        "pass --corpus PATH"
    )
