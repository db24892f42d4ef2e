"""The run folder and its checkpoints: what a day-long job meets between steps.

A run folder holds one run. Starting a run where one already is needs `--resume` (continue it) or
`--overwrite` (start over: the old run's checkpoints, log, final models and refreshes are removed first), so a
re-queued command never mixes two runs, and pruning only ever sees the current run's checkpoints.

A checkpoint `checkpoints/step_NNNNNNN/` is accelerate's `save_state` (models as safetensors, optimizer and
RNG states) plus the project's own state as JSON and safetensors (`state.json`, `state.safetensors`: the
counters, the lr schedule, the strategy), the config it was trained with (`config.yaml`) and a manifest of
every file's size and SHA-256 (`manifest.json`), all written into a temporary folder that is renamed into
place once complete. On resume the newest checkpoint whose files match their manifest is used (an older
complete one when the newest is torn, with one line saying so), every pickle accelerate or DeepSpeed will
read is checked for globals beyond tensors, numpy's RNG state and (in a DeepSpeed checkpoint) DeepSpeed's
optimizer-state classes before anything is loaded, then every file is read with
`torch.load(weights_only=True)` and those classes as torch safe globals (a planted pickle is refused, never
run), and the settings that decide data order, schedule and model shapes are compared with the checkpoint's
own: a change is refused by name unless allowed (`--allow-changed optim.max_steps`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import importlib.metadata
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from rlm.base.atomicio import atomic_write_json, atomic_write_text
from rlm.config import TrainConfig, renamed_settings, to_dict
from rlm.errors import UserError

CHECKPOINT_PREFIX = "step_"
MANIFEST = "manifest.json"
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
CONFIG = "config.yaml"
# What marks a folder as holding a run, and what `--overwrite` removes (the buffer and tokenizer stay: they
# are verified against the corpus and config whenever they are used).
RUN_PARTS = ("checkpoints", "log.jsonl", "final", "summary.json", "refresh", "rlm")
# Settings that may change between a checkpoint and its resume: how the run is watched and saved, not what
# it trains (every other key must match, or be named in --allow-changed).
OPERATIONAL_KEYS = frozenset(
    {
        "output_dir",
        "log_every",
        "eval_every",
        "eval_selection",
        "save_every",
        "keep_last",
        "max_bad_batches",
        "dist_timeout_s",
        "gradient_checkpointing",
        "retriever.gradient_checkpointing",
        "buffer.batch_size",
        "buffer.placement",
        "buffer.chunk_size",
        "strategy.cache_corrected_mb",
        "strategy.two_stage.overlap_every",
        "data.max_dev_examples",
    }
)
# The classes DeepSpeed's ZeRO optimizer states pickle: a dataclass, an enum and its loss scaler, whose
# constructors run nothing but their own fields. Imported from the installed deepspeed whenever a DeepSpeed
# checkpoint is read, so a release that moves or renames one stops the resume with that class's name.
DEEPSPEED_CHECKPOINT_CLASSES = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)
PICKLED_SUFFIXES = (".bin", ".pkl", ".pt")


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder `step_NNNNNNN`; None for any other name (never an error)."""
    digits = path.name[len(CHECKPOINT_PREFIX) :]
    if not path.name.startswith(CHECKPOINT_PREFIX) or not digits.isdigit():
        return None
    return int(digits)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders, oldest first; folders of other names (`step_final`, notes) are ignored."""
    folder = Path(output_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in folder.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None)]


# ---- the run folder ------------------------------------------------------------------------------------


def run_parts(output_dir: Path) -> list[str]:
    """What of a run the folder holds."""
    return [name for name in RUN_PARTS if (output_dir / name).exists()]


def claim_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds one, unless told to resume it or overwrite it."""
    held = run_parts(output_dir)
    if not held or resume:
        return
    if not overwrite:
        raise UserError(
            f"{output_dir} already holds a run ({', '.join(held)}): pass --resume to continue it or "
            "--overwrite to start over (which deletes it), or choose another output_dir"
        )
    for name in held:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


# ---- saving --------------------------------------------------------------------------------------------


def sha256(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file in `folder` (what `verify` checks on resume)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    atomic_write_json(folder / MANIFEST, {"files": entries})


def flatten_state(state: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """`state` as JSON, each tensor (and numpy array) replaced by a reference into `tensors`."""
    import numpy as np

    if isinstance(state, np.ndarray):
        state = torch.from_numpy(state)
    if isinstance(state, torch.Tensor):
        tensors[path] = state.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(state, dict):
        if not all(isinstance(k, str) for k in state):
            raise TypeError(f"state at {path or '<root>'} has non-string keys")
        return {k: flatten_state(v, tensors, f"{path}.{k}" if path else k) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [flatten_state(v, tensors, f"{path}.{i}") for i, v in enumerate(state)]
    if state is None or isinstance(state, bool | int | float | str):
        return state
    raise TypeError(f"state at {path or '<root>'} is a {type(state).__name__}: not JSON or a tensor")


def unflatten_state(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(state, dict):
        if set(state) == {"__tensor__"}:
            return tensors[state["__tensor__"]]
        return {k: unflatten_state(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [unflatten_state(v, tensors) for v in state]
    return state


def write_state(folder: Path, state: dict) -> None:
    """Save the project's state (no pickle): JSON for the structure, safetensors for its tensors."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    flat = flatten_state(state, tensors)
    save_file(tensors, str(folder / STATE_TENSORS))
    atomic_write_text(folder / STATE_JSON, json.dumps(flat, indent=1) + "\n")


def read_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    flat = json.loads((folder / STATE_JSON).read_text())
    return unflatten_state(flat, load_file(str(folder / STATE_TENSORS)))


def save_checkpoint(
    accelerator,
    output_dir: Path,
    step: int,
    keep_last: int,
    state: dict,
    config_text: str,
    prune: bool = True,
) -> Path:
    """Write checkpoint `step` whole or not at all, then keep the newest `keep_last` (`prune=False`: keep all).

    Every process writes its files into one temporary folder; the main process adds the project's state, the
    config and the manifest, and renames it into place. A step saved again replaces the old folder only once
    the new one is complete. A failed write (a full disk) removes the temporary folder and stops the run with
    one line; the previous checkpoints are untouched."""
    final = output_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = final.with_name(f".tmp-{final.name}")
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if main:
            write_state(tmp, state)
            atomic_write_text(tmp / CONFIG, config_text)
            write_manifest(tmp)
    except OSError as err:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = checkpoints(output_dir)
        why = "the disk is full" if err.errno == errno.ENOSPC else str(err)
        raise UserError(
            f"could not write checkpoint {final}: {why}; "
            + (f"the last complete one, {kept[-1]}, is intact" if kept else "no earlier checkpoint exists")
        ) from None
    if main:
        # Not `rlm.base.atomicio.atomic_directory`: every process wrote into the one temporary folder.
        old = final.with_name(f".old-{final.name}")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        if prune:
            for old in checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# ---- resuming ------------------------------------------------------------------------------------------


def verify(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder (None: every file is there with its recorded size and hash)."""
    manifest = folder / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is missing or unreadable"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were written"
        if sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest_good_checkpoint(output_dir: Path, say: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is named with what is wrong."""
    for folder in reversed(checkpoints(output_dir)):
        problem = verify(folder)
        if problem is None:
            return folder
        say(f"skipping checkpoint {folder}: {problem}")
    return None


def deepspeed_checkpoint_classes() -> list:
    """`DEEPSPEED_CHECKPOINT_CLASSES` imported from the installed deepspeed; a UserError names one it lacks."""
    classes = []
    for dotted in DEEPSPEED_CHECKPOINT_CLASSES:
        module, _, name = dotted.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            try:
                installed = f"deepspeed {importlib.metadata.version('deepspeed')}"
            except importlib.metadata.PackageNotFoundError:
                installed = "no deepspeed"
            raise UserError(
                f"a DeepSpeed checkpoint pickles {dotted}, which the installed {installed} does not have: "
                "resume with the deepspeed that wrote it, or name where this one keeps the class in "
                "rlm.training.checkpointing.DEEPSPEED_CHECKPOINT_CLASSES"
            ) from None
    return classes


def numpy_rng_globals() -> list:
    """What accelerate's saved numpy RNG state pickles: an array of uint32 and its bytes (written as text)."""
    import codecs

    import numpy as np

    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1
        multiarray = importlib.import_module("numpy.core.multiarray")
    # A state written under numpy 1 names `numpy.core`, one written under numpy 2 `numpy._core`.
    named = [
        (multiarray._reconstruct, f"{path}._reconstruct")
        for path in ("numpy.core.multiarray", "numpy._core.multiarray")
    ]
    return [*named, np.ndarray, np.dtype, np.dtypes.UInt32DType, codecs.encode]


def written_by_deepspeed(folder: Path) -> bool:
    """Whether a checkpoint holds a DeepSpeed engine's state (its model and ZeRO shards, `*_states.pt`)."""
    return any(folder.rglob("*mp_rank_*_states.pt"))


def checkpoint_safe_globals(folder: Path) -> list:
    """What a checkpoint's pickles may name beyond torch's own weights-only set: numpy's RNG state (accelerate)
    and, in a checkpoint DeepSpeed wrote, DeepSpeed's optimizer-state classes, resolved from the installed
    deepspeed (a UserError naming the class when one is gone)."""
    deepspeed = deepspeed_checkpoint_classes() if written_by_deepspeed(folder) else []
    return numpy_rng_globals() + deepspeed


@contextlib.contextmanager
def weights_only_loads(safe_globals: list) -> Iterator[None]:
    """Every `torch.load` in the block reads tensors and `safe_globals` only.

    `weights_only=True` even where a library passes False (DeepSpeed's checkpoint engine, accelerate's custom
    states): torch's own switch for that, `TORCH_FORCE_WEIGHTS_ONLY_LOAD`, is set for the block, and the
    globals are registered through `torch.serialization.safe_globals` for the block alone."""
    saved = {
        name: os.environ.pop(name, None)
        for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    }
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(safe_globals):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def unsafe_pickle_globals(folder: Path) -> dict[str, list[str]]:
    """Per pickled file of a checkpoint, the globals it names beyond tensors and `checkpoint_safe_globals`:
    what a weights-only load refuses (and a plain pickle load would run code through)."""
    found = {}
    with torch.serialization.safe_globals(checkpoint_safe_globals(folder)):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix in PICKLED_SUFFIXES:
                try:
                    names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
                except Exception as err:  # not a torch zip file: torch.load could only run it as a raw pickle
                    names = [f"<unreadable: {type(err).__name__}>"]
                if names:
                    found[str(path.relative_to(folder))] = names
    return found


def check_pickles(folder: Path) -> None:
    """Refuse a checkpoint whose pickles name anything beyond tensors, numpy RNG state and DeepSpeed's
    optimizer-state classes, naming each file and what it holds."""
    unsafe = unsafe_pickle_globals(folder)
    if unsafe:
        listed = "; ".join(f"{name}: {', '.join(globs)}" for name, globs in unsafe.items())
        raise UserError(
            f"refusing to resume from {folder}: its files would import code when loaded ({listed}); a "
            "checkpoint this project wrote holds only tensors, numbers and text"
        )


def load_checkpoint(accelerator, folder: Path) -> None:
    """`accelerator.load_state(folder)` with every file read by `torch.load(weights_only=True)` and the
    checkpoint's safe globals, so a file changed after `check_pickles` still cannot run code: it is refused
    with its name and the globals it holds."""
    with weights_only_loads(checkpoint_safe_globals(folder)):
        try:
            accelerator.load_state(str(folder))
        except pickle.UnpicklingError as err:
            check_pickles(folder)
            found = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
            raise UserError(f"refusing to resume from {folder}: {(found or [str(err)])[0]}") from None


def flat_config(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def changed_settings(saved_config: str, config: str, saved_processes: int, processes: int) -> dict:
    """{key: (checkpoint's value, this run's)} for the settings that decide what is trained. The checkpoint's
    settings are read under their current names (`rlm.config.RENAMED_SETTINGS`), a key either side lacks as its
    default; while both search exactly, `strategy.two_stage.*` decides nothing."""
    defaults = flat_config(to_dict(TrainConfig()))
    saved = flat_config(renamed_settings(yaml.safe_load(saved_config) or {}, warn=False))
    current = flat_config(yaml.safe_load(config) or {})
    # A key one side lacks is its default there (an older checkpoint's config predates it).
    before = {**{key: defaults[key] for key in defaults.keys() - saved.keys()}, **saved}
    after = {**{key: defaults[key] for key in defaults.keys() - current.keys()}, **current}
    ignored = set(OPERATIONAL_KEYS)
    if before.get("strategy.search", "exact") == after.get("strategy.search", "exact") == "exact":
        ignored |= {key for key in (*before, *after) if key.startswith("strategy.two_stage.")}
    changed = {
        key: (before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if key not in ignored and before.get(key) != after.get(key)
    }
    if saved_processes != processes:
        changed["processes"] = (saved_processes, processes)
    return changed


def check_settings(
    folder: Path, config: str, processes: int, saved_processes: int, allowed: Iterable[str]
) -> list[str]:
    """Refuse a resume whose settings differ from the checkpoint's beyond `allowed`; returns the allowed
    changes, described (for the log)."""
    saved = (folder / CONFIG).read_text() if (folder / CONFIG).is_file() else None
    if saved is None:
        raise UserError(f"{folder} has no {CONFIG}: it was not written by this version of rlm train")
    changed = changed_settings(saved, config, saved_processes, processes)
    allowed = set(allowed)
    refused = {k: v for k, v in changed.items() if k not in allowed}
    if refused:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        raise UserError(
            f"resuming {folder} with other settings would train another run ({listed}); use the "
            "checkpoint's settings, or pass --allow-changed KEY for each change you mean "
            f"(e.g. --allow-changed {next(iter(refused))})"
        )
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()]


def repair_log(log_path: Path, step: int) -> None:
    """Keep the log's records up to `step` (a killed run may have logged steps its checkpoint does not hold);
    a torn last line (a kill or a full disk mid-write) is dropped with a warning."""
    if not log_path.exists():
        return
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    keep = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                warnings.warn(f"{log_path}:{number}: dropped a torn last line", stacklevel=2)
                break
            raise UserError(
                f"{log_path}:{number}: not a JSON record (only a torn last line is dropped)"
            ) from None
        if record.get("step", 0) <= step:
            keep.append(line)
    atomic_write_text(log_path, "".join(line + "\n" for line in keep))
