"""Train every selection strategy with the same budget and seeds; report quality against re-embedding cost.

The paper's Table 1 (Algorithm 1, supervised retrieval) and Table 3 (Algorithm 2, retrieval-augmented QA) at
CPU scale, with the Fig. 2 plot (quality against passages re-embedded during training).

    # Algorithm 1 on the toy world, from the packaged MiniLM (small drift) and from a tiny random GTR (large drift)
    python scripts/bench/compare_strategies.py --algorithm 1 --data toy --start minilm
    python scripts/bench/compare_strategies.py --algorithm 1 --data toy --start random_gtr --lr 1e-3
    # Algorithm 1 on multihop200 (150 train / 50 held-out questions; in ../shared/data beside the checkout, or
    # --data-dir / $RLM_SHARED_DATA): 27 min on 2 CPU cores with native bf16 (AVX512-BF16/AMX). Elsewhere bf16
    # is emulated (~18x slower) and training falls back to float32 with a warning (`--set force_cpu_bf16=true`
    # keeps bf16): bf16 made a step 2.1x faster here, so expect about twice the time
    python scripts/bench/compare_strategies.py --algorithm 1 --data multihop200 --start minilm --steps 50 \
        --batch-size 8 --k 4 --num-random 8 --refresh-every 17 --snm-size 300 --set mixed_precision=bf16 \
        --jobs 2 --out scripts/bench/reports/compare_strategies/compare_alg1_multihop200_minilm_bf16
    # Algorithm 2 on the toy world (the quickstart recipe), Table 3's strategies
    python scripts/bench/compare_strategies.py --algorithm 2 --data toy
    # ... from the tiny random GTR (the paper's T5-init rows): 7 min with --jobs 2
    python scripts/bench/compare_strategies.py --algorithm 2 --data toy --start random_gtr --steps 750 \
        --num-passages 4000 --set optim.lr_retriever=1e-4 --set schedule.final_reader_only_steps=150 \
        --set eval_selection=true --jobs 2

Each run is `rlm.training.loop.train` with overrides; runs share one fixed buffer per (data, start), built first;
`--jobs N` trains N runs at once (on a small CPU two 1-thread runs beat one 2-thread run by 1.5x). Output:
`<out>.json` (every run, its drift log, the table's settings) and, made from it by `lab.comparison`
(`--render <out>.json` redoes them without training), `<out>.md` (mean and spread over seeds), `<out>.png`
(quality vs re-embedded) and `<out>_drift.png`. The drift columns explain the table: mean ||g(y) - B_y|| and
KL(P~ || P_stale) on the selected passages, averaged over the last quarter of training. For Algorithm 1 the
`start` row is the starting retriever before any update (`--strategies start` evaluates it alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

from lab.comparison import DRIFT_KEYS, drift_log, render, summarise, table_metrics
from lab.reporting import ROOT, arguments, int_list, results_path

from rlm.base.atomicio import atomic_write_json, atomic_write_text

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

    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    if (out_dir / "modules.json").exists():
        return str(out_dir)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(default_retriever_path())  # its vocabulary only
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
    keys, paths = ("id", "question", "answers", "gold_passage_ids"), []
    for name, part in (("train", ranked[held_out:]), ("dev", ranked[:held_out])):
        paths.append(work / f"multihop200_{name}.jsonl")
        text = "".join(json.dumps({k: getattr(ex, k) for k in keys}) + "\n" for ex in part)
        if not paths[-1].exists() or paths[-1].read_text() != text:
            # --jobs runs call this at once: a reader must never see a half-written file.
            atomic_write_text(paths[-1], text)
    return str(paths[0]), str(paths[1])


def base_overrides(args, work: Path) -> list[str]:
    out = [f"algorithm={args.algorithm}", f"optim.max_steps={args.steps}", "save_every=0", "log_every=10"]
    if args.start == "random_gtr":
        out.append(f"retriever.path={make_random_gtr(work / 'random_gtr')}")
    if args.data == "toy":
        out += [f"data.toy_world.dir={work / 'toy'}", f"data.toy_world.num_passages={args.num_passages}"]
    else:
        folder = Path(args.data_dir) / "multihop200"
        train, dev = split_multihop(work, folder)
        out += [f"data.corpus={folder / 'corpus.jsonl'}", f"data.train={train}", f"data.dev={dev}"]
    if args.algorithm == 1:
        out += [f"strategy.k={args.k}", f"strategy.num_random={args.num_random}"]
        out += ["strategy.share_across_batch=true", f"optim.batch_size={args.batch_size}"]
        out += [f"optim.lr_retriever={args.lr}", f"optim.warmup_steps={max(1, args.steps // 10)}"]
    return out


def run_config(args, work: Path, *extra: str):
    """(base YAML, overrides, config) of a run: the table's shared settings plus `extra`, the user's --set
    overrides last. Algorithm 2 starts from the quickstart recipe."""
    from rlm.config import load_config

    base = ROOT / "configs" / "quickstart.yaml" if args.algorithm == 2 else None
    overrides = base_overrides(args, work) + [*extra, *args.overrides]
    return base, overrides, load_config(base, overrides)


def one_run(args, work: Path, strategy: str, seed: int) -> dict:
    from rlm.training.loop import train

    out_dir = work / f"{strategy}_seed{seed}"
    extra = [f"output_dir={out_dir}", f"buffer.dir={work / 'buffer'}", f"strategy.name={strategy}"]
    extra += [f"strategy.refresh_every={args.refresh_every}", f"strategy.snm_size={args.snm_size}"]
    if strategy == "regression":  # only there, so adding the row does not change the other runs' cache keys
        extra.append(f"strategy.regression.samples={args.regression_samples}")
    base, overrides, cfg = run_config(args, work, *extra, f"seed={seed}")
    # A finished run is reused when its settings are the same, so seeds and strategies can be added later
    # (`--seeds 0` then `--seeds 0,1` trains seed 1 only); any change of settings retrains.
    material = [args.algorithm, str(base), overrides]
    if (precision := effective_precision(cfg)) != cfg.mixed_precision:
        # bf16 fell back to float32 on this CPU: not the run a native-bf16 machine cached with these settings.
        material.append(f"effective mixed_precision={precision}")
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]
    cached = out_dir / "compare_run.json"
    if cached.exists() and (old := json.loads(cached.read_text())).get("key") == key:
        return old["result"]
    start = time.time()
    summary = train(cfg, overwrite=True)  # the script owns this folder: a rerun starts over
    result = {"strategy": strategy, "seed": seed, "wall_s": round(time.time() - start, 1), **summary}
    if args.algorithm == 2 and strategy != "closed_book":
        result["dev_gold_passage_exact_match"] = gold_passage_em(cfg, out_dir)
    log = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    for name in DRIFT_KEYS:  # the mean over the last quarter of training
        values = [r[name] for r in log[-max(1, len(log) // 4) :] if name in r]
        result[name] = statistics.fmean(values) if values else None
    atomic_write_json(cached, {"key": key, "result": result})
    return result


def effective_precision(cfg) -> str:
    """The mixed precision a run trains with (`rlm.training.accelerator.make_accelerator`): on a CPU without
    native bf16, bf16 falls back to "no" (float32) unless `force_cpu_bf16=true`."""
    import torch

    from rlm.precision import cpu_mixed_precision

    if cfg.cpu or not torch.cuda.is_available():
        return cpu_mixed_precision(cfg.mixed_precision, force=cfg.force_cpu_bf16).mixed_precision
    return cfg.mixed_precision


def run_precision(cfg):
    """The autocast the runs' forward passes use (`effective_precision`), for what is measured outside."""
    from rlm.inference.device import autocast

    return autocast("cpu" if cfg.cpu else None, effective_precision(cfg) == "bf16")


def prepare(args, work: Path, evaluate: bool, num: int = 256) -> tuple[dict | None, dict]:
    """Up front, from the untrained retriever: the buffer B every run shares (built once: --jobs runs only read
    it), the `start` row when `evaluate`, the precision, and the dropout floor of `drift` (train-mode g(y) in
    the runs' precision against the float32 eval-mode buffer: the part of `drift` that dropout alone makes)."""
    from types import SimpleNamespace

    import torch

    from rlm.components import build_retriever, load_dev_examples, load_or_build_buffer, resolve_data
    from rlm.data.corpus import load_corpus
    from rlm.training.validation import validate

    cfg = run_config(args, work, f"buffer.dir={work / 'buffer'}")[2]
    corpus, retriever, row = load_corpus(resolve_data(cfg)[0]), build_retriever(cfg), None
    load_or_build_buffer(cfg, retriever, corpus)
    if evaluate:
        models, dev = SimpleNamespace(retriever=retriever.eval(), reader=None), load_dev_examples(cfg)
        start = time.time()
        with run_precision(cfg):  # evaluated as the trained runs are
            metrics = validate(models, corpus, dev, cfg)
        wall = round(time.time() - start, 1)
        row = {"strategy": "start", "seed": None, "wall_s": wall, "reembedded": 0} | metrics
        print(json.dumps(row))
    texts, tower = corpus.retrieval_texts()[:num], retriever.passage_tower
    torch.manual_seed(0)
    with torch.no_grad():
        clean = tower.eval().embed_texts(texts)
        with run_precision(cfg):
            noisy = tower.train().embed_texts(texts).float()
    precision = {"mixed_precision": cfg.mixed_precision, "precision": effective_precision(cfg)}
    return row, {"dropout_floor": float((noisy - clean).norm(dim=-1).mean())} | precision


def train_all(args, work: Path, tasks: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """Every (strategy, seed) run; with --jobs N, N at a time, each on cpu_count / N threads (two 1-thread runs
    train about 1.5x faster in total than one 2-thread run on this 2-core machine: small matmuls scale poorly)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    from rlm.quickstart.concurrent_runs import worker_context

    results = {}
    if args.jobs <= 1:
        for task in tasks:
            results[task] = one_run(args, work, *task)
            print(json.dumps(results[task]), flush=True)
        return results
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    pool = ProcessPoolExecutor(
        args.jobs, worker_context(), initializer=torch.set_num_threads, initargs=(threads,)
    )
    with pool:
        futures = {pool.submit(one_run, args, work, *task): task for task in tasks}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            print(json.dumps(results[futures[future]]), flush=True)
    return results


def gold_passage_em(cfg, out_dir: Path) -> float:
    """EM of the run's trained reader given each dev question's gold passages alone: what it could score if
    retrieval were perfect (the paper's 'reader EM with gold passages')."""
    from rlm.components import load_dev_examples, resolve_data
    from rlm.data.corpus import load_corpus
    from rlm.inference.checkpoint import load_checkpoint
    from rlm.inference.evaluation import evaluate_reader
    from rlm.inference.reading import read, with_gold_passages

    dev, reader = load_dev_examples(cfg), load_checkpoint(out_dir / "final", need_retriever=False)[1]
    gold = with_gold_passages(dev, None, num_passages=0)
    predictions = read(reader, dev, load_corpus(resolve_data(cfg)[0]), None, passage_ids=gold)
    return evaluate_reader(predictions, dev)["exact_match"]


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__)
    add = parser.add_argument
    add("--algorithm", type=int, choices=(1, 2), default=1)
    add("--data", choices=("toy", "multihop200"), default="toy")
    add("--start", choices=("minilm", "random_gtr"), default="minilm")
    add("--data-dir", default=DEFAULT_DATA_DIR, help="holds multihop200/ ($RLM_SHARED_DATA, ../shared/data)")
    add("--strategies", help="comma-separated; default: the paper's table for the algorithm")
    add("--seeds", default="0,1")
    add("--steps", type=int, default=150)
    add("--num-passages", type=int, default=2000)
    add("--batch-size", type=int, default=16)
    add("--k", type=int, default=8, help="top-k from the strategy (Algorithm 1)")
    add("--num-random", type=int, default=16, help="uniform negatives shared by the batch")
    add("--lr", type=float, default=5e-5, help="retriever learning rate (Algorithm 1)")
    add("--refresh-every", type=int, default=50, help="R for exhaustive and snm")
    add("--snm-size", type=int, default=500)
    add("--regression-samples", type=int, default=200, help="s' re-embedded per refit for regression")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    add("--jobs", type=int, default=1, help="runs at once, each on cpu_count/jobs threads (default 1)")
    add("--work", default=None, help="run folder (default runs/compare/<name>)")
    add(
        "--out",
        default=None,
        help="output stem (default scripts/bench/reports/compare_strategies/compare_<name>)",
    )
    add("--render", nargs="+", help="re-render the table and plots of saved JSONs (no training)")
    args = parser.parse_args(argv)
    for path in args.render or []:  # a JSON written before the runs carried drift logs keeps its drift plot
        print(render(path))
    if args.render:
        return
    strategies = args.strategies.split(",") if args.strategies else DEFAULT_STRATEGIES[args.algorithm]
    if args.data == "multihop200" and not (qa := Path(args.data_dir) / "multihop200" / "qa.jsonl").is_file():
        parser.error(f"--data multihop200: no {qa}; pass --data-dir")
    if "start" in strategies and args.algorithm != 1:
        parser.error("the 'start' row is for Algorithm 1 (Algorithm 2 has closed_book and frozen)")
    name = f"alg{args.algorithm}_{args.data}_{args.start}"
    work = Path(args.work or ROOT / "runs" / "compare" / name)
    out = Path(args.out or results_path("compare_strategies", f"compare_{name}")).with_suffix(".json")
    seeds = int_list(args.seeds)
    start_row, settings = prepare(args, work, "start" in strategies)
    trained = train_all(args, work, [(s, seed) for s in strategies if s != "start" for seed in seeds])
    runs = []
    for strategy in strategies:  # the untrained "start" row: one evaluation, whatever the seeds
        runs += [start_row] if strategy == "start" else [trained[(strategy, seed)] for seed in seeds]
    for run in runs:  # the drift plot's data, so the table can be re-plotted from the JSON alone
        if run["seed"] is not None:
            run["drift_log"] = drift_log(work / f"{run['strategy']}_seed{run['seed']}" / "log.jsonl")
    rows = summarise(runs, table_metrics(args.algorithm, runs))
    atomic_write_json(out, {"args": vars(args), "runs": runs, "rows": rows, **settings})
    print(render(out))


if __name__ == "__main__":
    main()
