"""Every float kernel family on one machine (scripts/bench/lab/kernel_families.py, scripts/kernel_families.py):
the caps take, the learning tests run under each, and the quickstart's verdict is read per family and seed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from lab.kernel_families import (
    TORCH_CAPABILITY,
    available_families,
    family_environment,
    parse_families,
)
from lab.reporting import ROOT
from script_loader import load_script

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2_ONLY | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16"}


def test_a_cpu_runs_the_families_its_flags_allow():
    assert available_families(AVX2_ONLY) == ["default", "avx2"]
    assert available_families(AVX512) == ["default", "avx2", "avx512"]
    assert parse_families("all", AVX2_ONLY) == ["default", "avx2"]
    with pytest.raises(SystemExit, match="cannot run the avx512 family"):
        parse_families("avx512", AVX2_ONLY)
    with pytest.raises(SystemExit, match="unknown kernel family 'sse'"):
        parse_families("sse", AVX512)


def test_each_family_caps_the_kernels_torch_runs():
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    for family in available_families():
        env = family_environment(family)
        assert env["MKL_ENABLE_INSTRUCTIONS"] and env["ONEDNN_MAX_CPU_ISA"]
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert done.stdout.strip() == TORCH_CAPABILITY[family]


def test_the_learning_tests_run_under_a_family_as_make_test_kernels_runs_them(capfd, tmp_path):
    script = load_script("kernel_families")
    test = "tests/test_retriever_corrector.py::test_identity_at_init_and_trainable"
    # Its own temporary folder: the inner suite's disk budget counts only what it writes.
    assert (
        script.main(["tests", "--families", "default", "--", test, "--basetemp", str(tmp_path / "inner")])
        == 0
    )
    out = capfd.readouterr().out
    assert "ATEN_CPU_CAPABILITY=default" in out and "| default | DEFAULT | 0 |" in out
    assert "1 passed" in out


def test_the_quickstart_verdict_is_read_per_family_and_seed_and_a_failing_run_is_named(tmp_path):
    script = load_script("kernel_families")
    measured = ROOT / "scripts" / "bench" / "reports" / "quickstart" / "quickstart_metrics.json"
    for name in ("avx2-seed0", "default-seed0"):
        (tmp_path / name).mkdir()
        shutil.copy(measured, tmp_path / name / "metrics.json")
    # One run where the corrector falls 4 points behind exhaustive re-embedding.
    worse = json.loads(measured.read_text())
    worse["dev"]["exact_match"] = worse["baselines"]["exhaustive"]["exact_match"] - 0.04
    (tmp_path / "default-seed0" / "metrics.json").write_text(json.dumps(worse))
    good = script.quickstart_run("avx2", 0, tmp_path, [])  # read back, never retrained
    bad = script.quickstart_run("default", 0, tmp_path, [])
    assert good["verdict"]["holds"] and good["corrector"]["own"] == pytest.approx(98.52)
    assert not bad["verdict"]["holds"]
    assert [k for k, v in bad["verdict"]["checks"].items() if not v] == [
        "within 3 of exhaustive (reembedded)"
    ]
    text = script.render(
        {
            "cpu": "a CPU",
            "flags": "avx2",
            "date": "today",
            "command": "c",
            "dev_questions": 135,
            "runs": [good, bad],
        }
    )
    assert "| avx2 | 0 | 98.5 / 99.3 |" in text and "FAILS: within 3 of exhaustive (reembedded)" in text
    assert "The verdict holds on 1 of 2 runs." in text
    # The README's table: each family's mean over seeds, then every run's mean and spread.
    assert "| corrector | 98.5 / 98.5 | 98.5 (0.0) | 99.3 / 95.3 | 97.3 (4.0) |" in text
