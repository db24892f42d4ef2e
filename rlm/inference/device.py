"""Where a trained checkpoint answers and in which precision: one default for the models and the index.

`inference_device` is the one default (the accelerator when there is one, else the CPU): `load_checkpoint`
puts the towers and the reader there, the corrector of an h(B) index runs there, and `index_on_gpu` sends a
faiss index to the GPU only when they are on one. `inference_bf16` and `autocast` turn on bfloat16 autocast
for the towers and the reader where it pays (an accelerator, or a CPU with native bf16).
"""

from __future__ import annotations

import contextlib
import warnings

from rlm.errors import UserError


def inference_device(device=None):
    """`device` as a torch.device; None: the accelerator (CUDA) when there is one, else the CPU. A name torch
    does not know (`--device gpu`) is a `UserError`."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device)
    except RuntimeError as err:  # torch's message lists some twenty device types
        raise UserError(f"unknown device {device!r}: use cpu, cuda or cuda:N (the GPU of index N)") from err


def index_on_gpu(device, wanted: str = "auto") -> bool | None:
    """`use_gpu` of a faiss index serving models on `device` (None: `inference_device`'s default): with `wanted`
    "auto" (an `IndexSpec.device`), on a GPU when they are on one and faiss sees one (None: faiss-cpu keeps it
    on the host), on the host otherwise (`--device cpu` keeps faiss off the GPU); "gpu" insists, "cpu" stays."""
    if wanted != "auto":
        return wanted == "gpu"
    return None if inference_device(device).type == "cuda" else False


def inference_bf16(device, requested: bool, support=None) -> bool:
    """Whether to run the towers and the reader under bf16 autocast on `device` when `requested`.

    On an accelerator, yes. On a CPU only where bf16 is native (AVX512-BF16 or AMX, `rlm.precision`):
    elsewhere it is emulated and many times slower than float32, so the run stays in float32 with a
    `CpuBf16Warning`.
    `support`: the CPU's `Bf16Support` when already known (tests)."""
    from rlm.precision import CpuBf16Warning, cpu_bf16_support

    if not requested or inference_device(device).type != "cpu":
        return requested
    support = support or cpu_bf16_support(probe=False)
    if support.native:
        return True
    warnings.warn(
        f"--bf16 ignored: bf16 is slow on this CPU ({support.describe()}); running in float32",
        CpuBf16Warning,
        stacklevel=2,
    )
    return False


def autocast(device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device`'s type when `enabled`, else nothing (an autocast the caller opened stays)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=inference_device(device).type, dtype=torch.bfloat16)
