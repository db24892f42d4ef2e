"""Run configuration: dataclasses loaded from YAML, overridable with `--set section.key=value`.

Config is data. Every key is declared here with its type and default, and a number with its range beside it
(`beta: float = setting(20.0, gt=0)`); a key that does not exist is an error (with the closest valid names),
never silently ignored, and so is a value outside a key's choices (a `Literal`) or its range. Values from the
command line are parsed as YAML scalars (`--set optim.lr_reader=3e-4`, `--set strategy.name=exhaustive`,
`--set data.dev=null`). A config file may extend another with `base: FILE` (`read_config_file`).

The core config is short: in each section the paper's settings (Algorithm 2: k, beta, the corrector's size,
weight and loss, the learning rates, steps, batch, the models, the strategy and its refresh) come first; what
goes beyond the paper (DAFT's alignment, the regression baseline, the reader recipe's phases, a reader built
here) follows a `# Beyond the paper` line, and the engineering knobs (logging, saving, memory, devices) a
`# Engineering` line. What each strategy is (`STRATEGY_FACTS`) is written here too, once: the strategy classes
read it, and loading a config checks against it without importing torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlm.errors import UserError
from rlm.retriever.index_spec import IndexSpecError, TwoStage


class _Yaml12BoolLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (true/false only): YAML 1.1 reads `mixed_precision: no` as False."""


_Yaml12BoolLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _first in "tTfF":
    _Yaml12BoolLoader.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list(_first),
    )


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12BoolLoader)  # noqa: S506 (a SafeLoader subclass)


@dataclass(frozen=True)
class StrategyFacts:
    """What a strategy is, for everything outside its class: building the components, validation, the config's
    checks. Written once, here, where loading a config reads it without importing torch; the strategy classes
    (`rlm.training.strategies`) read their attributes of the same names from it (`StrategyFact`)."""

    algorithms: tuple[int, ...] = (1, 2)  # the paper's algorithms it takes part in
    algorithms_reason: str = ""  # why, where not both
    trains_retriever: bool = True
    uses_passages: bool = True  # False: the reader answers closed book (nothing selected, nothing retrieved)
    uses_corrector: bool = False  # a corrector network h is built, trained and used for selection
    scans_fixed_buffer: bool = (
        True  # selects from B as built (never re-embedded): an index over B stays valid
    )
    shares_batch: bool = False  # every question of a batch scores the union of the batch's S_x
    follows_refresh_every: bool = False  # `strategy.refresh_every` schedules its re-embedding


# Every strategy, by the name `strategy.name` takes (the order is the one errors list them in).
STRATEGY_FACTS: dict[str, StrategyFacts] = {
    "in_batch": StrategyFacts(
        algorithms=(1,),
        algorithms_reason="its S_x are the batch's gold passages",
        scans_fixed_buffer=False,
        shares_batch=True,
    ),
    "corrector": StrategyFacts(uses_corrector=True),
    "stale": StrategyFacts(),
    "exhaustive": StrategyFacts(scans_fixed_buffer=False, follows_refresh_every=True),
    "regression": StrategyFacts(scans_fixed_buffer=False, follows_refresh_every=True),
    "snm": StrategyFacts(scans_fixed_buffer=False, follows_refresh_every=True),
    "two_round": StrategyFacts(scans_fixed_buffer=False),
    "frozen": StrategyFacts(algorithms=(2,), trains_retriever=False),
    "closed_book": StrategyFacts(
        algorithms=(2,), trains_retriever=False, uses_passages=False, scans_fixed_buffer=False
    ),
}
StrategyName = Literal[tuple(STRATEGY_FACTS)]  # the loader refuses any other name, listing these


class StrategyFact:
    """A strategy class's attribute read from its row of `STRATEGY_FACTS` (by the class's `name`), so the class
    and the config's checks cannot tell different stories: `uses_corrector = StrategyFact()`."""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute

    def __get__(self, instance: object, owner: type) -> Any:
        return getattr(STRATEGY_FACTS[owner.name], self.attribute)


@dataclass(frozen=True)
class Interval:
    """The numbers a setting accepts, from `low` to `high`, each end included or not. NaN is in none."""

    low: float = -math.inf
    high: float = math.inf
    low_included: bool = True
    high_included: bool = False

    def __contains__(self, value: object) -> bool:
        return (
            isinstance(value, int | float)
            and math.isfinite(value)
            and (self.low <= value if self.low_included else self.low < value)
            and (value <= self.high if self.high_included else value < self.high)
        )

    def __str__(self) -> str:  # "[0, 4294967295]", "(0, inf)"
        opening, closing = "[" if self.low_included else "(", "]" if self.high_included else ")"
        return f"{opening}{_number(self.low)}, {_number(self.high)}{closing}"

    def check(self, key: str, value: Any, optional: bool) -> None:
        """Refuse `value` of setting `key` unless it is inside (or None where the setting may be null)."""
        if (value is None and optional) or value in self:
            return
        # An int field is never NaN or infinite; a float one is told why nan or inf is refused.
        number = "a finite number " if isinstance(value, float) else ""
        if self.high == math.inf:
            wanted = f"{number}{'>=' if self.low_included else '>'} {_number(self.low)}"
        else:
            wanted = f"{number}in {self}"
        raise UserError(f"{key} must be {wanted}{' (or null)' if optional else ''}, got {value!r}")


def _number(bound: float) -> str:
    return str(int(bound)) if math.isfinite(bound) and bound == int(bound) else f"{bound:g}"


def setting(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A numeric field and the range its values must lie in (ge: >=, gt: >, le: <=, lt: <), checked when a
    config is loaded: `beta: float = setting(20.0, gt=0)`."""
    return field(default=default, metadata={"range": _interval(ge, gt, le, lt)})


def _interval(
    ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None
):
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise TypeError("setting() takes one lower bound (ge or gt) and one upper bound (le or lt)")
    return Interval(
        low=-math.inf if ge is None and gt is None else (ge if ge is not None else gt),
        high=math.inf if le is None and lt is None else (le if le is not None else lt),
        low_included=gt is None,
        high_included=le is not None,
    )


def field_range(each: dataclasses.Field) -> Interval | None:
    """The range of a numeric setting: its `setting(...)` one, or the `bounds` a section of another package
    writes beside its field (`rlm.retriever.index_spec.bounded`, which may not import this module)."""
    if "bounds" in each.metadata:
        return _interval(**each.metadata["bounds"])
    return each.metadata.get("range")


# accelerate's set_seed seeds numpy's legacy generator, which takes [0, 2^32).
SEED_MAX = 2**32 - 1


@dataclass
class DataToyWorldConfig:
    """`data.toy_world`: generate the offline toy world into `dir` when its files are missing (the generator's
    own settings are `rlm.data.toy_world.ToyWorldConfig`)."""

    num_passages: int = setting(2000, ge=100)  # the generator's own minimum, told before the run starts
    seed: int = setting(0, ge=0, le=SEED_MAX)
    options: dict[str, Any] = field(default_factory=dict)  # other rlm.data.toy_world.ToyWorldConfig fields
    # Engineering
    dir: str = "runs/toy_world"


@dataclass
class DataConfig:
    # The paper's settings
    corpus: str | None = None  # corpus file (jsonl / dpr tsv / pyserini); None: the toy world's corpus
    # Questions: a name in rlm.data.qa's registry (nq_open, trivia_qa, hotpot_qa, toy; nq, tqa, hotpotqa), or a
    # path to a local JSONL. Splits as the literature names them: train, dev (for nq_open, trivia_qa and
    # hotpot_qa a fixed carve-out of the published train, docs/data.md); never a test set here.
    train: str = "toy"
    train_split: str = "train"
    dev: str | None = "toy"
    dev_split: str = "dev"
    # A local copy of `train`'s / `dev`'s dataset in its layout (docs/data.md); None: the hub.
    train_path: str | None = None
    dev_path: str | None = None
    max_train_examples: int | None = setting(None, ge=1)
    # Beyond the paper: the offline toy world.
    toy_world: DataToyWorldConfig = field(default_factory=DataToyWorldConfig)
    # Engineering: what validation during training costs.
    max_dev_examples: int | None = setting(200, ge=1)
    # Validate during training on a hard subcorpus H_k (rlm.training.hard_subcorpus): an ids file, or "build" (H_k of
    # the initial retriever, from the fixed buffer, written once to <output_dir>/dev_subcorpus.txt). The
    # figure at the end of training is always on the whole corpus.
    dev_subcorpus: str | None = None
    dev_subcorpus_k: int = setting(100, ge=1)  # top-k per dev question of a built H_k


@dataclass
class AlignConfig:
    """Beyond the paper: DAFT's alignment stage (`retriever.align`). The first `steps` steps that train the
    retriever update the query tower alone (the passage tower is frozen, so the buffer is exact and the corrector
    is not trained); every `every` steps the kNN KL between the towers' embeddings of the dev questions (or 256
    training questions) is measured, and the stage ends early once it falls below `kl` or has not fallen for
    `patience` measurements. 0 steps: no alignment stage (both towers train from the start)."""

    steps: int = setting(0, ge=0)
    kl: float | None = setting(None, ge=0)
    every: int = setting(10, ge=1)
    patience: int = setting(3, ge=1)


@dataclass
class RetrieverConfig:
    # The paper's settings
    path: str | None = None  # sentence-transformers folder or hub name; None: the packaged all-MiniLM-L6-v2
    shared_towers: bool = False
    query_max_length: int = setting(64, ge=1)
    passage_max_length: int = setting(128, ge=1)
    # Beyond the paper: DAFT's light query tower and alignment stage, tower dropout.
    # The query tower, when it differs from the passage tower's model (DAFT's light query tower): a
    # sentence-transformers folder with the same output size, or "layers:N" for the first N layers of `path`.
    query_path: str | None = None
    # Training-time dropout of both towers; None keeps the checkpoint's (0.1 for MiniLM).
    dropout: float | None = setting(None, ge=0, lt=1)
    align: AlignConfig = field(default_factory=AlignConfig)
    # Engineering: a run stops when the mean pairwise cosine of the dev questions' query embeddings (logged at
    # every validation as dev_query_mean_cosine) exceeds this: the query tower has collapsed (DAFT). null: never.
    collapse_cosine: float | None = setting(0.99, gt=-1, le=1)
    # Activation checkpointing in both towers (Atlas' --use_gradient_checkpoint_retriever): each layer keeps
    # only its input for backward and recomputes the rest, about a third more tower compute. A passage of 256
    # tokens through GTR-base with gradient keeps 260 MiB (bf16 autocast) without it, 12 MiB with it
    # (docs/training.md, "Memory of the passage tower").
    gradient_checkpointing: bool = False


@dataclass
class WarmStartConfig:
    """Beyond the paper: the reader `reader.arch: warm_start` builds (`reader.warm_start`): the first `layers`
    layers of a pretrained BERT-family encoder (`path`, None: the packaged MiniLM) + a fresh decoder of the
    reader's `num_decoder_layers`, `num_heads` and `d_ff`, with the encoder's WordPiece (docs/reader_recipe.md)."""

    path: str | None = None
    layers: int = setting(2, ge=1)
    freeze_embeddings: bool = True  # keep the pretrained token embeddings (and tied output) fixed


@dataclass
class ReaderConfig:
    # The paper's settings
    path: str | None = None  # a saved FiD reader / HF seq2seq model; None: a small T5 from the fields below
    tokenizer: str | None = None  # tokenizer folder; None: train a BPE tokenizer on the corpus + questions
    max_passage_length: int = setting(96, ge=1)
    max_answer_length: int = setting(16, ge=1)
    num_passages: int | None = setting(
        None, ge=1
    )  # how many of the selected k the FiD reader reads; None: all k
    # Beyond the paper: a reader built here (`path` unset), its input template, its scoring.
    # "t5": the small T5 below, trained from scratch; "warm_start": a pretrained encoder + a fresh decoder, as
    # `warm_start` says. Ignored when `path` is set.
    arch: Literal["t5", "warm_start"] = "t5"
    vocab_size: int = setting(8000, ge=300)  # byte-level BPE: 256 bytes + the specials
    d_model: int = setting(128, ge=1)
    d_ff: int = setting(512, ge=1)
    num_layers: int = setting(2, ge=1)
    num_decoder_layers: int = setting(2, ge=1)
    num_heads: int = setting(4, ge=1)
    d_kv: int = setting(32, ge=1)
    dropout_rate: float = setting(0.0, ge=0, lt=1)
    # What the encoder reads per passage (rlm.reader.formatting); None: FiD's "question: .. title: .. context: ..".
    # `{rank}` gives the reader each passage's place in the retriever's order (scoring reads each as rank 1).
    template: str | None = None
    # P(a|y,x) from summed (the paper) or mean token log-likelihood.
    score_reduction: Literal["sum", "mean"] = "sum"
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass
class ScheduleConfig:
    """Beyond the paper: Algorithm 2's phases, in optimizer steps (docs/reader_recipe.md): the reader alone on
    each question's gold passage(s), the reader alone on the strategy's selection, the three losses together,
    and the reader alone again on the trained retriever's selection. What is left of `optim.max_steps` after the
    three reader-only phases is the joint phase (the paper's whole run). Algorithm 1 trains the retriever alone
    and ignores them."""

    # The first N steps the reader reads each question's gold passage(s) alone, and only the reader trains:
    # a reader that cannot yet copy an answer from one passage does not learn to do it among K retrieved
    # ones. Needs gold_passage_ids in the training data.
    gold_passage_steps: int = setting(0, ge=0)
    # The first N steps (counted from step 0, so they include the gold-passage steps) train the reader alone
    # on the strategy's selection (no retriever or corrector loss, no per-passage scoring): the reader learns
    # to read before its P(a|y,x) teaches the retriever. 0: joint from the first step.
    reader_only_steps: int = setting(0, ge=0)
    # The last N steps train the reader alone on the (by then trained) retriever's selection: the reader ends
    # on the passages it will read at prediction time. 0: joint until the end.
    final_reader_only_steps: int = setting(0, ge=0)


@dataclass
class BufferConfig:
    # The paper's settings
    dtype: Literal["float16", "float32"] = "float16"  # the rows as stored (rlm.retriever.buffer.DTYPES)
    # Engineering
    dir: str | None = None  # None: <output_dir>/buffer; built with the initial passage tower when missing
    batch_size: int = setting(64, ge=1)
    chunk_size: int = setting(65536, ge=1)  # rows of B corrected per chunk in the streamed top-k
    # Where the rows a process scans live: "host" (streamed from the memory-mapped buffer), "device" (copied
    # onto the accelerator, in the stored dtype), "auto" (the device when it is a GPU with room to spare).
    placement: Literal["auto", "host", "device"] = "auto"


@dataclass
class CorrectorConfig:
    # The paper's settings
    hidden_dim: int | None = setting(None, ge=1)  # None: hidden_mult * D
    hidden_mult: int = setting(4, ge=1)
    # 0: the residual and the optional linear term alone
    num_hidden_layers: int = setting(1, ge=0)
    loss: Literal["ce", "mse"] = "ce"  # "ce" (Eq. 6, the paper's default) or "mse" (Eq. 5)
    weight: float = setting(10.0, ge=0)  # Appendix B.1
    # Beyond the paper
    linear: bool = False  # add a zero-initialised linear term A x to the residual MLP


@dataclass
class RegressionConfig:
    """Beyond the paper: `strategy.name: regression` (Dynnibal-style approximate re-encoding,
    `retriever/reencode.py`): every `strategy.refresh_every` retriever updates, re-embed `samples` random
    passages, fit a Nystrom kernel ridge regression from their stale rows to the fresh ones, and apply it to the
    whole buffer."""

    samples: int = setting(
        8192, ge=1
    )  # s', passages re-embedded per refit (the paper's NQ and MSMARCO setting)
    landmarks: int = setting(128, ge=1)  # d', random rows of B, fixed for the run (the paper: 128)
    # "rbf" exp(-gamma |b - z|^2) or "linear" <b, z> (rlm.retriever.reencode.KERNELS)
    kernel: Literal["rbf", "linear"] = "rbf"
    # rbf width; None: 1 / (2 median squared sample-landmark distance), each refit
    gamma: float | None = setting(None, gt=0)
    ridge: float | None = setting(
        None, gt=0
    )  # per-sample ridge penalty; None: chosen at each refit on held-out samples


@dataclass
class StrategyConfig:
    # The paper's settings
    name: StrategyName = "corrector"
    k: int = setting(32, ge=1)
    refresh_every: int = setting(500, ge=1)  # R for exhaustive, snm and regression
    snm_size: int = setting(1_000_000, ge=1)  # M for snm (the paper: 1M; toy configs set their own)
    num_random: int = setting(0, ge=0)  # uniform random passages added to S_x (Algorithm 1 uses 64)
    share_across_batch: bool = False  # Algorithm 1: every question scores the union of the batch's S_x
    # How the top-k is searched: "exact" (every row through h) or "two_stage" (Appendix B.2, the fixed-buffer
    # strategies only: the best candidates by the stale buffer, re-scored with h, as `two_stage` says).
    search: Literal["exact", "two_stage"] = "exact"
    # Beyond the paper: the regression baseline's settings.
    regression: RegressionConfig = field(default_factory=RegressionConfig)
    # Engineering
    # Data-parallel: each process scans (and re-embeds) 1/W of the rows and the top-k lists are merged across
    # processes. null: sharded whenever there is more than one process.
    shard_buffer: bool | None = None
    # Two-stage search (`rlm.retriever.index_spec.TwoStage`): `candidates`, from a faiss index over each
    # process's rows (`first_stage: index`, the index as `two_stage.index` describes it: the `IndexSpec` that
    # `rlm index`, `rlm evaluate` and `rlm demo` take too) or a streamed scan of <q, B_y> over every row
    # (`scan`); every `overlap_every` steps the exact top-k is computed beside it and their overlap logged.
    two_stage: TwoStage = field(default_factory=TwoStage)
    # h(B) is kept between steps while no corrector weight changes (the reader-only phases, where selection
    # would otherwise run every row through h again for the same result), when it fits this many MiB per
    # process (float32); 0: h runs over every row at every step.
    cache_corrected_mb: int = setting(1024, ge=0)


@dataclass
class OptimConfig:
    # The paper's settings (a learning rate of 0 holds a component fixed)
    lr_reader: float = setting(1e-3, ge=0)
    lr_retriever: float = setting(2e-5, ge=0)
    lr_corrector: float = setting(1e-3, ge=0)
    weight_decay: float = setting(0.0, ge=0)
    warmup_steps: int = setting(50, ge=0)
    max_steps: int = setting(1000, ge=1)  # optimizer steps
    # Questions per optimizer step over all processes (the paper: 128). When set, the accumulation is derived
    # from it, questions_per_step / (batch_size x processes), so the effective batch does not change with the
    # process count; numbers that do not divide are refused.
    questions_per_step: int | None = setting(None, ge=1)
    # Clipped per component (reader, retriever, corrector); 0: no clipping
    max_grad_norm: float = setting(1.0, ge=0)
    # Engineering: memory (questions_per_step, when set, keeps the effective batch).
    batch_size: int = setting(8, ge=1)  # questions per process per micro-step
    gradient_accumulation_steps: int = setting(1, ge=1)

    def accumulation_steps(self, num_processes: int) -> int:
        """Micro-steps per optimizer step with `num_processes` data-parallel processes."""
        if self.questions_per_step is None:
            return self.gradient_accumulation_steps
        per_micro_step = self.batch_size * num_processes
        accum, rest = divmod(self.questions_per_step, per_micro_step)
        if rest or accum < 1:
            raise UserError(
                f"optim.questions_per_step={self.questions_per_step} is not a multiple of optim.batch_size x "
                f"processes = {self.batch_size} x {num_processes} = {per_micro_step}; change one of them"
            )
        if self.gradient_accumulation_steps not in (1, accum):
            raise UserError(
                f"optim.gradient_accumulation_steps={self.gradient_accumulation_steps} contradicts "
                f"optim.questions_per_step={self.questions_per_step} with {num_processes} process(es) and "
                f"batch_size {self.batch_size} (which need {accum}); set only one of them"
            )
        return accum


@dataclass
class TrainConfig:
    # The paper's settings
    algorithm: Literal[1, 2] = (
        2  # 2: retrieval-augmented LM (reader + retriever); 1: supervised retrieval (gold passages)
    )
    seed: int = setting(0, ge=0, le=SEED_MAX)
    beta: float = setting(20.0, gt=0)  # temperature of the retriever softmax over <q, p>
    # Beyond the paper: P_a(y|x) = softmax(log P(a|y,x) / T) (Eq. 8 is T = 1)
    reader_temperature: float = setting(1.0, gt=0)
    # Engineering
    output_dir: str = "runs/train"
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # accelerate's
    # Training on CPU falls back from bf16 to float32 (with a warning) where the CPU has no native bf16
    # (AVX512-BF16 or AMX; elsewhere it is emulated, many times slower: docs/training.md); true
    # keeps bf16 there anyway (rlm.precision).
    force_cpu_bf16: bool = False
    gradient_checkpointing: bool = False
    cpu: bool = False  # force CPU even when a GPU is visible
    log_every: int = setting(10, ge=1)
    eval_every: int = setting(0, ge=0)  # 0: only at the end
    # The final validation also answers from the strategy's own selection (`dev_selection_*`: top-k over h(B)
    # for the corrector, over the buffer as last refreshed for the others), what the reader read in its final
    # reader-only phase; `dev_*` stay on the corpus re-embedded with the trained passage tower (the paper).
    eval_selection: bool = False
    # Keep the corpus as the trained passage tower embeds it at the end (the final validation's embedding, or
    # one made for it) in this folder, a buffer as `rlm embed` writes it: `rlm index --buffer <it>` then builds
    # the inference index without embedding the corpus a second time (21M passages: hours of GPU time).
    # None: not kept. A folder holding other files is refused before the run starts.
    final_embeddings: str | None = None
    save_every: int = setting(100, ge=0)  # 0: only at the end
    keep_last: int = setting(2, ge=1)  # fewer would delete the checkpoint just written
    # A batch whose loss is non-finite on any process is skipped (the run moves on to the next one) and named
    # in the output with its question ids; the run stops with a checkpoint at the Nth distinct bad batch.
    max_bad_batches: int = setting(10, ge=1)
    # How long a process waits for the others at a collective before the run fails (every backend); the main
    # process names the rank that holds the others up at half of it (rlm.training.heartbeat). None: sized by the
    # run (rlm.training.accelerator.CollectiveTimeout): 30 min until the first step ends (the main process
    # verifying the newest checkpoint, the buffer build's meeting point), then 4 x the longest step, refresh
    # part, checkpoint or validation measured so far, at least 5 min. A value fixes it for the whole run.
    dist_timeout_s: int | None = setting(None, ge=10)
    # Where metrics go besides log.jsonl: accelerate's trackers (TensorBoard under <output_dir>/rlm; Weights &
    # Biases with the `wandb` extra, its run id kept in the checkpoint so a resumed run continues the same run).
    report_to: Literal["tensorboard", "wandb", "all", "none"] = "tensorboard"
    # Sections: the paper's, then the reader recipe's phases (beyond the paper)
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    corrector: CorrectorConfig = field(default_factory=CorrectorConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    @property
    def reader_passages(self) -> int:
        """K, the passages the reader reads: `reader.num_passages`, else all of the strategy's `k`."""
        return self.reader.num_passages or self.strategy.k

    def validate(self) -> TrainConfig:
        """The rules that combine keys (the loader has checked each value alone: its type, choices and range)."""
        name = self.strategy.name
        facts = STRATEGY_FACTS[name]
        only, why = facts.algorithms, facts.algorithms_reason
        if self.algorithm not in only:
            raise UserError(
                f"strategy {name!r} only makes sense for algorithm {' and '.join(map(str, only))}"
                f"{f' ({why})' if why else ''}; this config has algorithm {self.algorithm}"
            )
        if self.force_cpu_bf16 and self.mixed_precision != "bf16":
            raise UserError(
                f"force_cpu_bf16=true only applies to mixed_precision=bf16 (got {self.mixed_precision!r}); "
                "set mixed_precision=bf16 or drop force_cpu_bf16"
            )
        if self.strategy.search == "two_stage" and not facts.scans_fixed_buffer:
            scanning = [other for other, its in STRATEGY_FACTS.items() if its.scans_fixed_buffer]
            raise UserError(
                "strategy.search=two_stage searches an index over the fixed buffer: use it with a strategy that "
                f"scans it ({', '.join(scanning)}), not {name!r}"
            )
        if self.retriever.align.steps and self.retriever.shared_towers:
            raise UserError("retriever.align.steps trains the query tower alone: not with shared_towers")
        if self.strategy.search == "two_stage" and self.strategy.two_stage.index.rescore:
            raise UserError(
                "strategy.two_stage.index.rescore: two-stage search re-scores every candidate with h already; "
                "leave it 0"
            )
        if self.final_embeddings and not facts.uses_passages:
            raise UserError(
                f"final_embeddings keeps the corpus embedded by the passage tower: strategy {name!r} reads no "
                "passages; drop final_embeddings"
            )
        return self


def settings(cls: type | None = None, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) of every setting a user can give (`--set key=value`): each field of `cls`
    (default TrainConfig) and of its sections, a section's own fields instead of the section."""
    cls = TrainConfig if cls is None else cls
    hints = typing.get_type_hints(cls)
    found = []
    for each in dataclasses.fields(cls):
        tp = hints[each.name]
        if _is_dataclass_type(tp):
            found += settings(tp, f"{prefix}{each.name}.")
        else:
            found.append((f"{prefix}{each.name}", each, tp))
    return found


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _key(where: str) -> str:
    """The dotted key as the user writes it (`strategy.name`), from the loader's `config.strategy.name`."""
    return where.removeprefix("config.")


def _check_choice(value: Any, choices: tuple, where: str) -> Any:
    # By type too: YAML's `true` equals 1, and `2.0` equals 2, but neither is algorithm 2.
    if any(type(value) is type(choice) and value == choice for choice in choices):
        return value
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UserError(f"{_key(where)} must be one of {', '.join(map(str, choices))}; got {value!r}{hint}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` (with int -> float widening, Optional and Literal choices)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # `X | None`: what X says is wrong with the value
            return _coerce(value, options[0], where)
        for arg in options:
            try:
                return _coerce(value, arg, where)
            except ValueError:
                continue
        raise UserError(f"{where}: {value!r} does not fit {tp}")
    if origin is Literal:
        return _check_choice(value, typing.get_args(tp), where)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string; accept it as the number it obviously is.
        try:
            return float(value)
        except ValueError:
            raise UserError(f"{where}: expected float, got {value!r}") from None
    if origin is dict and not isinstance(value, dict):
        raise UserError(f"{where}: expected a mapping, got {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise UserError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float, str) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise UserError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


class RenamedSettingWarning(FutureWarning):
    """A config names a setting by a name it no longer has; it is read under its new one."""


# Settings that have a new name or place (dotted keys, the new one possibly in a sub-section): an old config (a
# file, `--set`, or a checkpoint's config.yaml) is read with one warning naming the new key, and refused only when
# it sets both.
RENAMED_SETTINGS = {
    # A non-finite batch is skipped now, not retried: the limit counts distinct bad batches (issue 48).
    "max_nonfinite_in_a_row": "max_bad_batches",
    # The paper first: extras moved into sub-sections of their own (issue 49).
    "retriever.align_steps": "retriever.align.steps",
    "retriever.align_kl": "retriever.align.kl",
    "retriever.align_every": "retriever.align.every",
    "retriever.align_patience": "retriever.align.patience",
    "reader.warm_start_path": "reader.warm_start.path",
    "reader.warm_start_layers": "reader.warm_start.layers",
    "reader.warm_start_freeze_embeddings": "reader.warm_start.freeze_embeddings",
    "strategy.candidates": "strategy.two_stage.candidates",
    "strategy.first_stage": "strategy.two_stage.first_stage",
    "strategy.overlap_every": "strategy.two_stage.overlap_every",
    "strategy.index_factory": "strategy.two_stage.index.factory",
    "strategy.nprobe": "strategy.two_stage.index.nprobe",
}


def _section(data: dict, keys: list[str], create: bool) -> dict | None:
    """The mapping at `keys` in `data` (None where there is none; with `create`, made, each level a copy)."""
    node = data
    for key in keys:
        child = node.get(key)
        if not isinstance(child, dict):
            if not create or child is not None:
                return None
            child = {}
        if create:
            child = node[key] = dict(child)
        node = child
    return node


def renamed_settings(data: dict, warn: bool = True) -> dict:
    """`data` (a config's nested mapping) with each setting of `RENAMED_SETTINGS` under its new name, warning
    once for each (`warn`); `data` itself is left as it was."""
    out = dict(data)
    for old, new in RENAMED_SETTINGS.items():
        *old_path, old_key = old.split(".")
        source = _section(out, old_path, create=False)
        if source is None or old_key not in source:
            continue
        *new_path, new_key = new.split(".")
        target = _section(out, new_path, create=True)
        if new_key in target:
            raise UserError(f"{old} is the old name of {new}: set {new} alone")
        source = _section(out, old_path, create=True)
        value = target[new_key] = source.pop(old_key)
        if warn:
            warnings.warn(
                f"config key {old} is now {new} (read as {new}={value!r}); rename it in your config",
                RenamedSettingWarning,
                stacklevel=3,
            )
    return out


def from_dict(cls: type, data: dict, where: str = "config") -> Any:
    """Build dataclass `cls` from a nested dict, refusing unknown keys, wrongly typed values, values outside a
    `Literal`'s choices and numbers outside the range their field carries (`setting`, or the class's own check:
    `IndexSpecError`); for the whole config, a setting under its old name or place (`RENAMED_SETTINGS`) is read
    under its new one, with a warning."""
    if where == "config":
        data = renamed_settings(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else f" (valid: {', '.join(names)})"
            raise UserError(f"unknown config key {where}.{key}{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
        interval = field_range(fields[key])
        if interval is not None:
            optional = type(None) in typing.get_args(hints[key])
            interval.check(_key(f"{where}.{key}"), kwargs[key], optional)
    try:
        return cls(**kwargs)
    except IndexSpecError as err:
        raise UserError(f"{_key(f'{where}.{err.field}')} must be {err.wanted}, got {err.value!r}") from None


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to a nested dict (value parsed as a YAML scalar)."""
    if "=" not in assignment:
        raise UserError(f"--set expects key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {dotted}: {key} is not a section")
    try:
        node[keys[-1]] = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise UserError(
            f"--set {assignment}: the value is not valid YAML ({' '.join(str(err).split())})"
        ) from None


def add_override_argument(parser, example: str = "strategy.name=exhaustive") -> None:
    """The `--set KEY=VALUE` option every config-driven command shares."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )


# The shipped configs, inside the package so that a non-editable install has them (`configs/` in a checkout
# is a link to this folder).
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def shipped_config(name: str | Path) -> Path | None:
    """The shipped config a name refers to: `nq`, `nq.yaml`, `configs/nq.yaml` or `configs/accelerate/ddp.yaml`;
    None when there is no such file."""
    parts = Path(name).parts
    if parts and parts[0] == "configs":
        parts = parts[1:]
    if not parts:
        return None
    candidate = SHIPPED_CONFIGS.joinpath(*parts)
    for path in (candidate, candidate.with_name(candidate.name + ".yaml")):
        if path.is_file():
            return path
    return None


def resolve_config_path(path: str | Path) -> Path:
    """`path` when it is a file; else the shipped config of that name (so `--config configs/quickstart.yaml`
    and `--config quickstart` work from any folder and from a non-editable install)."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = shipped_config(path)
    if shipped is None:
        names = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"config file not found: {path} (shipped configs: {', '.join(names)})")
    return shipped


def _merge(base: dict, override: dict) -> dict:
    """`base` with `override`'s keys set over it, sections merged key by key at every depth."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_config_file(path: str | Path, _extending: tuple[Path, ...] = ()) -> dict:
    """The mapping in config file `path`. With a top-level `base: FILE` it extends that file: FILE's mapping
    (itself read the same way) with this file's keys merged over it, this file winning. FILE is relative to
    `path`'s folder, else a shipped config's name (`base: nq`), so a config of one's own can extend a shipped
    one."""
    path = Path(path)
    try:
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:  # names the line and column: one line for the user, not a traceback
        raise UserError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config must be a YAML mapping at the top level")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base:
        raise UserError(f"{path}: base must name the config file this one extends, got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        base_path = shipped_config(base)
        if base_path is None:
            raise UserError(f"{path}: base {base} not found (neither in {path.parent} nor a shipped config)")
    chain = (*_extending, path.resolve())
    if base_path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, base_path.resolve()))
        raise UserError(f"{path}: its base files extend each other in a cycle: {cycle}")
    return _merge(read_config_file(base_path, chain), data)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load a TrainConfig from YAML (or defaults when path is None), then apply `--set` overrides.

    `output_dir` and `final_embeddings` may name `{strategy}` (strategy.name), so one file per dataset gives each
    strategy its own run folder."""
    data = {} if path is None else read_config_file(resolve_config_path(path))
    for assignment in overrides:
        apply_override(data, assignment)
    cfg = from_dict(TrainConfig, data)
    cfg.output_dir = cfg.output_dir.replace("{strategy}", cfg.strategy.name)
    if cfg.final_embeddings:
        cfg.final_embeddings = cfg.final_embeddings.replace("{strategy}", cfg.strategy.name)
    return cfg.validate()


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
