"""End-to-end smoke test of the paper-scale code paths on whatever device is at hand, a few minutes on one GPU.

One PASS/FAIL line per stage: the fixed buffer, two real training steps of every strategy (Algorithm 2, and
Algorithm 1 with top-k + uniform negatives shared across the batch), bf16 autocast, a 2-process DDP run when
two GPUs are visible (or `--ddp` on CPU), validation, a faiss index on the GPU (faiss-gpu) and the demo's
`QAService.answer` on the trained checkpoint. Tiny models on a 120-passage toy world: this checks placement,
dtypes and plumbing, not accuracy.

    bash scripts/gpu_smoke.sh                 # on a CUDA machine
    bash scripts/gpu_smoke.sh --device cpu    # the same stages on CPU (tests/test_gpu_smoke.py runs this)
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ALGORITHM2 = ("corrector", "stale", "exhaustive", "snm", "regression", "two_round", "frozen", "closed_book")
TINY = [
    "data.toy_world.num_passages=120",
    "data.max_dev_examples=8",
    "strategy.k=4",
    "strategy.refresh_every=1",
    "strategy.snm_size=30",
    "strategy.regression.samples=30",
    "retriever.passage_max_length=40",
    "retriever.query_max_length=24",
    "reader.d_model=32",
    "reader.d_ff=64",
    "reader.num_layers=1",
    "reader.num_decoder_layers=1",
    "reader.num_heads=2",
    "reader.d_kv=16",
    "reader.vocab_size=500",
    "reader.max_passage_length=40",
    "reader.max_answer_length=8",
    "optim.batch_size=2",
    "optim.max_steps=2",
    "optim.warmup_steps=1",
    "save_every=0",
    "log_every=1",
]


class Stages:
    """Runs each stage, prints one PASS/FAIL line for it, and keeps going after a failure."""

    def __init__(self):
        self.failed: list[str] = []

    def run(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            detail = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 (a smoke test reports every failure and goes on)
            self.failed.append(name)
            print(
                f"FAIL {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                flush=True,
            )
            traceback.print_exc(file=sys.stderr)
            return None
        note = f": {detail}" if detail else ""
        print(f"PASS {name} ({time.perf_counter() - start:.1f}s){note}", flush=True)
        return detail


def overrides(work: Path, out: str, device: str, *extra: str) -> list[str]:
    return [
        f"output_dir={work / out}",
        f"buffer.dir={work / 'buffer'}",
        f"data.toy_world.dir={work / 'toy'}",
        f"cpu={'true' if device == 'cpu' else 'false'}",
        *TINY,
        *extra,
    ]


def fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def check_device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (use --device cpu to run the stages on CPU)")
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"torch {torch.__version__}"


def build_buffer(work: Path, device: str) -> str:
    from rlm.config import load_config
    from rlm.setup import build_components

    cfg = load_config(None, overrides(work, "buffer_run", device, "data.dev=null"))
    parts = build_components(cfg)
    return f"{len(parts.buffer)} x {parts.buffer.dim} {parts.buffer.dtype}"


def train_steps(work: Path, device: str, name: str, *extra: str) -> str:
    """Two optimizer steps of the real loop; every trained parameter on the device, every loss finite."""
    from rlm.config import load_config
    from rlm.train import build_run, train_step

    fresh_accelerate_state()
    cfg = load_config(None, overrides(work, f"train_{name}", device, "data.dev=null", *extra))
    run = build_run(cfg, overwrite=True)
    wrong = {p.device.type for p in run.raw.parameters()} - {device}
    if wrong:
        raise RuntimeError(f"parameters on {wrong}, expected {device}")
    run.model.train()
    records = [train_step(run) for _ in range(cfg.optim.max_steps)]
    if any(r is None for r in records):
        raise RuntimeError("a step was skipped for a non-finite loss")
    losses = [r["loss"] for r in records]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite losses {losses}")
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, re-embedded {records[-1]['reembedded']}"


def train_and_save(work: Path, device: str) -> Path:
    """`rlm.train.train` end to end (validation at the end, the final checkpoint) with the corrector."""
    from rlm.config import load_config
    from rlm.train import train

    fresh_accelerate_state()
    cfg = load_config(None, overrides(work, "final_run", device))
    summary = train(cfg, overwrite=True)  # the script owns this folder: a rerun starts over
    if "dev_exact_match" not in summary:
        raise RuntimeError(f"no dev metrics in {summary}")
    return work / "final_run" / "final"


def ddp_two_processes(work: Path, device: str) -> str:
    config = "ddp.yaml" if device == "cuda" else "cpu_2proc.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [str(ROOT / "configs" / "accelerate" / config), "--num_processes", "2", "-m", "rlm.train"]
    for item in overrides(work, "ddp", device, "data.dev=null", "strategy.shard_buffer=true"):
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    if "buffer sharded across 2 processes" not in done.stdout:
        raise RuntimeError("the run did not start two processes")
    return "2 processes, buffer sharded"


def faiss_index(device: str) -> str:
    import numpy as np

    from retriever.index import PassageIndex

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 64)).astype("float32")
    index = PassageIndex.build(vectors, [str(i) for i in range(1000)], use_gpu=device == "cuda")
    _, ids = index.search(vectors[:5], 3)
    if [row[0] for row in ids] != [str(i) for i in range(5)]:
        raise RuntimeError("a vector is not its own nearest neighbour")
    if device == "cuda" and not index.on_gpu:
        raise RuntimeError("the index stayed on CPU (is faiss-gpu installed? pip install '.[gpu]')")
    return "on GPU" if index.on_gpu else "on CPU"


def qa_service(checkpoint: Path) -> str:
    from app.qa import QAService

    service = QAService.from_checkpoint(checkpoint)
    question = service.examples[0] if service.examples else "Where was the founder born?"
    result = service.answer(question, k=2)
    if len(result["passages"]) != 2:
        raise RuntimeError(f"expected 2 passages, got {len(result['passages'])}")
    return f"{question!r} -> {result['answer']!r} ({result['latency_ms']:.0f} ms)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu_smoke")
    parser.add_argument("--ddp", action="store_true", help="run the 2-process stage on CPU too")
    parser.add_argument("--strategies", default=",".join(ALGORITHM2), help="Algorithm 2 strategies to step")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stages = Stages()
    if stages.run(f"device {args.device}", check_device, args.device) is None:
        print("1 stage failed: device")
        return 1
    stages.run("buffer", build_buffer, args.work, args.device)
    for name in args.strategies.split(","):
        stages.run(
            f"train algorithm 2 [{name}]", train_steps, args.work, args.device, name, f"strategy.name={name}"
        )
    alg1 = (
        "algorithm=1",
        "strategy.name=corrector",
        "strategy.num_random=4",
        "strategy.share_across_batch=true",
    )
    stages.run(
        "train algorithm 1 [corrector, top-k + uniform, shared]",
        train_steps,
        args.work,
        args.device,
        "alg1",
        *alg1,
    )
    if args.device == "cuda" and torch.cuda.is_bf16_supported():
        stages.run(
            "train bf16 autocast [corrector]",
            train_steps,
            args.work,
            args.device,
            "bf16",
            "mixed_precision=bf16",
        )
    if (args.device == "cuda" and torch.cuda.device_count() >= 2) or args.ddp:
        stages.run("ddp 2 processes [corrector, sharded buffer]", ddp_two_processes, args.work, args.device)
    else:
        print("SKIP ddp 2 processes: fewer than 2 GPUs visible (--ddp runs it on CPU)")
    checkpoint = stages.run("train + validate + save [corrector]", train_and_save, args.work, args.device)
    stages.run("faiss index", faiss_index, args.device)
    if checkpoint is not None:
        stages.run("QAService.answer", qa_service, Path(checkpoint))
    if stages.failed:
        print(f"{len(stages.failed)} stage(s) failed: {', '.join(stages.failed)}")
        return 1
    print("all stages passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
