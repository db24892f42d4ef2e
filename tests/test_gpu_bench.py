"""`scripts/gpu_bench.sh`, a GPU session's prepared checks: what it installs from a bundle (`--bundle DIR`, the
folder `scripts/gpu_bundle.py` builds) and the time it may take. On this CPU machine the smoke test stops at
its device stage (`--device cuda`, no CUDA) and the benchmark at once, so only the bookkeeping runs."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bench.sh"
PROBE = "rlm_bundle_probe"  # a package no environment has


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel of PROBE 1.0."""
    dist = f"{PROBE}-1.0.dist-info"
    files = {
        f"{PROBE}/__init__.py": "",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{PROBE}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{dist}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"]))
    return path


def make_bundle(folder: Path) -> Path:
    (folder / "wheels").mkdir(parents=True)
    wheel = probe_wheel(folder / "wheels")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (folder / "SHA256SUMS").write_text(f"{digest}  wheels/{wheel.name}\n")
    return folder


def gpu_bench(tmp_path: Path, bundle: Path) -> tuple[subprocess.CompletedProcess, str]:
    """gpu_bench.sh --bundle BUNDLE, its reports in tmp_path/out; what it did, and its gpu_bench.log."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_BENCH_OUT": str(out), "BENCH_ARGS": f"--render {tmp_path / 'none.json'}"}
    cmd = ["bash", str(SCRIPT), "--bundle", str(bundle), "--device", "cuda", "--work", str(tmp_path / "work")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return done, (out / "gpu_bench.log").read_text()


def test_gpu_bench_installs_the_bundle_without_an_index_where_every_step_imports_it(tmp_path):
    done, log = gpu_bench(tmp_path, make_bundle(tmp_path / "bundle"))
    # The line lists what Python, with the PYTHONPATH the steps run with, finds in the install folder.
    assert re.search(
        rf"gpu_bench: install: {PROBE}-1\.0 in \d+ s \(pip install --no-index --find-links ", log
    ), log
    assert "gpu_bench: gpu_smoke: exit 1" in log  # no CUDA here
    assert "gpu_bench: bench_paper_step: exit" in log
    assert (tmp_path / "out" / "gpu_smoke" / "gpu_smoke.json").is_file()
    assert done.returncode == 1


def test_gpu_bench_installs_nothing_from_a_bundle_whose_files_do_not_match_their_checksums(tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    (wheel,) = (bundle / "wheels").glob("*.whl")
    wheel.write_bytes(wheel.read_bytes()[:-10])  # cut short, as a copy interrupted
    _, log = gpu_bench(tmp_path, bundle)
    assert "gpu_bench: install: refused, the files of" in log and "do not match its SHA256SUMS" in log
    assert f"{PROBE}-1.0 in" not in log
    assert "gpu_bench: gpu_smoke: exit" in log  # the checks run on, without the bundle


def test_gpu_bench_time_limits_add_up_to_nine_minutes_at_most():
    limits = [
        int(seconds) for seconds in re.findall(r"^\s*(?:elif )?timeout (\d+) ", SCRIPT.read_text(), re.M)
    ]
    assert len(limits) == 3  # the install, the smoke test, the benchmark
    assert sum(limits) <= 9 * 60
    # The smoke test's first report comes after the install and its imports: within 2 minutes.
    assert limits[0] <= 60
