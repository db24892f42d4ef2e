"""Run by tests/test_train_multiprocess.py under `accelerate launch`: the real `build_run` + `train_step`, with
instruments a single process cannot have: a NaN injected on one rank only, a record of accelerate's micro-step
counter at each optimizer step, whether a skipped step moved any parameter, and a digest of every parameter
after the run (one JSON file per rank).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_train.py OUT_DIR \
        [--nan-rank R --nan-call C] --set key=value ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from rlm.config import add_override_argument, load_config
from rlm.training.loop import host_record, train_step
from rlm.training.run import build_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--nan-rank", type=int, default=-1, help="the rank whose forward returns a NaN loss")
    parser.add_argument("--nan-call", type=int, default=-1, help="at its forward call number C (0-based)")
    add_override_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_config(None, args.overrides)
    run = build_run(cfg, overwrite=True)
    acc = run.accelerator
    raw = run.raw

    calls = {"n": 0}
    forward = raw.forward

    def forward_with_nan(*a, **k):
        out = forward(*a, **k)
        if acc.process_index == args.nan_rank and calls["n"] == args.nan_call:
            out.loss = out.loss * float("nan")
        calls["n"] += 1
        return out

    raw.forward = forward_with_nan  # DDP calls the wrapped module, which looks forward up on the instance

    optimizer_steps = []
    step = run.optimizer.step

    def recorded_step(*a, **k):
        # accelerate's micro-step counter and sync flag when the optimizer really steps
        optimizer_steps.append({"micro_step": acc.step, "sync_gradients": acc.sync_gradients})
        return step(*a, **k)

    run.optimizer.step = recorded_step

    def params_sha256() -> str:
        digest = hashlib.sha256()
        for name, param in sorted(raw.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().numpy().tobytes())
        return digest.hexdigest()

    run.model.train()
    records, skipped_at, skipped_moved = [], [], []
    while run.state.step < cfg.optim.max_steps:
        before, weights = run.state.step, params_sha256()
        record = train_step(run)
        if record is None:
            skipped_at.append(before)
            skipped_moved.append(params_sha256() != weights)  # a skipped window must leave them as they were
        else:
            records.append(host_record(record))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "rank": acc.process_index,
        "world": acc.num_processes,
        "accumulation_steps": run.accumulation_steps,
        "records": records,
        "skipped_at": skipped_at,
        "optimizer_steps": optimizer_steps,
        "forward_calls": calls["n"],
        "params_sha256": params_sha256(),
        "skipped_moved_params": skipped_moved,
        "torch_threads": torch.get_num_threads(),
    }
    (args.out / f"rank{acc.process_index}.json").write_text(json.dumps(result, indent=2))
    acc.end_training()


if __name__ == "__main__":
    main()
