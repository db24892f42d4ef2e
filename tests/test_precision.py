"""bf16 only where the CPU runs it natively: detection from the CPU flags, and `make_accelerator`'s fallback."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from script_loader import load_script

import rlm.precision as precision
import rlm.training.accelerator as train
from rlm.config import load_config
from rlm.precision import CpuBf16Warning, cpu_bf16_support, cpu_mixed_precision, read_cpu_flags

# /proc/cpuinfo as Linux writes it (two CPUs, trimmed): an AVX2-only EPYC, and one with AVX512-BF16.
AVX2_FLAGS = "fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni"
AVX512_BF16_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
AMX_FLAGS = AVX512_BF16_FLAGS.replace(" avx512_bf16", "") + " amx_bf16 amx_tile amx_int8"


def cpuinfo(flags: str) -> str:
    cpu = "processor\t: {n}\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\nbogomips\t: 4800\n"
    return "\n".join(cpu.format(n=n, flags=flags) for n in range(2))


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """Point the cpuinfo reader at a file with the given flags (and fix the probe's ratio, which is timing)."""

    def use(flags: str | None, ratio: float = 25.0):
        # The kernels uncapped, whatever family this test runs under (`make test-kernels`).
        monkeypatch.setattr(precision, "torch_cpu_capability", lambda: "AVX512")
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        path = tmp_path / "cpuinfo"
        if flags is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(cpuinfo(flags))
        monkeypatch.setattr(precision, "CPUINFO", path)
        monkeypatch.setattr(precision, "probe_ratio", lambda: ratio)

    return use


def test_flags_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo(AVX2_FLAGS))
    assert read_cpu_flags(path) == set(AVX2_FLAGS.split())
    path.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 has no `flags` line
    assert read_cpu_flags(path) is None
    assert read_cpu_flags(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "flags, native, named",
    [
        (AVX2_FLAGS, False, "not even AVX512"),
        (AVX512_BF16_FLAGS, True, "avx512_bf16"),
        (AMX_FLAGS, True, "amx_bf16"),
    ],
)
def test_native_bf16_is_decided_by_the_cpu_flags_not_the_timing(fake_cpu, flags, native, named):
    # The probe's ratio contradicts the flags on purpose: the flags decide, so every process agrees.
    fake_cpu(flags, ratio=0.5 if not native else 30.0)
    support = cpu_bf16_support()
    assert support.native is native and named in support.reason
    assert support.ratio == (0.5 if not native else 30.0)
    assert math.isnan(cpu_bf16_support(probe=False).ratio)


@pytest.mark.parametrize(
    "capability, onednn_isa, capped_by",
    [
        ("AVX2", None, "ATEN_CPU_CAPABILITY"),
        ("DEFAULT", "SSE41", "ATEN_CPU_CAPABILITY"),
        ("AVX512", "AVX512_CORE", "ONEDNN_MAX_CPU_ISA"),
        ("AVX512", "avx2", "ONEDNN_MAX_CPU_ISA"),
        ("AVX512", "AVX512_CORE_BF16", None),
        ("AVX512", "AVX512_CORE_AMX", None),
        ("AVX512", "AVX10_1_512", None),
    ],
)
def test_bf16_counts_as_emulated_where_the_kernels_are_capped_below_it(
    fake_cpu, monkeypatch, capability, onednn_isa, capped_by
):
    # A machine with AVX512-BF16 computing what an AVX2 one does decides as the AVX2 one would.
    fake_cpu(AVX512_BF16_FLAGS, ratio=30.0)
    monkeypatch.setattr(precision, "torch_cpu_capability", lambda: capability)
    if onednn_isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)
    support = cpu_bf16_support(probe=False)
    assert support.native is (capped_by is None)
    if capped_by:
        assert capped_by in support.reason and "avx512_bf16" in support.reason


def test_without_flags_the_capability_hint_then_the_probe_decide(fake_cpu, monkeypatch):
    fake_cpu(None, ratio=30.0)
    monkeypatch.setattr(precision, "torch_cpu_capability", lambda: "AVX2")
    assert not cpu_bf16_support(probe=False).native  # AVX2 cannot have AVX512-BF16 or AMX
    monkeypatch.setattr(precision, "torch_cpu_capability", lambda: "AVX512")
    assert not cpu_bf16_support().native  # bf16 30x slower than float32: emulated
    fake_cpu(None, ratio=0.5)
    assert cpu_bf16_support().native


def test_the_real_probe_measures_a_positive_ratio():
    assert precision.probe_ratio(rows=16, dim=32, repeats=1) > 0


def test_choice_names_the_ratio_and_the_setting(fake_cpu):
    fake_cpu(AVX2_FLAGS, ratio=31.4)
    fallback = cpu_mixed_precision("bf16")
    assert (
        fallback.mixed_precision == "no"
        and "31.4x" in fallback.warning
        and "force_cpu_bf16" in fallback.warning
    )
    forced = cpu_mixed_precision("bf16", force=True)
    assert forced.mixed_precision == "bf16" and "keeping" in forced.warning
    assert cpu_mixed_precision("no") == precision.PrecisionChoice("no", None)


def make(tmp_path, *overrides):
    return train.make_accelerator(load_config(None, [f"output_dir={tmp_path}", *overrides]))


def test_make_accelerator_falls_back_to_float32_on_a_cpu_without_native_bf16(
    fake_cpu, fresh_accelerator_state, tmp_path
):
    fake_cpu(AVX2_FLAGS, ratio=31.4)
    with pytest.warns(CpuBf16Warning, match=r"31\.4x.*falling back to mixed_precision=no"):
        acc = make(tmp_path, "mixed_precision=bf16", "cpu=true")
    assert acc.mixed_precision == "no"
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_make_accelerator_keeps_bf16_when_forced(fake_cpu, fresh_accelerator_state, tmp_path):
    fake_cpu(AVX2_FLAGS, ratio=31.4)
    with pytest.warns(CpuBf16Warning, match="keeping mixed_precision=bf16"):
        acc = make(tmp_path, "mixed_precision=bf16", "force_cpu_bf16=true", "cpu=true")
    assert acc.mixed_precision == "bf16"
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_make_accelerator_keeps_bf16_silently_on_a_native_cpu(fake_cpu, fresh_accelerator_state, tmp_path):
    fake_cpu(AVX512_BF16_FLAGS, ratio=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CpuBf16Warning)
        acc = make(tmp_path, "mixed_precision=bf16", "cpu=true")
    assert acc.mixed_precision == "bf16"


class RecordingAccelerator:
    """Stands in for accelerate's Accelerator where CUDA is faked: records what make_accelerator asks for."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.num_processes, self.is_local_main_process = 1, True


@pytest.mark.parametrize("cpu_flag", [False, True])
def test_on_cuda_bf16_is_left_alone_unless_the_run_is_forced_onto_the_cpu(
    fake_cpu, monkeypatch, tmp_path, cpu_flag
):
    fake_cpu(AVX2_FLAGS, ratio=31.4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train, "Accelerator", RecordingAccelerator)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    if not cpu_flag:
        # On the GPU the CPU is not even asked.
        monkeypatch.setattr(train, "cpu_bf16_support", lambda: pytest.fail("CPU asked about bf16 on CUDA"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = make(tmp_path, "mixed_precision=bf16", f"cpu={str(cpu_flag).lower()}")
    bf16_warnings = [w for w in caught if issubclass(w.category, CpuBf16Warning)]
    if cpu_flag:  # cpu=true trains on the CPU even with a GPU visible: the CPU's bf16 matters
        assert acc.kwargs["mixed_precision"] == "no" and acc.kwargs["cpu"] is True and bf16_warnings
    else:
        assert acc.kwargs["mixed_precision"] == "bf16" and acc.kwargs["cpu"] is False and not bf16_warnings


@pytest.mark.parametrize(
    "cuda, cpu_flag, tf32", [(True, False, True), (True, True, False), (False, False, False)]
)
def test_a_gpu_run_takes_tf32_for_its_float32_matmuls_and_a_cpu_run_leaves_the_flags(
    monkeypatch, tmp_path, cuda, cpu_flag, tf32
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(train, "Accelerator", RecordingAccelerator)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        make(tmp_path, f"cpu={str(cpu_flag).lower()}")
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:  # the flags are process-wide
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_force_cpu_bf16_without_bf16_is_refused():
    with pytest.raises(ValueError, match="force_cpu_bf16"):
        load_config(None, ["force_cpu_bf16=true"])
    assert load_config(None, ["mixed_precision=bf16", "force_cpu_bf16=true"]).force_cpu_bf16


def test_compare_strategies_measures_in_the_precision_the_runs_train_with(fake_cpu):
    # Its start row and dropout floor run outside training, under the runs' autocast: never bf16 where the
    # runs fell back to float32.
    compare = load_script("compare_strategies")
    fake_cpu(AVX2_FLAGS)
    cfg = load_config(None, ["mixed_precision=bf16", "cpu=true"])
    with compare.run_precision(cfg):
        assert not torch.is_autocast_enabled("cpu")
    forced = load_config(None, ["mixed_precision=bf16", "cpu=true", "force_cpu_bf16=true"])
    with compare.run_precision(forced):
        assert torch.is_autocast_enabled("cpu")
    fake_cpu(AVX512_BF16_FLAGS)
    with compare.run_precision(cfg):
        assert torch.is_autocast_enabled("cpu")
