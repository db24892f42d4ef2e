"""Training-step benchmark: where an Algorithm 2 step spends its time, per strategy, and the paper's Table 2.

Part 1 runs the real training step (`rlm.training.loop.train_step`, as `rlm train` runs it) on the toy world (quickstart
config: packaged MiniLM, small T5) for the corrector, stale and exhaustive strategies and reports the median
wall time of each phase: select, retriever (f and g forward), reader_scoring, reader (FiD forward), corrector
(its loss), backward+optimizer (the rest of the step: backward, clipping, AdamW, schedule).

Part 2 is the analogue of the paper's Table 2 (steps/s against re-embedding): for a buffer of N passages the
selection cost is measured directly (corrected top-k over an [N, D] buffer with corrector hidden 1D..8D; the
stale top-k), and exhaustive re-embedding every R steps costs N / (measured passages/s of the passage tower)
seconds every R steps. The rest of the step is part 1's stale step without its selection. The re-embedding
cost is extrapolated from the measured throughput, not run N times; the table says so.

    python scripts/bench/bench_training.py                 # ~5 minutes on a 2-core CPU
    python scripts/bench/bench_training.py --quick         # ~1 minute
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator

from lab.benchmarking import median_of
from lab.reporting import ROOT, arguments, int_list, results_path, table, write_report

from rlm.config import load_config

# torch and the training code are imported where they run: `--help` needs neither (~8 CPU-s).

PHASES = [
    "select",
    "retriever",
    "reader_scoring",
    "reader",
    "corrector",
    "losses",
    "backward+optimizer",
    "reembed",
]


def step_phases(run, args) -> dict:
    """Median seconds per phase of the measured steps; the time no phase timed is `backward+optimizer`."""
    from rlm.training.loop import train_step
    from rlm.training.throughput import PhaseTimer, step_phases

    timer = PhaseTimer(run.accelerator.device)
    timer.attach(
        run.raw, step_phases(run.raw)
    )  # the step's phases, timed from outside it as `rlm train` does
    run.strategy.before_step = timer("reembed")(run.strategy.before_step)  # refreshes timed as "reembed"
    run.model.train()
    steps = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        train_step(run, timer)
        total, phases = time.perf_counter() - start, timer.take()
        phases["backward+optimizer"] = total - sum(phases.values())
        phases["step_total"] = total - phases.get("reembed", 0.0)
        if step >= args.warmup:
            steps.append(phases)
    out = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in {k for s in steps for k in s}}
    # Re-embedding happens once every R steps: a median would hide it, so it is amortised (mean).
    out["reembed"] = statistics.fmean(s.get("reembed", 0.0) for s in steps)
    out["reembedded"] = run.strategy.reembedded
    return out


def per_phase(args) -> tuple[dict, float]:
    """Each strategy's real training steps (`build_run` + `train_step`: accelerate, clipping, schedule,
    autocast), and the passage tower's throughput."""
    from accelerate.state import AcceleratorState

    from rlm.training.run import build_run

    work, bf16 = args.work, str(args.force_cpu_bf16).lower()
    overrides = [f"output_dir={work}/run", f"buffer.dir={work}/buffer", f"data.toy_world.dir={work}/toy"]
    overrides += [f"data.toy_world.num_passages={args.num_passages}", f"optim.batch_size={args.batch_size}"]
    overrides += [f"optim.max_steps={args.warmup + args.steps}", f"strategy.k={args.k}", "cpu=true"]
    overrides += [f"strategy.refresh_every={args.refresh_every}", f"mixed_precision={args.mixed_precision}"]
    overrides += [f"force_cpu_bf16={bf16}", "data.dev=null", "save_every=0", "schedule.gold_passage_steps=0"]
    # every measured step a joint step (the quickstart's reader curriculum would make them reader-only)
    overrides += ["schedule.reader_only_steps=0", "schedule.final_reader_only_steps=0"]
    results, throughput = {}, 0.0
    for name in ("stale", "corrector", "exhaustive"):
        AcceleratorState._reset_state(reset_partial_state=True)
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", [*overrides, f"strategy.name={name}"])
        run = build_run(cfg, overwrite=True)
        # What the steps ran in: bf16 falls back to "no" on a CPU without native bf16 (rlm.precision).
        args.effective_mixed_precision = run.accelerator.mixed_precision
        results[name] = step_phases(run, args)
        if name == "stale":  # passage-tower throughput, to extrapolate re-embedding N passages
            texts = run.corpus.retrieval_texts()
            sample = [texts[i] for i in range(min(len(texts), 512))]
            start = time.perf_counter()
            with run.accelerator.autocast():  # in the steps' precision, as the refreshes embed
                run.raw.retriever.passage_tower.encode(sample, batch_size=cfg.buffer.batch_size)
            throughput = len(sample) / (time.perf_counter() - start)
    return results, throughput


def timed_median(repeats: int, fn):
    # At 1 repetition the call is long enough to need no warm-up.
    return median_of(repeats, fn, warmup=repeats > 1)


def selection_costs(args, n: int, dim: int, precision: str) -> dict:
    """Seconds per selection (median) over an [n, dim] clustered buffer, the way each strategy selects, in the
    steps' precision: stale exact, corrected exact (hidden 1D-8D), and two-stage (the auto faiss index, then
    `candidates` rows re-scored with h) with its top-k overlap with exact."""
    import torch
    from lab.benchmarking import clustered_buffer, corrector_moving, overlap

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.index_spec import auto_index_factory
    from rlm.retriever.search import corrected_topk, two_stage_corrected_topk

    buffer, q = clustered_buffer(n, dim, args.batch_size)
    rows = PassageBuffer.from_embeddings([str(i) for i in range(n)], buffer)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    reps = args.repeats if n <= 200_000 else 1
    out = {"n": n, "stale": {}, "corrector": {}, "two_stage": {}}
    # Made outside autocast: inside it, the bf16 copy of a weight cast before its in-place rescaling would be
    # cached and used for the rest of the region.
    correctors = {mult: corrector_moving(dim, mult * dim, 0.2) for mult in (1, 2, 4, 8)}
    with cast, torch.no_grad():
        out["stale"]["seconds"], stale = timed_median(reps, lambda: corrected_topk(q, rows, None, args.k))
        exact = {0: stale}
        for mult, h in correctors.items():
            seconds, exact[mult] = timed_median(reps, lambda h=h: corrected_topk(q, rows, h, args.k))
            found = overlap(stale.indices, exact[mult].indices)
            out["corrector"][mult] = {"seconds": seconds, "stale_overlap": found}
        factory = auto_index_factory(n)
        build_s, index = timed_median(1, lambda: PassageIndex.from_buffer(rows, factory))
        out["index"] = {"factory": factory, "build_s": build_s, "nprobe": args.nprobe}
        nprobe = args.nprobe if factory.startswith("IVF") else None
        search = functools.partial(two_stage_corrected_topk, q, rows, k=args.k, index=index, nprobe=nprobe)
        for mult in (0, 4, 8):  # 0: the stale strategy with the same index (no h)
            h = correctors.get(mult)
            seconds, top = timed_median(reps, lambda h=h: search(corrector=h, num_candidates=args.candidates))
            out["two_stage"][mult] = dict(seconds=seconds, overlap=overlap(top.indices, exact[mult].indices))
    return out


def method_row(method: str, select_s: float, **extra) -> dict:
    return {"method": method, "select_s": select_s, **extra}


def table2(args, phases: dict, throughput: float, dim: int, precision: str) -> list[dict]:
    """Per N: one optimizer step of each method = part 1's stale step without its selection + the method's
    selection (+ its share of re-embedding N passages every R steps, extrapolated from the measured throughput)."""
    base = phases["stale"]["step_total"] - phases["stale"].get("select", 0.0)
    rows = []
    for n in args.table2_n:
        costs = selection_costs(args, n, dim, precision)
        ts, exact, index = costs["two_stage"], costs["corrector"], costs["index"]
        stale = costs["stale"]["seconds"]
        names = {0: f"stale, two-stage index ({index['factory']})"}
        names |= {m: f"corrector hidden {m}D, two-stage ({args.candidates} candidates)" for m in (4, 8)}
        two_stage = [method_row(names[m], ts[m]["seconds"], overlap=ts[m]["overlap"]) for m in (0, 4, 8)]
        group = [method_row("stale (no re-embedding)", stale), two_stage[0]]
        group += [method_row(f"corrector hidden {m}D, exact", c["seconds"]) for m, c in exact.items()]
        group += two_stage[1:]
        for r in (50, 500):
            extra = {"reembed_s": n / throughput / r, "reembed_per_step": n / r}
            group.append(method_row(f"exhaustive R={r} (re-embedding extrapolated)", stale, **extra))
        for row in group:
            step_s = base + row["select_s"] + row.get("reembed_s", 0.0)
            row.update(n=n, index_build_s=index["build_s"], step_s=step_s)
            row.update(steps_per_s=1 / row["step_s"], relative_to_stale=row["step_s"] / group[0]["step_s"])
        rows += group
    return rows


def table2_goals(rows: list[dict]) -> Iterator[str]:
    """Per N: the two-stage corrector step <= 1.25x the stale step, and >= 2x faster than exhaustive at R = 500."""
    for n in sorted({r["n"] for r in rows}):
        group = {r["method"]: r for r in rows if r["n"] == n}
        stale = next(r for m, r in group.items() if m.startswith("stale (no"))
        exhaustive = next(r for m, r in group.items() if m.startswith("exhaustive R=500"))
        for m, r in ((m, r) for m, r in group.items() if "two-stage (" in m):
            vs_stale, vs_exh = r["step_s"] / stale["step_s"], exhaustive["step_s"] / r["step_s"]
            yield (
                f"- N = {n:,}, {m}: {vs_stale:.2f}x the stale step (goal <= 1.25x: {'met' if vs_stale <= 1.25 else 'NOT met'}), "
                f"exhaustive R=500 takes {vs_exh:.2f}x its step (goal >= 2x: {'met' if vs_exh >= 2 else 'NOT met'}); "
                f"top-k overlap with exact {r['overlap']:.3f}"
            )


def markdown(results: dict) -> str:
    args, phases, precision = results["args"], results["phases"], results["effective_mixed_precision"]
    stale = phases["stale"]["step_total"] + phases["stale"].get("reembed", 0.0)
    rows = [{"strategy": s, **p, "total": p["step_total"] + p.get("reembed", 0.0)} for s, p in phases.items()]
    columns = [("strategy", "strategy", ""), *((p, lambda r, p=p: r.get(p, 0.0), ".3f") for p in PHASES)]
    columns += [("step total", "total", ".3f"), ("vs stale", lambda r: f"{r['total'] / stale:.2f}x", "")]
    t2 = [("N", "n", ","), ("method", "method", ""), ("select (s)", "select_s", ".3f")]
    t2 += [("step (s)", "step_s", ".3f"), ("steps/s", "steps_per_s", ".3f")]
    t2 += [("vs stale", lambda r: f"{r['relative_to_stale']:.2f}x", "")]
    t2 += [("passages re-embedded per step", lambda r: r.get("reembed_per_step", 0), ".0f")]
    t2 += [("top-k overlap with exact", "overlap", ".3f")]
    builds = {r["n"]: r["index_build_s"] for r in results["table2"]}
    return "\n\n".join(
        [
            f"## Per-phase step time (median of {args['steps']} steps, seconds; toy world N={args['num_passages']}, "
            f"batch {args['batch_size']}, k={args['k']}, exhaustive R={args['refresh_every']}, mixed_precision={precision})",
            table(rows, columns),
            f"## Table 2 analogue: one optimizer step per method (D={results['dim']}; passage tower "
            f"{results['throughput']:.0f} passages/s measured; selections in {precision}, clustered fp16 buffer, "
            f"{args['batch_size']} queries, k={args['k']}; two-stage: {args['candidates']} candidates, nprobe {args['nprobe']})",
            table(results["table2"], t2),
            "Index build (once per run, before the first step): "
            + ", ".join(f"N = {n:,} {b:.1f} s" for n, b in builds.items())
            + ". Step = part 1's stale step without its selection + the method's selection (+ N/R passages "
            "re-embedded at the measured throughput, extrapolated, for exhaustive).",
            "Goals (two-stage corrector step <= 1.25x stale; >= 2x faster than exhaustive R=500):",
            "\n".join(table2_goals(results["table2"])),
        ]
    )


def main() -> None:
    parser = arguments(__doc__)
    add = parser.add_argument
    add("--work", default="runs/bench_training")
    sizes = {"--num-passages": 2000, "--batch-size": 8, "--k": 8, "--steps": 6, "--warmup": 2}
    for flag, default in sizes.items():
        add(flag, type=int, default=default)
    add("--refresh-every", type=int, default=3, help="R of exhaustive in part 1 (divides --steps)")
    table2_n = "comma-separated buffer sizes for table 2"
    add("--table2-n", type=int_list, default=[100_000, 1_000_000], help=table2_n)
    add("--candidates", type=int, default=1024, help="two-stage: rows re-scored with h")
    add("--nprobe", type=int, default=64, help="two-stage: IVF lists searched")
    add("--repeats", type=int, default=3, help="per selection (1 above 200k rows)")
    add("--threads", type=int, default=None)
    bf16 = (
        "accelerate's mixed precision for the training steps. bf16 is emulated, and ~18x slower, on CPUs "
        "without AVX512-BF16 or AMX: there the steps fall back to float32 with a warning (the table says "
        "which precision ran) unless --force-cpu-bf16"
    )
    add("--mixed-precision", default="no", choices=("no", "bf16"), help=bf16)
    add("--force-cpu-bf16", action="store_true", help="keep bf16 on a CPU without native bf16")
    add("--quick", action="store_true", help="fewer steps, N=20k, 120k for table 2")
    add("--out", default=results_path("bench_training"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.table2_n, args.repeats = 3, 1, [20_000, 120_000], 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    phases, throughput = per_phase(args)
    results = {"args": vars(args), "phases": phases, "throughput": throughput, "dim": 384}
    results["effective_mixed_precision"] = precision = args.effective_mixed_precision
    results["table2"] = table2(args, phases, throughput, 384, precision)
    write_report(args.out, markdown(results), results)


if __name__ == "__main__":
    main()
