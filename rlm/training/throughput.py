"""How fast a run trains, where people look: questions, passages and tokens per second, seconds per phase of the
optimizer step, peak memory and an ETA, per optimizer step over each logging interval (`rlm.training.loop.RunLog`
writes them to `log.jsonl`, the trackers and the progress bar; docs/training.md lists the keys).

The phases are timed flat by `PhaseTimer`, from outside the step: the loop times the window's selection
(`select`), and forward hooks on the model's components time its forward (`step_phases`: retriever, reader_scoring,
reader, corrector, then `losses`, the step's arithmetic after its last component); the step's code holds no timer.
The time of the optimizer step that no phase holds is `backward_optimizer` (backward, clipping, the optimizer
step, and a refresh at the steps a re-embedding strategy refreshes). What the step read is counted where it enters the modules, by forward pre-hooks: the
questions of each micro-batch (the model's forward), the passages and tokens the passage tower embedded with
gradient (g over S_x, step 3) and the tokens the reader read with gradient (FiD, step 6). Scoring, refreshes and
validation run without gradient and are not counted.

The model FLOPs of the steps (`DenseFlops`: every dense layer's matmuls as the step runs them, scoring, h over
the buffer and refreshes included, validation not) give `model_tflops_per_step`, and over the device's peak
(`PEAK_TFLOPS`) the MFU; `input_wait_s` is how long a step waited for the inputs its background thread makes
(`rlm.training.step_inputs`).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from accelerate.utils import gather_object

COUNTS = ("questions", "passages", "reader_tokens", "passage_tokens")
GIB = 2**30


class PhaseTimer:
    """The seconds of each phase of the training step: `start()` at the step's top, then `lap("reader")` at the
    end of each phase adds the time since the previous mark to that phase (flat: no phase inside another);
    `with timer("select"):` times a block. `attach` lays the marks from outside a model: forward hooks.

    On CUDA a mark is an event recorded on the current stream instead of a read of the host clock: the host runs
    ahead of the GPU, so its clock would charge a phase with the kernels queued before it and miss its own. The
    events are read by `take`, one wait for the GPU per logging interval, never one per phase: timing adds no
    synchronisation to the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.last = None

    def start(self) -> None:
        """The next `lap` counts from here."""
        self.last = self.mark()

    def lap(self, name: str) -> None:
        """Add the time since the last `start` or `lap` to phase `name`."""
        now = self.mark()
        self.add(name, self.last, now)
        self.last = now

    def mark(self):
        """A point in time on the step's clock: a recorded CUDA event, or the host's clock."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, name: str, start, end) -> None:
        """Add the time from mark `start` to mark `end` to `name`."""
        if self.cuda:
            self.pending.append((name, start, end))
        else:
            self.seconds[name] += end - start

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            self.add(name, start, self.mark())

    def attach(self, model: torch.nn.Module, phases: list[tuple[torch.nn.Module, Callable]]) -> list:
        """Time `model`'s forward by its parts, from outside: forward hooks start the clock when the forward
        begins, lap `phase_of(part)` when each call of a `(part, phase_of)` of `phases` ends, and lap `losses`
        when the forward ends (what the step computes after its last part). A part called outside the
        forward (validation, a refresh, the window's selection) is not timed. Returns the hooks' handles."""
        inside = [False]

        def begun(module, args) -> None:
            inside[0] = True
            self.start()

        def ended(module, args, output) -> None:
            if inside[0]:
                self.lap("losses")
            inside[0] = False

        def lapper(phase_of: Callable):
            def lap(module, args, output) -> None:
                if inside[0]:
                    self.lap(phase_of(module))

            return lap

        handles = [model.register_forward_pre_hook(begun)]
        handles += [part.register_forward_hook(lapper(phase_of)) for part, phase_of in phases]
        return [*handles, model.register_forward_hook(ended, always_call=True)]

    def take(self) -> dict[str, float]:
        """Seconds per name since the last `take` (on CUDA, after waiting for the GPU to reach the last mark)."""
        if self.pending:
            self.pending[-1][2].synchronize()  # one stream: every earlier event has completed too
            for name, start, end in self.pending:
                self.seconds[name] += start.elapsed_time(end) / 1000
            self.pending.clear()
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


class NoTimer:
    """A timer for a step nobody measures: its blocks cost nothing."""

    def __call__(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


NO_TIMER = NoTimer()


# Peak dense (no sparsity) tensor-core throughput of one GPU in TFLOP/s, from the vendors' datasheets: bf16 (and
# fp16) for mixed precision, TF32 for float32 runs (`allow_tf32` puts their matmuls on TF32 tensor cores).
# Matched against torch.cuda.get_device_name in this order (the first name found in it wins).
PEAK_TFLOPS = (
    ("H200", {"bf16": 989.4, "tf32": 494.7}),
    ("GH200", {"bf16": 989.4, "tf32": 494.7}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "tf32": 156.0}),
    ("L40S", {"bf16": 362.05, "tf32": 183.0}),
    ("L4", {"bf16": 121.0, "tf32": 60.0}),
)


def step_phases(model) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], str]]]:
    """The training model's parts and the phase each call of one ends (`PhaseTimer.attach`): the towers
    `retriever` (f(x), step 1; g(S_x), step 3), the reader `reader_scoring` in eval mode (each passage alone,
    step 4) and `reader` in training mode (FiD, step 6), h `corrector` (step 7)."""
    towers = {id(t): t for t in (model.retriever.query_tower, model.retriever.passage_tower)}.values()
    phases = [(tower, lambda module: "retriever") for tower in towers]
    if model.reader is not None:
        phases.append((model.reader, lambda module: "reader" if module.training else "reader_scoring"))
    if model.corrector is not None:
        phases.append((model.corrector, lambda module: "corrector"))
    return phases


def peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """The device's peak FLOP/s for the step's matmuls (`PEAK_TFLOPS`), or None: a GPU not in the table, or a
    CPU, whose peak depends on its vector units, cores and clocks under load, which nothing here measures."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    kind = "tf32" if mixed_precision == "no" else "bf16"
    return next((peaks[kind] * 1e12 for key, peaks in PEAK_TFLOPS if key in name), None)


class DenseFlops:
    """The matmul FLOPs of every `nn.Linear` of a model as its steps run them: 2 x rows x in x out for the forward,
    as much again for each gradient its backward computes (the input's, the weight's). Forwards that activation
    checkpointing runs again inside the backward are not counted again (model FLOPs, not hardware FLOPs).
    Attention's own products (the scores and their weighted sum) are left out; padding positions are in (a
    layer counts the rows it is given). Counted on the host from shapes: nothing waits for the device."""

    def __init__(self, model: torch.nn.Module):
        self.flops = 0
        self.counting = False  # on inside the training step (`Throughput.step`) only
        self.hooks = [
            module.register_forward_hook(self._count)
            for module in model.modules()
            if isinstance(module, torch.nn.Linear)
        ]

    def _count(self, module: torch.nn.Linear, args, output) -> None:
        # Outside the step, or activation checkpointing's recomputation inside the backward.
        if not self.counting or _in_backward():
            return
        x = args[0]
        rows, inner, outer = x.numel() // module.in_features, module.in_features, module.out_features
        grads = torch.is_grad_enabled() and (x.requires_grad + module.weight.requires_grad)
        self.flops += 2 * rows * inner * outer * (1 + grads)

    def take(self) -> int:
        taken, self.flops = self.flops, 0
        return taken

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _in_backward() -> bool:
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and graph_task() != -1


class Throughput:
    """The counts and clocks of a run's training steps, read once per logging interval (`interval`).

    Attaches its `PhaseTimer` to the model (`step_phases`) and counting hooks on the model, its reader and its
    passage tower; `close` takes them off; the loop times the window's selection with `timer`. With `retriever.shared_towers` the one tower is also the query tower: its
    questions' tokens (f(x) with gradient, step 1) count as passage-tower tokens too."""

    def __init__(self, model, device: torch.device, mixed_precision: str = "no"):
        self.model, self.device = model, device
        self.timer = PhaseTimer(device)
        self.flops, self.peak_flops = DenseFlops(model), peak_flops(device, mixed_precision)
        self.inputs = getattr(model, "inputs", None)  # the thread making the step's inputs (step_inputs)
        self.waited_from = self.inputs.waited_s if self.inputs is not None else 0.0
        # Running totals; a token count stays a tensor on its module's device until `interval` reads it.
        self.counts: dict[str, int | torch.Tensor] = dict.fromkeys(COUNTS, 0)
        self.hooks = self.timer.attach(model, step_phases(model))
        self.hooks.append(model.register_forward_pre_hook(self._count_questions, with_kwargs=True))
        if model.reader is not None:
            hook = self._counter(None, "reader_tokens")
            self.hooks.append(model.reader.register_forward_pre_hook(hook, with_kwargs=True))
        hook = self._counter("passages", "passage_tokens")
        self.hooks.append(model.retriever.passage_tower.register_forward_pre_hook(hook, with_kwargs=True))
        if self.timer.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def _count_questions(self, module, args, kwargs) -> None:
        batch = args[0] if args else kwargs["batch"]
        self.counts["questions"] += len(batch.questions)

    def _counter(self, rows_key: str | None, tokens_key: str):
        """A forward pre-hook counting the tokens (and rows) of a module's input when it runs with gradient."""

        def count(module, args, kwargs) -> None:
            if not torch.is_grad_enabled():
                return
            mask = args[1] if len(args) > 1 else kwargs["attention_mask"]
            # Summed on the mask's device and read at `interval`: an int here would wait for the GPU.
            self.counts[tokens_key] = self.counts[tokens_key] + mask.sum()
            if rows_key is not None:
                self.counts[rows_key] += mask.shape[0]

        return count

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one optimizer step (its phases inside it: `timer`'s hooks, and the loop's `select`)."""
        start = self.timer.mark()
        self.flops.counting = True
        try:
            yield
        finally:
            self.flops.counting = False
            self.timer.add("step", start, self.timer.mark())

    def interval(self, accelerator, steps: int, seconds: float) -> dict[str, float]:
        """This interval's figures: `steps` optimizer steps in `seconds` of wall time. Collective: every process
        calls it at the same step. Counts are summed over the processes; seconds (each phase's and the
        interval's) and peak memory are the largest process's: the slowest process sets the pace of a step
        whose gradients every process waits for."""
        phases = self.timer.take()
        step_s = phases.pop("step", 0.0)
        phases["backward_optimizer"] = max(step_s - sum(phases.values()), 0.0)
        phases["step"] = step_s
        waited = self.inputs.waited_s if self.inputs is not None else 0.0
        local = {
            "counts": {key: float(total) for key, total in self.counts.items()},
            "seconds": {"interval": seconds, **{k: v / max(steps, 1) for k, v in phases.items()}},
            "memory": self.peak_memory(),
            "flops": self.flops.take(),
            "input_wait_s": waited - self.waited_from,
        }
        self.waited_from = waited
        self.counts = dict.fromkeys(COUNTS, 0)
        every = gather_object([local]) if accelerator.num_processes > 1 else [local]
        counts = {key: sum(p["counts"][key] for p in every) for key in COUNTS}
        names = sorted({name for p in every for name in p["seconds"]})
        seconds = {name: max(p["seconds"].get(name, 0.0) for p in every) for name in names}
        interval_s = max(seconds.pop("interval"), 1e-9)
        memory_key = "peak_cuda_memory_gib" if self.timer.cuda else "peak_rss_gib"
        flops = sum(p["flops"] for p in every)
        # Of the device's peak, over every process's device: the model's FLOPs over what the devices could have
        # done in the interval (left out where the peak is not known: a CPU, a GPU not in PEAK_TFLOPS).
        mfu = (
            {}
            if self.peak_flops is None
            else {"mfu": round(flops / (interval_s * len(every) * self.peak_flops), 4)}
        )
        return {
            "interval_s": round(interval_s, 6),  # a fast interval is tens of ms: rates times it stay exact
            **{f"{key}_per_step": round(counts[key] / max(steps, 1), 4) for key in COUNTS},
            "questions_per_s": round(counts["questions"] / interval_s, 4),
            "passages_per_s": round(counts["passages"] / interval_s, 4),
            "tokens_per_s": round((counts["reader_tokens"] + counts["passage_tokens"]) / interval_s, 2),
            **{f"seconds_{name}": round(value, 5) for name, value in seconds.items()},
            memory_key: round(max(p["memory"] for p in every) / GIB, 4),
            "model_tflops_per_step": round(flops / max(steps, 1) / 1e12, 6),
            **mfu,
            # The host seconds a step waited for the background thread's inputs (the slowest process's).
            "input_wait_s": round(max(p["input_wait_s"] for p in every) / max(steps, 1), 5),
        }

    def peak_memory(self) -> int:
        """Bytes: on CUDA the most allocated by tensors since the last call (the peak is reset); elsewhere the
        process's peak resident set since it started (`ru_maxrss`, which cannot be reset)."""
        if self.timer.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux

    def close(self) -> None:
        """Take the hooks off."""
        for hook in self.hooks:
            hook.remove()
        self.flops.close()
