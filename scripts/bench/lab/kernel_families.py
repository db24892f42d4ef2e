"""The float kernel families a CPU can run, and the environment that makes this machine run each one.

PyTorch picks its kernels by the CPU it finds: ATen's own (`default`, `avx2`, `avx512`), MKL's and oneDNN's code
paths. Their float sums differ in the last bits, and a model trained from scratch lands elsewhere on each: a
learning test or a table measured on one CPU kind can fail on another. Capping all three libraries together
makes a CPU with more instruction sets compute what a CPU with fewer does (seed 0 of the quickstart reproduced an
AVX2-only EPYC's figures to the digit on an AVX-512 one), so every family below the machine's own is checked
on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from rlm.precision import read_cpu_flags

# Each family: the caps of ATen, MKL and oneDNN that select it, and the x86 flags a CPU needs to run it.
FAMILIES: dict[str, dict[str, str]] = {
    "default": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    },
}
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "default": ("sse4_2",),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512dq", "avx512bw", "avx512vl"),
}
# What torch reports (`torch.backends.cpu.get_cpu_capability()`) under each family: the check that a cap took.
TORCH_CAPABILITY = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}


def available_families(flags: Iterable[str] | None = None) -> list[str]:
    """The families this CPU can run, fewest instruction sets first (all of them where no flags are readable:
    the caller finds out by running)."""
    have = read_cpu_flags() if flags is None else set(flags)
    if have is None:
        return list(FAMILIES)
    return [name for name, needed in REQUIRED_FLAGS.items() if all(f in have for f in needed)]


def family_environment(name: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) with the caps of family `name`."""
    if name not in FAMILIES:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}")
    return {**(os.environ if base is None else base), **FAMILIES[name]}


def parse_families(text: str, flags: Iterable[str] | None = None) -> list[str]:
    """'all' (the families this CPU runs) or a comma-separated list of family names, each one this CPU runs."""
    runnable = available_families(flags)
    if text == "all":
        return runnable
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in FAMILIES:
            raise SystemExit(f"error: unknown kernel family {name!r}; known: {', '.join(FAMILIES)}")
        if name not in runnable:
            raise SystemExit(f"error: this CPU cannot run the {name} family (it runs {', '.join(runnable)})")
    return names
