"""The training loop: `train` is the whole run of `rlm train` (and of `accelerate launch -m rlm.train`).

`train` opens the run (`training_run`: the accelerator, `rlm.training.run.build_run`: data, models, the fixed
buffer B, the strategy, optimizer and schedule, prepared by accelerate, resumed from its newest good checkpoint)
and runs the loop (`train_loop`): one optimizer step after another (`train_step`: refresh, an accumulation window,
per-component clipping, step, schedule), DAFT's alignment stage around the steps it holds, logging, validation,
checkpoints, stop signals. The window's selection is made where the window is formed (`accumulation_window`);
the algorithm itself is `rlm.training.steps.algorithm2_step` (or `algorithm1_step`), run through the model's
forward so DDP syncs it.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from rlm.base.atomicio import atomic_directory, atomic_write_json, atomic_write_text
from rlm.config import TrainConfig, dump_config
from rlm.retriever.distributed import Processes
from rlm.training import checkpointing
from rlm.training.accelerator import (
    clip_per_component,
    engine_step_held,
    finite_on_every_process,
    make_accelerator,
    mean_over_processes,
    tracked_config,
    use_fp32_master_weights,
    zero_loss,
)
from rlm.training.alignment_stage import check_collapse
from rlm.training.model_card import write_model_card
from rlm.training.preemption import Preempted, StopSignals
from rlm.training.run import NonFiniteLossError, TrainRun, build_run
from rlm.training.schedule import reader_only_step
from rlm.training.selection import select_window
from rlm.training.throughput import NO_TIMER, NoTimer, PhaseTimer, Throughput
from rlm.training.validation import check_kept_embeddings_folder, keep_passage_embeddings


def train(
    cfg: TrainConfig, resume: bool = False, accelerator=None, overwrite: bool = False, allow_changed=()
) -> dict:
    """Train `cfg`'s run to `optim.max_steps`, validate on dev, save `final/`; returns the summary.

    A folder that holds a run needs `resume` (continue its newest complete checkpoint, with the same settings
    but those in `allow_changed`) or `overwrite` (start over). SIGTERM or SIGUSR1 ends the run after the
    current step with a checkpoint, raising `Preempted`."""
    with training_run(cfg, resume, accelerator, overwrite, allow_changed) as run:
        return train_loop(run)


@contextlib.contextmanager
def training_run(
    cfg: TrainConfig, resume: bool = False, accelerator=None, overwrite: bool = False, allow_changed=()
) -> Iterator[TrainRun]:
    """The run `cfg` describes, built and resumed (`rlm.training.run.build_run`); while it is open SIGTERM and
    SIGUSR1 ask it to stop after the current step."""
    check_kept_embeddings_folder(cfg)  # refused now, not after hours of training
    stops = StopSignals()
    with stops.installed():
        run = build_run(cfg, accelerator or make_accelerator(cfg), resume, overwrite, allow_changed, stops)
        try:
            yield run
        finally:
            run.heartbeat.close()


def train_loop(run: TrainRun, until: int | None = None) -> dict:
    """The steps from where `run` stands to step `until` (default: the last one); after the last one, the final
    validation and `final/` (`finish`). Returns the summary (`{"steps": ...}` when stopped at `until`)."""
    cfg, acc, state = run.cfg, run.accelerator, run.state
    until = cfg.optim.max_steps if until is None else until
    log = RunLog(run, until)
    run.model.train()
    stop_signal = None
    while state.step < until and stop_signal is None:
        started = time.monotonic()
        aligning = run.alignment is not None and run.alignment.before_step(state.step, run.raw)
        with log.throughput.step():
            record = train_step(run, log.throughput.timer)
        run.step_ended(time.monotonic() - started)  # the heartbeat, and the process group's timeout
        if record is None:  # a non-finite loss somewhere: the batch is skipped on every process
            log.flush()  # the log holds every step a checkpoint written now holds
            skipped_batch(run)
            continue
        if aligning:
            alignment_step_ended(run, record)
        log.step(record)
        if cfg.eval_every and state.step % cfg.eval_every == 0 and run.dev_examples:
            record.update(run.validate())  # on the hard subcorpus when configured
            check_collapse(cfg.retriever, record, state.step)
        log.write(record)
        stop_signal = run.stops.requested_anywhere(acc)  # SIGTERM / SIGUSR1 on any process
        if stop_signal is None and cfg.save_every and state.step % cfg.save_every == 0:
            log.flush()
            run.save()
    log.close()
    if stop_signal is not None:
        raise run.preempted(stop_signal)
    return finish(run) if state.step == cfg.optim.max_steps else {"steps": state.step}


def alignment_step_ended(run: TrainRun, record: dict) -> None:
    """After an optimizer step of DAFT's alignment stage: the stage measures the towers when due (its figures in
    `record`) and decides whether it ends; re-embedding schedules count from the first passage-tower update."""
    examples = run.dev_examples or run.train_examples  # what the stage measures the towers on
    questions = [ex.question for ex in examples[:256]]
    ended = run.alignment.after_step(run.state.step, run.raw.retriever, questions, record)
    if ended is not None:
        run.strategy.start_step = run.state.step
        run.accelerator.print(
            f"step {run.state.step}: alignment stage ends ({ended}); both towers train from here"
        )


def train_step(run: TrainRun, timer: PhaseTimer | NoTimer = NO_TIMER) -> dict | None:
    """One optimizer step: refresh (if the strategy is due), an accumulation window of micro-batches, clip per
    component, step, schedule. Returns the step's log record, its figures from the device still there
    (`host_record` reads them), or None when a non-finite loss on any process skipped the window's batch (on
    every process alike: the next step trains the next window). `timer` times the window's selection."""
    cfg, acc, state, strategy = run.cfg, run.accelerator, run.state, run.strategy
    before = strategy.state_dict()
    try:
        strategy.before_step(state.step, run.reembed)
    except Preempted as err:  # every process stopped at the same part of a refresh
        strategy.load_state_dict(before)  # as after the last step: a checkpoint now redoes the refresh
        raise run.preempted(err.signum) from None
    sums, finite = accumulation_window(run, reader_only_step(cfg, state.step), timer)
    if not finite:
        run.optimizer.zero_grad(set_to_none=True)
        window = state.window
        state.bad_batches.append(
            {"step": state.step, "window": window, "questions": run.window_question_ids(window)}
        )
        return None
    norms = clip_per_component(acc, run.optimizer, cfg.optim.max_grad_norm)
    lrs = {f"lr_{group['name']}": group["lr"] for group in run.optimizer.param_groups}  # this step's
    run.optimizer.step()
    if not run.optimizer.step_was_skipped:  # fp16 loss scaling skips steps that overflowed
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    return {
        "step": state.step,
        **mean_over_processes(acc, sums),
        **norms,
        **strategy.pop_metrics(),
        **lrs,
        "reembedded": strategy.reembedded,
        "nonfinite_skipped": len(state.bad_batches),
    }


def accumulation_window(
    run: TrainRun, reader_only: bool, timer: PhaseTimer | NoTimer = NO_TIMER
) -> tuple[dict[str, torch.Tensor], bool]:
    """The step's micro-batches: S_x selected for all of them at once (Algorithm 2's step 2, timed as
    `select`), then each one's forward and backward. Returns their mean figures, on the device, and whether
    every loss on every process was finite."""
    acc, state, windows = run.accelerator, run.state, run.accumulation_steps
    sums: dict[str, torch.Tensor] = {}
    finite, losses = True, []
    batches = [run.batch(state.step, micro, state.window) for micro in range(windows)]
    # Under the forward's autocast: the q that selects is the q step 1 embeds again, to the bit.
    with timer("select"), acc.autocast():
        selections = select_window(run.raw, batches, run.strategy, run.corpus, run.cfg, reader_only)
    # DeepSpeed steps inside the window's last backward and sums the micro-steps' gradients in its own buffers,
    # so there each loss is judged before its backward. Elsewhere the window's gradients are dropped after a
    # non-finite loss, so one verdict at its end is enough: one read from the device per window.
    judged_each = acc.distributed_type == DistributedType.DEEPSPEED
    for micro, (batch, selection) in enumerate(zip(batches, selections)):
        # Every micro-step of the window goes through accumulate() and backward, a skipped one too: that keeps
        # accelerate's micro-step counter (and DeepSpeed's) on the window and DDP's reducer in step.
        with acc.accumulate(run.model):
            out = run.model(batch, run.strategy, run.corpus, selection=selection, reader_only=reader_only)
            losses.append(out.loss.detach())
            last = micro == windows - 1
            if judged_each or last:
                finite = finite_on_every_process(acc, torch.stack(losses)) and finite
                losses = []
            with engine_step_held(acc, run.optimizer, hold=last and not finite):
                acc.backward(out.loss if finite else zero_loss(acc, run.model, out.loss))
            for key, value in {"loss": out.loss.detach(), **out.metrics}.items():
                sums[key] = sums.get(key, 0.0) + value / windows
    return sums, finite


def host_record(record: dict) -> dict:
    """`record` with its figures from the device read into Python numbers (one read for all of them), rounded
    to 6 decimals; what is already a Python value stays as it is."""
    keys = [key for key, value in record.items() if isinstance(value, torch.Tensor)]
    if not keys:
        return dict(record)
    device = record[keys[0]].device
    values = torch.stack([record[key].detach().to(device, torch.float32).reshape(()) for key in keys])
    return {**record, **{key: round(value, 6) for key, value in zip(keys, values.tolist())}}


def skipped_batch(run: TrainRun) -> None:
    """After a window whose loss was non-finite: name its batch, and stop at the `max_bad_batches`th."""
    state, cfg = run.state, run.cfg
    bad = state.bad_batches[-1]
    run.accelerator.print(
        f"step {state.step}: non-finite loss; skipped the batch of window {bad['window']} "
        f"({len(state.bad_batches)} of at most {cfg.max_bad_batches}), questions {' '.join(bad['questions'])}"
    )
    if len(state.bad_batches) >= cfg.max_bad_batches:
        path = run.save(prune=False)  # the good checkpoints before it stay
        windows = ", ".join(str(b["window"]) for b in state.bad_batches)
        raise NonFiniteLossError(
            f"{len(state.bad_batches)} batches with non-finite losses (windows {windows}; their questions are "
            f"printed above) by step {state.step}; the last good state is saved in {path}. Lower the learning "
            "rates or use mixed_precision=no, then --resume (or raise max_bad_batches)."
        )


class RunLog:
    """`log.jsonl`, the trackers (TensorBoard / W&B) and the progress bar of a run that trains to step `stop`.

    A step's record keeps its figures on the device until a log step (every `log_every` steps), where the
    records since the last one are read together and written (`flush`): reading a loss back each step would
    wait for the device at every step. The loop flushes before every checkpoint too, so `log.jsonl` holds
    every step a checkpoint holds."""

    def __init__(self, run: TrainRun, stop: int):
        self.run, self.stop, cfg, acc, state = run, stop, run.cfg, run.accelerator, run.state
        self.path = Path(cfg.output_dir) / "log.jsonl"
        if state.tracker_run_id is None:  # a resumed run keeps its W&B run
            state.tracker_run_id = uuid.uuid4().hex[:12]
        if acc.is_main_process:
            acc.init_trackers(
                "rlm",
                config=tracked_config(cfg),
                init_kwargs={
                    "wandb": {"id": state.tracker_run_id, "resume": "allow", "dir": str(cfg.output_dir)}
                },
            )
            checkpointing.repair_log(self.path, state.step)
        self.progress = tqdm(
            total=cfg.optim.max_steps,
            initial=state.step,
            desc=f"train[{cfg.strategy.name}]",
            disable=not acc.is_local_main_process,
        )
        self.throughput = Throughput(run.raw, acc.device, acc.mixed_precision)
        self.t_start = self.t_last = time.time()
        self.step_start, self.steps_since_log = state.step, 0
        self.pending: list[dict] = []  # records not yet written (`flush`)
        self.due = False  # the last step was a log step

    def step(self, record: dict) -> None:
        """Count a step taken; every `log_every` steps add its speed to `record` (its losses are shown when it
        is written) (collective: every process calls it at every step)."""
        cfg, acc, state = self.run.cfg, self.run.accelerator, self.run.state
        self.steps_since_log += 1
        self.progress.update(1)
        self.due = state.step % cfg.log_every == 0 or state.step == cfg.optim.max_steps
        if self.due:
            if acc.device.type == "cuda":
                torch.cuda.synchronize(acc.device)  # the host clock at a point the GPU has reached
            now = time.time()
            record["steps_per_s"] = round(self.steps_since_log / max(now - self.t_last, 1e-9), 4)
            record.update(self.throughput.interval(acc, self.steps_since_log, now - self.t_last))
            # At the pace of this session's steps so far, validations and checkpoints included.
            per_step = (now - self.t_start) / max(state.step - self.step_start, 1)
            record["eta_s"] = round(max(self.stop - state.step, 0) * per_step, 2)
            state.wall_time += now - self.t_last
            self.t_last, self.steps_since_log = now, 0

    def write(self, record: dict) -> None:
        """Write `record` at a log step, with the ones kept since the last; keep it until then otherwise."""
        self.pending.append(record)
        if self.due:
            self.flush()

    def flush(self) -> None:
        """Read the kept records from the device and write them (the first read waits for the device; the
        others find their figures done)."""
        if not self.pending:
            return
        acc = self.run.accelerator
        records = [host_record(record) for record in self.pending]
        self.pending = []
        if acc.is_local_main_process and "questions_per_s" in records[-1]:
            self.progress.set_postfix(progress_postfix(records[-1]))
        if acc.is_main_process:
            for record in records:
                acc.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"])
            with open(self.path, "a") as fh:
                fh.writelines(json.dumps(record) + "\n" for record in records)

    def close(self) -> None:
        self.flush()
        self.progress.close()
        self.throughput.close()


def progress_postfix(record: dict) -> dict[str, str]:
    """The progress bar's postfix: the step's losses and the interval's speed and memory (tqdm shows the ETA)."""
    shown = {k: f"{record[k]:.3f}" for k in ("loss", "reader_loss", "retriever_loss") if k in record}
    shown["q/s"] = f"{record['questions_per_s']:.3g}"
    shown["tok/s"] = f"{record['tokens_per_s']:.3g}"
    memory = record.get("peak_cuda_memory_gib", record.get("peak_rss_gib"))
    shown["mem"] = f"{memory:.1f}G"
    return shown


def finish(run: TrainRun) -> dict:
    """After the last step: validate on the whole corpus, write `final/` and `summary.json`, end together."""
    cfg, acc, state, output_dir = run.cfg, run.accelerator, run.state, Path(run.cfg.output_dir)
    summary = {
        "steps": state.step,
        "reembedded": run.strategy.reembedded,
        "nonfinite_skipped": len(state.bad_batches),
        **({"prefix": state.prefix} if state.prefix is not None else {}),
        "data": run.data_splits,  # which questions the figures below are on: dataset, split, size
    }
    if run.dev_examples:
        summary.update(run.validate(subcorpus=False))  # the whole corpus, sharded
        check_collapse(cfg.retriever, summary, state.step)
        if cfg.eval_selection and run.strategy.uses_passages and not run.strategy.shares_batch:
            summary.update(run.validate(selection=True))  # what the final reader-only phase read
        # Validations whose passage embeddings were reused (the tower had not moved since the last one).
        summary["validation_embeddings_reused"] = run.validation_cache.hits
    if acc.distributed_type == DistributedType.DEEPSPEED:
        use_fp32_master_weights(run.raw)  # every process: the gather is collective
    if acc.is_main_process:
        # Whole or not at all: never a new retriever beside an old reader.
        with atomic_directory(output_dir / "final") as tmp:
            run.raw.save_pretrained(tmp)
            atomic_write_text(tmp / "config.yaml", dump_config(cfg))
            write_model_card(tmp, cfg, summary, run.corpus, run.raw.retriever, run.strategy.buffer)
        atomic_write_json(output_dir / "summary.json", summary)
    # Every process ends together: one that tears down its process group while another is still at work (the
    # main process writing final/) can leave that one waiting on a rendezvous store that is gone.
    acc.wait_for_everyone()
    if cfg.final_embeddings:  # after final/: a full disk here loses no model
        keep_final_embeddings(run)
    if acc.num_processes > 1:
        # gloo's worker thread frees a finished collective's tensors under the GIL; the process group's
        # destructor (when the DDP wrapper goes) joins that thread holding the GIL: a deadlock seen at exit
        # on a 2-machine run (py-spy: ~ProcessGroupGloo -> thread::join vs ~AsyncBarrierWork -> decref).
        # Give the thread a moment to drain before anything is torn down.
        time.sleep(0.5)
    acc.end_training()
    return summary


def keep_final_embeddings(run: TrainRun) -> None:
    """The corpus as the trained passage tower embeds it, kept in `final_embeddings` as a buffer (every process
    writes its share: the final validation's, reused when it held them; under DeepSpeed the tower has just
    taken its fp32 master weights, the ones final/ holds, so they are embedded again)."""
    cfg, acc = run.cfg, run.accelerator
    with acc.autocast():  # as validation embedded: its rows are then reused
        keep_passage_embeddings(
            run.raw.retriever,
            run.corpus,
            cfg.final_embeddings,
            Processes.of(acc),
            cfg.buffer.batch_size,
            run.validation_cache,
        )
    if acc.is_main_process:
        print(
            f"kept the corpus embedded by the trained passage tower in {cfg.final_embeddings}: `rlm index "
            f"--buffer {cfg.final_embeddings} --out INDEX` indexes it without embedding it again",
            flush=True,
        )
