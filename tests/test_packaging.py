"""A non-editable install (`pip install .`) carries everything the product commands need: the shipped configs,
the `evaluate` metric module, and a tiny `rlm quickstart` runs from it in a folder far from the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tiny_run import TINY_QUICKSTART

from rlm.config import SHIPPED_CONFIGS, load_config, resolve_config_path

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_QUICKSTART


def test_checkout_configs_folder_is_the_shipped_one():
    # README commands say configs/...: in a checkout that is the packaged folder itself, never a copy.
    assert (ROOT / "configs").resolve() == SHIPPED_CONFIGS
    assert (SHIPPED_CONFIGS / "accelerate" / "ddp.yaml").is_file()


def test_configs_resolve_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = SHIPPED_CONFIGS / "nq.yaml"
    for name in ("nq", "nq.yaml", "configs/nq.yaml"):
        assert resolve_config_path(name) == want
    assert resolve_config_path("configs/accelerate/ddp.yaml") == SHIPPED_CONFIGS / "accelerate" / "ddp.yaml"
    assert load_config("nq").strategy.name == "corrector"
    mine = tmp_path / "configs" / "nq.yaml"  # a file of the user's own comes first
    mine.parent.mkdir()
    mine.write_text("strategy:\n  name: stale\n")
    assert load_config("configs/nq.yaml").strategy.name == "stale"
    with pytest.raises(FileNotFoundError, match="shipped configs: .*nq_alg1"):
        load_config("nq_alg2")


@pytest.mark.slow
def test_quickstart_runs_from_a_wheel_install(tmp_path):
    # Built from a copy of the sources: setuptools writes build/ and *.egg-info next to them.
    source = tmp_path / "source"
    skip = (
        ".venv",
        ".git",
        "build",
        "dist",
        "runs",
        "docs",
        "tests",
        "*.egg-info",
        "__pycache__",
        ".*_cache",
    )
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*skip))
    wheels = tmp_path / "wheels"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(wheels),
    ]
    done = subprocess.run([*build, str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("rlm_corrector-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in SHIPPED_CONFIGS.rglob("*.yaml"):
        assert f"rlm/configs/{shipped.relative_to(SHIPPED_CONFIGS).as_posix()}" in names
    assert "rlm/inference/metrics_module/metrics_module.py" in names and "atomicio/__init__.py" in names

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    # PYTHONPATH comes before the checkout's editable finder: every rlm module is the installed copy.
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    check = "import rlm, atomicio, sys; print(rlm.__file__); print(atomicio.__file__)"
    where = subprocess.run([sys.executable, "-c", check], cwd=away, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    argv = [sys.executable, "-m", "rlm", "quickstart", "--no-serve", "--no-baselines", "--output-dir", "qs"]
    for assignment in TINY:
        argv += ["--set", assignment]
    done = subprocess.run(argv, cwd=away, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((away / "qs" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["dev_questions"] == 8
    assert (away / "qs" / "final" / "reader").is_dir()
