"""One training run: everything it holds (`TrainRun`) and how it is made (`build_run`): the run folder claimed,
data, models, the fixed buffer B, the strategy, the optimizer and schedule, accelerate's prepare, and the
checkpoint it resumes from. `rlm.training.loop` advances it one optimizer step at a time.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from torch.optim.lr_scheduler import LambdaLR

from rlm.base.atomicio import atomic_write_text
from rlm.components import buffer_folder, build_components
from rlm.config import TrainConfig, dump_config
from rlm.data.corpus import Corpus
from rlm.errors import UserError
from rlm.retriever.buffer import BuildStopped
from rlm.retriever.distributed import Processes
from rlm.training import attempt, checkpointing
from rlm.training.accelerator import (
    CollectiveTimeout,
    configure_ddp,
    configure_deepspeed,
    distribute_strategy,
    make_accelerator,
)
from rlm.training.alignment_stage import AlignmentStage
from rlm.training.batch import Batch
from rlm.training.checkpointing import checkpoints
from rlm.training.hard_subcorpus import hard_subcorpus_from_buffer, save_subcorpus_ids
from rlm.training.heartbeat import Heartbeat
from rlm.training.model import RetrievalAugmentedModel, embed_rows
from rlm.training.preemption import Preempted, StopSignals
from rlm.training.schedule import (
    batch_indices,
    check_gold_passages,
    lr_lambda,
    make_batch,
    retriever_start,
    retriever_stop,
)
from rlm.training.strategies import make_strategy
from rlm.training.strategies.base import SelectionStrategy
from rlm.training.validation import PassageEmbeddingCache, subcorpus_path, validate


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainState:
    """Counters that must survive a resume (saved with the checkpoint, as JSON)."""

    step: int = 0  # optimizer steps done
    # The batches skipped for a non-finite loss, each {"step", "window", "questions"}: the optimizer step that
    # skipped it, its data window (`window`) and its question ids. Every skip moves the data on by one window.
    bad_batches: list[dict] = field(default_factory=list)
    wall_time: float = 0.0
    tracker_run_id: str | None = None  # W&B's run id, so a resumed run logs into the same run
    prefix: str | None = None  # the shared prefix this run continued from (rlm.training.prefix), if any

    @property
    def window(self) -> int:
        """The data window the current step trains on: its place in the data order (a pure function of the
        seed and the window), past the windows of the steps before it and of the batches skipped."""
        return self.step + len(self.bad_batches)

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint written before bad batches were skipped counts retries of batches later trained
        # (`nonfinite_total`, `nonfinite_in_a_row`): none moved the data on.
        state = {k: v for k, v in state.items() if k not in ("nonfinite_total", "nonfinite_in_a_row")}
        self.__dict__.update(state)


def build_optimizer(model: RetrievalAugmentedModel, strategy, optim_cfg) -> torch.optim.AdamW:
    """One AdamW, a parameter group per component. Fused (one kernel over all tensors) where torch has it: a
    per-tensor loop is several times slower for the towers' many small tensors (docs/training.md)."""
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
    data_splits: dict  # what train and dev are (`rlm.data.qa.QASplit.record`), for summary.json and the card
    model: torch.nn.Module  # as prepared by accelerate (DDP / DeepSpeed wrapper)
    strategy: SelectionStrategy
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    state: TrainState
    accumulation_steps: int
    # Passage embeddings of the last validation, reused while the passage tower is unchanged.
    validation_cache: PassageEmbeddingCache = field(default_factory=PassageEmbeddingCache)
    # SIGTERM / SIGUSR1 received (`rlm.training.preemption`): checked between steps and inside long refreshes.
    stops: StopSignals = field(default_factory=StopSignals)
    # The process group's timeout, sized by the stretches between collectives measured here and in the loop.
    timeout: CollectiveTimeout = field(default_factory=lambda: CollectiveTimeout(None, multiprocess=False))
    # This process's progress, which the main process reads to name a rank that holds the others up.
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(None, 0, 1))
    # The time this step's refresh took, which the step's own measure leaves out (its parts are measured).
    _refresh_s: float = field(default=0.0, init=False, repr=False)
    alignment: AlignmentStage | None = None  # DAFT's stage 1, when `retriever.align.steps` asks for one

    @property
    def raw(self) -> RetrievalAugmentedModel:
        return self.accelerator.unwrap_model(self.model)

    # Refreshes and validation run in the training step's precision (accelerate's autocast: a no-op unless
    # mixed_precision is set); only the fixed buffer B, built once and shared by runs, is always float32.
    def reembed(self, rows) -> torch.Tensor:
        """The rows embedded by the current passage tower, in parts of `REEMBED_PART_ROWS`. Before each part the
        processes agree whether any got a stop signal (`StopSignals.stop_together`): a refresh of a large corpus
        outlasts a scheduler's grace, and this way every process stops at the same part, from where they
        checkpoint together. Every process runs as many parts (the most any has; the rest empty), so that
        they agree as often, and no wait at a collective is longer than a part."""
        acc = self.accelerator
        count = max(-(-len(rows) // REEMBED_PART_ROWS), 1)
        if acc.num_processes > 1:
            count = int(acc.gather(torch.tensor([count], device=acc.device)).max())
        with acc.autocast(), self.heartbeat.doing("refresh"):
            tower = self.raw.retriever.passage_tower
            texts = self.corpus.retrieval_texts()
            parts = []
            for start in range(0, count * REEMBED_PART_ROWS, REEMBED_PART_ROWS):
                self.stops.stop_together(acc, self.state.step)
                started = time.monotonic()
                part = rows[start : start + REEMBED_PART_ROWS]
                parts.append(embed_rows(tower, texts, part, batch_size=self.cfg.buffer.batch_size))
                took = time.monotonic() - started
                self._refresh_s += took
                self.timeout.measured(took)  # the longest wait a refresh makes: one part
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Work every process does together between two collectives (a checkpoint, a validation): marked in
        the heartbeat, and measured for the process group's timeout."""
        started = time.monotonic()
        with self.heartbeat.doing(what):
            yield
        self.timeout.measured(time.monotonic() - started)

    def step_ended(self, seconds: float) -> None:
        """The loop's word that an optimizer step (taken or skipped) ended after `seconds`; a refresh in it
        counts by its parts, between which the processes meet."""
        self.heartbeat.step_done(self.state.step)
        self.timeout.measured(seconds - self._refresh_s)
        self._refresh_s = 0.0

    def preempted(self, signum: int) -> Preempted:
        """Every process agreed to stop on `signum`: a checkpoint of the current step, then the main process's
        record for the launcher; returns the `Preempted` to raise (every process must call it)."""
        return stop_recorded(self.accelerator, self.cfg, signum, self.state.step, self.save())

    def validate(self, subcorpus: bool = True, selection: bool = False) -> dict[str, float]:
        """Dev metrics, the work sharded across the processes (every process must call it); `selection`:
        answering from the strategy's own selection (`dev_selection_*`) instead of the re-embedded corpus."""
        acc = self.accelerator
        with acc.autocast(), self.phase("validation"):
            return validate(
                self.raw,
                self.corpus,
                self.dev_examples,
                self.cfg,
                procs=Processes.of(acc),
                device=acc.device,
                subcorpus=subcorpus,
                cache=self.validation_cache,
                strategy=self.strategy if selection else None,
            )

    def save(self, prune: bool = True) -> Path:
        """A checkpoint of the current step (every process must call it); with `prune`, only the newest
        `keep_last` checkpoints stay, and only the refreshed rows they or this step need."""
        state = {
            "train": self.state.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "strategy": self.strategy.state_dict(),
            "alignment": None if self.alignment is None else self.alignment.state_dict(),
            "processes": self.accelerator.num_processes,
            # The corpus edition trained over: a resume over a later one of its lineage goes on (`load`).
            "corpus": {"edition": self.corpus.fingerprint, "rows": len(self.corpus)},
        }
        output_dir = Path(self.cfg.output_dir)
        with self.phase("checkpoint"):
            path = checkpointing.save_checkpoint(
                self.accelerator,
                output_dir,
                self.state.step,
                self.cfg.keep_last,
                state,
                dump_config(self.cfg),
                prune,
            )
        self.tell_strategy_kept_checkpoints()
        if self.accelerator.is_main_process:  # the refreshed rows neither they nor this step need
            self.strategy.prune_refreshes(self.strategy.checkpoint_steps, self.state.step)
        return path

    def tell_strategy_kept_checkpoints(self) -> None:
        """The steps of the checkpoints on disk, which the strategy keeps the refreshed rows of at its refreshes."""
        found = checkpointing.checkpoints(Path(self.cfg.output_dir))
        self.strategy.checkpoint_steps = tuple(checkpointing.checkpoint_step(p) for p in found)

    def load(self, folder: Path) -> None:
        """Continue from checkpoint `folder` (verified and checked by `find_checkpoint`)."""
        checkpointing.load_checkpoint(self.accelerator, folder)  # weights only: no pickled code runs
        state = checkpointing.read_state(folder)
        changed = corpus_change(state.get("corpus"), self.corpus, folder, buffer_folder(self.cfg))
        if changed:
            self.accelerator.print(changed)
        self.state.load_state_dict(state["train"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.load_state_dict(state["strategy"])
        self.tell_strategy_kept_checkpoints()
        if self.alignment is not None and state.get("alignment"):
            self.alignment.load_state_dict(state["alignment"])
            if self.alignment.end is not None:  # re-embedding counts from the first passage-tower update
                self.strategy.start_step = self.alignment.end

    def batch(self, step: int, micro: int, window: int | None = None) -> Batch:
        """This process's questions at micro-step `micro` of optimizer step `step`, taken from data window
        `window` (default: `step`; the loop passes `TrainState.window`, which skipped batches move on)."""
        cfg, acc = self.cfg, self.accelerator
        window = step if window is None else window
        indices = batch_indices(
            window * self.accumulation_steps + micro,
            len(self.train_examples),
            cfg.optim.batch_size,
            acc.process_index,
            acc.num_processes,
            cfg.seed,
        )
        gold_phase = cfg.algorithm == 2 and step < cfg.schedule.gold_passage_steps
        return make_batch(self.train_examples, indices, self.corpus, cfg.algorithm, gold_passages=gold_phase)

    def window_question_ids(self, window: int) -> list[str]:
        """The ids of every process's questions in data window `window`, rank by rank, micro-step by micro-step:
        computed from the data order, which every process knows (nothing is gathered)."""
        cfg, world, accum = self.cfg, self.accelerator.num_processes, self.accumulation_steps
        return [
            self.train_examples[i].id
            for rank in range(world)
            for micro in range(accum)
            for i in batch_indices(
                window * accum + micro, len(self.train_examples), cfg.optim.batch_size, rank, world, cfg.seed
            )
        ]


def alignment_stage(cfg: TrainConfig, accelerator: Accelerator) -> AlignmentStage | None:
    """DAFT's alignment stage when `retriever.align.steps` asks for one."""
    if not cfg.retriever.align.steps:
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise UserError(
            "retriever.align.steps is not supported under DeepSpeed (it freezes a tower per step)"
        )
    return AlignmentStage(cfg.retriever, retriever_start(cfg), cfg.buffer.batch_size)


def strategy_for(cfg: TrainConfig, buffer) -> SelectionStrategy:
    """The run's selection strategy over the fixed buffer, on the run's schedule."""
    return make_strategy(
        cfg.strategy,
        buffer,
        cfg.optim.max_steps,
        seed=cfg.seed,
        chunk_size=cfg.buffer.chunk_size,
        # Re-embedding counts from the first step that moves the passage tower: after the alignment stage
        # (lowered to where it ends when it ends early).
        start_step=retriever_start(cfg) + cfg.retriever.align.steps,
        stop_step=retriever_stop(cfg),
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
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))  # read back by evaluate, resume
        attempt.start_attempt(output_dir)  # before the others write records of this attempt
    accelerator.wait_for_everyone()
    return None if verdict[0] is None else Path(verdict[0])


def check_shared_folder(folder: Path, procs, key: str) -> None:
    """Refuse, on every process, a folder that not every process sees: the main process writes a file there and
    the others look for it (`procs`: `rlm.retriever.distributed.Processes`; every one must call).

    Every process writes its part of the buffer, its checkpoint files and its refreshed rows there, which the
    main one reads: on a machine's own disk (a relative path is taken from each machine's working directory)
    the main process fails when it finalizes the buffer and the others wait at a collective for
    `dist_timeout_s`; this says so at the start instead. Creates `folder` when it is missing."""
    if procs.world == 1:
        return
    name = f".shared-probe-{uuid.uuid4().hex}" if procs.rank == 0 else None
    probe = folder / procs.gather_object([name])[0]  # the main process's name, on every process
    if procs.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
    procs.barrier()
    for _ in range(5):  # a network file system may show another machine's new file a moment later
        if probe.exists():
            break
        time.sleep(1)
    seen = procs.gather_object([probe.exists()])
    if procs.rank == 0:
        probe.unlink(missing_ok=True)
    blind = [rank for rank, found in enumerate(seen) if not found]
    if blind:
        where = "" if folder.is_absolute() else " (relative: from each machine's working directory)"
        raise UserError(
            f"{key}={folder}{where} is not on storage every process sees: process(es) {blind} cannot see the "
            "file the main process wrote there; give a folder on a file system every machine mounts at that path"
        )


def build_run(
    cfg: TrainConfig,
    accelerator: Accelerator | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_changed=(),
    stops: StopSignals | None = None,
) -> TrainRun:
    """Data, models, the fixed buffer B, the strategy, optimizer and schedule, prepared by accelerate; a stop
    signal (`stops`) ends a buffer build between batches with `Preempted`, on every process alike."""
    stops = stops or StopSignals()
    accelerator = accelerator or make_accelerator(cfg)
    timeout = CollectiveTimeout(cfg.dist_timeout_s, accelerator.num_processes > 1, say=accelerator.print)
    accum = cfg.optim.accumulation_steps(accelerator.num_processes)
    accelerator.gradient_accumulation_steps = accum
    configure_deepspeed(accelerator, cfg.optim, accum)
    set_seed(cfg.seed)
    resume_from = claim_run_folder(accelerator, cfg, resume, overwrite, allow_changed)
    buffer_dir = buffer_folder(cfg)
    for key, folder in (("output_dir", Path(cfg.output_dir)), ("buffer.dir", buffer_dir)):
        check_shared_folder(folder, Processes.of(accelerator), key)
    # From here on the main process can name a rank that holds the others up (the run closes it as it ends;
    # a start that fails ends the process, and the thread with it).
    heartbeat = heartbeat_for(cfg, accelerator, timeout).start()
    parts = components_or_stop(cfg, accelerator, stops)
    if cfg.algorithm == 2 and cfg.schedule.gold_passage_steps:
        check_gold_passages(parts.train_examples, parts.corpus)
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, parts.corrector, parts.collator, cfg)
    strategy = strategy_for(cfg, parts.buffer)
    distribute_strategy(strategy, cfg, accelerator)
    alignment = alignment_stage(cfg, accelerator)
    model, optimizer, scheduler = prepared_for_training(model, strategy, cfg, accelerator)
    run = TrainRun(
        cfg=cfg,
        accelerator=accelerator,
        corpus=parts.corpus,
        train_examples=parts.train_examples,
        dev_examples=parts.dev_examples,
        data_splits=parts.data_splits,
        model=model,
        strategy=strategy,
        optimizer=optimizer,
        scheduler=scheduler,
        state=TrainState(),
        accumulation_steps=accum,
        stops=stops,
        timeout=timeout,
        heartbeat=heartbeat,
        alignment=alignment,
    )
    ensure_dev_subcorpus(run)
    # The steps' randomness (dropout) depends on the seed alone, not on which components were built before
    # (a corrector's initialisation draws from the same generator): runs of different strategies draw alike.
    set_seed(cfg.seed)
    if resume_from is not None:
        run.load(resume_from)
        accelerator.print(f"resumed from {resume_from} at step {run.state.step}")
    return run


def corpus_change(saved: dict | None, corpus, checkpoint: Path, buffer_dir: Path) -> str | None:
    """What changed in the corpus since `checkpoint` was trained over the edition `saved` (its fingerprint and
    rows; None: a checkpoint older than the record, taken as this corpus), said in a line; None when nothing
    did. A later edition of the same lineage (`rlm corpus update --buffer` applied since) goes on: its new rows
    are selectable through h at once, its removed ones never selected. Any other is refused."""
    if saved is None or saved["edition"] == corpus.fingerprint:
        return None
    lineage = getattr(corpus, "lineage", [corpus.fingerprint])
    if saved["edition"] not in lineage:
        raise UserError(
            f"checkpoint {checkpoint} was trained over corpus edition {saved['edition']}, but the corpus with the "
            f"updates of buffer {buffer_dir} is {corpus.fingerprint}, which does not descend from it (updates "
            "undone, or applied to a rebuilt buffer): restore the buffer's edition.json and updates/ the run was "
            "trained with, or start a new run"
        )
    updates = len(lineage) - 1 - lineage.index(saved["edition"])
    removed = len(getattr(corpus, "removed", ()))
    return (
        f"the corpus changed since {checkpoint.name}: {updates} corpus update(s) applied to buffer {buffer_dir}, "
        f"{saved['rows']:,} -> {len(corpus):,} rows ({removed:,} removed in all); the new rows are selected "
        f"from now on, the removed ones never (edition {corpus.fingerprint})"
    )


def prepared_for_training(
    model: RetrievalAugmentedModel, strategy, cfg: TrainConfig, accelerator: Accelerator
):
    """The model (its reader gradient-checkpointed when asked) and its optimizer prepared by accelerate, and the
    lr schedule, which is not handed to accelerate: `train_step` steps it once per optimizer step taken."""
    if cfg.gradient_checkpointing and model.reader is not None:
        model.reader.gradient_checkpointing_enable()
    optimizer = build_optimizer(model, strategy, cfg.optim)
    scheduler = LambdaLR(optimizer, lr_lambda(cfg.optim.warmup_steps, cfg.optim.max_steps))
    configure_ddp(accelerator, cfg, model)  # after the optimizer's groups froze what is not trained
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


def components_or_stop(cfg: TrainConfig, accelerator: Accelerator, stops: StopSignals):
    """Data, models and the fixed buffer B (built once by the initial passage tower, verified on every load); a
    stop signal ends the buffer build between batches, every process at the build's meeting point, where the
    stop is recorded and `Preempted` raised (its finished shards stay)."""

    def stop_between_batches() -> None:  # the buffer build's check
        if stops.received is not None:
            raise BuildStopped(f"stopped by {signal.Signals(stops.received).name}")

    try:
        return build_components(cfg, accelerator, check=stop_between_batches)
    except BuildStopped:
        signum = stops.requested_anywhere(accelerator)
        if signum is None:
            raise
        raise stop_recorded(accelerator, cfg, signum, 0, None) from None


def heartbeat_for(cfg: TrainConfig, accelerator: Accelerator, timeout: CollectiveTimeout) -> Heartbeat:
    """This process's heartbeat in the attempt's folder, watching stalls against the current `timeout`."""
    folder = attempt.attempt_folder(cfg.output_dir)
    rank, world = accelerator.process_index, accelerator.num_processes
    return Heartbeat(folder, rank, world, timeout=lambda: timeout.seconds)


def stop_recorded(
    accelerator: Accelerator, cfg: TrainConfig, signum: int, step: int, checkpoint: Path | None
) -> Preempted:
    """After every process agreed to stop on `signum` and what the run resumes from is on disk (`checkpoint`,
    or the buffer's finished shards): the main process's record for the launcher (`rlm.training.attempt`,
    which the sbatch script requeues on), and the `Preempted` every process raises."""
    if accelerator.is_main_process:
        name = signal.Signals(signum).name
        folder = attempt.attempt_folder(cfg.output_dir)
        attempt.write_stopped(folder, name, step, None if checkpoint is None else str(checkpoint))
    # No process exits before the record is on disk: the first to exit makes its launcher, then srun, end the
    # others, the main process among them.
    accelerator.wait_for_everyone()
    return Preempted(signum, step, checkpoint)


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
            Processes.of(acc),
            acc.device,
        )
    if acc.is_main_process:
        save_subcorpus_ids(ids, path)
        acc.print(f"hard dev subcorpus: {len(ids)} passages -> {path}")
    acc.wait_for_everyone()
