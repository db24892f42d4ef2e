"""The one-command offline path: toy world -> buffer -> Algorithm 2 training (corrector) -> dev EM table.

`run_quickstart` trains with `configs/quickstart.yaml` into `output_dir` (the checkpoint lands in
`<output_dir>/final`), then puts its dev EM next to four baselines trained on the same budget and config with
only `strategy.name` changed: `exhaustive` (the buffer re-embedded on a schedule: the method's ceiling),
`stale` (the trained query tower against the never-updated buffer, no corrector), `frozen` (retriever never
trained) and `closed_book` (no passages). A baseline
is trained when `<output_dir>/baselines.json` has no figure for these settings (or always / never, as asked)
and cached there; cached figures are shown with the date they were measured, flagged when they came from
other settings. Everything is recorded in `<output_dir>/metrics.json`.

Its last stage, a living corpus (`rlm.quickstart.living_corpus`), is prepared as soon as the main run's
checkpoint is saved (the world's next edition written, the base corpus indexed by the trained passage tower,
the folder the demo serves) and measured after the table (`living_corpus_stage`): the edition's questions
before and after one corpus update, under `edition` in metrics.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from rlm.base.atomicio import atomic_write_text
from rlm.config import SHIPPED_CONFIGS, TrainConfig, load_config
from rlm.errors import UserError, read_json_file
from rlm.quickstart.living_corpus import LivingCorpus

DEFAULT_CONFIG = SHIPPED_CONFIGS / "quickstart.yaml"
BASELINES = {
    "exhaustive": "exhaustive (buffer re-embedded)",
    "stale": "stale buffer, no corrector",
    "frozen": "frozen retriever (reader trained)",
    "closed_book": "closed book (no passages)",
}
BASELINES_FILE = "baselines.json"
METRICS_FILE = "metrics.json"


@dataclass
class QuickstartResult:
    """What `run_quickstart` measured and where it wrote it."""

    metrics: dict
    table: str
    checkpoint: Path
    metrics_path: Path
    # The last stage's folders, prepared when the checkpoint was saved; None with the stage skipped, and
    # `no_edition` then says why when it was asked for.
    living: LivingCorpus | None = None
    no_edition: str | None = None


def quickstart_config(
    config_path: str | Path | None = None, output_dir: str | Path | None = None, overrides: list[str] = ()
) -> TrainConfig:
    """The quickstart config; `output_dir` also moves the toy world (and buffer) under it. `overrides` win."""
    pre = []
    if output_dir is not None:
        pre = [f"output_dir={output_dir}", f"data.toy_world.dir={Path(output_dir) / 'toy_world'}"]
    cfg = load_config(config_path or DEFAULT_CONFIG, [*pre, *overrides])
    if cfg.algorithm != 2:
        raise UserError(
            "the quickstart trains reader + retriever (algorithm: 2); drop the algorithm override"
        )
    return cfg


def baseline_config(cfg: TrainConfig, strategy: str) -> TrainConfig:
    """`cfg` with only the strategy changed, its own output folder, and the main run's buffer and toy world."""
    root = Path(cfg.output_dir)
    return replace(
        cfg,
        output_dir=str(root / "baselines" / strategy),
        strategy=replace(cfg.strategy, name=strategy),
        buffer=replace(cfg.buffer, dir=cfg.buffer.dir or str(root / "buffer")),
    )


def settings_key(cfg: TrainConfig) -> str:
    """A short hash of everything that decides a baseline's figure (the config minus strategy and folders)."""
    from rlm.training.prefix import shared_settings_key

    return shared_settings_key(cfg)


def dev_scores(summary: dict, k: int) -> dict:
    """EM, F1 and answer recall@k (fractions; recall None without passages) from a `train()` summary's final
    dev validation on the re-embedded corpus, the same answering from the run's own selection (`selection_*`,
    None unless `eval_selection`), and the passages the run re-embedded."""
    missing = [key for key in ("dev_exact_match", "dev_f1") if key not in summary]
    if missing:
        raise UserError(f"training summary has no {', '.join(missing)}: the quickstart needs data.dev set")
    return {
        "exact_match": summary["dev_exact_match"],
        "f1": summary["dev_f1"],
        "recall": summary.get(f"dev_recall@{k}"),
        "selection_exact_match": summary.get("dev_selection_exact_match"),
        "selection_f1": summary.get("dev_selection_f1"),
        "selection_recall": summary.get(f"dev_selection_recall@{k}"),
        "reembedded": summary.get("reembedded", 0),
    }


def headline_em(row: dict) -> float | None:
    """The EM a run is compared on: answering from its own selection when measured (what its reader trained
    on last; no re-embedding at prediction time), else from the re-embedded corpus (or closed book)."""
    selection = row.get("selection_exact_match")
    return row.get("exact_match") if selection is None else selection


def load_cached_baselines(path: Path) -> dict:
    """{strategy: {"exact_match", "f1", "measured_at", "settings"}} from a baselines file; {} when absent."""
    if not path.is_file():
        return {}
    data = read_json_file(path, "delete it or rerun with --baselines")
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: expected a JSON object of baseline figures; delete it or rerun with --baselines"
        )
    return data


def baselines_to_measure(mode: str, cached: dict, key: str) -> list[str]:
    """The baselines a quickstart trains: all ("always"), those with no cached figure for these settings
    ("missing"), or none ("never")."""
    if mode not in BASELINE_MODES:
        raise UserError(f"baselines must be one of {BASELINE_MODES}, got {mode!r}")
    return {
        "always": list(BASELINES),
        "missing": [name for name in BASELINES if cached.get(name, {}).get("settings") != key],
        "never": [],
    }[mode]


def baseline_rows(measured: dict, cached: dict, key: str) -> dict:
    """For each baseline: its EM/F1 and a `source` label (measured now / cached from DATE / not measured)."""
    rows = {}
    for name in BASELINES:
        if name in measured:
            rows[name] = {**measured[name], "source": "measured now"}
        elif name in cached:
            entry = cached[name]
            day = str(entry.get("measured_at", "?"))[:10]
            other = "" if entry.get("settings") == key else ", other settings"
            rows[name] = {**entry, "source": f"cached from {day}{other}"}
        else:
            rows[name] = {
                "exact_match": None,
                "f1": None,
                "recall": None,
                "reembedded": None,
                "source": "not measured (--no-baselines)",
            }
    return rows


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _count(value) -> str:
    return "-" if value is None else f"{value:,}"


def _cells(row: dict, reembedded, closed: bool = False) -> str:
    """`closed`: a closed-book run reads nothing, so its EM is the same either way."""
    own = row.get("exact_match") if closed else row.get("selection_exact_match")
    own_recall = row.get("recall") if closed else row.get("selection_recall")
    return (
        f"{_pct(own)} | {_pct(row.get('exact_match'))} | {_pct(row.get('recall'))} | {_pct(own_recall)} "
        f"| {_count(reembedded)}"
    )


def _margins(mine, baselines: dict) -> list[str]:
    """This run's EM over the baselines that bound it, where both are known."""
    lines = []
    for name, label in (
        ("frozen", "the frozen retriever"),
        ("exhaustive", "exhaustive re-embedding"),
        ("closed_book", "closed book"),
    ):
        other = headline_em(baselines.get(name, {}))
        if other is not None and mine is not None:
            lines.append(f"EM over {label}: {100 * (mine - other):+.1f} points")
    return lines


def format_results(metrics: dict) -> str:
    """The quickstart's table: this run's dev EM/F1 next to the baselines, each labelled with its source."""
    k = metrics.get("k", "K")
    dev = metrics["dev"]
    main = {
        "exact_match": dev.get("exact_match"),
        "recall": dev.get(f"recall@{k}"),
        "selection_exact_match": dev.get("selection_exact_match"),
        "selection_recall": dev.get(f"selection_recall@{k}"),
    }
    lines = [
        f"dev set: {metrics['dev_questions']} questions, the reader reads K = {k} passages; "
        f"{metrics['strategy']} run: {metrics['steps']} steps; "
        f"{metrics.get('runs_trained', 1)} run(s) trained in {metrics['train_seconds'] / 60:.1f} min",
        "EM from its selection: each run answers from what it selected from in training (h(B) for the "
        "corrector,\nthe buffer as last refreshed for the others: nothing re-embedded at prediction time); "
        "EM re-embedded: from the\ncorpus re-embedded with the trained passage tower (the paper's protocol).",
        "",
        f"| run | EM from its selection | EM re-embedded | answer recall@{k} re-embedded "
        f"| answer recall@{k} selection | passages re-embedded in training | source |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {metrics['strategy']} (this run) | {_cells(main, metrics['reembedded'])} | measured now |",
    ]
    from rlm.training.strategies import strategy_class

    for name, row in metrics["baselines"].items():
        closed = not strategy_class(name).uses_passages  # reads nothing: its selection is the same
        lines.append(
            f"| {BASELINES[name]} | {_cells(row, row.get('reembedded'), closed)} | {row['source']} |"
        )
    majority = metrics.get("majority_answer")
    if majority:
        lines.append(
            f"| majority answer per question type (no model) | {_pct(majority['exact_match'])} "
            f"| {_pct(majority['exact_match'])} | - | - | - | measured now |"
        )
    lines.append("")
    lines += _margins(headline_em(main), metrics["baselines"])
    return "\n".join(lines).rstrip()


def _dev_reference(cfg: TrainConfig) -> tuple[int, dict]:
    """(number of dev questions scored, EM/F1 of guessing the most frequent train answer per question type)."""
    from rlm.components import load_dev_examples, load_train_examples
    from rlm.inference.evaluation import majority_answer_baseline

    train, dev = load_train_examples(cfg), load_dev_examples(cfg)
    return len(dev), majority_answer_baseline(train, dev)


def _stage(number: int, total: int, text: str) -> None:
    print(f"\n[{number}/{total}] {text}", flush=True)


BASELINE_MODES = ("missing", "always", "never")


def _check_quickstart_arguments(cfg: TrainConfig, jobs: int | None) -> None:
    if not cfg.data.dev:
        raise UserError("the quickstart reports dev EM: set data.dev (e.g. --set data.dev=toy)")
    if jobs is not None and jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {jobs}")


def _with_shared_prefix(cfg: TrainConfig, root: Path, runs: list, stages: int) -> list:
    """`runs`, those that read passages continuing from the shared gold-passage steps (trained first)."""
    prefix = shared_prefix(cfg, root / "shared", stages)
    if prefix is None:
        return runs
    return [replace(job, prefix=prefix if _reads_passages(job.cfg) else None) for job in runs]


def _print_run_done(name: str, summary: dict, seconds: float, k: int) -> None:
    scores = dev_scores(summary, k)
    own = scores["selection_exact_match"]
    em = f"dev EM {100 * scores['exact_match']:.1f}"
    print(
        f"{name}: {summary['steps']} steps in {seconds / 60:.1f} min; {em}"
        + ("" if own is None else f" (from its own selection {100 * own:.1f})"),
        flush=True,
    )


def _cache_measured_baselines(
    cache_path: Path, cached: dict, summaries: dict, to_measure: list[str], k: int, key: str
) -> dict:
    """The dev scores of the baselines trained now, stamped and added to the baselines file."""
    measured = {
        name: {**dev_scores(summaries[name], k), "measured_at": _now(), "settings": key}
        for name in to_measure
    }
    if measured:
        atomic_write_text(cache_path, json.dumps({**cached, **measured}, indent=2) + "\n")
    return measured


def _quickstart_metrics(
    cfg: TrainConfig,
    summary: dict,
    *,
    train_seconds: float,
    runs_trained: int,
    workers: int,
    baselines: dict,
    settings: str,
) -> dict:
    """metrics.json's content: the main run's `summary` and the baselines' rows next to the dev reference."""
    num_dev, majority = _dev_reference(cfg)
    return {
        "created_at": _now(),
        "strategy": cfg.strategy.name,
        "steps": summary["steps"],
        "reembedded": summary["reembedded"],
        "train_seconds": round(train_seconds, 1),
        "runs_trained": runs_trained,
        "workers": workers,
        "dev_questions": num_dev,
        "k": cfg.reader_passages,
        "dev": {key[len("dev_") :]: value for key, value in summary.items() if key.startswith("dev_")},
        "baselines": baselines,
        "majority_answer": majority,
        "settings": settings,
        "checkpoint": str(Path(cfg.output_dir) / "final"),
    }


def run_quickstart(
    cfg: TrainConfig,
    baselines: str = "missing",
    jobs: int | None = None,
    on_checkpoint: Callable[[Path, LivingCorpus | None], None] | None = None,
    edition: bool = True,
) -> QuickstartResult:
    """Train the corrector run and the baselines, evaluate on dev, write metrics.json.

    `baselines`: "missing" trains those with no cached figure for these settings (the first run measures
    them, later runs reuse them), "always" retrains them, "never" shows whatever the cache holds. What every
    run would do alike is done once: the toy world, the buffer B, and the gold-passage steps (`rlm.training.prefix`),
    which each run that reads passages continues from. The runs train `jobs` at a time (default: one per CPU
    core), each on one torch thread (`rlm.quickstart.concurrent_runs`). As soon as the main run's checkpoint is
    saved, while the baselines may still train, `_checkpoint_saved` prepares the last stage (with `edition`) and
    calls `on_checkpoint(final, living)`; `living_corpus_stage` measures it after the table.
    """
    from rlm.quickstart.concurrent_runs import RunJob, available_cores, train_runs

    _check_quickstart_arguments(cfg, jobs)
    root = Path(cfg.output_dir)
    key = settings_key(cfg)
    cache_path = root / BASELINES_FILE
    cached = load_cached_baselines(cache_path)
    to_measure = baselines_to_measure(baselines, cached, key)
    runs = [RunJob(cfg.strategy.name, cfg)] + [RunJob(n, baseline_config(cfg, n)) for n in to_measure]
    stages = 5 if edition else 4  # the last: a living corpus
    _stage(1, stages, "data: the toy world and the buffer B, embedded once by the initial passage tower")
    corpus_path = build_data_and_buffer(cfg)
    print(f"corpus: {corpus_path}")
    runs = _with_shared_prefix(cfg, root, runs, stages)
    workers = min(jobs or available_cores(), len(runs))
    _stage(3, stages, f"train: {', '.join(j.name for j in runs)}; {workers} at a time, one torch thread each")
    living: dict = {}  # the last stage's fields of QuickstartResult

    def done(job: RunJob, summary: dict, seconds: float) -> None:
        _print_run_done(job.name, summary, seconds, cfg.reader_passages)
        if job is runs[0]:
            living.update(_checkpoint_saved(root, corpus_path, edition, on_checkpoint))

    started = time.perf_counter()
    summaries = train_runs(runs, workers, done)
    train_seconds = _training_seconds(time.perf_counter() - started, workers, living.get("living"))
    summary = summaries[cfg.strategy.name]
    measured = _cache_measured_baselines(cache_path, cached, summaries, to_measure, cfg.reader_passages, key)

    _stage(4, stages, "evaluate: dev EM next to the baselines")
    metrics = _quickstart_metrics(
        cfg,
        summary,
        train_seconds=train_seconds,
        runs_trained=len(runs),
        workers=workers,
        baselines=baseline_rows(measured, cached, key),
        settings=key,
    )
    table = format_results(metrics)
    metrics_path = root / METRICS_FILE
    atomic_write_text(metrics_path, json.dumps(metrics, indent=2) + "\n")
    return QuickstartResult(metrics, table, root / "final", metrics_path, **living)


def _training_seconds(seconds: float, workers: int, living: LivingCorpus | None) -> float:
    """The runs' wall time, less the last stage's preparation where nothing trained meanwhile (one worker)."""
    if workers > 1 or living is None:
        return seconds
    return seconds - living.seconds["write_edition"] - living.seconds["index_base_corpus"]


def _checkpoint_saved(root: Path, corpus_path: str, edition: bool, on_checkpoint) -> dict:
    """The main run's checkpoint is saved: the last stage prepared (with `edition`), then `on_checkpoint`
    called with it; returns the preparation's fields of `QuickstartResult`."""
    prepared = prepare_edition(root, corpus_path) if edition else {}
    if on_checkpoint is not None:
        on_checkpoint(root / "final", prepared.get("living"))
    return prepared


def prepare_edition(root: Path, corpus_path: str) -> dict:
    """The last stage's preparation for the checkpoint in `root / "final"` (`prepare_living_corpus`):
    {"living": its folders}, or {"no_edition": why not} for a corpus that takes none."""
    from rlm.quickstart.living_corpus import prepare_living_corpus

    try:
        living = prepare_living_corpus(root, Path(corpus_path).parent, root / "final")
    except UserError as err:
        print(f"no edition of the corpus: {err}", flush=True)
        return {"no_edition": str(err)}
    seconds = living.seconds["write_edition"] + living.seconds["index_base_corpus"]
    print(
        f"edition: the world's next edition in {living.update.root}, the corpus indexed by the trained passage "
        f"tower in {living.index} ({seconds:.1f} s)",
        flush=True,
    )
    return {"living": living}


def living_corpus_stage(result: QuickstartResult) -> str:
    """The last stage, after the table: the edition prepared with the checkpoint measured before and after its
    corpus update (`measure_living_corpus`, the reader reading the run's K), recorded under `edition` in
    metrics.json; returns its tables."""
    from rlm.quickstart.living_corpus import format_edition, measure_living_corpus

    _stage(
        5,
        5,
        "a living corpus: the world's next edition, taken by the index without retraining (rlm corpus update)",
    )
    if result.living is None:
        result.metrics["edition"] = {"skipped": result.no_edition}
        text = f"skipped: {result.no_edition}"
    else:
        result.metrics["edition"] = measure_living_corpus(result.living, result.metrics["k"])
        text = format_edition(result.metrics["edition"])
    atomic_write_text(result.metrics_path, json.dumps(result.metrics, indent=2) + "\n")
    return text


def _reads_passages(cfg: TrainConfig) -> bool:
    from rlm.training.strategies import strategy_class

    return strategy_class(cfg.strategy.name).uses_passages


def build_data_and_buffer(cfg: TrainConfig) -> str:
    """Generate the toy world (when missing) and build B (when missing) before any run starts, so that runs
    trained side by side only load them; returns the corpus path."""
    from rlm.components import build_retriever, load_or_build_buffer, resolve_data
    from rlm.data.corpus import load_corpus

    corpus_path, _, _ = resolve_data(cfg)
    load_or_build_buffer(cfg, build_retriever(cfg), load_corpus(corpus_path))
    return corpus_path


def shared_prefix(cfg: TrainConfig, folder: Path, stages: int = 4) -> Path | None:
    """The gold-passage steps every strategy trains alike, trained once into `folder / "prefix"` with `cfg`'s
    strategy (reused when a prefix of the same settings is there); None when the recipe has none."""
    from rlm.quickstart.concurrent_runs import train_one
    from rlm.training.prefix import read_prefix_meta, shared_steps

    steps = shared_steps(cfg)
    out = folder / "prefix"
    if not steps or not _reads_passages(cfg):
        return None
    _stage(
        2,
        stages,
        f"shared: the first {steps} steps (the reader on the gold passages), trained once for all runs",
    )
    if (out / "prefix.json").is_file():
        try:
            read_prefix_meta(out, cfg)
        except UserError:
            pass  # other settings: trained again below
        else:
            print(f"reused {out}")
            return out
    # The main run's settings, strategy and buffer, in a folder of its own.
    train_one(replace(baseline_config(cfg, cfg.strategy.name), output_dir=str(folder)), prefix_out=out)
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
