"""Whether this CPU runs bf16 natively, and what `mixed_precision=bf16` should become on it.

On x86 CPUs with AVX512-BF16 or AMX, PyTorch's bf16 matmuls (oneDNN) run on bf16 instructions and bf16
autocast is faster than float32. Elsewhere (e.g. AVX2-only CPUs) they are emulated, many times slower than
float32 (figures in docs/training.md, "Precision"). So training on CPU asks this module before it turns bf16 on
(`rlm.training.accelerator.make_accelerator`).

The decision comes from the CPU flags (`/proc/cpuinfo`), so every process on a machine takes the same one;
the timed probe (`probe_ratio`) is reported in the messages, and decides only where no flags can be read.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags, as Linux spells them
# Capabilities below AVX512 cannot have AVX512-BF16 or AMX (both need AVX512): a hint where no flags are readable.
NO_AVX512_CAPABILITIES = ("DEFAULT", "NO AVX", "AVX", "AVX2")
# oneDNN's ISA caps (`ONEDNN_MAX_CPU_ISA`) at or above which its bf16 matmuls run on bf16 instructions; a lower cap
# (AVX512_CORE, AVX2, ...) makes it emulate them on a CPU that has them, as `scripts/kernel_families.py` does to
# compute on one machine what a machine with fewer instruction sets computes.
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL")
# Where flags are unreadable, bf16 counts as native when the probe's bf16 matmul is at most this many times
# slower than float32: between native kernels (about float32's time or less) and emulated ones (an order of
# magnitude slower and more; docs/training.md, "Precision").
PROBE_NATIVE_MAX_RATIO = 2.0


class CpuBf16Warning(UserWarning):
    """bf16 was requested for CPU work on a CPU that emulates it."""


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    ratio: float  # bf16 / float32 time of the probe matmul (> 1: bf16 slower); nan when not measured
    reason: str

    def describe(self) -> str:
        measured = (
            "" if math.isnan(self.ratio) else f"; a bf16 matmul took {self.ratio:.1f}x the float32 time"
        )
        return f"{self.reason}{measured}"


def read_cpu_flags(path: Path | None = None) -> set[str] | None:
    """The x86 `flags` of the first CPU in /proc/cpuinfo; None when there is no such file or line (not Linux,
    or not x86: aarch64 lists `Features`, decided by the probe)."""
    try:
        text = (path or CPUINFO).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return None


def torch_cpu_capability() -> str:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch or an unusual build: only a hint
        return "unknown"


def probe_ratio(rows: int = 256, dim: int = 384, repeats: int = 5, slow_s: float = 0.02) -> float:
    """bf16 time / float32 time of one [rows, dim] @ [dim, dim] matmul (MiniLM's width), best of `repeats`
    after a warm-up, on one thread.

    One thread because on a shared machine a multi-threaded call this short waits for scheduler ticks longer
    than the call itself, which drowns the ratio. An emulated bf16 call is many times a native one, so the
    repeats stop at the first call slower than `slow_s` (the ratio is then far above any threshold anyway;
    the timings behind `slow_s` are in docs/training.md, "Precision")."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, dim, generator=gen), torch.randn(dim, dim, generator=gen)

    def best(x, y) -> float:
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - start)
            if i >= 1 and times[-1] > slow_s:
                break
        return min(times[1:])  # the first call is the warm-up (oneDNN primitive creation)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = best(a, b)
        bf16 = best(a.bfloat16(), b.bfloat16())
    finally:
        torch.set_num_threads(threads)
    return bf16 / max(fp32, 1e-9)


def kernel_cap(capability: str, environ: dict | None = None) -> str | None:
    """Why this process's kernels run below the CPU's bf16 instructions, or None: torch's own kernels capped
    under AVX512 (`ATEN_CPU_CAPABILITY`) or oneDNN's under AVX512_CORE_BF16 (`ONEDNN_MAX_CPU_ISA`)."""
    environ = os.environ if environ is None else environ
    if capability in NO_AVX512_CAPABILITIES:
        return f"torch's CPU kernels are capped at {capability} (ATEN_CPU_CAPABILITY)"
    isa = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and not isa.startswith("AVX10") and isa not in ONEDNN_BF16_ISAS:
        return f"oneDNN is capped at {isa} (ONEDNN_MAX_CPU_ISA)"
    return None


def cpu_bf16_support(probe: bool = True, cpuinfo: Path | None = None) -> Bf16Support:
    """Does this CPU run bf16 natively? From its flags; the probe ratio only decides where flags are missing."""
    flags = read_cpu_flags(cpuinfo)
    capability = torch_cpu_capability()
    ratio = probe_ratio() if probe else math.nan
    if flags is not None:
        have = [f for f in NATIVE_BF16_FLAGS if f in flags]
        if have and (capped := kernel_cap(capability)):
            return Bf16Support(
                False, ratio, f"the CPU has {' and '.join(have)}, but {capped}, so bf16 is emulated"
            )
        if have:
            return Bf16Support(
                True, ratio, f"the CPU has {' and '.join(have)} (torch CPU capability {capability})"
            )
        extra = "" if "avx512f" in flags else ", not even AVX512"
        return Bf16Support(
            False,
            ratio,
            f"the CPU flags have neither avx512_bf16 nor amx_bf16{extra}, so bf16 is emulated "
            f"(torch CPU capability {capability})",
        )
    if capability in NO_AVX512_CAPABILITIES:
        return Bf16Support(
            False, ratio, f"no CPU flags readable; torch CPU capability {capability} has no AVX512"
        )
    if not probe:
        ratio = probe_ratio()  # nothing else to decide from
    return Bf16Support(
        ratio <= PROBE_NATIVE_MAX_RATIO,
        ratio,
        f"no CPU flags readable (torch CPU capability {capability}): decided by a timed matmul "
        f"(native if bf16 takes at most {PROBE_NATIVE_MAX_RATIO}x the float32 time)",
    )


@dataclass(frozen=True)
class PrecisionChoice:
    mixed_precision: str  # what to run with
    warning: str | None  # what to tell the user, if anything


def cpu_mixed_precision(
    requested: str,
    force: bool = False,
    support: Bf16Support | None = None,
    setting: str = "force_cpu_bf16=true",
) -> PrecisionChoice:
    """The mixed precision to use for CPU work when `requested` was asked for: bf16 falls back to "no" on a CPU
    without native bf16, unless `force`. `setting` names how the user forces it, for the message."""
    if requested != "bf16":
        return PrecisionChoice(requested, None)
    support = support or cpu_bf16_support()
    if support.native:
        return PrecisionChoice("bf16", None)
    why = f"bf16 is slow on this CPU: {support.describe()}"
    if force:
        return PrecisionChoice("bf16", f"{why}; keeping mixed_precision=bf16 because {setting} is set")
    return PrecisionChoice(
        "no",
        f"{why}; falling back to mixed_precision=no (float32). Set {setting} to keep bf16 anyway, or run on "
        "a CPU with AVX512-BF16 or AMX",
    )
