"""Scale benchmark (`rlm bench scale`): the sharded corrected top-k at 1M-4M rows x 768 on 1 and 2 processes,
and a projection to 21M x 768 on 8 GPUs.

For each N a buffer of random unit vectors is written as `rlm embed` writes one, opened memory-mapped by
`PassageBuffer.load`, and scanned by 1 process, then by 2 (gloo, `torch.distributed.run`), each through
`retriever.distributed.ShardedRows` over its contiguous half: the code path of a sharded training run. Every
process gets the same torch threads (default 1): "2 processes" models two devices. Per process (B = 8 queries,
k = 32, bf16 autocast): start-up (imports, process group, load, first pass), the stale and the corrected top-k
over its rows (h = CorrectorNetwork(768, --hidden)), wider correctors on a slice of its rows (scaled per row),
one corrector-loss step on B_y, peak RSS and the buffer pages it holds; wall and CPU seconds, min over
repetitions.

The projection to 21M x 768 on 8 H100s uses each part's FLOPs and bytes per row (checked against the CPU
figures) and stated GPU constants (`--proj-*`); the report prints the formulas.

    python scripts/bench_scale.py                      # N = 1M, 2M, 4M (~15-20 min on 2 shared cores)
    python scripts/bench_scale.py --quick              # N = 50k, 100k (about a minute)
    python scripts/bench_scale.py --render docs/results/bench_scale/bench_scale.json   # .md/.png of a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from rlm.experiments import reporting
from rlm.experiments.benchmarking import PROJECTION_DEFAULTS as DEFAULTS
from rlm.experiments.benchmarking import (
    autocast,
    corrector_moving,
    fmt_n,
    gpu_rates,
    run_or_render,
    scale_arguments,
    synthetic_buffers,
)
from rlm.experiments.reporting import load_average

D, BATCH, K, CHUNK, SEED, BETA, GB = 768, 8, 32, 65_536, 0, 20.0, 1e9
# T5-base: 12 layers, d_model 768, d_ff 3072, vocab 32128; GTR-base = T5-base encoder (+ Dense 768x768).
T5_LAYERS, T5_D, T5_FF, T5_VOCAB = 12, 768, 3072, 32_128
T5_ENC = T5_LAYERS * (4 * T5_D**2 + 2 * T5_D * T5_FF)  # 84.9M matmul parameters
T5_DEC = T5_LAYERS * (8 * T5_D**2 + 2 * T5_D * T5_FF)  # 113.2M (self + cross attention + FFN)
T5_EMB = T5_D * T5_VOCAB  # 24.7M (shared input embedding / LM head)
FID_ACT_GIB_PER_QUESTION = 0.41  # docs/results/bench_reader: T5-base FiD, K=32 x 256 tokens, checkpointing
CLOCKS = ("wall_s", "cpu_s")


def random_rows(s: int, rows: int) -> np.ndarray:
    """Shard s: fp16 unit vectors N(0, I)/norm from rng([SEED, s]) (deterministic whatever the shard order)."""
    block = np.random.default_rng([SEED, s]).standard_normal((rows, D), dtype=np.float32)
    return (block / np.linalg.norm(block, axis=1, keepdims=True)).astype(np.float16)


# ----------------------------------------------------------------------------------------------- worker


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon, RssFile of this process in bytes (Linux /proc; zeros elsewhere)."""
    out = dict.fromkeys(("VmRSS", "VmHWM", "RssAnon", "RssFile"), 0)
    with contextlib.suppress(OSError):
        for key, _, value in (
            line.partition(":") for line in Path("/proc/self/status").read_text().splitlines()
        ):
            if key in out:
                out[key] = int(value.split()[0]) * 1024
    return out


def cpu_pressure() -> float | None:
    """/proc/pressure/cpu 'some avg10': % of the last 10 s some runnable task waited for a core (Linux PSI)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return float(Path("/proc/pressure/cpu").read_text().split("avg10=")[1].split()[0])
    return None


def make_processes():
    """`Processes` for this rank: gloo all_gather along dim 0 and barrier when WORLD_SIZE > 1."""
    import torch.distributed as dist

    from retriever.distributed import Processes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes()
    dist.init_process_group("gloo")

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def gather_object(items: list) -> list:
        parts = [None] * world
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    return Processes(dist.get_rank(), world, gather, dist.barrier, gather_object)


def timed(procs, fn, reps: int) -> tuple[dict, object]:
    """Wall and CPU seconds of `fn` (min over `reps`, each after a barrier) and its last result. CPU seconds are
    the work this process did whatever other jobs took from the shared cores; wall seconds include the waits."""
    walls, cpus, out = [], [], None
    for _ in range(reps):
        procs.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": min(walls), "cpu_s": min(cpus), "all_wall_s": walls, "all_cpu_s": cpus}, out


def worker(args) -> dict:
    """One process of W: everything its record in the JSON holds."""
    import torch.distributed as dist

    from retriever.buffer import PassageBuffer
    from retriever.corrector import corrector_ce_loss
    from retriever.distributed import ShardedRows, slice_rows

    import_s = time.time() - psutil.Process().create_time()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    procs = make_processes()
    init_s = time.perf_counter() - start
    status, pressure = {"start": proc_status()}, [cpu_pressure()]
    start = time.perf_counter()
    buffer = PassageBuffer.load(args.buffer)
    lo, hi = procs.part(len(buffer))

    def rows_of(stop: int):
        return ShardedRows(slice_rows(buffer, lo, stop), torch.arange(lo, stop), procs)

    rows = rows_of(hi)
    open_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(SEED + procs.rank)
    queries = torch.nn.functional.normalize(torch.randn(BATCH, D, generator=generator), dim=-1)

    def select(corrector, which=rows):
        with autocast(args.dtype):
            return which.topk(queries, corrector, K, CHUNK)

    # The first pass pages the rows in (a device run copies them onto the device here instead).
    first, _ = timed(procs, lambda: select(None), 1)
    stale_t, stale = timed(procs, lambda: select(None), args.stale_reps)
    corrected_t, top = timed(procs, lambda: select(corrector_moving(D, args.hidden)), args.reps)
    status["scanned"] = proc_status()
    pressure.append(cpu_pressure())
    slices = []
    for hidden, slice_rows_ in args.slice_hidden:
        m = max(1, min(slice_rows_, hi - lo))
        h, part = corrector_moving(D, hidden), rows_of(lo + m)
        t, _ = timed(procs, lambda h=h, p=part: select(h, p), args.slice_reps)
        slices.append({"hidden": hidden, "rows": m, **t, **{f"{c}_per_row": t[c] / m for c in CLOCKS}})
    status["slices"] = proc_status()

    # Corrector-loss step: h on B_y (B x k rows of the whole buffer), CE against target scores, backward.
    losses = []
    targets = torch.randn(BATCH, K, generator=torch.Generator().manual_seed(3))
    for hidden in [args.hidden] + [h for h, _ in args.loss_hidden]:
        h = corrector_moving(D, hidden).train()

        def loss_step(h=h):
            h.zero_grad(set_to_none=True)
            with autocast(args.dtype):
                corrected = torch.einsum("bd,bkd->bk", queries, h(buffer.rows(top.indices).float()))
                loss = corrector_ce_loss(targets, corrected, beta=BETA)
            loss.backward()

        loss_step()  # warm-up
        losses.append({"hidden": hidden, **timed(procs, loss_step, args.loss_reps)[0]})
    status["end"] = proc_status()
    pressure.append(cpu_pressure())
    record = {"rank": procs.rank, "world": procs.world, "threads": torch.get_num_threads(), "rows": hi - lo}
    record |= {"row_range": [lo, hi], "buffer_bytes_scanned": (hi - lo) * D * 2}
    record |= {
        "buffer_bytes_mapped": len(buffer) * D * 2,
        # Buffer pages this process holds after scanning its rows (file-backed RSS grown since the start) ...
        "buffer_resident_bytes": status["scanned"]["RssFile"] - status["start"]["RssFile"],
        # ... and what reading B_y (rows of the whole buffer, often another process's) added to it.
        "b_y_resident_bytes": status["end"]["RssFile"] - status["slices"]["RssFile"],
        "import_s": import_s,
        "init_s": init_s,
        "open_s": open_s,
        "first_pass_s": first["wall_s"],
        "startup_s": import_s + init_s + open_s + first["wall_s"],
        "stale": stale_t,
        "corrected": corrected_t,
        "corrected_hidden": args.hidden,
        "slices": slices,
        "loss_steps": losses,
        "peak_rss_selection_bytes": status["scanned"]["VmHWM"],  # page-in + stale + corrected scans
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # incl. slices, loss
        "cpu_pressure_avg10": pressure,
        "status": status,
        "top_rows": top.indices.tolist(),
        "stale_rows": stale.indices.tolist(),
    }
    if procs.world > 1:
        procs.barrier()
        dist.destroy_process_group()
    return record


# ----------------------------------------------------------------------------------------------- projection


def t5_step_flops(p: dict) -> dict[str, float]:
    """FLOPs of one optimizer step of the paper's setting (all GPUs together), by component. Training matmuls
    cost 8 x params x tokens with gradient checkpointing (forward 2, backward 4, re-forward 2); attention
    adds 4 x L x d per token per layer forward (scores and values)."""
    q, k, lp, la = p["questions_per_step"], p["passages"], p["passage_tokens"], p["answer_tokens"]
    enc_tokens, dec_tokens, lq = q * k * lp, q * la, p["query_tokens"]
    attn = 4 * T5_LAYERS * T5_D * lp  # per token, forward
    cross_kv = 4 * T5_LAYERS * T5_D**2  # K and V of every encoder state, per decoder pass, forward
    cross_attn = 4 * T5_LAYERS * T5_D * k * lp  # per decoder token, forward, over all k passages
    return {
        "fid_reader": 8 * (T5_ENC + attn + cross_kv) * enc_tokens
        + 8 * (T5_DEC - 2 * T5_LAYERS * T5_D**2 + cross_attn + T5_EMB) * dec_tokens,
        # Step 4: every passage scored alone, no grad: encoder forward + decoder over the answer.
        "reader_scoring": 2 * (T5_ENC + attn + cross_kv) * enc_tokens
        + 2 * (T5_DEC + 4 * T5_LAYERS * T5_D * lp + T5_EMB) * q * k * la,
        # Step 3: the live passage tower g on the q x k selected passages, with grad (checkpointing).
        "passage_tower": 8 * (T5_ENC + attn + T5_D**2) * enc_tokens,
        "query_tower": 8 * (T5_ENC + 4 * T5_LAYERS * T5_D * lq + T5_D**2) * q * lq,
    }


def project(measured: dict, p: dict, hiddens: list[int]) -> dict:
    """The projection to p['n'] x 768 on p['gpus'] GPUs, per corrector width: memory, seconds per step, days."""
    n, w = p["n"], p["gpus"]
    rows = math.ceil(n / w)
    accumulation = max(1, p["questions_per_step"] // (p["micro_batch"] * w))
    gathered = p["micro_batch"] * w  # queries every process scores (all-gathered) per micro-step
    gemm, hbm = gpu_rates(p)
    flops = t5_step_flops(p)
    model_s = sum(flops.values()) / (w * p["peak_tflops"] * 1e12 * p["train_mfu"])
    params = T5_ENC + T5_DEC + T5_EMB + 2 * (T5_ENC + T5_EMB + T5_D**2)  # reader + f + g (biases ignored)
    # DDP: fp32 gradients all-reduced (2x bytes over the bus) + AdamW (read/write ~16 B/param) on every GPU.
    sync_s = 2 * 4 * params / (p["nvlink_gbps"] * 1e9) + 16 * params / hbm
    # Refresh (exhaustive baseline, every R steps): N/W passages through GTR-base, forward.
    embed_flops = 2 * (T5_ENC + 4 * T5_LAYERS * T5_D * p["passage_tokens"] + T5_D**2) * p["passage_tokens"]
    refresh_s = rows * embed_flops / (p["peak_tflops"] * 1e12 * p["embed_mfu"])
    buffer_bytes = rows * D * 2
    # Start-up: launch + ids + the node's buffer read once from disk + its rows to the device + model weights.
    startup = {
        "launch_s": p["launch_s"],
        "ids_and_open_s": measured.get("open_s_per_row", 0.0) * n,
        "buffer_disk_s": n * D * 2 / (p["disk_gbps"] * 1e9),
        "buffer_h2d_s": buffer_bytes / (p["pcie_gbps"] * 1e9),
        "models_s": w * 4 * params / (p["disk_gbps"] * 1e9),
    }
    stale_s = rows * 2 * D / hbm + rows * 2 * gathered * D / gemm
    out = {"params": p, "rows_per_process": rows, "accumulation": accumulation}
    out |= {"selections_per_step": accumulation, "gathered_queries": gathered, "model_flops_per_step": flops}
    out |= {"model_step_s": model_s, "sync_s": sync_s, "refresh_s_per_process": refresh_s, "startup": startup}
    out |= {"startup_s": sum(startup.values()), "by_hidden": []}
    out["stale"] = {
        "bytes_per_row": 2 * D,
        "seconds": stale_s,
        "cpu_seconds_per_row": measured.get("stale_s_per_row"),
    }
    for hidden in hiddens:
        row_flops = 4 * D * hidden + 2 * gathered * D
        # bytes per row: fp16 row read, bf16 cast written + read, hidden activations and h's output written +
        # read (bf16), fp32 scores written.
        row_bytes = 2 * D + 4 * D + 4 * hidden + 4 * D + 4 * gathered
        select_s = rows * row_flops / gemm + rows * row_bytes / hbm
        loss_s = 3 * p["micro_batch"] * p["passages"] * 4 * D * hidden / gemm
        cpu_row = measured.get("corrected_s_per_row", {}).get(hidden)
        per_step = {
            "model (FiD reader + towers, MFU)": model_s,
            "corrected selection": accumulation * select_s,
        }
        per_step |= {
            "corrector loss": accumulation * loss_s,
            "gradient all-reduce + AdamW": sync_s,
            "refresh": 0.0,
        }
        step_s = sum(per_step.values())
        # Weights, grads and Adam moments (16 B/param) of reader, f, g and h; checkpointed activations: FiD
        # ~0.41 GiB per question (bench_reader), the passage tower about as much.
        memory = {
            "buffer shard": buffer_bytes,
            "selection working set": CHUNK * (2 * hidden + 10 * D) + gathered * CHUNK * 4,
            "model states": 16 * (params + 2 * D * hidden + hidden + D),
            "activations (checkpointed)": 2 * FID_ACT_GIB_PER_QUESTION * 2**30 * p["micro_batch"],
        }
        h = {
            "hidden": hidden,
            "flops_per_row": row_flops,
            "bytes_per_row": row_bytes,
            "cpu_seconds_per_row": cpu_row,
        }
        h |= {"cpu_gflops": row_flops / cpu_row / 1e9 if cpu_row else None}
        h |= {
            "gpu_seconds_per_row": row_flops / gemm + row_bytes / hbm,
            "selection_s": select_s,
            "loss_s": loss_s,
        }
        h |= {"per_step": per_step, "step_s": step_s, "selection_fraction": accumulation * select_s / step_s}
        h |= {"days": (p["steps"] * step_s + out["startup_s"]) / 86400}
        h["exhaustive_step_s"] = (
            step_s - accumulation * (select_s + loss_s - stale_s) + refresh_s / p["refresh_every"]
        )
        h |= {"gpu_memory_bytes": memory, "gpu_memory_total_bytes": sum(memory.values())}
        out["by_hidden"].append(h)
    return out


# ----------------------------------------------------------------------------------------------- summary


def slowest(records: list[dict], key, hidden=None) -> float:
    """The largest of `key(record)` (or of key over the items with this `hidden` of list `records`)."""
    return max(key(r) for r in records if hidden is None or r["hidden"] == hidden)


def per_process(records: list[dict], slice_rows: dict[int, dict]) -> dict:
    """One run's figures per process: the slowest / largest of its W processes (a step waits for the slowest);
    the slice widths' per-row costs (measured at one N) scaled to this run's rows."""
    keys = ("rows", "buffer_bytes_scanned", "buffer_resident_bytes", "b_y_resident_bytes")
    keys += ("peak_rss_selection_bytes", "peak_rss_bytes", "startup_s", "import_s", "init_s", "open_s")
    out = {key: max(r[key] for r in records) for key in (*keys, "first_pass_s")}
    out |= {
        f"{part}_{c}": max(r[part][c] for r in records) for part in ("stale", "corrected") for c in CLOCKS
    }
    losses = [x for r in records for x in r["loss_steps"]]
    out["loss_ms"] = {
        x["hidden"]: 1e3 * slowest(losses, lambda y: y["wall_s"], x["hidden"])
        for x in records[0]["loss_steps"]
    }
    out["scaled"] = {
        h: {c: costs[f"{c}_per_row"] * out["rows"] for c in CLOCKS} for h, costs in slice_rows.items()
    }
    pressure = [p for r in records for p in r["cpu_pressure_avg10"] if p is not None]
    out["cpu_pressure_max"] = max(pressure) if pressure else None
    return out


def summarize(results: dict) -> None:
    """Per (N, W) the per-process figures, per N the 1 -> 2 process ratios, and the 1-process CPU per-row
    costs the projection starts from (CPU seconds: the work, without the waits for a core)."""
    slices = {}  # per W: per-row costs of each slice width (slowest process)
    for run in (run for size in results["sizes"] for run in size["runs"]):
        items = [x for r in run["processes"] for x in r["slices"]]
        if items and run["world"] not in slices:
            slices[run["world"]] = {
                x["hidden"]: {"rows": x["rows"]}
                | {
                    f"{c}_per_row": slowest(items, lambda y, c=c: y[f"{c}_per_row"], x["hidden"])
                    for c in CLOCKS
                }
                for x in run["processes"][0]["slices"]
            }
    summary, ratios = [], []
    for size in results["sizes"]:
        by_world = {
            run["world"]: per_process(run["processes"], slices.get(run["world"], {})) for run in size["runs"]
        }
        summary += [{"n": size["n"], "world": world, **pp} for world, pp in by_world.items()]
        if 1 in by_world and 2 in by_world:
            one, two = by_world[1], by_world[2]
            ratio = {
                "n": size["n"],
                "buffer_memory": one["buffer_resident_bytes"] / max(two["buffer_resident_bytes"], 1),
            }
            ratio["peak_rss"] = one["peak_rss_selection_bytes"] / two["peak_rss_selection_bytes"]
            ratio |= {
                f"{part}_{c}": one[f"{part}_{c}"] / two[f"{part}_{c}"]
                for part in ("stale", "corrected")
                for c in CLOCKS
            }
            ratios.append(ratio | {"top_k_equal": size.get("sharded_equals_whole")})
    one_proc = [s for s in summary if s["world"] == 1]
    rows = sum(s["rows"] for s in one_proc)
    largest = max(one_proc, key=lambda s: s["n"])
    results["summary"], results["ratios"], results["slice_costs"] = summary, ratios, slices
    results["per_row"] = {
        "stale_s_per_row": sum(s["stale_cpu_s"] for s in one_proc) / rows,
        "corrected_s_per_row": {
            results["hidden"]: sum(s["corrected_cpu_s"] for s in one_proc) / rows,
            **{h: c["cpu_s_per_row"] for h, c in slices.get(1, {}).items()},
        },
        "open_s_per_row": largest["open_s"] / largest["rows"],
    }


def goals(results: dict) -> list[str]:
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = []
    if results["ratios"]:
        mem, cpu, wall = (
            min(r[key] for r in results["ratios"])
            for key in ("buffer_memory", "corrected_cpu_s", "corrected_wall_s")
        )
        lines.append(
            f"- 1 -> 2 processes, per-process buffer memory falls by >= 1.7x: {met(mem >= 1.7)} (lowest {mem:.2f}x)."
        )
        lines.append(
            f"- 1 -> 2 processes, per-process corrected selection time falls by >= 1.7x: CPU time {met(cpu >= 1.7)} "
            f"(lowest {cpu:.2f}x); wall time {met(wall >= 1.7)} (lowest {wall:.2f}x; needs a free core per process)."
        )
    proj = results["projection"]
    lines += [
        f"- 21M x 768 on {proj['params']['gpus']} GPUs, h{h['hidden']}, micro-batch {variant['params']['micro_batch']} "
        f"(A = {variant['accumulation']}): corrected selection {h['selection_fraction']:.1%} of a {h['step_s']:.2f} s "
        f"optimizer step (goal <= 10%: {met(h['selection_fraction'] <= 0.10)})."
        for variant in results["projection_variants"]
        for h in variant["by_hidden"]
    ]
    return [*lines, f"- start-up {proj['startup_s']:.0f} s (goal <= 120 s: {met(proj['startup_s'] <= 120)})."]


# ----------------------------------------------------------------------------------------------- report

FORMULAS = """```
selection  t_sel   = r * (4*D*H + 2*G*D) / (peak * gemm_eff) + r * (12*D + 4*H + 4*G) bytes / HBM
loss       t_loss  = 3 * (b*k) * 4*D*H / (peak * gemm_eff)
model      t_mod   = F_step / (W * peak * MFU)   (F_step: FiD reader, reader scoring, both towers; 8x params x
                     tokens with checkpointing, 2x for the no-grad scoring)
sync       t_sync  = 2*4*P_all / bus + 16*P_all / HBM            (fp32 gradient all-reduce + AdamW)
step       t_step  = t_mod + A*(t_sel + t_loss) + t_sync        (+ t_ref / R for the exhaustive baseline)
refresh    t_ref   = r * 2*(P_enc + attn)*L / (peak * embed_MFU)  (the corrector never refreshes)
days               = (steps * t_step + t_start) / 86400
start-up   t_start = launch + open (CPU-measured per row * N) + N*D*2 / disk + r*D*2 / PCIe + W * model bytes / disk
```"""


def markdown(results: dict) -> str:
    hidden, slice_h = results["hidden"], [h for h, _ in results["slice_hidden"]]
    loss_h = slice_h or [hidden]
    proj = results["projection"]
    p = proj["params"]
    columns = [("N", lambda s: fmt_n(s["n"]), ""), ("procs", "world", "d"), ("rows / process", "rows", ",")]
    columns += [
        (f"{title} GB", lambda s, key=key: s[key] / GB, ".2f")
        for title, key in (
            ("buffer scanned", "buffer_bytes_scanned"),
            ("buffer resident", "buffer_resident_bytes"),
            ("peak RSS", "peak_rss_selection_bytes"),
        )
    ]
    columns += [
        ("start-up s", "startup_s", ".1f"),
        ("stale top-k s wall / CPU", lambda s: f"{s['stale_wall_s']:.2f} / {s['stale_cpu_s']:.2f}", ""),
        (
            f"corrected h{hidden} s wall / CPU",
            lambda s: f"{s['corrected_wall_s']:.1f} / {s['corrected_cpu_s']:.1f}",
            "",
        ),
    ]
    columns += [
        (f"corrected h{h} s CPU (scaled)", lambda s, h=h: s["scaled"].get(h, {}).get("cpu_s"), ".0f")
        for h in slice_h
    ]
    loss = lambda s: " / ".join(f"{s['loss_ms'][h]:.0f}" for h in loss_h)  # noqa: E731
    columns += [
        ("loss step ms " + " / ".join(f"h{h}" for h in loss_h), loss, ""),
        ("CPU pressure %", "cpu_pressure_max", ".0f"),
    ]
    ratio_columns = [
        ("N", lambda r: fmt_n(r["n"]), ""),
        ("buffer resident", "buffer_memory", ".2f"),
        ("peak RSS", "peak_rss", ".2f"),
    ]
    ratio_columns += [
        (f"{part} top-k {c}", f"{part}_{c}_s", ".2f")
        for part in ("stale", "corrected")
        for c in ("wall", "cpu")
    ]
    ratio_columns.append(("merged top-k = 1-process top-k", "top_k_equal", ""))
    step_rows = [
        {"micro_batch": v["params"]["micro_batch"], "accumulation": v["accumulation"], **h, **h["per_step"]}
        for v in results["projection_variants"]
        for h in v["by_hidden"]
    ]
    step_columns = [
        ("corrector h", "hidden", "d"),
        ("micro-batch", "micro_batch", "d"),
        ("A", "accumulation", "d"),
    ]
    step_columns += [
        ("selection / step s", "corrected selection", ".3f"),
        ("loss / step ms", lambda h: 1e3 * h["corrector loss"], ".1f"),
        ("model s", "model (FiD reader + towers, MFU)", ".3f"),
        ("sync s", "gradient all-reduce + AdamW", ".3f"),
        ("step s", "step_s", ".3f"),
        ("selection share", "selection_fraction", ".1%"),
        (f"days for {p['steps']:,} steps (+ start-up)", "days", ".2f"),
        (f"exhaustive R={p['refresh_every']} step s", "exhaustive_step_s", ".3f"),
        ("GPU memory / process GB", lambda h: h["gpu_memory_total_bytes"] / GB, ".1f"),
    ]
    mfu = "; ".join(
        f"MFU {v['params']['train_mfu']:.0%}: "
        + ", ".join(f"h{h['hidden']} {h['selection_fraction']:.1%}" for h in v["by_hidden"])
        for v in results["projection_mfu"]
    )
    return f"""# Scale benchmark: sharded corrected top-k on 1 and 2 processes, and a 21M x 768 projection

Command: `{results["command"]}`; {reporting.machine_line(results["machine"])}; {results["wall_s"] / 60:.1f} min.

**Timings are noisy**: the 2 cores were shared with other people's jobs (load average {results["load_before"]} \
before, {results["load_after"]} after; CPU pressure: the kernel's share of time some task waited for a core). Read \
the 1- and 2-process runs of each N (back to back, same buffer) through their ratios; CPU time is the work a \
process did, wall time includes its waits.

Buffer: fp16 x {D}, random unit vectors, memory-mapped; {BATCH} queries per process, k = {K}, chunk {CHUNK:,}, \
{results["dtype"]} autocast; per process = the slowest of the W; min over {results["reps"]} reps. Wider h on a slice \
({", ".join(f"h{h} on {rows:,} rows" for h, rows in results["slice_hidden"])}; at N = \
{", ".join(fmt_n(n) for n in results["slices_at"])}), scaled per row.

{reporting.table(results["summary"], columns)}

![selection seconds and memory per process vs N](bench_scale.png)

## 1 -> 2 processes (per process: 1-process figure / 2-process figure)

{reporting.table(results["ratios"], ratio_columns)}

## Projection: 21M x 768 on 8 GPUs

Constants (`--proj-*`): {p["gpus"]} x H100 SXM, bf16 peak {p["peak_tflops"]:g} TFLOP/s, GEMMs at \
{p["gemm_efficiency"]:.0%} of it, model MFU {p["train_mfu"]:.0%}, refresh MFU {p["embed_mfu"]:.0%}, HBM \
{p["hbm_tbps"]:g} TB/s, PCIe {p["pcie_gbps"]:g} GB/s, disk {p["disk_gbps"]:g} GB/s, bus {p["nvlink_gbps"]:g} GB/s, \
launch {p["launch_s"]:g} s. Setting (configs/nq.yaml): N = {p["n"]:,}, W = {p["gpus"]}, {p["questions_per_step"]} \
questions x {p["passages"]} passages x {p["passage_tokens"]} tokens per step, {p["micro_batch"]} per GPU per \
micro-step -> A = {proj["accumulation"]} selections of G = {proj["gathered_queries"]} queries against r = \
{proj["rows_per_process"]:,} rows; {p["steps"]:,} steps. Per process (H = corrector width, b = questions per GPU \
per micro-step, P = matmul parameters, L = tokens):

{FORMULAS}

t_mod = {proj["model_step_s"]:.3f} s, t_sync = {proj["sync_s"] * 1e3:.0f} ms, t_ref = \
{proj["refresh_s_per_process"]:.0f} s per process every {p["refresh_every"]} steps; start-up \
{", ".join(f"{k} {v:.1f} s" for k, v in proj["startup"].items())} = {proj["startup_s"]:.0f} s.

{reporting.table(step_rows, step_columns)}

Selection share by the model's MFU: {mfu}.

## Goals

""" + "\n".join(results["goals"])


def plot(results: dict):
    fig, (left, right) = reporting.figure(2, (11, 4.2))
    h = results["hidden"]
    for world, style in ((1, "-o"), (2, "--s")):
        rows = sorted((s for s in results["summary"] if s["world"] == world), key=lambda s: s["n"])
        for ax, key, color, alpha, label in (
            (left, "corrected_cpu_s", "C0", 1.0, f"corrected h{h}, CPU s"),
            (left, "corrected_wall_s", "C0", 0.35, f"corrected h{h}, wall s"),
            (left, "stale_cpu_s", "C2", 1.0, "stale, CPU s"),
            (left, "stale_wall_s", "C2", 0.35, "stale, wall s"),
            (right, "peak_rss_selection_bytes", "C3", 1.0, "peak RSS"),
            (right, "buffer_resident_bytes", "C1", 1.0, "resident buffer"),
        ):
            ys = [s[key] / (GB if key.endswith("bytes") else 1) for s in rows]
            ax.plot(
                [s["n"] / 1e6 for s in rows], ys, style, color=color, alpha=alpha, label=f"{label}, W={world}"
            )
    left.set(ylabel="seconds per selection, per process", yscale="log", title="selection time per process")
    right.set(ylabel="GB per process", title="memory per process")
    for ax in (left, right):
        ax.set_xlabel("N (million rows x 768)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


# ----------------------------------------------------------------------------------------------- main


def int_keys(value):
    """A saved JSON's dicts keyed by corrector width get their int keys back (JSON keys are strings)."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): int_keys(v) for k, v in value.items()}
    return [int_keys(v) for v in value] if isinstance(value, list) else value


def parse_slices(text: str) -> list[tuple[int, int]]:
    """'3072:100000,8192:25000' -> [(3072, 100000), (8192, 25000)]."""
    return [
        (int(h), int(r or 100_000)) for h, _, r in (item.partition(":") for item in text.split(",") if item)
    ]


def run_size(args, folder: Path, n: int, with_slices: bool) -> dict:
    """Every process count on one written buffer; whether the merged top-k of 2 processes is the 1-process one."""
    size = {"n": n, "runs": []}
    widths = ",".join(f"{h}:{r}" for h, r in args.slice_hidden)
    for world in args.procs:
        out = folder.parent / f"out_{n}_{world}"
        cmd = [
            sys.executable,
            *(
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                if world > 1
                else []
            ),
        ]
        cmd += [
            __file__,
            "--worker",
            "--buffer",
            str(folder),
            "--worker-out",
            str(out),
            "--loss-hidden",
            widths,
        ]
        cmd += ["--slice-hidden", widths if with_slices else "", "--dtype", args.dtype]
        for name in ("threads", "hidden", "reps", "stale_reps", "slice_reps", "loss_reps"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        reporting.run_json(cmd, {"OMP_NUM_THREADS": str(args.threads)}, f"{world}-process run on {folder}")
        records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        shutil.rmtree(out, ignore_errors=True)
        size["runs"].append({"world": world, "processes": records})
        print(
            f"N={n:,} W={world}: corrected {max(r['corrected']['cpu_s'] for r in records):.1f} s CPU per process",
            file=sys.stderr,
        )
    whole, sharded = (
        next((r["processes"][0] for r in size["runs"] if test(r["world"])), None)
        for test in (lambda w: w == 1, lambda w: w > 1)
    )
    if whole is not None and sharded is not None:  # rank 0's queries are the 1-process run's queries
        size["sharded_equals_whole"] = all(whole[k] == sharded[k] for k in ("top_rows", "stale_rows"))
    for record in (record for run in size["runs"] for record in run["processes"]):
        del record["top_rows"], record["stale_rows"]
    return size


def benchmark(args, argv) -> dict:
    wall = time.perf_counter()
    results = {
        "command": reporting.command("bench_scale.py", argv),
        "machine": {**reporting.machine(), "threads": args.threads},
    }
    results |= {
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "threads": args.threads,
        "dtype": args.dtype,
    }
    results |= {
        "hidden": args.hidden,
        "slice_hidden": args.slice_hidden,
        "slices_at": args.slices_at or [min(args.sizes)],
    }
    results |= {"reps": args.reps, "load_before": load_average(), "sizes": []}
    make = lambda n: (random_rows, f"synthetic:{n}x{D}:seed{SEED}")  # noqa: E731
    for n, folder, written in synthetic_buffers(args, D, "buffer", make):
        results["sizes"].append({**run_size(args, folder, n, n in results["slices_at"]), "write": written})
    results["load_after"] = load_average()
    summarize(results)
    p = {key: getattr(args, f"proj_{key}") for key in DEFAULTS}
    hiddens = args.proj_hidden or sorted({h for h, _ in args.slice_hidden} or {args.hidden})
    results["projection"] = project(results["per_row"], p, hiddens)
    one_step = {**p, "micro_batch": max(1, p["questions_per_step"] // p["gpus"])}  # A = 1
    results["projection_variants"] = [results["projection"]]
    if one_step["micro_batch"] != p["micro_batch"]:
        results["projection_variants"].append(project(results["per_row"], one_step, hiddens))
    results["projection_mfu"] = [
        project(results["per_row"], {**p, "train_mfu": m}, hiddens) for m in (0.3, 0.5)
    ]
    results["goals"] = goals(results)
    results["wall_s"] = time.perf_counter() - wall
    return results


def main(argv: list[str] | None = None) -> int:
    parser = scale_arguments(
        __doc__, "bench_scale", "1M,2M,4M; --quick 50k,100k", hidden=D, threads=1, dtype="bf16"
    )
    add = parser.add_argument
    add("--procs", type=reporting.int_list, default=[1, 2], help="process counts for each N (default 1,2)")
    add(
        "--slice-hidden",
        type=parse_slices,
        help="HIDDEN:ROWS,...: widths measured on a slice of each process's rows and scaled (default "
        "3072:100000,8192:25000; --quick 3072:5000,8192:2000); '' for none",
    )
    add(
        "--slices-at",
        type=reporting.int_list,
        help="the N at which the slices are measured (default: smallest)",
    )
    for name, reps in (("stale", 2), ("slice", 2), ("loss", 5)):
        add(f"--{name}-reps", type=int, default=reps)
    for key, value in DEFAULTS.items():
        add(f"--proj-{key.replace('_', '-')}", type=type(value), default=value, help=argparse.SUPPRESS)
    add(
        "--proj-hidden",
        type=reporting.int_list,
        help="corrector widths to project (default: the slice widths)",
    )
    for name in ("--worker", "--buffer", "--worker-out", "--loss-hidden"):
        kind = {"--worker": {"action": "store_true"}, "--loss-hidden": {"type": parse_slices, "default": []}}
        add(name, **kind.get(name, {"type": Path}), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([50_000, 100_000] if args.quick else [1_000_000, 2_000_000, 4_000_000])
    if args.slice_hidden is None:
        args.slice_hidden = parse_slices("3072:5000,8192:2000" if args.quick else "3072:100000,8192:25000")
    args.reps = args.reps or (1 if args.quick else 2)
    if args.quick:
        args.stale_reps, args.loss_reps, args.slice_reps = min(args.stale_reps, 2), min(args.loss_reps, 2), 1
    if args.worker:
        record = worker(args)
        args.worker_out.mkdir(parents=True, exist_ok=True)
        (args.worker_out / f"rank{record['rank']}.json").write_text(json.dumps(record))
        if record["rank"] == 0:  # one line for run_json (two ranks' prints may share a line); records: files
            print("{}", flush=True)
        return 0
    return run_or_render(args, argv, benchmark, markdown, plot, load=int_keys)


if __name__ == "__main__":
    sys.exit(main())
