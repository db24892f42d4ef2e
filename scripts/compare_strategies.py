"""Train every selection strategy with the same budget and seeds; report quality against re-embedding cost.

The paper's Table 1 (Algorithm 1, supervised retrieval) and Table 3 (Algorithm 2, retrieval-augmented QA) at
CPU scale, with the Fig. 2 plot (quality against passages re-embedded during training).

    # Algorithm 1 on the toy world, from the packaged MiniLM (small drift) and from a tiny random GTR (large drift)
    python scripts/compare_strategies.py --algorithm 1 --data toy --start minilm
    python scripts/compare_strategies.py --algorithm 1 --data toy --start random_gtr --lr 1e-3
    # Algorithm 1 on multihop200 (150 train / 50 held-out questions; from ../shared/data beside the checkout, or
    # --data-dir / $RLM_SHARED_DATA): 27 min on 2 CPU cores with
    # native bf16 (AVX512-BF16/AMX). Elsewhere bf16 is emulated (~18x slower) and training falls back to float32
    # with a warning (`--set force_cpu_bf16=true` keeps bf16): bf16 made a step 2.1x faster here, so expect
    # about twice the time
    python scripts/compare_strategies.py --algorithm 1 --data multihop200 --start minilm --steps 50 \
        --batch-size 8 --k 4 --num-random 8 --refresh-every 17 --snm-size 300 --set mixed_precision=bf16 \
        --jobs 2 --out docs/results/compare_strategies/compare_alg1_multihop200_minilm_bf16
    # Algorithm 2 on the toy world (the quickstart recipe), Table 3's strategies
    python scripts/compare_strategies.py --algorithm 2 --data toy
    # ... from the tiny random GTR (the paper's T5-init rows): 7 min with --jobs 2
    python scripts/compare_strategies.py --algorithm 2 --data toy --start random_gtr --steps 750 \
        --num-passages 4000 --set optim.lr_retriever=1e-4 --set schedule.final_reader_only_steps=150 \
        --set eval_selection=true --jobs 2

Each run is `rlm.train.train` with overrides; runs share one fixed buffer per (data, start), built first;
`--jobs N` trains N runs at once (on a small CPU two 1-thread runs beat one 2-thread run by 1.5x). Output:
`<out>.json` (every run, its drift log, the table's settings), then, made from that JSON by `rlm.experiments.comparison`,
`<out>.md` (mean and spread over seeds), `<out>.png` (quality vs re-embedded) and `<out>_drift.png`: re-render
them without training with `python scripts/compare_strategies.py --render <out>.json`.
The drift columns explain the table: mean ||g(y) - B_y|| and KL(P~ || P_stale) on the selected passages,
averaged over the last quarter of training. For Algorithm 1 the `start` row is the starting retriever
before any update (`--strategies start` evaluates it alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

from atomicio import atomic_write_json, atomic_write_text
from rlm.experiments.comparison import drift_log, render, summarise, table_metrics
from rlm.experiments.reporting import arguments, results_path

ROOT = Path(__file__).resolve().parents[1]
# The real third-party data (multihop200) sits beside a checkout in ../shared/data; elsewhere say where.
DEFAULT_DATA_DIR = os.environ.get("RLM_SHARED_DATA", str(ROOT.parent / "shared" / "data"))
DEFAULT_STRATEGIES = {
    # "start" is the starting retriever evaluated before any update: the row every strategy must beat.
    1: ["start", "in_batch", "stale", "corrector", "exhaustive", "snm", "two_round", "regression"],
    2: ["closed_book", "frozen", "stale", "corrector", "exhaustive"],
}


def make_random_gtr(out_dir: Path, seed: int = 0) -> str:
    """A tiny GTR-shaped retriever (T5 encoder + Dense) with random weights, in the sentence-transformers layout."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    from retriever.encoder import SentenceEncoder, default_retriever_path

    if (out_dir / "modules.json").exists():
        return str(out_dir)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(
        default_retriever_path()
    )  # a vocabulary; the weights are random
    config = T5Config(vocab_size=len(tokenizer), d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4)
    encoder = SentenceEncoder(T5EncoderModel(config), tokenizer, dense=torch.nn.Linear(128, 128, bias=False))
    encoder.save_pretrained(out_dir)
    return str(out_dir)


def split_multihop(work: Path, folder: Path, held_out: int = 50) -> tuple[str, str]:
    """Deterministic train / held-out split of multihop200 (`folder`) by a hash of the question id."""
    from rlm.data.qa import load_qa_dataset

    examples = load_qa_dataset("multihop200", "all", str(folder))
    ranked = sorted(examples, key=lambda ex: hashlib.sha256(ex.id.encode()).hexdigest())
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in (("train", ranked[held_out:]), ("dev", ranked[:held_out])):
        path = work / f"multihop200_{name}.jsonl"
        keys = ("id", "question", "answers", "gold_passage_ids")
        text = "".join(json.dumps({k: getattr(ex, k) for k in keys}) + "\n" for ex in part)
        if not path.exists() or path.read_text() != text:
            # --jobs runs call this at once: a reader must never see a half-written file.
            atomic_write_text(path, text)
        paths.append(str(path))
    return paths[0], paths[1]


def base_overrides(args, work: Path) -> list[str]:
    out = [f"algorithm={args.algorithm}", f"optim.max_steps={args.steps}", "save_every=0", "log_every=10"]
    if args.start == "random_gtr":
        out.append(f"retriever.path={make_random_gtr(work / 'random_gtr')}")
    if args.data == "toy":
        out += [f"data.toy_world.dir={work / 'toy'}", f"data.toy_world.num_passages={args.num_passages}"]
    else:
        folder = Path(args.data_dir) / "multihop200"
        train, dev = split_multihop(work, folder)
        out += [
            f"data.corpus={folder / 'corpus.jsonl'}",
            f"data.train={train}",
            f"data.dev={dev}",
        ]
    if args.algorithm == 1:
        out += [
            f"strategy.k={args.k}",
            f"strategy.num_random={args.num_random}",
            "strategy.share_across_batch=true",
            f"optim.batch_size={args.batch_size}",
            f"optim.lr_retriever={args.lr}",
            f"optim.warmup_steps={max(1, args.steps // 10)}",
        ]
    return out


def base_config(args) -> Path | None:
    """The YAML every run of the table starts from: Algorithm 2 uses the quickstart recipe."""
    return ROOT / "configs" / "quickstart.yaml" if args.algorithm == 2 else None


def table_config(args, work: Path, *extra: str):
    """The table's shared settings plus `extra`, with the user's --set overrides last, as every run has them."""
    from rlm.config import load_config

    return load_config(base_config(args), base_overrides(args, work) + [*extra, *args.overrides])


def one_run(args, work: Path, strategy: str, seed: int) -> dict:
    from rlm.config import load_config
    from rlm.train import train

    out_dir = work / f"{strategy}_seed{seed}"
    overrides = base_overrides(args, work) + [
        f"output_dir={out_dir}",
        f"buffer.dir={work / 'buffer'}",
        f"strategy.name={strategy}",
        f"strategy.refresh_every={args.refresh_every}",
        f"strategy.snm_size={args.snm_size}",
        # Only in the regression runs, so adding the row does not change the other runs' cache keys.
        *([f"strategy.regression.samples={args.regression_samples}"] if strategy == "regression" else []),
        f"seed={seed}",
        *args.overrides,
    ]
    config = base_config(args)
    cfg = load_config(config, overrides)
    # A finished run is reused when its settings are the same, so seeds and strategies can be added later
    # (`--seeds 0` then `--seeds 0,1` trains seed 1 only); any change of settings retrains.
    material = [args.algorithm, str(config), overrides]
    precision = effective_precision(cfg)
    if precision != cfg.mixed_precision:
        # bf16 fell back to float32 on this CPU: not the run a native-bf16 machine cached with these settings.
        material.append(f"effective mixed_precision={precision}")
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]
    cached = out_dir / "compare_run.json"
    if cached.exists() and json.loads(cached.read_text()).get("key") == key:
        return json.loads(cached.read_text())["result"]
    start = time.time()
    summary = train(cfg, overwrite=True)  # the script owns this folder: a rerun starts over
    wall = time.time() - start
    log = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    tail = log[-max(1, len(log) // 4) :]

    def tail_mean(key):
        values = [r[key] for r in tail if key in r]
        return statistics.fmean(values) if values else None

    if args.algorithm == 2 and strategy != "closed_book":
        summary["dev_gold_passage_exact_match"] = gold_passage_em(cfg, out_dir)
    result = {
        "strategy": strategy,
        "seed": seed,
        "wall_s": round(wall, 1),
        **summary,
        "drift": tail_mean("drift"),
        "kl_fresh_stale": tail_mean("kl_fresh_stale"),
        "kl_fresh_corrected": tail_mean("kl_fresh_corrected"),
    }
    atomic_write_json(cached, {"key": key, "result": result})
    return result


def effective_precision(cfg) -> str:
    """The mixed precision `rlm.training.accelerator.make_accelerator` trains a run with: on a CPU without native bf16, bf16
    falls back to "no" (float32) unless `force_cpu_bf16=true`."""
    import torch

    from rlm.precision import cpu_mixed_precision

    if cfg.cpu or not torch.cuda.is_available():
        return cpu_mixed_precision(cfg.mixed_precision, force=cfg.force_cpu_bf16).mixed_precision
    return cfg.mixed_precision


def run_precision(cfg):
    """The autocast a run's forward passes use (`--set mixed_precision=bf16`), for what is measured outside it:
    the precision the runs train with (`effective_precision`)."""
    import contextlib

    import torch

    if effective_precision(cfg) == "bf16":
        on_cpu = cfg.cpu or not torch.cuda.is_available()
        return torch.autocast(device_type="cpu" if on_cpu else "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare(args, work: Path) -> None:
    """Build what every run shares (data files, the starting retriever, the fixed buffer B) once, up front, so
    that runs started in parallel by --jobs only read it."""
    from rlm.components import build_retriever, load_or_build_buffer, resolve_data
    from rlm.data.corpus import load_corpus

    cfg = table_config(args, work, f"buffer.dir={work / 'buffer'}")
    load_or_build_buffer(cfg, build_retriever(cfg), load_corpus(resolve_data(cfg)[0]))


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def train_all(args, work: Path, tasks: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """Every (strategy, seed) run; with --jobs N, N at a time, each on cpu_count / N threads (two 1-thread runs
    train about 1.5x faster in total than one 2-thread run on this 2-core machine: small matmuls scale poorly)."""
    if args.jobs <= 1:
        results = {}
        for task in tasks:
            results[task] = one_run(args, work, *task)
            print(json.dumps(results[task]), flush=True)
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    pool = ProcessPoolExecutor(
        args.jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(threads,),
    )
    with pool:
        futures = {pool.submit(one_run, args, work, *task): task for task in tasks}
        results = {}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            print(json.dumps(results[futures[future]]), flush=True)
    return results


def start_point(args, work: Path) -> dict:
    """The starting retriever on the held-out questions, no training: the same metrics as a trained run."""
    from types import SimpleNamespace

    from rlm.components import build_retriever, load_dev_examples, resolve_data
    from rlm.data.corpus import load_corpus
    from rlm.training.validation import validate

    cfg = table_config(args, work)
    corpus_path, dev = resolve_data(cfg)[0], load_dev_examples(cfg)
    retriever = build_retriever(cfg).eval()
    start = time.time()
    with run_precision(cfg):  # evaluated as the trained runs are
        metrics = validate(
            SimpleNamespace(retriever=retriever, reader=None), load_corpus(corpus_path), dev, cfg
        )
    return {
        "strategy": "start",
        "seed": None,
        "wall_s": round(time.time() - start, 1),
        "reembedded": 0,
        **metrics,
    }


def gold_passage_em(cfg, out_dir: Path) -> float:
    """EM of the run's trained reader given each dev question's gold passages alone: what it could score if
    retrieval were perfect (the paper's 'reader EM with gold passages')."""
    from rlm.components import load_dev_examples, resolve_data
    from rlm.data.corpus import load_corpus
    from rlm.inference.evaluation import evaluate_reader, load_checkpoint, read, with_gold_passages

    corpus_path, dev = resolve_data(cfg)[0], load_dev_examples(cfg)
    _, reader, _ = load_checkpoint(out_dir / "final", need_retriever=False)
    gold = with_gold_passages(dev, None, num_passages=0)
    predictions = read(reader, dev, load_corpus(corpus_path), None, passage_ids=gold)
    return evaluate_reader(predictions, dev)["exact_match"]


def dropout_floor(args, work: Path, num: int = 256) -> float:
    """Mean ||g_train(y) - g_eval(y)|| of the untrained passage tower: the part of `drift` that dropout alone
    makes (train-mode g(y), in the runs' precision, against the float32 eval-mode buffer), before any update."""
    import torch

    from rlm.components import build_retriever, resolve_data
    from rlm.data.corpus import load_corpus

    cfg = table_config(args, work)
    corpus = load_corpus(resolve_data(cfg)[0])
    tower = build_retriever(cfg).passage_tower
    texts = corpus.retrieval_texts()[:num]
    torch.manual_seed(0)
    with torch.no_grad():
        clean = tower.eval().embed_texts(texts)
        with run_precision(cfg):
            noisy = tower.train().embed_texts(texts).float()
    return float((noisy - clean).norm(dim=-1).mean())


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--algorithm", type=int, choices=(1, 2), default=1)
    parser.add_argument("--data", choices=("toy", "multihop200"), default="toy")
    parser.add_argument("--start", choices=("minilm", "random_gtr"), default="minilm")
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="folder holding multihop200/ (default: $RLM_SHARED_DATA, else ../shared/data beside the checkout)",
    )
    parser.add_argument("--strategies", help="comma-separated; default: the paper's table for the algorithm")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--num-passages", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--k", type=int, default=8, help="top-k from the strategy (Algorithm 1)")
    parser.add_argument("--num-random", type=int, default=16, help="uniform negatives shared by the batch")
    parser.add_argument("--lr", type=float, default=5e-5, help="retriever learning rate (Algorithm 1)")
    parser.add_argument("--refresh-every", type=int, default=50, help="R for exhaustive and snm")
    parser.add_argument("--snm-size", type=int, default=500)
    parser.add_argument(
        "--regression-samples", type=int, default=200, help="s' re-embedded per refit for regression"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, each on cpu_count/jobs threads (default 1)"
    )
    parser.add_argument("--work", default=None, help="run folder (default runs/compare/<name>)")
    parser.add_argument(
        "--out",
        default=None,
        help="output path stem (default docs/results/compare_strategies/compare_<name>)",
    )
    parser.add_argument(
        "--render", nargs="+", help="re-render the table and plots of saved JSONs (no training)"
    )
    args = parser.parse_args(argv)
    if args.render:
        for path in args.render:  # a JSON written before the runs carried drift logs keeps its drift plot
            print(render(path))
        return

    name = f"alg{args.algorithm}_{args.data}_{args.start}"
    work = Path(args.work or ROOT / "runs" / "compare" / name)
    out = Path(args.out or results_path("compare_strategies", f"compare_{name}"))
    strategies = args.strategies.split(",") if args.strategies else DEFAULT_STRATEGIES[args.algorithm]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.data == "multihop200" and not (Path(args.data_dir) / "multihop200" / "qa.jsonl").is_file():
        parser.error(
            f"--data multihop200: no {Path(args.data_dir) / 'multihop200' / 'qa.jsonl'}; pass --data-dir"
        )
    if "start" in strategies and args.algorithm != 1:
        parser.error("the 'start' row is for Algorithm 1 (Algorithm 2 has closed_book and frozen)")
    prepare(args, work)
    tasks = [(strategy, seed) for strategy in strategies if strategy != "start" for seed in seeds]
    trained = train_all(args, work, tasks)
    runs = []
    for strategy in strategies:
        if strategy == "start":  # deterministic: one evaluation, whatever the seeds
            runs.append(start_point(args, work))
            print(json.dumps(runs[-1]))
        else:
            runs += [trained[(strategy, seed)] for seed in seeds]
    for run in runs:  # the drift plot's data, so the table can be re-plotted from the JSON alone
        if run["seed"] is not None:
            run["drift_log"] = drift_log(work / f"{run['strategy']}_seed{run['seed']}" / "log.jsonl")
    cfg = table_config(args, work)
    report = {
        "args": vars(args),
        "runs": runs,
        "rows": summarise(runs, table_metrics(args.algorithm, runs)),
        "dropout_floor": dropout_floor(args, work),
        "mixed_precision": cfg.mixed_precision,
        "precision": effective_precision(cfg),
    }
    atomic_write_json(out.with_suffix(".json"), report)
    print(render(out.with_suffix(".json")))


if __name__ == "__main__":
    main()
