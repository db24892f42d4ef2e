"""Joint training on accelerate: `accelerate launch -m rlm.train --config configs/x.yaml --set key=value ...`.

Three parts: `build_run` (data, models, buffer, strategy, optimizer, accelerate's prepare), `train_step` (one
optimizer step: refresh, an accumulation window, per-component clipping, step, schedule) and `train` (the loop
around it: logging, validation, checkpoints). The algorithm itself is `rlm.training.steps.algorithm2_step` (or
`algorithm1_step`), run through the model's forward so DDP syncs it. The lr schedule advances once per
optimizer step for any process count.

Data order is a pure function of (seed, micro-step): each epoch is a seeded permutation of the training set,
and process r of W takes its slice of every global batch. Resuming at micro-step m therefore sees exactly the
batches an uninterrupted run would, with no dataloader state to restore. Checkpoints, the run folder's
ownership and resuming are `rlm.training.checkpointing`; stop signals are `rlm.training.preemption`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
    broadcast_object_list,
    gather_object,
    set_seed,
)
from tqdm.auto import tqdm

from atomicio import atomic_directory, atomic_write_json, atomic_write_text
from retriever.alignment import alignment_metrics
from rlm.components import build_components
from rlm.config import TrainConfig, add_override_argument, dump_config, load_config
from rlm.data.corpus import Corpus
from rlm.errors import UserError
from rlm.precision import CpuBf16Warning, cpu_bf16_support, cpu_mixed_precision
from rlm.training import checkpointing
from rlm.training.checkpointing import checkpoints
from rlm.training.hard_subcorpus import hard_subcorpus_from_buffer, save_subcorpus_ids
from rlm.training.model import RetrievalAugmentedModel, embed_rows
from rlm.training.preemption import EXIT_PREEMPTED, Preempted, StopSignals
from rlm.training.prefix import load_prefix, place_tokenizer, save_prefix, shared_steps
from rlm.training.steps import Batch
from rlm.training.strategies import Processes, SelectionStrategy, make_strategy
from rlm.training.validation import PassageEmbeddingCache, subcorpus_path, validate


@dataclass
class TrainState:
    """Counters that must survive a resume (saved with the checkpoint, as JSON)."""

    step: int = 0  # optimizer steps done
    nonfinite_total: int = 0
    nonfinite_in_a_row: int = 0
    wall_time: float = 0.0
    # DAFT's alignment stage: the step it ended at (None while it runs or when there is none), the best kNN
    # KL so far and how many measurements since it last fell.
    align_end: int | None = None
    align_best: float = float("inf")
    align_stalled: int = 0
    tracker_run_id: str | None = None  # W&B's run id, so a resumed run logs into the same run

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class DeepSpeedClippingWarning(UserWarning):
    """DeepSpeed clips one global gradient norm where DDP clips each component."""


class NonFiniteLossError(RuntimeError):
    pass


class RepresentationCollapseError(RuntimeError):
    """The query tower maps every dev question to nearly the same vector (DAFT's collapse)."""


def batch_indices(micro_step: int, num_examples: int, batch_size: int, rank: int, world: int, seed: int):
    """Example indices of process `rank` at `micro_step`: epoch = seeded permutation, drop the last partial batch."""
    global_batch = batch_size * world
    per_epoch = num_examples // global_batch
    if per_epoch == 0:
        raise UserError(
            f"{num_examples} training examples cannot fill one global batch of {global_batch}; "
            "lower optim.batch_size or use more data"
        )
    epoch, pos = divmod(micro_step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    start = pos * global_batch + rank * batch_size
    return order[start : start + batch_size].tolist()


def make_batch(examples, indices, corpus, algorithm: int, gold_passages: bool = False) -> Batch:
    """The questions at `indices`; `gold_passages`: the reader reads each question's gold passages only."""
    chosen = [examples[i] for i in indices]
    gold = others = None
    if algorithm == 1:
        # The first gold passage is the label; a multi-hop question's other gold passages are relevant too,
        # so they are kept out of its negatives (as DPR keeps positives out of its hard negatives).
        golds = [[corpus.index_of(pid) for pid in ex.gold_passage_ids] for ex in chosen]
        gold = torch.tensor([g[0] for g in golds], dtype=torch.long)
        others = torch.full((len(golds), max(len(g) for g in golds) - 1), -1, dtype=torch.long)
        for i, g in enumerate(golds):
            others[i, : len(g) - 1] = torch.tensor(g[1:], dtype=torch.long)
    given = None
    if gold_passages:
        given = [
            [(corpus[r].title, corpus[r].text) for r in map(corpus.index_of, ex.gold_passage_ids)]
            for ex in chosen
        ]
    return Batch(
        [ex.question for ex in chosen], [ex.answers[0] for ex in chosen], gold, given, other_gold_rows=others
    )


def reader_only_step(cfg: TrainConfig, step: int) -> bool:
    """Whether optimizer step `step` (0-based) trains the reader alone: the first `schedule.reader_only_steps`
    and the last `schedule.final_reader_only_steps` of the run, outside [retriever_start, retriever_stop)."""
    return not retriever_start(cfg) <= step < retriever_stop(cfg)


def retriever_start(cfg: TrainConfig) -> int:
    """The first optimizer step that trains the retriever (Algorithm 2's reader-only warm-up comes first)."""
    return cfg.schedule.reader_only_steps if cfg.algorithm == 2 else 0


def retriever_stop(cfg: TrainConfig) -> int:
    """The step after the retriever's last update (Algorithm 2's final reader-only phase follows it)."""
    final = cfg.schedule.final_reader_only_steps if cfg.algorithm == 2 else 0
    return cfg.optim.max_steps - final


def aligning(cfg: TrainConfig, state: TrainState, step: int) -> bool:
    """Whether optimizer step `step` is in DAFT's alignment stage (the query tower trains alone)."""
    first = retriever_start(cfg)
    return state.align_end is None and first <= step < first + cfg.retriever.align_steps


def check_gold_passages(examples, corpus) -> None:
    """The gold-passage curriculum needs every training question's gold passages in the corpus."""
    for ex in examples:
        if not ex.gold_passage_ids:
            raise UserError(
                f"schedule.gold_passage_steps needs gold_passage_ids on every training question; {ex.id} has "
                "none (set schedule.gold_passage_steps=0 for data without gold passages)"
            )
        for gid in ex.gold_passage_ids:
            try:
                corpus.index_of(gid)
            except KeyError:
                raise UserError(
                    f"schedule.gold_passage_steps: gold passage {gid!r} of {ex.id} is not in the corpus "
                    "(set schedule.gold_passage_steps=0)"
                ) from None


def lr_lambda(warmup: int, total: int):
    """Linear warm-up, then linear decay to 10% of the peak."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        frac = (step - warmup) / max(1, total - warmup)
        return max(0.1, 1.0 - 0.9 * frac)

    return fn


def build_optimizer(model: RetrievalAugmentedModel, strategy, optim_cfg) -> torch.optim.AdamW:
    """One AdamW, a parameter group per component. Fused (one kernel over all tensors) where torch has it: for
    the two MiniLM towers on this 2-core CPU a step of it takes 0.02 s instead of 0.16 s (the per-tensor loop)."""
    groups = model.parameter_groups(strategy, optim_cfg)
    devices = {p.device.type for group in groups for p in group["params"]}
    fused = bool(devices) and devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, weight_decay=optim_cfg.weight_decay, fused=fused)


# Rows re-embedded between two looks at the stop signals (a few seconds of a GPU's work).
REEMBED_PART_ROWS = 16384


@dataclass
class TrainRun:
    """What one run holds: made by `build_run`, advanced one optimizer step at a time by `train_step`."""

    cfg: TrainConfig
    accelerator: Accelerator
    corpus: Corpus
    train_examples: list
    dev_examples: list
    model: torch.nn.Module  # as prepared by accelerate (DDP / DeepSpeed wrapper)
    strategy: SelectionStrategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainState
    accumulation_steps: int
    # Passage embeddings of the last validation, reused while the passage tower is unchanged.
    validation_cache: PassageEmbeddingCache = field(default_factory=PassageEmbeddingCache)
    # SIGTERM / SIGUSR1 received (`rlm.training.preemption`): checked between steps and inside long refreshes.
    stops: StopSignals = field(default_factory=StopSignals)

    @property
    def raw(self) -> RetrievalAugmentedModel:
        return self.accelerator.unwrap_model(self.model)

    # Refreshes and validation run in the training step's precision (accelerate's autocast: a no-op unless
    # mixed_precision is set); only the fixed buffer B, built once and shared by runs, is always float32.
    def reembed(self, rows) -> torch.Tensor:
        """The rows embedded by the current passage tower, in parts between which a stop signal ends the
        refresh (a refresh of a large corpus outlasts a scheduler's grace)."""
        with self.accelerator.autocast():
            tower = self.raw.retriever.passage_tower
            texts = self.corpus.retrieval_texts()
            parts = []
            for start in range(0, max(len(rows), 1), REEMBED_PART_ROWS):
                self.stops.check(self.state.step)
                part = rows[start : start + REEMBED_PART_ROWS]
                parts.append(embed_rows(tower, texts, part, batch_size=self.cfg.buffer.batch_size))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    def validate(self, subcorpus: bool = True, selection: bool = False) -> dict[str, float]:
        """Dev metrics, the work sharded across the processes (every process must call it); `selection`:
        answering from the strategy's own selection (`dev_selection_*`) instead of the re-embedded corpus."""
        acc = self.accelerator
        with acc.autocast():
            return validate(
                self.raw,
                self.corpus,
                self.dev_examples,
                self.cfg,
                procs=processes(acc),
                device=acc.device,
                subcorpus=subcorpus,
                cache=self.validation_cache,
                strategy=self.strategy if selection else None,
            )

    def save(self, prune: bool = True) -> Path:
        """A checkpoint of the current step (every process must call it)."""
        state = {
            "train": self.state.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "strategy": self.strategy.state_dict(),
            "processes": self.accelerator.num_processes,
        }
        output_dir = Path(self.cfg.output_dir)
        return checkpointing.save_checkpoint(
            self.accelerator,
            output_dir,
            self.state.step,
            self.cfg.keep_last,
            state,
            dump_config(self.cfg),
            prune,
        )

    def load(self, folder: Path) -> None:
        """Continue from checkpoint `folder` (verified and checked by `find_checkpoint`)."""
        self.accelerator.load_state(str(folder))
        state = checkpointing.read_state(folder)
        self.state.load_state_dict(state["train"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.load_state_dict(state["strategy"])

    def batch(self, step: int, micro: int) -> Batch:
        """This process's questions at micro-step `micro` of optimizer step `step`."""
        cfg, acc = self.cfg, self.accelerator
        indices = batch_indices(
            step * self.accumulation_steps + micro,
            len(self.train_examples),
            cfg.optim.batch_size,
            acc.process_index,
            acc.num_processes,
            cfg.seed,
        )
        gold_phase = cfg.algorithm == 2 and step < cfg.schedule.gold_passage_steps
        return make_batch(self.train_examples, indices, self.corpus, cfg.algorithm, gold_passages=gold_phase)


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


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    cuda, deepspeed = torch.cuda.is_available(), launched_with_deepspeed()
    # DeepSpeed's CPU accelerator talks gloo; unless accelerate is told so, every rank sees one process.
    backend = {"backend": "gloo"} if deepspeed and not cuda else {}
    handlers = [
        DistributedDataParallelKwargs(find_unused_parameters=True),
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.dist_timeout_s), **backend),
    ]
    # Training runs on CPU without CUDA, or with cfg.cpu (which DeepSpeed ignores: it finds the GPU itself).
    on_cpu = not cuda or (cfg.cpu and not deepspeed)
    mixed_precision, message = cfg.mixed_precision, None
    if on_cpu and cfg.mixed_precision == "bf16":
        # bf16 emulated on a CPU without AVX512-BF16/AMX makes every step ~18x slower. The choice comes from
        # the CPU flags, the same on every process of a machine (checked below); the probe is only reported.
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


def claim_run_folder(
    accelerator: Accelerator, cfg: TrainConfig, resume: bool, overwrite: bool, allow_changed=()
) -> Path | None:
    """Make `cfg.output_dir` this run's; returns the checkpoint to continue from (None: start fresh).

    The main process decides (a folder holding a run needs --resume or --overwrite; the newest checkpoint
    that verifies, with no code in its pickles and the same settings) and every process gets its verdict, so
    an error stops all of them with the same message."""
    output_dir = Path(cfg.output_dir)
    verdict: list = [None, None]  # (checkpoint, error)
    if accelerator.is_main_process:
        try:
            checkpointing.claim_output_dir(output_dir, resume, overwrite)
            found = checkpointing.latest_good_checkpoint(output_dir, accelerator.print) if resume else None
            if found is not None:
                checkpointing.check_pickles(found)
                saved = checkpointing.read_state(found).get("processes")
                for change in checkpointing.check_settings(
                    found, dump_config(cfg), accelerator.num_processes, saved, allow_changed
                ):
                    accelerator.print(f"resuming with a changed setting (allowed): {change}")
            elif resume and checkpoints(output_dir):
                raise UserError(f"--resume: no checkpoint under {output_dir / 'checkpoints'} is complete")
            verdict = [None if found is None else str(found), None]
        except UserError as err:
            verdict = [None, str(err)]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict, from_process=0)
    if verdict[1] is not None:
        raise UserError(verdict[1])
    if resume and verdict[0] is None:
        accelerator.print(f"--resume: no checkpoint under {output_dir / 'checkpoints'}, starting fresh")
    return None if verdict[0] is None else Path(verdict[0])


def build_run(
    cfg: TrainConfig,
    accelerator: Accelerator | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_changed=(),
    stops: StopSignals | None = None,
) -> TrainRun:
    """Data, models, the fixed buffer B, the strategy, optimizer and schedule, prepared by accelerate; a stop
    signal (`stops`) ends a buffer build between batches with `Preempted`."""
    stops = stops or StopSignals()
    accelerator = accelerator or make_accelerator(cfg)
    accum = cfg.optim.accumulation_steps(accelerator.num_processes)
    accelerator.gradient_accumulation_steps = accum
    configure_deepspeed(accelerator, cfg.optim, accum)
    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    resume_from = claim_run_folder(accelerator, cfg, resume, overwrite, allow_changed)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))  # read back by evaluate, resume
    accelerator.wait_for_everyone()

    # Data, models and the fixed buffer B (built once by the initial passage tower, verified on every load).
    parts = build_components(cfg, accelerator, check=lambda: stops.check(0))
    if cfg.algorithm == 2 and cfg.schedule.gold_passage_steps:
        check_gold_passages(parts.train_examples, parts.corpus)
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, parts.corrector, parts.collator, cfg)
    strategy = make_strategy(
        cfg.strategy,
        parts.buffer,
        cfg.optim.max_steps,
        seed=cfg.seed,
        chunk_size=cfg.buffer.chunk_size,
        # Re-embedding counts from the first step that moves the passage tower: after the alignment stage
        # (lowered to where it ends when it ends early).
        start_step=retriever_start(cfg) + cfg.retriever.align_steps,
        stop_step=retriever_stop(cfg),
    )
    distribute_strategy(strategy, cfg, accelerator)
    if cfg.retriever.align_steps and accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise UserError(
            "retriever.align_steps is not supported under DeepSpeed (it freezes a tower per step)"
        )
    if cfg.gradient_checkpointing and model.reader is not None:
        model.reader.gradient_checkpointing_enable()

    optimizer = build_optimizer(model, strategy, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim.warmup_steps, cfg.optim.max_steps)
    )
    # The scheduler is not handed to accelerate: `train_step` steps it exactly once per optimizer step taken.
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    run = TrainRun(
        cfg,
        accelerator,
        parts.corpus,
        parts.train_examples,
        parts.dev_examples,
        model,
        strategy,
        optimizer,
        scheduler,
        state,
        accum,
        stops=stops,
    )
    ensure_dev_subcorpus(run)
    # The steps' randomness (dropout) depends on the seed alone, not on which components were built before
    # (a corrector's initialisation draws from the same generator): runs of different strategies draw alike.
    set_seed(cfg.seed)
    if resume_from is not None:
        run.load(resume_from)
        accelerator.print(f"resumed from {resume_from} at step {state.step}")
        if state.align_end is not None:
            strategy.start_step = state.align_end
    return run


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


def processes(accelerator: Accelerator) -> Processes:
    return Processes(
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.gather,
        accelerator.wait_for_everyone,
        gather_object,
        device=accelerator.device,  # NCCL gathers only tensors on this process's GPU
    )


def ensure_dev_subcorpus(run: TrainRun) -> None:
    """Build the hard subcorpus once, at the start, from the initial towers (before any checkpoint loads)."""
    cfg, acc = run.cfg, run.accelerator
    path = subcorpus_path(cfg)
    if cfg.data.dev_subcorpus != "build" or not run.dev_examples or path.exists():
        return
    with torch.no_grad(), acc.autocast():
        ids = hard_subcorpus_from_buffer(
            run.corpus,
            run.dev_examples,
            run.raw.retriever.query_tower,
            run.strategy.buffer,
            cfg.data.dev_subcorpus_k,
            processes(acc),
            acc.device,
        )
    if acc.is_main_process:
        save_subcorpus_ids(ids, path)
        acc.print(f"hard dev subcorpus: {len(ids)} passages -> {path}")
    acc.wait_for_everyone()


def distribute_strategy(strategy: SelectionStrategy, cfg: TrainConfig, accelerator: Accelerator) -> None:
    """Shard the strategy's rows across the processes (by default when there are several), place them, and
    give refreshes a folder in the run (checkpoints reference their files)."""
    world = accelerator.num_processes
    shard = world > 1 if cfg.strategy.shard_buffer is None else cfg.strategy.shard_buffer
    procs = processes(accelerator)
    per_process = len(strategy.buffer) // (world if shard else 1) + 1
    nbytes = per_process * strategy.buffer.dim * strategy.buffer.dtype.itemsize
    device = placement_device(cfg.buffer.placement, accelerator, nbytes)
    strategy.distribute(procs, shard, device, refresh_dir=Path(cfg.output_dir) / "refresh")
    if strategy.sharded:
        accelerator.print(f"buffer sharded across {world} processes")
    if device is not None:
        accelerator.print(f"scanned rows on {device} ({nbytes / 2**30:.2f} GiB per process)")


def finite_on_every_process(accelerator: Accelerator, loss: torch.Tensor) -> bool:
    """Whether `loss` is finite on all processes: every process must take the same decision, or DDP's
    collectives would deadlock. A sum of non-finite flags (accelerate's reduce knows sum, mean and max)."""
    bad = (~torch.isfinite(loss.detach())).float().reshape(1).to(accelerator.device)
    return float(accelerator.reduce(bad, "sum")) == 0


def clip_per_component(accelerator: Accelerator, optimizer, max_norm: float) -> dict[str, float]:
    """Clip each component's gradient (one parameter group each) to `max_norm` on its own and return the norms.

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
            norms[f"grad_norm_{group['name']}"] = float(norm)
    return norms


def optimizer_engine_norm(accelerator: Accelerator) -> float | None:
    """The global gradient norm DeepSpeed's last step clipped with (None when it reports none)."""
    engines = [m for m in accelerator._models if hasattr(m, "get_global_grad_norm")]
    norm = engines[0].get_global_grad_norm() if engines else None
    return None if norm is None else float(norm)


def _zero_loss(run: TrainRun, loss: torch.Tensor) -> torch.Tensor:
    """What a skipped window backpropagates. DDP: the step's own graph, zeroed (DDP must see the graph it
    prepared in forward; the window's gradients are dropped afterwards). DeepSpeed steps inside backward at the
    window's end, so there the skipped micro-batches contribute exact zeros (a graph over the parameters
    alone, free of the NaN) and the window's earlier micro-batches make the step."""
    if run.accelerator.distributed_type == DistributedType.DEEPSPEED:
        return sum(p.sum() * 0.0 for p in run.model.parameters() if p.requires_grad)
    return loss.nan_to_num(0.0) * 0.0


@contextlib.contextmanager
def engine_step_held(run: TrainRun, hold: bool) -> Iterator[None]:
    """Under DeepSpeed the last backward of a window runs the optimizer step itself, on the window's finite
    micro-batches. For a skipped window that step must not move the parameters: every group's learning rate
    is 0 for it (no update, no weight decay), restored after. AdamW's moments do take in the finite
    micro-batches' gradients, which DDP's skip (no optimizer step at all, in `train_step`) leaves out."""
    if not hold or run.accelerator.distributed_type != DistributedType.DEEPSPEED:
        yield
        return
    groups = run.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def train_step(run: TrainRun) -> dict | None:
    """One optimizer step: refresh (if the strategy is due), an accumulation window of micro-batches, clip per
    component, step, schedule. Returns the step's log record, or None when a non-finite loss on any process
    skipped it (on every process alike)."""
    cfg, acc, state, strategy = run.cfg, run.accelerator, run.state, run.strategy
    strategy.begin_step(state.step)
    before = strategy.state_dict()
    try:
        strategy.before_step(state.step, run.reembed)
    except Preempted:
        strategy.load_state_dict(before)  # as after the last step: a checkpoint now redoes the refresh
        raise
    reader_only = reader_only_step(cfg, state.step)
    sums: dict[str, float] = {}
    finite = True
    for micro in range(run.accumulation_steps):
        # Every micro-step of the window goes through accumulate() and backward, a skipped one too: that keeps
        # accelerate's micro-step counter (and DeepSpeed's) on the window and DDP's reducer in step.
        with acc.accumulate(run.model):
            out = run.model(run.batch(state.step, micro), strategy, run.corpus, reader_only=reader_only)
            finite = finite_on_every_process(acc, out.loss) and finite
            last = micro == run.accumulation_steps - 1
            with engine_step_held(run, hold=last and not finite):
                acc.backward(out.loss if finite else _zero_loss(run, out.loss))
            for key, value in {"loss": float(out.loss.detach()), **out.metrics}.items():
                sums[key] = sums.get(key, 0.0) + value / run.accumulation_steps
    if not finite:
        run.optimizer.zero_grad(set_to_none=True)
        state.nonfinite_total += 1
        state.nonfinite_in_a_row += 1
        return None
    align = aligning(cfg, state, state.step)
    if align:  # DAFT stage 1: only the query tower moves (AdamW skips parameters without a gradient)
        frozen = [*run.raw.retriever.passage_tower.parameters()]
        frozen += [*run.raw.corrector.parameters()] if run.raw.corrector is not None else []
        for p in frozen:
            p.grad = None
    norms = clip_per_component(acc, run.optimizer, cfg.optim.max_grad_norm)
    lrs = {f"lr_{group['name']}": group["lr"] for group in run.optimizer.param_groups}  # this step's
    run.optimizer.step()
    if not run.optimizer.step_was_skipped:  # fp16 loss scaling skips steps that overflowed
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.nonfinite_in_a_row = 0
    state.step += 1
    record = {
        "step": state.step,
        **{k: round(v, 6) for k, v in mean_over_processes(acc, sums).items()},
        **{k: round(v, 6) for k, v in norms.items()},
        **strategy.pop_metrics(),
        **lrs,
        **({"aligning": 1} if align else {}),
        "reembedded": strategy.reembedded,
        "nonfinite_skipped": state.nonfinite_total,
    }
    if align:
        check_alignment(run, record)
    return record


LOSS_KEYS = ("loss", "reader_loss", "retriever_loss", "corrector_loss")


def mean_over_processes(accelerator: Accelerator, sums: dict[str, float]) -> dict[str, float]:
    """The step's losses averaged over every process's micro-batches (what the step optimised), not rank 0's
    alone; other figures stay this process's. Every process has the same loss keys: they follow the step's
    phase, which all share."""
    keys = [k for k in LOSS_KEYS if k in sums]
    if accelerator.num_processes == 1 or not keys:
        return sums
    local = torch.tensor([sums[k] for k in keys], dtype=torch.float32, device=accelerator.device)
    mean = accelerator.reduce(local, reduction="mean")
    return {**sums, **dict(zip(keys, mean.tolist()))}


def alignment_questions(run: TrainRun, limit: int = 256) -> list[str]:
    """The questions the alignment stage measures the towers on: the dev set's, else training questions."""
    examples = run.dev_examples or run.train_examples
    return [ex.question for ex in examples[:limit]]


def check_alignment(run: TrainRun, record: dict) -> None:
    """After a step of the alignment stage (`train_step` calls it): every `align_every` steps (and at its last
    step) measure the kNN KL between the towers; end the stage below `align_kl`, after `align_patience`
    measurements without a new best, or at its last step. Every process measures the same questions, so they
    all decide alike."""
    cfg, state, rc = run.cfg, run.state, run.cfg.retriever
    step, first = state.step, retriever_start(run.cfg)
    last = step >= first + rc.align_steps
    if (step - first) % rc.align_every and not last:
        return
    metrics = alignment_metrics(run.raw.retriever, alignment_questions(run), cfg.buffer.batch_size)
    kl = metrics["query_passage_knn_kl"]
    record.update(
        {"align_knn_kl": round(kl, 4), "align_query_mean_cosine": round(metrics["query_mean_cosine"], 4)}
    )
    check_collapse(cfg, {"dev_query_mean_cosine": metrics["query_mean_cosine"]}, step)
    if kl < state.align_best:
        state.align_best, state.align_stalled = kl, 0
    else:
        state.align_stalled += 1
    reason = None
    if rc.align_kl is not None and kl < rc.align_kl:
        reason = f"kNN KL {kl:.2f} < retriever.align_kl={rc.align_kl}"
    elif state.align_stalled >= rc.align_patience:
        reason = f"kNN KL has not fallen for {rc.align_patience} measurements (best {state.align_best:.2f})"
    elif last:
        reason = f"retriever.align_steps={rc.align_steps} reached (kNN KL {kl:.2f})"
    if reason is not None:
        state.align_end = step
        run.strategy.start_step = step  # re-embedding schedules count from the first passage-tower update
        record["align_end"] = step
        run.accelerator.print(f"step {step}: alignment stage ends ({reason}); both towers train from here")


def train(
    cfg: TrainConfig,
    resume: bool = False,
    accelerator: Accelerator | None = None,
    prefix: str | Path | None = None,
    prefix_out: str | Path | None = None,
    overwrite: bool = False,
    allow_changed=(),
) -> dict:
    """Train `cfg`'s run to `optim.max_steps`, validate on dev, save `final/`; returns the summary.

    A folder that holds a run needs `resume` (continue its newest complete checkpoint, with the same settings
    but those in `allow_changed`) or `overwrite` (start over). `prefix`: a shared prefix (`rlm.training.prefix`: the
    gold-passage steps, which every strategy trains alike) that a fresh run continues from instead of training
    those steps; `prefix_out`: train only those steps and save them there as a prefix. SIGTERM or SIGUSR1
    ends the run after the current step with a checkpoint, raising `Preempted`."""
    accelerator = accelerator or make_accelerator(cfg)
    if prefix is not None and accelerator.is_main_process:
        place_tokenizer(prefix, cfg)  # the other processes load it when they build the reader
    stops = StopSignals()
    with stops.installed():
        run = build_run(cfg, accelerator, resume, overwrite, allow_changed, stops)
        return train_loop(run, prefix, prefix_out)


def train_loop(run: TrainRun, prefix=None, prefix_out=None) -> dict:
    """The steps from where `run` stands to the end, then the final validation and `final/`."""
    cfg, acc, state, output_dir = run.cfg, run.accelerator, run.state, Path(run.cfg.output_dir)
    log_path = output_dir / "log.jsonl"
    prefix_log = load_prefix(run, prefix) if prefix is not None and state.step == 0 else None
    if state.tracker_run_id is None or prefix_log is not None:  # a new run; a resumed one keeps its W&B run
        state.tracker_run_id = uuid.uuid4().hex[:12]
    if acc.is_main_process:
        acc.init_trackers(
            "rlm",
            config=tracked_config(cfg),
            init_kwargs={"wandb": {"id": state.tracker_run_id, "resume": "allow", "dir": str(output_dir)}},
        )
        if prefix_log is None:
            checkpointing.repair_log(log_path, state.step)
        else:
            atomic_write_text(log_path, "".join(line + "\n" for line in prefix_log))
    stop = shared_steps(cfg) if prefix_out is not None else cfg.optim.max_steps
    progress = tqdm(
        total=cfg.optim.max_steps,
        initial=state.step,
        desc=f"train[{cfg.strategy.name}]",
        disable=not acc.is_local_main_process,
    )
    run.model.train()
    t_last, steps_since_log = time.time(), 0
    while state.step < stop:
        try:
            record = train_step(run)
        except Preempted as err:  # mid-refresh; one process is at a point a checkpoint can be made from
            if acc.num_processes > 1:
                raise
            raise Preempted(err.signum, state.step, run.save()) from None
        if record is None:
            acc.print(
                f"step {state.step}: non-finite loss, step skipped ({state.nonfinite_in_a_row} in a row)"
            )
            if state.nonfinite_in_a_row >= cfg.max_nonfinite_in_a_row:
                path = run.save(prune=False)  # the good checkpoints before it stay
                raise NonFiniteLossError(
                    f"{state.nonfinite_in_a_row} non-finite losses in a row at step {state.step}; the last good "
                    f"state is saved in {path}. Lower the learning rates or use mixed_precision=no, then --resume."
                )
            continue
        steps_since_log += 1
        progress.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.optim.max_steps:
            now = time.time()
            record["steps_per_s"] = round(steps_since_log / max(now - t_last, 1e-9), 4)
            state.wall_time += now - t_last
            t_last, steps_since_log = now, 0
            progress.set_postfix(
                {k: f"{record[k]:.3f}" for k in ("loss", "reader_loss", "retriever_loss") if k in record}
            )
        if cfg.eval_every and state.step % cfg.eval_every == 0 and run.dev_examples:
            record.update(run.validate())  # on the hard subcorpus when configured
            check_collapse(cfg, record, state.step)
        if acc.is_main_process:
            acc.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=state.step)
            with open(log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        signum = run.stops.requested_anywhere(acc)
        if signum is not None:
            progress.close()
            raise Preempted(signum, state.step, run.save())
        if cfg.save_every and state.step % cfg.save_every == 0:
            run.save()
        if acc.is_main_process:  # refreshed rows that no kept checkpoint and not this step needs
            kept = [checkpointing.checkpoint_step(p) for p in checkpoints(output_dir)]
            run.strategy.prune_refreshes(kept)

    progress.close()
    if prefix_out is not None:
        save_prefix(run, prefix_out, log_path)
        acc.end_training()
        return {"steps": state.step, "prefix": str(prefix_out)}
    summary = {
        "steps": state.step,
        "reembedded": run.strategy.reembedded,
        "nonfinite_skipped": state.nonfinite_total,
        **({"prefix": str(prefix)} if prefix_log is not None else {}),
    }
    if run.dev_examples:
        summary.update(run.validate(subcorpus=False))  # the whole corpus, sharded
        check_collapse(cfg, summary, state.step)
        if cfg.eval_selection and run.strategy.uses_passages and not run.strategy.shares_batch:
            summary.update(run.validate(selection=True))  # what the final reader-only phase read
        # Validations whose passage embeddings were reused (the tower had not moved since the last one).
        summary["validation_embeddings_reused"] = run.validation_cache.hits
    if acc.distributed_type == DistributedType.DEEPSPEED:
        use_fp32_master_weights(run)  # every process: the gather is collective
    if acc.is_main_process:
        # Whole or not at all: never a new retriever beside an old reader.
        with atomic_directory(output_dir / "final") as tmp:
            run.raw.save_pretrained(tmp)
            atomic_write_text(tmp / "config.yaml", dump_config(cfg))
        atomic_write_json(output_dir / "summary.json", summary)
    # Every process ends together: one that tears down its process group while another is still at work (the
    # main process writing final/) can leave that one waiting on a rendezvous store that is gone.
    acc.wait_for_everyone()
    if acc.num_processes > 1:
        # gloo's worker thread frees a finished collective's tensors under the GIL; the process group's
        # destructor (when the DDP wrapper goes) joins that thread holding the GIL: a deadlock seen at exit
        # on a 2-machine run (py-spy: ~ProcessGroupGloo -> thread::join vs ~AsyncBarrierWork -> decref).
        # Give the thread a moment to drain before anything is torn down.
        time.sleep(0.5)
    acc.end_training()
    return summary


def use_fp32_master_weights(run: TrainRun) -> None:
    """Under DeepSpeed the module holds the step's precision (bf16 with mixed precision) and the optimizer the
    fp32 master weights; `final/` gets the latter (gathered from the ZeRO partitions), as an fp32 run would.
    Called after the last step and validation: the module is not trained further."""
    from deepspeed.utils import safe_get_full_fp32_param

    for param in run.raw.parameters():
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        param.data = (master if master is not None else param.data).to(param.device, torch.float32)


def check_collapse(cfg: TrainConfig, metrics: dict, step: int) -> None:
    """Stop the run (every process sees the same figures) when the query tower has collapsed."""
    cosine, limit = metrics.get("dev_query_mean_cosine"), cfg.retriever.collapse_cosine
    if cosine is not None and limit is not None and cosine > limit:
        raise RepresentationCollapseError(
            f"step {step}: the query tower has collapsed: the dev questions' query embeddings have a mean "
            f"pairwise cosine of {cosine:.4f} > retriever.collapse_cosine={limit} (every question retrieves "
            "nearly the same passages). A light query tower needs aligning first (DAFT); otherwise lower "
            "optim.lr_retriever. Set retriever.collapse_cosine=null to train on anyway."
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m rlm.train` and `accelerate launch -m rlm.train`: `rlm train`, with its error handling."""
    from rlm.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML run config (configs/*.yaml); defaults when omitted")
    add_override_argument(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in output_dir (with the same settings)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an output_dir that holds a run (its checkpoints, log and final models are deleted)",
    )
    parser.add_argument(
        "--allow-changed",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: accept this setting differing from the checkpoint's (e.g. optim.max_steps to "
        "train longer); repeat for several",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (the file, the defaults and every --set) as YAML and exit",
    )


def run(args: argparse.Namespace) -> int:
    from rlm.cli import main_process

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    try:
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite, allow_changed=args.allow_changed)
    except Preempted as err:
        if main_process():
            print(f"rlm train: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (NonFiniteLossError, RepresentationCollapseError) as err:
        if main_process():
            print(f"error: {err}", file=sys.stderr)
        return 1
    if main_process():
        print(json.dumps(summary, indent=2))
    return 0 if all(not isinstance(v, float) or math.isfinite(v) for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
