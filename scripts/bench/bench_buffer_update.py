"""A living corpus on the training side (issue 50 item 4): what a trained run selects through h after
`rlm corpus update --buffer` grew its fixed buffer B, against before and against B rebuilt from the edited corpus.

On a trained quickstart run (`rlm quickstart --no-serve --no-baselines --output-dir RUN`) and its world's next
edition (`rlm toy-world --next-edition-of RUN/toy_world --out ED`): the run's buffer is copied, the edition is
applied to the copy by `rlm corpus update --buffer`'s code (its passages embedded by g0, the run's starting
passage tower), and the edition's questions and the unchanged dev questions are selected for as training selects
(`SelectionStrategy.select`, top-k <f(x), h(B_y)> with the run's trained query tower f and corrector h) over
B before the update, after it, and over B rebuilt by embedding the whole edited corpus with g0. Answer recall@k
of each change kind (a selected passage holds the answer: the new value of a changed fact), removed rows
selected, and the update's time against the rebuild's.

    python scripts/bench/bench_buffer_update.py RUN ED --out scripts/bench/reports/buffer_update
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

KS = (4, 20)


def select(strategy_cfg, buffer, corpus, queries, h, k: int):
    """The passages training would select for each query (top-k through h), and the removed rows among them."""
    from rlm.training.strategies import make_strategy

    top = make_strategy(strategy_cfg, buffer, 1).select(queries, h, k=k).indices
    removed = int(np.isin(top.numpy(), buffer.removed).sum())
    return [[corpus[int(r)] for r in row] for row in top], removed


def recall(examples, selected, k: int) -> dict:
    """Answer recall@k by change kind (`meta.change`; the unchanged dev questions as "unchanged"): the share of
    questions with a selected passage whose text holds an answer (the current one; for a removed person's
    question, the answer the deleted passage gave)."""
    found = defaultdict(list)
    for ex, passages in zip(examples, selected):
        kind = (ex.meta or {}).get("change", "unchanged")
        text = " ".join(f"{p.title} {p.text}".lower() for p in passages[:k])
        found[kind].append(any(a.lower() in text for a in ex.answers))
    return {kind: (float(np.mean(hits)), len(hits)) for kind, hits in sorted(found.items())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="a trained quickstart run folder")
    parser.add_argument(
        "edition", type=Path, help="its world's next edition (rlm toy-world --next-edition-of)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from rlm.config import load_config
    from rlm.data.buffer_edition import corpus_of_buffer, grown_buffer
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.inference.checkpoint import load_checkpoint
    from rlm.inference.corpus_update import buffer_encoder, open_buffer, update_buffer
    from rlm.retriever.buffer import PassageBuffer, embed_passages
    from rlm.retriever.corrector import CorrectorNetwork

    final = args.run / "final"
    cfg = load_config(final / "config.yaml")
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(args.run / "buffer", work / "buffer")
    base = load_corpus(args.run / "toy_world" / "corpus.jsonl")
    retriever, _, _ = load_checkpoint(final, need_reader=False, device="cpu")
    h = CorrectorNetwork.from_pretrained(final / "corrector").eval()
    examples = [
        ex
        for name in ("dev", "unchanged_dev")
        for ex in load_qa_dataset("jsonl", "dev", args.edition / f"{name}.jsonl")
    ]
    queries = retriever.query_tower.encode([ex.question for ex in examples])
    k = max(KS)

    def measured(buffer, corpus) -> dict:
        selected, removed = select(cfg.strategy, buffer, corpus, queries, h, k)
        return {"recall": {f"@{r}": recall(examples, selected, r) for r in KS}, "removed_selected": removed}

    results = {"before": measured(PassageBuffer.load(work / "buffer"), base)}
    started = time.perf_counter()
    edits = (args.edition / "add.jsonl", args.edition / "delete.txt")
    update, _ = update_buffer(work / "buffer", base, *edits, checkpoint=final)
    results["update_s"] = time.perf_counter() - started
    results["update"] = {"added": update.added, "replaced": update.replaced, "deleted": update.deleted}
    edition = corpus_of_buffer(work / "buffer", base)
    results["after"] = measured(grown_buffer(PassageBuffer.load(work / "buffer"), edition), edition)

    live = edition.live()
    started = time.perf_counter()
    g0 = buffer_encoder(open_buffer(work / "buffer", base), final)
    rows = embed_passages(g0.tower, live.retrieval_texts(), batch_size=64, precision=g0.precision)
    results["rebuild_s"] = time.perf_counter() - started
    rebuilt = PassageBuffer.from_embeddings(list(live.ids), torch.from_numpy(rows))
    results["rebuilt"] = measured(rebuilt, live)
    results["passages"] = {"base": len(base), "edition_live": len(live)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "buffer_update.json").write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))


def render(results: dict) -> str:
    lines = [
        f"update of the buffer: {results['update']} in {results['update_s']:.1f} s; B rebuilt from the edited corpus "
        f"({results['passages']['edition_live']} passages) by g0: {results['rebuild_s']:.1f} s",
        "",
        "| questions | n | "
        + " | ".join(f"{s} @{k}" for k in KS for s in ("before", "after", "rebuilt"))
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in KS for _ in range(3)) + " |",
    ]
    for kind, (_, n) in results["before"]["recall"][f"@{KS[0]}"].items():
        cells = [
            f"{results[s]['recall'][f'@{k}'][kind][0]:.3f}"
            for k in KS
            for s in ("before", "after", "rebuilt")
        ]
        lines.append(f"| {kind} | {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "removed rows selected: "
        + ", ".join(f"{s} {results[s]['removed_selected']}" for s in ("before", "after", "rebuilt"))
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
