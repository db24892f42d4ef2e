"""Training-step benchmark: where an Algorithm 2 step spends its time, per strategy, and the paper's Table 2.

Part 1 runs the real training step (`rlm.train.train_step`, as `rlm train` runs it) on the toy world (quickstart
config: packaged MiniLM, small T5) for the corrector, stale and exhaustive strategies and reports the median
wall time of each phase: select, retriever (f and g forward), reader_scoring, reader (FiD forward), corrector
(its loss), backward+optimizer (the rest of the step: backward, clipping, AdamW, schedule).

Part 2 is the analogue of the paper's Table 2 (steps/s against re-embedding): for a buffer of N passages the
selection cost is measured directly (corrected top-k over an [N, D] buffer with corrector hidden 1D..8D; the
stale top-k), and exhaustive re-embedding every R steps costs N / (measured passages/s of the passage tower)
seconds every R steps. The rest of the step is part 1's stale step without its selection. The re-embedding
cost is extrapolated from the measured throughput, not run N times; the table says so.

    python scripts/bench_training.py                 # ~5 minutes on a 2-core CPU
    python scripts/bench_training.py --quick         # ~1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from accelerate.state import AcceleratorState

from retriever.corrector import CorrectorNetwork
from retriever.search import corrected_topk
from rlm.config import load_config
from rlm.train import build_run, train_step

ROOT = Path(__file__).resolve().parents[1]


class PhaseTimer:
    """`with timer("name"):` accumulates wall time per phase for the current step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def per_phase(args) -> tuple[dict, float]:
    """Real training steps (`rlm.train.build_run` + `train_step`: accelerate, clipping, schedule, autocast)
    with the model's phase timer on; everything outside the timed phases is `backward+optimizer`."""
    overrides = [
        f"output_dir={args.work}/run",
        f"buffer.dir={args.work}/buffer",
        f"data.toy_world.dir={args.work}/toy",
        f"data.toy_world.num_passages={args.num_passages}",
        f"optim.batch_size={args.batch_size}",
        f"optim.max_steps={args.warmup + args.steps}",
        f"strategy.k={args.k}",
        f"strategy.refresh_every={args.refresh_every}",
        f"mixed_precision={args.mixed_precision}",
        f"force_cpu_bf16={str(args.force_cpu_bf16).lower()}",
        "data.dev=null",
        "save_every=0",
        "cpu=true",
        # every measured step a joint step (the quickstart's reader curriculum would make them reader-only)
        "reader.gold_passage_steps=0",
        "reader.reader_only_steps=0",
        "reader.final_reader_only_steps=0",
    ]
    results, throughput = {}, 0.0
    args.effective_mixed_precision = args.mixed_precision
    for name in ("stale", "corrector", "exhaustive"):
        AcceleratorState._reset_state(reset_partial_state=True)
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", [*overrides, f"strategy.name={name}"])
        run = build_run(cfg)
        # What the steps ran in: bf16 falls back to "no" on a CPU without native bf16 (rlm.precision).
        args.effective_mixed_precision = run.accelerator.mixed_precision
        timer = PhaseTimer()
        run.raw.timer = timer
        before_step = run.strategy.before_step

        def timed_refresh(step, embed, before_step=before_step, timer=timer):
            with timer("reembed"):
                before_step(step, embed)

        run.strategy.before_step = timed_refresh
        run.model.train()
        steps = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            train_step(run)
            phases = timer.take()
            total = time.perf_counter() - start
            phases["backward+optimizer"] = total - sum(phases.values())
            phases["step_total"] = total - phases.get("reembed", 0.0)
            if step >= args.warmup:
                steps.append(phases)
        keys = sorted({k for s in steps for k in s})
        results[name] = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
        # Re-embedding happens once every R steps: a median would hide it, so it is amortised (mean).
        results[name]["reembed"] = statistics.fmean(s.get("reembed", 0.0) for s in steps)
        results[name]["reembedded"] = run.strategy.reembedded
        if name == "stale":
            # Passage-tower throughput (passages/s), for extrapolating a full re-embedding of N passages.
            texts = run.corpus.retrieval_texts()
            sample = [texts[i] for i in range(min(len(texts), 512))]
            start = time.perf_counter()
            with run.accelerator.autocast():  # in the steps' precision, as the refreshes embed
                run.raw.retriever.passage_tower.encode(sample, batch_size=cfg.buffer.batch_size)
            throughput = len(sample) / (time.perf_counter() - start)
    return results, throughput


def select_time(n: int, dim: int, hidden_mult: int | None, queries: int, k: int, repeats: int) -> float:
    buffer = torch.nn.functional.normalize(torch.randn(n, dim), dim=-1).half()
    q = torch.nn.functional.normalize(torch.randn(queries, dim), dim=-1)
    corrector = None
    if hidden_mult:
        corrector = CorrectorNetwork(dim, hidden_mult * dim)
        with torch.no_grad():  # a trained-looking corrector: non-zero residual branch
            for p in corrector.parameters():
                p.normal_(0, 0.02)
    corrected_topk(q, buffer, corrector, k)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        corrected_topk(q, buffer, corrector, k)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table2(args, phases: dict, throughput: float, dim: int) -> list[dict]:
    base = phases["stale"]["step_total"] - phases["stale"].get("select", 0.0)
    rows = []
    stale_select = select_time(args.table2_n, dim, None, args.batch_size, args.k, args.repeats)
    rows.append({"method": "stale (no re-embedding)", "step_s": base + stale_select, "reembed_per_step": 0})
    for mult in (1, 2, 4, 8):
        t = select_time(args.table2_n, dim, mult, args.batch_size, args.k, args.repeats)
        rows.append({"method": f"corrector hidden {mult}D", "step_s": base + t, "reembed_per_step": 0})
    reembed_s = args.table2_n / throughput
    for r in (50, 500):
        rows.append(
            {
                "method": f"exhaustive R={r} (re-embedding extrapolated)",
                "step_s": base + stale_select + reembed_s / r,
                "reembed_per_step": args.table2_n / r,
            }
        )
    for row in rows:
        row["steps_per_s"] = 1.0 / row["step_s"]
        row["relative_to_stale"] = row["step_s"] / rows[0]["step_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", default="runs/bench_training")
    parser.add_argument("--num-passages", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--refresh-every",
        type=int,
        default=3,
        help="R of the exhaustive strategy in part 1 (divides --steps)",
    )
    parser.add_argument("--table2-n", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--mixed-precision",
        default="no",
        choices=("no", "bf16"),
        help="accelerate's mixed precision for the training steps. bf16 is emulated, and ~18x slower, on CPUs "
        "without AVX512-BF16 or AMX: there the steps fall back to float32 with a warning (the table says "
        "which precision ran) unless --force-cpu-bf16",
    )
    parser.add_argument(
        "--force-cpu-bf16",
        action="store_true",
        help="keep bf16 on a CPU without native bf16 (to measure how slow it is)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps, N=20k for table 2")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_training"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.table2_n, args.repeats = 3, 1, 20_000, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    phases, throughput = per_phase(args)
    names = ["select", "retriever", "reader_scoring", "reader", "corrector", "backward+optimizer", "reembed"]
    lines = [
        f"## Per-phase step time (median of {args.steps} steps, seconds; toy world N={args.num_passages}, "
        f"batch {args.batch_size}, k={args.k}, exhaustive R={args.refresh_every}, "
        f"mixed_precision={args.effective_mixed_precision})",
        "",
        "| strategy | " + " | ".join(names) + " | step total | vs stale |",
        "|---" * (len(names) + 3) + "|",
    ]
    stale_total = phases["stale"]["step_total"] + phases["stale"].get("reembed", 0.0)
    for name, p in phases.items():
        total = p["step_total"] + p.get("reembed", 0.0)
        cells = " | ".join(f"{p.get(n, 0.0):.3f}" for n in names)
        lines.append(f"| {name} | {cells} | {total:.3f} | {total / stale_total:.2f}x |")
    dim = 384
    rows = table2(args, phases, throughput, dim)
    lines += [
        "",
        f"## Table 2 analogue: steps/s at N={args.table2_n:,} passages (D={dim}; passage tower "
        f"{throughput:.0f} passages/s measured)",
        "",
        "| method | step (s) | steps/s | vs stale | passages re-embedded per step |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['step_s']:.3f} | {row['steps_per_s']:.3f} | "
            f"{row['relative_to_stale']:.2f}x | {row['reembed_per_step']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "phases": phases, "throughput": throughput, "table2": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
