"""Two CPU processes, launched as users launch them: `accelerate launch --config_file configs/accelerate/...`.

What only several processes can show: the lr schedule per optimizer step, a non-finite loss on one rank
skipping the step on all of them with accumulation, ranks that stay identical, the shipped launcher config
starting two processes, and a sharded buffer selecting what the whole buffer selects.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from local_port import CPU_2PROC, launch_env
from local_port import accelerate_launch as launch
from tiny_run import as_set_args, read_log, runs_beside, tiny_overrides

from rlm.training.schedule import lr_lambda

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def accelerate_launch(config: Path, *program: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        launch(config, *program), capture_output=True, text=True, env=launch_env(), timeout=600, cwd=REPO
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


def overrides(root: Path, out: str, *extra: str) -> list[str]:
    return as_set_args(tiny_overrides(root, out, "cpu=true", "log_every=1", "save_every=0", *extra))


@pytest.fixture(scope="module")
def root(tiny_world, tmp_path_factory):
    return runs_beside(tiny_world, tmp_path_factory.mktemp("multiprocess"))


# The training probe's schedule: accumulation 2, warm-up 4 of 8 steps.
STEPS, WARMUP, LR = 8, 4, 1e-3


@pytest.fixture(scope="module")
def probes(root) -> Path:
    """One `accelerate launch` for both probes (tests/multiprocess_probes.py; a launch is ~20 CPU-s of process
    start-up): the selection probe writes `select_probe/`, then the training probe, with a NaN on rank 1's third
    forward, `nan_probe/`; each builds its own run."""
    select = [
        str(root / "select_probe"),
        *overrides(root, "select", "strategy.name=corrector", "optim.max_steps=4"),
    ]
    select += [
        "--set",
        "data.dev=toy",
        "--set",
        "data.max_dev_examples=8",
        "--set",
        "data.dev_subcorpus=build",
    ]
    select += ["--set", "data.dev_subcorpus_k=5"]
    train = [str(root / "nan_probe"), "--nan-rank", "1", "--nan-call", "2"]
    train += overrides(
        root,
        "nan",
        f"optim.max_steps={STEPS}",
        f"optim.warmup_steps={WARMUP}",
        f"optim.lr_reader={LR}",
        "optim.gradient_accumulation_steps=2",
        "strategy.name=corrector",
    )
    accelerate_launch(CPU_2PROC, str(REPO / "tests" / "multiprocess_probes.py"), *select, "--", *train)
    return root


def test_nan_on_one_rank_skips_the_step_everywhere_and_windows_stay_aligned(probes):
    """Accumulation 2, warm-up 4 of 8 steps, a NaN on rank 1's third forward (step 1, micro-step 0)."""
    steps, warmup, lr = STEPS, WARMUP, LR
    out = probes / "nan_probe"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2], "accelerate launch did not start two processes"
    for r in ranks:
        # The window holding the NaN (optimizer step 1) is skipped on both ranks; the next window trains step 1.
        assert r["skipped_at"] == [1] and r["skipped_moved_params"] == [False]
        assert [rec["step"] for rec in r["records"]] == list(range(1, steps + 1))
        assert r["records"][-1]["nonfinite_skipped"] == 1
        # Every optimizer step falls on a window boundary of accelerate's micro-step counter.
        assert len(r["optimizer_steps"]) == steps
        assert all(s["sync_gradients"] and s["micro_step"] % 2 == 0 for s in r["optimizer_steps"])
        # The lr of optimizer step i is the schedule's value at i, whatever the process count.
        expected = [lr * lr_lambda(warmup, steps)(i) for i in range(steps)]
        assert [rec["lr_reader"] for rec in r["records"]] == pytest.approx(expected, rel=1e-9)
        assert r["forward_calls"] == 2 * (steps + 1)
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "the ranks' weights diverged"
    # The logged losses are the step's, averaged over both ranks' micro-batches, not rank 0's alone.
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert all(a[k] == b[k] for k in ("loss", "reader_loss", "retriever_loss", "corrector_loss")), a[
            "step"
        ]


def test_cpu_2proc_config_trains_two_processes_and_a_sharded_buffer_selects_the_same(root):
    train = ["-m", "rlm.train"]
    # Exhaustive re-embedding before steps 2 and 3: the refreshes are sharded too.
    steps = ("optim.max_steps=3", "strategy.name=exhaustive", "strategy.refresh_every=1")
    done = accelerate_launch(
        CPU_2PROC, *train, *overrides(root, "ddp", *steps, "strategy.shard_buffer=false")
    )
    assert "buffer sharded" not in done.stdout
    log = read_log(root / "ddp" / "log.jsonl")
    assert sorted(log) == [1, 2, 3] and log[3]["reembedded"] == 2 * 120
    assert (root / "ddp" / "final" / "retriever" / "query_tower" / "modules.json").exists()
    # Each process holding half of B (the default with two processes) and merging top-k lists must pick the
    # same S_x: the same losses.
    done = accelerate_launch(CPU_2PROC, *train, *overrides(root, "ddp_sharded", *steps))
    assert "buffer sharded across 2 processes" in done.stdout
    # Refreshed rows live in the run folder as fp16 files, half per process; only the ones in use are kept.
    refreshes = sorted(p.name for p in (root / "ddp_sharded" / "refresh").iterdir())
    assert refreshes == ["step_0000002"]
    assert sorted(p.name for p in (root / "ddp_sharded" / "refresh" / "step_0000002").iterdir()) == [
        "rank00000_rows0-60.npy",
        "rank00001_rows60-120.npy",
    ]
    sharded = read_log(root / "ddp_sharded" / "log.jsonl")
    for step in (1, 2, 3):
        for key in ("loss", "reader_loss", "retriever_loss"):
            assert sharded[step][key] == pytest.approx(log[step][key], rel=1e-4, abs=1e-5), (step, key)


def test_every_strategy_selects_the_same_with_its_rows_sharded_across_two_processes(probes):
    """Stale, corrector, exhaustive, two-round, SNM and regression, with and without Algorithm 1's forced label and
    uniform rows: each process scanning (and re-embedding) half the rows selects what one process scanning all
    of them selects; the re-embedding counter counts each passage once; a resumed strategy reads the refreshed
    rows back from the run folder."""
    out = probes / "select_probe"
    ranks = [json.loads((out / f"select_rank{r}.json").read_text()) for r in (0, 1)]
    n = 120
    # The hard dev subcorpus was built once at the start: the dev questions' gold passages and top-5 rows.
    hard = (probes / "select" / "dev_subcorpus.txt").read_text().split()
    assert 8 <= len(hard) <= 8 * (5 + 2) < n
    for results in ranks:
        validations = {r["validation"]: r for r in results if "validation" in r}
        results = [r for r in results if "validation" not in r]
        # Sharded validation gives the one-process figures, on every process.
        for name in ("full", "hard", "selection"):
            assert validations[name]["sharded"] == validations[name]["whole"], name
            assert (
                validations[name]["sharded"]
                == [r for r in ranks[0] if r.get("validation") == name][0]["sharded"]
            )
        assert "dev_exact_match" in validations["full"]["sharded"]
        assert "dev_selection_exact_match" in validations["selection"]["sharded"]
        assert len(results) == 12 and [r["strategy"] for r in results[-2:]] == [
            "corrector/two_stage",
            "corrector/two_stage/scan",
        ]
        for r in results:
            case = (r["strategy"], r["forced"])
            assert r["sharded"]["rows"] == r["whole"]["rows"], case
            flat = [x for row in r["whole"]["scores"] for x in row]
            assert [x for row in r["sharded"]["scores"] for x in row] == pytest.approx(flat, abs=1e-5), case
            assert r["resumed_same"], case
            assert r["sharded"]["reembedded"] == r["whole"]["reembedded"], case
            if r["strategy"] in ("exhaustive/exact", "two_round/exact"):
                assert r["whole"]["embedded_here"] == n and r["sharded"]["embedded_here"] == n // 2, case
            if r["strategy"] in ("snm/exact", "regression/exact"):
                assert r["whole"]["embedded_here"] == 40 and r["sharded"]["embedded_here"] == 20, case
