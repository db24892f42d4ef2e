"""Run by tests/test_train_multiprocess.py under `accelerate launch`: every strategy's selection with its rows
sharded across the processes against the same strategy unsharded, on the real components of a run (one JSON
file per rank: the comparisons and the rows each process re-embedded).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_select.py OUT_DIR --set ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from rlm.config import RegressionConfig, add_override_argument, load_config
from rlm.retriever.distributed import Processes
from rlm.retriever.index_spec import IndexSpec, TwoStage
from rlm.training.run import build_run
from rlm.training.strategies import make_strategy

# (strategy, the step whose refresh is compared, Algorithm 1's forced label + uniform rows)
CASES = [
    ("corrector", 0, False),
    ("corrector", 0, True),
    ("stale", 0, True),
    ("exhaustive", 1, False),
    ("exhaustive", 1, True),
    ("two_round", 2, True),
    ("snm", 0, False),
    ("snm", 0, True),
    ("regression", 1, False),  # s' samples re-embedded in halves and gathered, every process the same fit
    ("regression", 1, True),
    ("corrector", 0, "two_stage"),  # a faiss index over each process's rows, re-scored with h
    ("corrector", 0, "scan"),  # two-stage with each process's exact stale candidates, re-scored with h
]


def main(argv: list[str] | None = None, end_training: bool = True) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    add_override_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_config(None, args.overrides)
    run = build_run(cfg, overwrite=True)
    acc, model = run.accelerator, run.raw.eval()
    procs = Processes.of(acc)
    with torch.no_grad():  # a corrector that is not the identity, the same on every process
        generator = torch.Generator().manual_seed(7)
        for p in model.corrector.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        # The passage tower drifts, so a refresh changes the rows (the same drift on every process).
        for p in model.retriever.passage_tower.parameters():
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=generator))
    batch = run.batch(0, 0)
    with torch.no_grad():
        queries = model.retriever.encode_queries(batch.questions)
    include = batch.gold_rows[:, None] if batch.gold_rows is not None else None
    if include is None:  # Algorithm 2 data: force each question's first gold passage in, as Algorithm 1 does
        include = torch.tensor([[run.corpus.index_of(ex)] for ex in _first_golds(run, batch)])

    results = []
    for name, step, forced in CASES:
        search = "two_stage" if forced in ("two_stage", "scan") else "exact"
        first_stage = "scan" if forced == "scan" else "index"
        forced = forced is True
        regression = RegressionConfig(samples=40, landmarks=16)
        scfg = dataclasses.replace(
            cfg.strategy, name=name, k=4, refresh_every=1, snm_size=40, regression=regression
        )
        extra = {"include": include if forced else None}
        record = {
            "strategy": f"{name}/{search}" + ("/scan" if first_stage == "scan" else ""),
            "forced": forced,
        }
        for mode in ("whole", "sharded"):
            strategy = make_strategy(scfg, run.strategy.buffer, max_steps=4, seed=cfg.seed)
            folder = args.out / f"refresh_{name}_{forced}"
            if mode == "sharded":
                # Two-stage against exact: the sharded run searches an index, the whole one every row.
                strategy = make_strategy(
                    dataclasses.replace(
                        scfg,
                        search=search,
                        two_stage=TwoStage(
                            first_stage=first_stage, index=IndexSpec(factory="IVF4,Flat", nprobe=4)
                        ),
                    ),
                    run.strategy.buffer,
                    max_steps=4,
                    seed=cfg.seed,
                )
                strategy.distribute(procs, True, None, refresh_dir=folder)
            else:  # every process alone, with the whole buffer (its refreshes in fp16 files as in training)
                strategy.distribute(Processes(), False, None, refresh_dir=folder / f"whole{procs.rank}")
            embedded = []
            for s in range(step + 1):
                strategy.before_step(s, lambda rows, embedded=embedded: _count(embedded, run.reembed(rows)))
            h = model.corrector if strategy.uses_corrector else None
            top = strategy.select(queries, h, num_random=3 if forced else 0, **extra)
            record[mode] = {
                "rows": top.indices.tolist(),
                "scores": top.scores.tolist(),
                "embedded_here": sum(embedded),
                "reembedded": strategy.reembedded,
            }
            if mode == "sharded":
                # A resumed process reads the refreshed rows back from the run folder: the same selection.
                plain = strategy.select(queries, h, **extra)
                again = make_strategy(scfg, run.strategy.buffer, max_steps=4, seed=cfg.seed)
                again.distribute(procs, True, None, refresh_dir=folder)
                again.load_state_dict(strategy.state_dict())
                resumed = again.select(queries, h, **extra)
                record["resumed_same"] = bool(torch.equal(plain.indices, resumed.indices))
        results.append(record)
    # Validation, sharded (each process embeds half the passages and reads half the questions) and whole.
    from rlm.training.validation import validate

    for name, subcorpus in (("full", False), ("hard", True)):
        figures = {
            mode: validate(model, run.corpus, run.dev_examples, cfg, procs=p, subcorpus=subcorpus)
            for mode, p in (("sharded", procs), ("whole", Processes()))
        }
        results.append({"validation": name, **figures})
    # Answering from the training selection (eval_selection): <q, h(B)> with h(B)'s rows sharded, as whole.
    figures = {}
    for mode, p in (("sharded", procs), ("whole", Processes())):
        strategy = make_strategy(cfg.strategy, run.strategy.buffer, max_steps=4, seed=cfg.seed)
        strategy.distribute(p, True, None)
        figures[mode] = validate(model, run.corpus, run.dev_examples, cfg, procs=p, strategy=strategy)
    results.append({"validation": "selection", **figures})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"select_rank{acc.process_index}.json").write_text(json.dumps(results, indent=2))
    if end_training:  # not when another probe runs next in these processes (tests/multiprocess_probes.py)
        acc.end_training()


def _count(counted: list[int], embeddings: torch.Tensor) -> torch.Tensor:
    counted.append(int(embeddings.shape[0]))
    return embeddings


def _first_golds(run, batch):
    by_question = {ex.question: ex for ex in run.train_examples}
    return [by_question[q].gold_passage_ids[0] for q in batch.questions]


if __name__ == "__main__":
    main()
