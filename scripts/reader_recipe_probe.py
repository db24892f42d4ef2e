"""Probe (issue 27): which reader-only phases make the quickstart's reader answer from a good retriever's top-4?

A reader-only loop outside `rlm train`, on fixed selections so that a recipe costs a minute instead of a
quickstart: each training question reads its gold passage alone ("gold"), the packaged MiniLM's top-4 over the
corpus ("minilm": what the reader read before the retriever trained, in the old recipe), or a trained
retriever's top-4 ("trained": a quickstart checkpoint's towers, the corpus re-embedded once). The reader,
tokenizer, optimizer, schedule and batch order are the quickstart's. Dev EM is measured reading the trained
top-4, MiniLM's top-4, the gold passage alone, and the gold among the trained top-4's other passages, ranked
first and ranked last. docs/reader_recipe.md has the runs.

    python scripts/reader_recipe_probe.py --checkpoint runs/quickstart/final \
        --phases gold:150,minilm:250,trained:250 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from atomicio import atomic_write_json
from reader.fid import FiDConfig, FiDReader
from reader.small_t5 import SmallT5Config
from reader.tokenizer import load_tokenizer
from retriever.encoder import DualEncoder, default_retriever_path
from rlm.config import load_config
from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.metrics import exact_match
from rlm.train import batch_indices, lr_lambda


def selections(cfg, checkpoint: Path, corpus, splits: dict) -> dict:
    """{"minilm"|"trained": {split: [top-8 corpus rows per question]}}."""
    out = {}
    for name, tower in (("minilm", None), ("trained", checkpoint / "retriever")):
        if tower is None:
            retriever = DualEncoder.from_towers(default_retriever_path())
        else:
            retriever = DualEncoder.from_pretrained(str(tower))
        retriever.query_tower.max_length = cfg.retriever.query_max_length
        retriever.passage_tower.max_length = cfg.retriever.passage_max_length
        passages = retriever.passage_tower.encode(corpus.retrieval_texts())
        out[name] = {}
        for split, examples in splits.items():
            queries = retriever.query_tower.encode([ex.question for ex in examples])
            out[name][split] = (queries @ passages.T).topk(8, dim=1).indices.tolist()
    return out


def train_reader(cfg, tokenizer, corpus, train, chosen, phases, seed: int) -> FiDReader:
    rc = cfg.reader
    model = SmallT5Config(
        d_model=rc.d_model,
        d_ff=rc.d_ff,
        num_layers=rc.num_layers,
        num_decoder_layers=rc.num_decoder_layers,
        num_heads=rc.num_heads,
        d_kv=rc.d_kv,
        dropout_rate=rc.dropout_rate,
    )
    template = {"template": rc.template} if rc.template else {}
    fid = FiDConfig(
        max_passage_length=rc.max_passage_length, max_answer_length=rc.max_answer_length, **template
    )
    reader = FiDReader.from_config(tokenizer, model, fid, seed=seed)
    total = sum(steps for _, steps in phases)
    optimizer = torch.optim.AdamW(reader.parameters(), lr=cfg.optim.lr_reader, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim.warmup_steps, total))
    step = 0
    for source, steps in phases:
        for _ in range(steps):
            rows = batch_indices(step, len(train), cfg.optim.batch_size, 0, 1, seed)
            lists = [
                [corpus.index_of(g) for g in train[i].gold_passage_ids]
                if source == "gold"
                else chosen[source]["train"][i][: rc.num_passages]
                for i in rows
            ]
            batch = reader.collator(
                [train[i].question for i in rows],
                [[(corpus[r].title, corpus[r].text) for r in rs] for rs in lists],
                [train[i].answers[0] for i in rows],
            )
            reader(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(reader.parameters(), cfg.optim.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
    return reader


def dev_em(reader, corpus, dev, lists) -> float:
    answers = reader.answer(
        [ex.question for ex in dev],
        [[(corpus[r].title, corpus[r].text) for r in rs] for rs in lists],
        batch_size=64,
    )
    return round(100 * sum(exact_match(a, ex.answers) for a, ex in zip(answers, dev)) / len(dev), 1)


def measure(reader, corpus, dev, chosen, k: int) -> dict:
    trained = [rows[:k] for rows in chosen["trained"]["dev"]]
    gold = [corpus.index_of(ex.gold_passage_ids[0]) for ex in dev]
    others = [[r for r in rows if r != g][: k - 1] for rows, g in zip(chosen["trained"]["dev"], gold)]
    return {
        "trained top-4": dev_em(reader, corpus, dev, trained),
        "MiniLM top-4": dev_em(reader, corpus, dev, [rows[:k] for rows in chosen["minilm"]["dev"]]),
        "gold alone": dev_em(reader, corpus, dev, [[g] for g in gold]),
        "gold ranked first": dev_em(reader, corpus, dev, [[g, *o] for g, o in zip(gold, others)]),
        "gold ranked last": dev_em(reader, corpus, dev, [[*o, g] for g, o in zip(gold, others)]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a quickstart run's final/ folder")
    parser.add_argument("--phases", action="append", required=True, help="e.g. gold:150,trained:250")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, help="write OUT.json")
    args = parser.parse_args(argv)
    cfg = load_config(args.checkpoint / "config.yaml", saved=True)
    world = Path(cfg.data.toy_world.dir)
    corpus = load_corpus(world / "corpus.jsonl")
    splits = {split: load_qa_dataset("toy", split, str(world)) for split in ("train", "dev")}
    chosen = selections(cfg, args.checkpoint, corpus, splits)
    tokenizer = load_tokenizer(args.checkpoint / "reader")
    report = []
    for spec in args.phases:
        phases = [(name, int(steps)) for name, steps in (part.split(":") for part in spec.split(","))]
        for seed in map(int, args.seeds.split(",")):
            reader = train_reader(cfg, tokenizer, corpus, splits["train"], chosen, phases, seed)
            row = {"phases": spec, "seed": seed, **measure(reader, corpus, splits["dev"], chosen, 4)}
            print(json.dumps(row), flush=True)
            report.append(row)
    if args.out:
        atomic_write_json(args.out.with_suffix(".json"), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
