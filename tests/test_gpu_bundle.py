"""`scripts/gpu_bundle.py`, the folder an air-gapped GPU node installs from, built without network: a stand-in
pip on the command line writes wheels of chosen sizes and tags and records what it was asked for."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bundle.py"
MIB = 2**20

# pip download / pip wheel: each requested `name==version` becomes OUT/<name>-<version>-<tag>.whl of the size
# FAKE_PIP_SIZES gives it (bytes, default 1,000), tagged as FAKE_PIP_TAGS says (default py3-none-any).
FAKE_PIP = """
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
sizes, tags = (json.loads(os.environ.get(key, "{}")) for key in ("FAKE_PIP_SIZES", "FAKE_PIP_TAGS"))
dest = Path(args[args.index("-d" if args[0] == "download" else "-w") + 1])
dest.mkdir(parents=True, exist_ok=True)
valued = {"-d", "-w", "--python-version", "--implementation", "--abi", "--platform"}
for i, arg in enumerate(args[1:], 1):
    if not arg.startswith("-") and args[i - 1] not in valued:
        name, _, version = arg.partition("==")
        tag = tags.get(name, "py3-none-any")
        wheel = dest / f"{name.replace('-', '_')}-{version or '1.0'}-{tag}.whl"
        wheel.write_bytes(b"w" * sizes.get(name, 1000))
"""


def bundle(tmp_path: Path, out: Path, *options: str, sizes=None, tags=None) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake_pip.py"
    fake.write_text(FAKE_PIP)
    env = {**os.environ, "FAKE_PIP_LOG": str(tmp_path / "pip.log")}
    env |= {"FAKE_PIP_SIZES": json.dumps(sizes or {}), "FAKE_PIP_TAGS": json.dumps(tags or {})}
    cmd = [sys.executable, str(SCRIPT), str(out), "--pip", f"{sys.executable} {fake}", *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def pip_calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "pip.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def pinned(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


@pytest.fixture(scope="module")
def wheels() -> list[str]:
    return load_script("gpu_bundle").WHEELS


def test_the_bundle_holds_each_wheel_the_repository_and_a_manifest_of_their_sizes(tmp_path, wheels):
    out = tmp_path / "bundle"
    done = bundle(tmp_path, out, sizes={"faiss-cpu": 300_000})
    assert done.returncode == 0, done.stderr[-3000:]

    download, wheel = pip_calls(tmp_path)
    # Only wheels for the node's Python, none of their dependencies (torch would be ~900 MB), each pinned to
    # the version installed here; deepspeed, an sdist on PyPI, built into a wheel.
    assert download[:5] == ["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    assert download[-len(wheels) :] == [pinned(name) for name in wheels]
    assert wheel == ["wheel", "--no-deps", "-w", wheel[3], pinned("deepspeed")]

    manifest = json.loads((out / "manifest.json").read_text())
    files = {f["path"]: f for f in manifest["files"]}
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert set(files) == names - {"manifest.json", "SHA256SUMS"}
    assert {p.split("/")[0] for p in files} == {"wheels", "repo.tar.gz"}
    assert len([p for p in files if p.startswith("wheels/")]) == len(wheels) + 1
    assert all(f["bytes"] == (out / path).stat().st_size for path, f in files.items())
    assert manifest["total_bytes"] == sum(f["bytes"] for f in files.values()) <= manifest["limit_bytes"]
    assert manifest["limit_bytes"] == 64 * MIB
    assert [f["bytes"] for path, f in files.items() if path.startswith("wheels/faiss_cpu-")] == [300_000]
    checked = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=out, capture_output=True)
    assert checked.returncode == 0, checked.stdout

    with tarfile.open(out / "repo.tar.gz") as archive:
        packed = set(archive.getnames())
    assert {"rlm-corrector/scripts/gpu_bench.sh", "rlm-corrector/tests/tiny_run.py"} <= packed


def test_a_bundle_over_the_size_limit_is_refused_and_nothing_is_left(tmp_path):
    out = tmp_path / "bundle"
    done = bundle(tmp_path, out, "--max-mb", "2", sizes={"faiss-cpu": 3 * MIB})
    assert done.returncode == 1
    assert "refused: 3.0 MiB after the wheels, over the limit of 2 MiB" in done.stderr
    assert "faiss_cpu" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake_pip.py", "pip.log"]
    assert [call[0] for call in pip_calls(tmp_path)] == ["download"]  # stopped before building deepspeed


def test_a_deepspeed_build_that_is_not_pure_python_is_refused(tmp_path):
    out = tmp_path / "bundle"
    done = bundle(tmp_path, out, tags={"deepspeed": "cp312-cp312-linux_x86_64"})
    assert done.returncode == 1 and "not one pure-Python wheel" in done.stderr
    assert not out.exists()


def test_a_dry_run_lists_what_it_would_fetch_and_fetches_nothing(tmp_path, wheels):
    out = tmp_path / "bundle"
    cmd = [sys.executable, str(SCRIPT), str(out), "--dry-run", "--pip", str(tmp_path / "no_such_pip")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    download, wheel, archive = done.stdout.splitlines()[1:]
    assert "download --no-deps --only-binary=:all:" in download
    assert download.split()[-len(wheels) :] == [pinned(name) for name in wheels]
    assert wheel.startswith("DS_BUILD_OPS=0 ") and wheel.endswith(
        f"wheel --no-deps -w {out}/wheels {pinned('deepspeed')}"
    )
    assert archive.startswith("git -C") and " archive " in archive and archive.endswith("HEAD")
    assert not out.exists()


def test_a_folder_that_holds_anything_is_not_built_into(tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    done = bundle(tmp_path, out)
    assert done.returncode == 2 and "is not an empty folder" in done.stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and not pip_calls(tmp_path)
