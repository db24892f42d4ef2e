"""The scripts in scripts/ and scripts/bench/ as a user of a checkout meets them: importable side by side without
shadowing anything, and each benchmark in scripts/bench/README.md with its command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lab.benchmarking import corrector_moving, overlap

ROOT = Path(__file__).resolve().parents[1]

LOAD_ALL_SCRIPTS = """
import importlib.util, sys
from pathlib import Path

scripts = Path(sys.argv[1])
sys.path.append(str(scripts / "bench"))  # the lab, as a benchmark run from the checkout sees it
before = list(sys.path)
for path in sorted([*scripts.glob("*.py"), *scripts.glob("bench/*.py")]):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
added = [p for p in sys.path if p not in before]
assert str(scripts) not in sys.path, f"a script put {scripts} on sys.path"

import evaluate  # the library, not a script of that name

assert hasattr(evaluate, "load"), f"`import evaluate` found {evaluate.__file__}"
print("ok", added)
"""


def test_loading_every_script_leaves_installed_packages_importable():
    # A script named like a library (there was a scripts/evaluate.py) on sys.path breaks `evaluate.load` for the
    # rest of the process (CI failed this way with the metrics test after a benchmark test had loaded
    # bench_training in-process).
    out = subprocess.run(
        [sys.executable, "-c", LOAD_ALL_SCRIPTS, str(ROOT / "scripts")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


@pytest.mark.parametrize("move", [0.2, 1.0])
def test_benchmark_corrector_moves_unit_vectors_by_the_stated_amount(move):
    net = corrector_moving(64, 128, move, seed=3)
    assert not net.training
    probe = F.normalize(torch.randn(4096, 64, generator=torch.Generator().manual_seed(7)), dim=-1)
    with torch.no_grad():
        moved = (net(probe) - probe).norm(dim=-1).mean().item()
    assert moved == pytest.approx(move, rel=0.1)


def test_overlap_is_the_fraction_of_the_reference_found_per_query():
    reference = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    found = torch.tensor([[4, 3, 9, 9], [5, 6, 7, 8]])
    assert overlap(found, reference) == pytest.approx((0.5 + 1.0) / 2)


def test_the_entry_points_beside_the_lab_stay_thin_and_every_benchmark_has_its_readme_entry():
    thin = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert sum(len(p.read_text().splitlines()) for p in thin) <= 1500, [p.name for p in thin]
    readme = (ROOT / "scripts" / "bench" / "README.md").read_text()
    for script in sorted((ROOT / "scripts" / "bench").glob("*.py")):
        assert f"python scripts/bench/{script.name}" in readme, (
            f"scripts/bench/README.md: no command of {script.name}"
        )


def test_a_child_process_reports_its_own_peak_memory_not_its_parents():
    """Linux keeps getrusage's ru_maxrss across exec: a worker started by a parent holding 400 MB reported the
    parent's peak as its own. `peak_rss_mb` (VmHWM) is the child's."""
    import numpy as np
    from lab.benchmarking import peak_rss_mb

    held = np.ones(400 * 2**20 // 8)  # the parent's 400 MB, resident
    code = (
        "import json, resource, sys; sys.path.append(sys.argv[1]); from lab.benchmarking import peak_rss_mb; "
        "print(json.dumps([peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "scripts" / "bench")], capture_output=True, text=True
    )
    own, inherited = json.loads(out.stdout)
    assert own < 150 and peak_rss_mb() > 400 and held.sum() > 0
    assert inherited > own  # what the old measure said: the parent's peak, or more
