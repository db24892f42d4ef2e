"""The first steps of a run that every strategy trains alike: trained once, saved, and continued by each.

Algorithm 2's gold-passage steps (`schedule.gold_passage_steps`) train the reader alone on each question's
gold passages: no strategy selects anything yet, the retriever and the corrector have no gradient, and the
batches are a function of (seed, step). Runs whose configs differ only in `strategy.name` therefore compute the
very same thing for those steps. `save_prefix` writes what a run holds after them: the reader's weights and
tokenizer, the reader's AdamW moments, how far the lr schedule went, the step counters, the random state and the log lines.
`load_prefix` puts that into a freshly built run of any strategy that reads passages, which continues exactly
as if it had trained those steps itself (`tests/test_prefix.py` compares the two, loss by loss).

Files are JSON and safetensors (no pickle), written atomically as one folder.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlm.base.atomicio import atomic_directory, atomic_write_text
from rlm.config import TrainConfig, dump_config
from rlm.errors import UserError

FORMAT = 1
META = "prefix.json"
TENSORS = "state.safetensors"
LOG = "log.jsonl"


def shared_settings_key(cfg: TrainConfig) -> str:
    """A short hash of everything a run's figures depend on except its strategy and its folders: runs with the
    same key differ only in how they select passages."""
    neutral = replace(
        cfg,
        output_dir="",
        strategy=replace(cfg.strategy, name=""),
        buffer=replace(cfg.buffer, dir=None),
        data=replace(cfg.data, toy_world=replace(cfg.data.toy_world, dir="")),
    )
    return hashlib.sha256(dump_config(neutral).encode()).hexdigest()[:12]


def shared_steps(cfg: TrainConfig) -> int:
    """How many of the run's first optimizer steps are the same for every strategy: the gold-passage steps
    of Algorithm 2 (none for Algorithm 1, whose every step trains the retriever)."""
    return min(cfg.schedule.gold_passage_steps, cfg.optim.max_steps) if cfg.algorithm == 2 else 0


def _reader_group(optimizer) -> dict:
    groups = [g for g in optimizer.param_groups if g.get("name") == "reader"]
    if len(groups) != 1:
        raise ValueError("the optimizer has no 'reader' parameter group")
    return groups[0]


def _check_shareable(run) -> None:
    acc = run.accelerator
    if acc.num_processes > 1 or acc.state.deepspeed_plugin is not None:
        raise UserError("a shared prefix is saved and continued by one process without DeepSpeed")
    if not run.strategy.uses_passages:
        raise UserError(
            f"strategy {run.strategy.name!r} reads no passages, so its gold-passage steps differ from the "
            "other strategies': train it from the start"
        )


def save_prefix(run, folder: str | Path, log_path: Path | None = None) -> Path:
    """Write the prefix of `run` (stopped after `shared_steps(run.cfg)` optimizer steps) to `folder`."""
    _check_shareable(run)
    steps = shared_steps(run.cfg)
    if run.state.step != steps:
        raise ValueError(
            f"a prefix ends at step {steps} (the gold-passage steps); the run is at {run.state.step}"
        )
    reader = run.raw.reader
    # Copies, one per name: tied weights (T5's shared embeddings) would share memory, which safetensors refuses.
    tensors = {f"reader.{name}": t.detach().cpu().clone() for name, t in reader.state_dict().items()}
    moments = run.optimizer.state
    for i, param in enumerate(_reader_group(run.optimizer)["params"]):
        for name, value in moments.get(param, {}).items():
            tensors[f"adamw.{i}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    numpy_state = np.random.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.numpy"] = torch.from_numpy(numpy_state[1].astype(np.int64))
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    python_state = random.getstate()
    meta = {
        "format": FORMAT,
        "steps": steps,
        "settings": shared_settings_key(run.cfg),
        "scheduler_steps": run.scheduler.last_epoch,
        "train_state": run.state.state_dict(),
        "rng_numpy": [numpy_state[0], *map(float, numpy_state[2:])],
        "rng_python": [python_state[0], list(python_state[1]), python_state[2]],
    }
    tokenizer = Path(run.cfg.output_dir) / "tokenizer"
    with atomic_directory(folder) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        atomic_write_text(tmp / META, json.dumps(meta, indent=2) + "\n")
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, tmp / "tokenizer")
        lines = []
        if log_path is not None and log_path.is_file():
            lines = [line for line in log_path.read_text().splitlines() if line]
        atomic_write_text(tmp / LOG, "".join(line + "\n" for line in lines))
    return Path(folder)


def read_prefix_meta(folder: str | Path, cfg: TrainConfig) -> dict:
    """The prefix's description, refused unless it was trained with `cfg`'s settings (strategy aside)."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{folder}: not a shared prefix (no {META})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: unreadable ({err}); delete the folder to train the prefix again") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: prefix format {meta.get('format')!r}, this version reads {FORMAT}")
    if meta.get("settings") != shared_settings_key(cfg) or meta.get("steps") != shared_steps(cfg):
        raise UserError(
            f"{folder} was trained with other settings than this run's (only strategy.name and the folders "
            "may differ); delete it to train the prefix again"
        )
    return meta


def place_tokenizer(folder: str | Path, cfg: TrainConfig) -> None:
    """Give the run the prefix's tokenizer before its reader is built (the run would train the same one)."""
    source, target = Path(folder) / "tokenizer", Path(cfg.output_dir) / "tokenizer"
    if source.is_dir() and not (target / "tokenizer.json").exists():
        with atomic_directory(target) as tmp:
            shutil.copytree(source, tmp, dirs_exist_ok=True)


def load_prefix(run, folder: str | Path) -> None:
    """Continue `run` (just built, at step 0) from the prefix in `folder`: its states, and its log lines as the
    start of the run's `log.jsonl`. The run is a new one (its own tracker run) that records where it began."""
    _check_shareable(run)
    folder = Path(folder)
    meta = read_prefix_meta(folder, run.cfg)
    if run.state.step != 0:
        raise ValueError("a prefix starts a fresh run; this one has trained already")
    tensors = load_file(str(folder / TENSORS))
    reader = run.raw.reader
    weights = {name[len("reader.") :]: t for name, t in tensors.items() if name.startswith("reader.")}
    try:
        reader.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise UserError(
            f"{folder}: its reader does not fit this run's ({str(err).splitlines()[0]})"
        ) from None
    state, group = run.optimizer.state, _reader_group(run.optimizer)
    # As torch's own load_state_dict places them: moments beside the parameter, the step counter too for the
    # fused and capturable kernels, on the host otherwise.
    step_on_device = bool(group.get("fused") or group.get("capturable"))
    for i, param in enumerate(group["params"]):
        found = {n.split(".", 2)[2]: t for n, t in tensors.items() if n.startswith(f"adamw.{i}.")}
        if found:
            state[param] = {
                n: t.to(param.device) if n != "step" or step_on_device else t for n, t in found.items()
            }
    # The schedule advanced as the prefix's did (its parameter groups may differ from this run's: a stale run
    # has no corrector group), so every group gets the learning rate of this step.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
        for _ in range(int(meta["scheduler_steps"])):
            run.scheduler.step()
    run.state.load_state_dict(meta["train_state"])
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted(n for n in tensors if n.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[n] for n in cuda])
    name, pos, has_gauss, gauss = meta["rng_numpy"]
    np.random.set_state(
        (name, tensors["rng.numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), gauss)
    )
    version, internal, gauss_next = meta["rng_python"]
    random.setstate((version, tuple(internal), gauss_next))
    run.state.tracker_run_id, run.state.prefix = None, str(folder)
    lines = (folder / LOG).read_text().splitlines() if (folder / LOG).is_file() else []
    atomic_write_text(Path(run.cfg.output_dir) / "log.jsonl", "".join(line + "\n" for line in lines))
