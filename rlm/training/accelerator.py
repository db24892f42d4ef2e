"""The accelerate side of training: the accelerator (mixed precision, trackers, process-group timeout),
DeepSpeed's batch sizes, where each process keeps the rows it scans, and the per-step collectives (a
non-finite loss anywhere skips the step everywhere; losses averaged over processes; per-component clipping).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
    gather_object,
)

from rlm.base.evalmode import eval_mode
from rlm.config import TrainConfig, dump_config
from rlm.errors import UserError
from rlm.precision import CpuBf16Warning, cpu_bf16_support, cpu_mixed_precision
from rlm.retriever.distributed import Processes
from rlm.training import checkpointing
from rlm.training.schedule import retriever_start, retriever_stop
from rlm.training.strategies.base import SelectionStrategy


class DeepSpeedClippingWarning(UserWarning):
    """DeepSpeed clips one global gradient norm where DDP clips each component."""


def trackers(report_to: str) -> list[str] | None:
    """accelerate's `log_with` for `report_to`; W&B is an extra (`pip install .[wandb]`)."""
    wanted = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"]}.get(
        report_to, []
    )
    if "wandb" in wanted:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError(
                f"report_to={report_to} needs Weights & Biases: pip install 'rlm-corrector[wandb]'"
            ) from None
    return wanted or None


def tracked_config(cfg: TrainConfig) -> dict:
    """The run config as trackers store hyperparameters: flat keys, numbers, text and booleans only."""
    flat = checkpointing.flat_config(yaml.safe_load(dump_config(cfg)) or {})
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in flat.items()}


def launched_with_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def skip_deepspeed_cpu_inference_kernel() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce (`deepspeed_shm_comm`) as its
    communication starts: a C++ build in every new environment (the build's hash holds the install path; its
    cost is in docs/training.md). Only DeepSpeed's tensor-parallel inference calls that kernel
    (`inference_all_reduce`); training's collectives go through torch.distributed (gloo) either way."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def allow_tf32(cuda: bool) -> None:
    """On a GPU, float32 matmuls and convolutions on TensorFloat-32 tensor cores (Ampere and later): what stays
    float32 under bf16 autocast (the corrector's scan of h(B) outside autocast, the losses' reductions) runs
    several times faster, at bf16's range and a 10-bit mantissa. Off by default in PyTorch since 1.12; on in
    nanoGPT and the transformers Trainer's `tf32` option. Never set on a CPU run (the flags are CUDA's)."""
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    cuda, deepspeed = torch.cuda.is_available(), launched_with_deepspeed()
    allow_tf32(cuda and not cfg.cpu)
    backend = {}
    if deepspeed and not cuda:
        # DeepSpeed's CPU accelerator talks gloo; unless accelerate is told so, every rank sees one process.
        backend = {"backend": "gloo"}
        skip_deepspeed_cpu_inference_kernel()
    # DDP's own settings wait for the model: `configure_ddp`, before `prepare`.
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s or STARTUP_DIST_TIMEOUT_S)
    handlers = [InitProcessGroupKwargs(timeout=timeout, **backend)]
    # Training runs on CPU without CUDA, or with cfg.cpu (which DeepSpeed ignores: it finds the GPU itself).
    on_cpu = not cuda or (cfg.cpu and not deepspeed)
    mixed_precision, message = cfg.mixed_precision, None
    if on_cpu and cfg.mixed_precision == "bf16":
        # bf16 emulated on a CPU without AVX512-BF16/AMX makes every step many times slower (docs/training.md,
        # "Precision"). The choice comes from the CPU flags, the same on every process of a machine (checked
        # below); the probe is only reported.
        choice = cpu_mixed_precision("bf16", force=cfg.force_cpu_bf16, support=cpu_bf16_support())
        mixed_precision, message = choice.mixed_precision, choice.warning
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launcher is not None and launcher != cfg.mixed_precision and os.environ.get("RANK", "0") == "0":
        # One place decides: the run config (saved with every checkpoint and compared on resume).
        warnings.warn(
            f"the accelerate launcher config asks for mixed_precision={launcher}; the run config's "
            f"mixed_precision={cfg.mixed_precision} is used (set it with --set mixed_precision=...)",
            stacklevel=2,
        )
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        # Without CUDA, accelerate must be told it is on CPU, or torchrun ranks run as unrelated processes;
        # under DeepSpeed that would silently train plain DDP instead (DeepSpeed finds the CPU itself).
        cpu=(cfg.cpu or not cuda) and not deepspeed,
        log_with=trackers(cfg.report_to),
        project_dir=cfg.output_dir,
        # The schedule is stepped once per optimizer step by the loop: accelerate's own stepping advances it
        # once per process per step, W times too fast with W processes.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=handlers,
    )
    if on_cpu and cfg.mixed_precision == "bf16":
        if accelerator.num_processes > 1:
            # Processes on different machines could read different flags (or, without flags, time the probe
            # differently); a DDP/DeepSpeed run whose ranks train in different precisions must not start.
            chosen = gather_object([mixed_precision])
            if len(set(chosen)) > 1:
                raise UserError(
                    f"the processes disagree on bf16 support of their CPUs ({chosen}): set mixed_precision=no, "
                    "or mixed_precision=bf16 with force_cpu_bf16=true"
                )
        if message and accelerator.is_local_main_process:
            warnings.warn(message, CpuBf16Warning, stacklevel=2)
    return accelerator


# The process group's timeout when `dist_timeout_s` is not set: until the first optimizer step ends (the main
# process verifying the newest checkpoint while the others wait, the buffer build's meeting point), then
# `DIST_TIMEOUT_FACTOR` times the longest step, refresh part, checkpoint or validation measured so far, at
# least `MIN_DIST_TIMEOUT_S` (the first checkpoint or validation comes after the first step: a checkpoint of
# the paper's size, ~5 GB written and hashed by the main process, fits in it on slow shared storage).
STARTUP_DIST_TIMEOUT_S = 1800
MIN_DIST_TIMEOUT_S = 300
DIST_TIMEOUT_FACTOR = 4


class CollectiveTimeout:
    """How long this process waits at a collective before the run fails: `fixed` (`dist_timeout_s`) when set,
    else sized by what the run measures (`measured`), so that a hung rank ends a run in minutes, not an hour.

    A refresh's processes meet before each of its parts (`rlm.training.preemption`), so no collective waits
    for a whole refresh: after the start, the longest waits are a step's (a slower rank), a refresh part's and
    the main process's own work at a checkpoint or validation, which `measured` is told of as each ends."""

    def __init__(self, fixed: int | None, multiprocess: bool, say=print):
        self.fixed, self.multiprocess, self.say = fixed, multiprocess, say
        self.seconds = float(fixed or STARTUP_DIST_TIMEOUT_S)
        self.longest = 0.0

    def measured(self, seconds: float) -> None:
        """A stretch of work between collectives took `seconds`: the timeout covers it `DIST_TIMEOUT_FACTOR`
        times over (never lowered again once a longer one is seen)."""
        self.longest = max(self.longest, seconds)
        if self.fixed:
            return
        wanted = float(max(MIN_DIST_TIMEOUT_S, math.ceil(DIST_TIMEOUT_FACTOR * self.longest)))
        if wanted == self.seconds:  # `longest` only grows: after the start, so does the timeout
            return
        self.seconds = wanted
        if not self.multiprocess or not torch.distributed.is_initialized():
            return
        # Private in torch (since 2.3), and the one way to change a live process group's timeout; each process
        # sets its own, which bounds the waits it makes.
        torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=wanted))
        self.say(
            f"process-group timeout {wanted:.0f} s: {DIST_TIMEOUT_FACTOR} x the longest step, refresh part, "
            f"checkpoint or validation so far ({self.longest:.1f} s), at least {MIN_DIST_TIMEOUT_S} s "
            "(dist_timeout_s fixes it)"
        )


def configure_deepspeed(accelerator: Accelerator, optim_cfg, accumulation_steps: int) -> None:
    """Fill DeepSpeed's batch sizes from our config (there is no prepared DataLoader for accelerate to read them
    from) and refuse a launcher config that contradicts it."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": optim_cfg.batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": optim_cfg.batch_size * accumulation_steps * accelerator.num_processes,
        # DeepSpeed clips inside its step, with one global norm (per-component clipping is not possible there).
        "gradient_clipping": optim_cfg.max_grad_norm,
    }
    if optim_cfg.max_grad_norm > 0 and accelerator.is_main_process:
        warnings.warn(
            "under DeepSpeed the gradients of reader, retriever and corrector are clipped together, to one "
            f"global norm of {optim_cfg.max_grad_norm} (DDP clips each component alone): a large corrector "
            "gradient (loss weight corrector.weight) shrinks the reader's and retriever's steps too. The norm "
            "is logged as grad_norm_global; docs/training.md compares the two on the toy world.",
            DeepSpeedClippingWarning,
            stacklevel=2,
        )
    for key, value in wanted.items():
        have = ds.get(key, "auto")
        if have in ("auto", None):
            ds[key] = value
        elif float(have) != value:
            raise UserError(
                f"the DeepSpeed config sets {key}={have} but the run config needs {value} (optim.batch_size, "
                "optim.questions_per_step / gradient_accumulation_steps and the process count); set it to "
                "'auto' in the accelerate config"
            )
    if accelerator.mixed_precision == "bf16":
        # The module's parameters, and so each micro-step's gradients, are bf16 under DeepSpeed; without this
        # ZeRO-2 also sums the window's micro-steps in bf16 (8 mantissa bits: with 4 micro-steps a small
        # gradient added to a large one loses its last bits). fp32 accumulation is what DDP does. A DeepSpeed
        # config of one's own that sets data_types.grad_accum_dtype keeps its choice.
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


def reader_alone_steps(cfg: TrainConfig) -> bool:
    """Whether some optimizer steps train the reader alone (Algorithm 2's gold-passage curriculum and its
    reader-only phases): at those, the retriever and the corrector are trainable but take no part in the loss."""
    return cfg.algorithm == 2 and (
        cfg.schedule.gold_passage_steps > 0
        or retriever_start(cfg) > 0
        or retriever_stop(cfg) < cfg.optim.max_steps
    )


def unreached_parameters(model: torch.nn.Module) -> list[str]:
    """Trainable parameters of the towers and the reader that their forward never reaches: a BERT-family
    model's pooler (the towers mean-pool its last hidden states; a warm-started reader's encoder has one too).
    Found by one short input through each, in eval mode, with `autograd.grad` (no `.grad` is written)."""
    towers = {id(t): t for t in (model.retriever.query_tower, model.retriever.passage_tower)}.values()
    probes = [
        (f"retriever.{name}", tower, lambda t=tower: t.embed_texts(["probe"]).sum())
        for name, tower in zip(("query_tower", "passage_tower"), towers)
    ]
    if model.reader is not None:
        inputs = model.collator(["probe"], [[("probe", "probe")]], ["probe"])
        inputs = {k: inputs[k].to(model.reader.device) for k in ("input_ids", "attention_mask", "labels")}
        probes.append(("reader", model.reader, lambda: model.reader(**inputs).loss))
    unreached = []
    for prefix, module, forward in probes:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            continue
        with eval_mode(module), torch.enable_grad():
            grads = torch.autograd.grad(forward(), [p for _, p in named], allow_unused=True)
        unreached += [f"{prefix}.{name}" for (name, _), grad in zip(named, grads) if grad is None]
    return unreached


def find_unused_parameters(cfg: TrainConfig, model: torch.nn.Module) -> bool:
    """DDP's `find_unused_parameters` for this run: whether some step leaves a trainable parameter without a
    gradient. DDP then walks the autograd graph after every forward to find them (its reduction would
    otherwise wait for their gradients forever, and fail at the next step); it is set only where needed.
    Parameters a strategy does not train (`frozen`, `closed_book`: the retriever) have requires_grad off and
    are no part of DDP; call this after `RetrievalAugmentedModel.parameter_groups` has set them."""
    trained_besides_reader = any(
        p.requires_grad
        for part in (model.retriever, model.corrector)
        if part is not None
        for p in part.parameters()
    )
    if trained_besides_reader and reader_alone_steps(cfg):
        return True
    if cfg.retriever.align.steps:  # DAFT's alignment stage freezes the passage tower and h for its steps
        return True
    return bool(unreached_parameters(model))


def configure_ddp(accelerator: Accelerator, cfg: TrainConfig, model: torch.nn.Module) -> None:
    """DDP's settings for `accelerator.prepare(model)` (nothing to set for one process or under DeepSpeed)."""
    if accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return
    find = find_unused_parameters(cfg, model)
    accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=find)
    accelerator.print(f"DDP: find_unused_parameters={find}")


def placement_device(placement: str, accelerator: Accelerator, nbytes: int) -> torch.device | None:
    """Where a process keeps the rows it scans: None = host memory (streamed), else a device. "auto" takes the
    GPU when the rows fit in half of its free memory (the rest is the models' and activations')."""
    device = accelerator.device
    if placement == "host" or (placement == "auto" and device.type != "cuda"):
        return None
    if placement == "auto":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free // 2:
            return None
    return device


def distribute_strategy(strategy: SelectionStrategy, cfg: TrainConfig, accelerator: Accelerator) -> None:
    """Shard the strategy's rows across the processes (by default when there are several), place them, and
    give refreshes a folder in the run (checkpoints reference their files)."""
    world = accelerator.num_processes
    shard = world > 1 if cfg.strategy.shard_buffer is None else cfg.strategy.shard_buffer
    procs = Processes.of(accelerator)
    per_process = len(strategy.buffer) // (world if shard else 1) + 1
    nbytes = per_process * strategy.buffer.dim * strategy.buffer.dtype.itemsize
    device = placement_device(cfg.buffer.placement, accelerator, nbytes)
    strategy.distribute(procs, shard, device, refresh_dir=Path(cfg.output_dir) / "refresh")
    if strategy.sharded:
        accelerator.print(f"buffer sharded across {world} processes")
    if device is not None:
        accelerator.print(f"scanned rows on {device} ({nbytes / 2**30:.2f} GiB per process)")


def finite_on_every_process(accelerator: Accelerator, losses: torch.Tensor) -> bool:
    """Whether every one of `losses` (any shape) is finite on all processes: every process must take the same
    decision, or DDP's collectives would deadlock. A sum of non-finite flags (accelerate's reduce knows sum,
    mean and max); the one read from the device the training step makes outside log steps."""
    bad = (~torch.isfinite(losses.detach())).any().float().reshape(1).to(accelerator.device)
    return float(accelerator.reduce(bad, "sum")) == 0


def clip_per_component(
    accelerator: Accelerator, optimizer, max_norm: float
) -> dict[str, torch.Tensor | float]:
    """Clip each component's gradient (one parameter group each) to `max_norm` on its own and return the norms
    (on the device: read at the log step).

    One global norm would let one component's loss shrink another's update (the corrector term, weight 10,
    would scale the reader's and retriever's steps), which the paper's stop-gradients keep apart. Under
    DeepSpeed the engine clips (one global norm, `gradient_clipping` in its config) inside its step.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # The engine has stepped already (in the window's last backward); its one norm is what it clipped.
        norm = optimizer_engine_norm(accelerator)
        return {} if norm is None else {"grad_norm_global": norm}
    accelerator.unscale_gradients()  # fp16: clip the true gradients (a no-op otherwise)
    norms = {}
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
            norms[f"grad_norm_{group['name']}"] = norm.detach()
    return norms


def optimizer_engine_norm(accelerator: Accelerator) -> float | None:
    """The global gradient norm DeepSpeed's last step clipped with (None when it reports none)."""
    engines = [m for m in accelerator._models if hasattr(m, "get_global_grad_norm")]
    norm = engines[0].get_global_grad_norm() if engines else None
    return None if norm is None else float(norm)


LOSS_KEYS = ("loss", "reader_loss", "retriever_loss", "corrector_loss")


def mean_over_processes(accelerator: Accelerator, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's losses averaged over every process's micro-batches (what the step optimised), not rank 0's
    alone; other figures stay this process's. Every process has the same loss keys: they follow the step's
    phase, which all share. The figures stay on the device (nothing is read back)."""
    keys = [k for k in LOSS_KEYS if k in sums]
    if accelerator.num_processes == 1 or not keys:
        return sums
    local = torch.stack([torch.as_tensor(sums[k], device=accelerator.device).float() for k in keys])
    mean = accelerator.reduce(local, reduction="mean")
    return {**sums, **dict(zip(keys, mean.unbind()))}


def zero_loss(accelerator: Accelerator, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """What a skipped window backpropagates. DDP: the step's own graph, zeroed (DDP must see the graph it
    prepared in forward; the window's gradients are dropped afterwards). DeepSpeed steps inside backward at the
    window's end, so there the skipped micro-batches contribute exact zeros (a graph over the parameters
    alone, free of the NaN) and the window's earlier micro-batches make the step."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
    return loss.nan_to_num(0.0) * 0.0


@contextlib.contextmanager
def engine_step_held(accelerator: Accelerator, optimizer, hold: bool) -> Iterator[None]:
    """Under DeepSpeed the last backward of a window runs the optimizer step itself, on the window's finite
    micro-batches. For a skipped window that step must not move the parameters: every group's learning rate
    is 0 for it (no update, no weight decay), restored after. AdamW's moments do take in the finite
    micro-batches' gradients, which DDP's skip (no optimizer step at all, in `train_step`) leaves out."""
    if not hold or accelerator.distributed_type != DistributedType.DEEPSPEED:
        yield
        return
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def use_fp32_master_weights(model: torch.nn.Module) -> None:
    """Under DeepSpeed the module holds the step's precision (bf16 with mixed precision) and the optimizer the
    fp32 master weights; `final/` gets the latter (gathered from the ZeRO partitions), as an fp32 run would.
    Called after the last step and validation: the module is not trained further."""
    from deepspeed.utils import safe_get_full_fp32_param

    for param in model.parameters():
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        param.data = (master if master is not None else param.data).to(param.device, torch.float32)
