"""`scripts/gpu_smoke.sh --device cpu`: the GPU smoke test's stages, run the way a user runs the script."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_gpu_smoke_script_passes_every_stage_on_cpu(tmp_path):
    cmd = ["bash", str(REPO / "scripts" / "gpu_smoke.sh"), "--device", "cpu", "--work", str(tmp_path)]
    cmd += ["--strategies", "corrector,snm,closed_book"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert not any(line.startswith("FAIL") for line in lines)
    for stage in (
        "buffer",
        "[corrector]",
        "[snm]",
        "[closed_book]",
        "algorithm 1",
        "validate",
        "faiss",
        "QAService",
    ):
        assert any(line.startswith("PASS") and stage in line for line in lines), (stage, lines)
    assert done.stdout.strip().splitlines()[-1] == "all stages passed"
