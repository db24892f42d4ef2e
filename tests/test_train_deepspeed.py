"""DeepSpeed ZeRO-2 on two CPU processes (gloo), launched with the shipped accelerate config as users launch it.

DeepSpeed picks its CPU accelerator when no GPU is visible, so `configs/accelerate/deepspeed_zero2.yaml` with
`--num_processes 2` runs here: the batch sizes filled from the run config, parameters in bf16 (the config's
mixed precision), ZeRO-2 optimizer shards per rank, and a resumed run that gives the same losses. What stays
untested here: NCCL, CUDA kernels and GPU memory (docs/training.md, scripts/bench/gpu_smoke.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from local_port import accelerate_launch
from tiny_run import as_set_args, read_log, tiny_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ZERO2 = REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"
STEPS = 3
EXTRA = [
    "optim.questions_per_step=8",  # 2 per process x 2 processes x accumulation 2
    f"optim.max_steps={STEPS}",
    "optim.warmup_steps=2",
    "log_every=1",
    "save_every=2",
    "mixed_precision=bf16",  # the run config's precision is the one accelerate (and DeepSpeed) use
    "force_cpu_bf16=true",  # bf16 ZeRO shards even on a CPU without native bf16 (which would fall back)
]


def launch(root: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = accelerate_launch(ZERO2, "--num_processes", "2", "-m", "rlm.train")
    cmd += as_set_args(tiny_overrides(root, out, *EXTRA))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


def test_deepspeed_zero2_trains_on_two_cpu_processes_and_resumes_exactly(tmp_path):
    full = launch(tmp_path, "full")
    log = read_log(tmp_path / "full" / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    checkpoint = tmp_path / "full" / "checkpoints" / "step_0000002"
    shards = sorted(p.name for p in (checkpoint / "pytorch_model").iterdir())
    # ZeRO-2: one optimizer-state shard per rank, bf16 parameters (the config's mixed precision).
    assert [s for s in shards if s.startswith("bf16_zero_pp_rank_")] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert (tmp_path / "full" / "final" / "corrector" / "model.safetensors").exists()
    assert log[1]["lr_reader"] == pytest.approx(0.5e-3) and log[2]["lr_reader"] == pytest.approx(1e-3)
    # One global norm clips the three components together under DeepSpeed: it is logged (and warned of).
    assert all(log[s]["grad_norm_global"] > 0 for s in log) and "grad_norm_reader" not in log[1]
    assert full.stderr.count("DeepSpeedClippingWarning") == 1  # from the main process
    # DeepSpeed's shared-memory inference all-reduce is not compiled for training on CPU (~100 s per new
    # environment, rlm.training.accelerator.skip_deepspeed_cpu_inference_kernel).
    assert "deepspeed_shm_comm" not in full.stdout + full.stderr
    # final/ holds the fp32 master weights, not the bf16 module's: values bf16 cannot represent occur.
    from safetensors.torch import load_file

    reader = load_file(str(tmp_path / "full" / "final" / "reader" / "model.safetensors"))
    weights = torch.cat([t.flatten() for t in reader.values() if t.is_floating_point()])
    assert weights.dtype == torch.float32
    assert (weights != weights.to(torch.bfloat16).float()).float().mean() > 0.5

    # Resume from the step-2 checkpoint: step 3 must repeat the uninterrupted run's losses.
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoints" / checkpoint.name)
    shutil.copytree(tmp_path / "full" / "tokenizer", tmp_path / "resumed" / "tokenizer")
    done = launch(tmp_path, "resumed", "--resume")
    assert "resumed from" in done.stdout and "at step 2" in done.stdout
    resumed = read_log(tmp_path / "resumed" / "log.jsonl")
    assert sorted(resumed) == [3]
    for key in ("loss", "reader_loss", "retriever_loss", "corrector_loss"):
        assert resumed[3][key] == pytest.approx(log[3][key], rel=1e-5, abs=1e-6), key


def test_a_skipped_window_leaves_the_parameters_as_they_were_under_deepspeed(tmp_path):
    """ZeRO-2 steps inside the window's last backward: a NaN on rank 1's first micro-step of optimizer step 1
    (accumulation 2) must leave every parameter where step 0 left it, on both ranks, and the next window trains
    step 1."""
    out = tmp_path / "nan_probe"
    cmd = accelerate_launch(
        ZERO2, "--num_processes", "2", str(REPO / "tests" / "multiprocess_train.py"), str(out)
    )
    cmd += ["--nan-rank", "1", "--nan-call", "2"]
    extra = [e for e in EXTRA if not e.startswith(("save_every", "optim.max_steps"))]
    cmd += as_set_args(tiny_overrides(tmp_path, "nan", *extra, "optim.max_steps=2", "save_every=0"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["skipped_at"] == [1] and r["skipped_moved_params"] == [False]
        assert [rec["step"] for rec in r["records"]] == [1, 2]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
