"""How far a checkpoint's answers can be trusted: the reader's ceilings, coverage, calibration, abstention.

    python scripts/answer_quality.py --checkpoint runs/quickstart/final \
        --out-of-corpus ../shared/data/nq_open/NQ-open.dev.jsonl --out docs/results/answer_quality/answer_quality

Prints (and writes as markdown, JSON and a reliability diagram):

* the reader's dev EM reading the trained retriever's top-K, the same with the gold passage swapped in, and
  the gold passage alone (what the reader can do when retrieval is perfect);
* on the held-out test split (the answer policy is fitted on dev by `rlm calibrate`): coverage, EM of the
  answered questions, EM at full coverage, the share of correct answers kept, ECE (with its bootstrap
  standard error) and AUROC of the confidence, and its reliability diagram;
* the share abstained on the world's test questions its corpus does not answer (each kind) and on
  out-of-corpus questions (any QA JSONL, e.g. NQ-open's, which ask about the real world).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from rlm.experiments.reporting import figure, table, write_report


def gold_last(examples, retrieved, k: int) -> list[list[str]]:
    """Each question's top-k with its (first) gold passage moved to the last place: what the reader makes of a
    retriever that ranks the answering passage below three others."""
    out = []
    for ex, ids in zip(examples, retrieved.ids):
        gold = ex.gold_passage_ids[0]
        out.append([pid for pid in ids if pid != gold][: k - 1] + [gold])
    return out


def reader_rows(checkpoint: Path, world: Path, k: int) -> dict:
    """Dev EM from the retriever's top-k, with the gold swapped in, with the gold ranked last, and from the
    gold passage alone."""
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.inference import evaluation

    retriever, reader, _ = evaluation.load_checkpoint(checkpoint)
    corpus = load_corpus(world / "corpus.jsonl")
    dev = load_qa_dataset("toy", "dev", str(world))
    embeddings = evaluation.embed_corpus(retriever.passage_tower, corpus.retrieval_texts())
    index = evaluation.build_index(embeddings, corpus.ids)
    common = {"corpus": corpus, "reader": reader, "index": index, "k": 20, "num_passages": k}
    rows = {
        f"the trained retriever's top-{k}": evaluation.run_evaluation(dev, retriever=retriever, **common),
        f"top-{k} with the gold passage swapped in": evaluation.run_evaluation(
            dev, retriever=retriever, gold_passages=True, **common
        ),
        "the gold passage alone": evaluation.run_evaluation(
            dev, retriever=None, gold_passages=True, **{**common, "index": None}
        ),
    }
    out = {name: result.metrics["exact_match"] for name, result in rows.items()}
    retrieved = evaluation.retrieve(retriever.query_tower, index, [q.question for q in dev], 20)
    answers = evaluation.read(
        reader, dev, corpus, None, num_passages=k, passage_ids=gold_last(dev, retrieved, k)
    )
    out[f"top-{k} with the gold passage ranked last"] = evaluation.evaluate_reader(answers, dev)[
        "exact_match"
    ]
    out["gold_ranked_first"] = rows[f"the trained retriever's top-{k}"].metrics.get("gold_recall@1")
    return out


def answer_all(service, examples, k) -> list[dict]:
    results = []
    for start in range(0, len(examples), 32):
        part = examples[start : start + 32]
        results += service.answer_many([q.question for q in part], k, best_guess=True)
    return results


def bootstrap_se(conf: np.ndarray, correct: np.ndarray, draws: int = 500, seed: int = 0) -> float:
    from rlm.inference.answer_policy import expected_calibration_error

    rng = np.random.default_rng(seed)
    values = []
    for _ in range(draws):
        pick = rng.integers(0, len(conf), len(conf))
        values.append(expected_calibration_error(conf[pick], correct[pick]))
    return float(np.std(values))


def policy_rows(
    checkpoint: Path, world: Path, out_of_corpus: Path | None, num_out: int, k
) -> tuple[dict, list]:
    from app.qa import QAService
    from rlm.data.qa import load_qa_dataset, read_qa_jsonl
    from rlm.inference.answer_policy import auroc, expected_calibration_error, reliability_bins
    from rlm.inference.metrics import exact_match

    service = QAService.from_checkpoint(checkpoint)
    if service.policy is None:
        raise SystemExit(f"{checkpoint} has no answer policy: run `rlm calibrate --checkpoint {checkpoint}`")
    test = load_qa_dataset("toy", "test", str(world))
    unanswerable = load_qa_dataset("toy", "test_unanswerable", str(world))
    answered = answer_all(service, test, k)
    right = np.array([bool(exact_match(r["best_guess"], q.answers)) for r, q in zip(answered, test)])
    kept = np.array([not r["abstained"] for r in answered])
    refused = answer_all(service, unanswerable, k)
    conf = np.array([r["confidence"] for r in answered + refused])
    correct = np.concatenate([right, np.zeros(len(refused), dtype=bool)])
    rows = {
        "test_questions": len(test),
        "coverage": float(kept.mean()),
        "answered_exact_match": float(right[kept].mean()) if kept.any() else None,
        "full_coverage_exact_match": float(right.mean()),
        "correct_kept": float(kept[right].mean()) if right.any() else None,
        "held_out_questions": len(conf),
        "ece": expected_calibration_error(conf, correct),
        "ece_bootstrap_se": bootstrap_se(conf, correct),
        "auroc": auroc(conf, correct),
        "threshold": service.policy.threshold,
        "fitted_on": service.policy.fitted_on,
    }
    for kind in sorted({q.meta["type"] for q in unanswerable}):
        picked = [r for r, q in zip(refused, unanswerable) if q.meta["type"] == kind]
        rows[f"abstained_{kind}"] = float(np.mean([r["abstained"] for r in picked]))
    if out_of_corpus is not None:
        outside = read_qa_jsonl(out_of_corpus, allow_empty_answers=True)[:num_out]
        results = answer_all(service, outside, k)
        rows["out_of_corpus_questions"] = len(outside)
        rows["out_of_corpus_source"] = str(out_of_corpus)
        rows["abstained_out_of_corpus"] = float(np.mean([r["abstained"] for r in results]))
    return rows, reliability_bins(conf, correct)


def markdown(report: dict) -> str:
    p, reader = report["policy"], report["reader"]
    policy = {
        f"coverage (share of {p['test_questions']} answerable questions answered)": p["coverage"],
        "EM of the answered questions": p["answered_exact_match"],
        "EM at full coverage (every best guess)": p["full_coverage_exact_match"],
        "correct answers kept": p["correct_kept"],
    }
    policy |= {
        f"abstained: {k.removeprefix('abstained_').replace('_', ' ')}": v
        for k, v in p.items()
        if k.startswith("abstained_")
    }
    percent = [{"what": k, "value": None if v is None else 100 * v} for k, v in policy.items()]
    ece = f"{p['ece']:.3f} ({p['ece_bootstrap_se']:.3f})"
    percent[4:4] = [{"what": f"ECE over {p['held_out_questions']} questions (bootstrap s.e.)", "value": ece}]
    percent[5:5] = [
        {"what": "AUROC, correct vs wrong", "value": None if p["auroc"] is None else f"{p['auroc']:.3f}"}
    ]
    dev = [{"what": k, "value": 100 * v} for k, v in reader.items() if k != "gold_ranked_first"]
    return (
        f"{table(dev, [('what the reader reads (dev)', 'what', ''), ('EM', 'value', '.1f')])}\n\ngold passage ranked "
        f"first for {100 * reader['gold_ranked_first']:.1f}% of dev questions\n\n"
        + table(percent, [("answer policy, held-out test", "what", ""), ("value", "value", ".1f")])
    )


def plot(bins: list[dict]):
    fig, ax = figure(1, (4.5, 4.5))
    full = [b for b in bins if b["count"]]
    centres = [(b["low"] + b["high"]) / 2 for b in full]
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    ax.bar(centres, [b["accuracy"] for b in full], width=0.09, alpha=0.7, label="accuracy in the bin")
    for x, b in zip(centres, full):
        ax.annotate(str(b["count"]), (x, b["accuracy"]), ha="center", va="bottom", fontsize=7)
    ax.set(
        xlabel="confidence",
        ylabel="share correct",
        xlim=(0, 1),
        ylim=(0, 1.05),
        title="Reliability (held-out test)",
    )
    ax.legend(loc="upper left", fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--world", type=Path, help="its toy world folder (default: from its config)")
    parser.add_argument("--out-of-corpus", type=Path, help="a QA JSONL of questions from outside the world")
    parser.add_argument("--num-out", type=int, default=300)
    parser.add_argument("--k", type=int, default=None, help="passages read (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, help="write OUT.md, OUT.json and OUT.png")
    args = parser.parse_args(argv)
    world = args.world
    if world is None:
        import yaml

        from app.qa import corpus_from_config

        config = yaml.safe_load((args.checkpoint / "config.yaml").read_text())
        world = corpus_from_config(config, args.checkpoint).parent
    import yaml

    from rlm.inference.evaluation import reader_passages_from_config

    k = args.k or reader_passages_from_config(
        yaml.safe_load((args.checkpoint / "config.yaml").read_text()), 4
    )
    from rlm.experiments.reporting import cpu_name

    report = {"checkpoint": str(args.checkpoint), "cpu": cpu_name(), "k": k}
    report["reader"] = reader_rows(args.checkpoint, world, k)
    report["policy"], bins = policy_rows(args.checkpoint, world, args.out_of_corpus, args.num_out, args.k)
    report["reliability"] = bins
    if args.out:
        write_report(args.out, markdown(report), report, {".png": lambda: plot(bins)})
    else:
        print(markdown(report))
    return 0


if __name__ == "__main__":
    from rlm.errors import user_errors

    try:
        raise SystemExit(main())
    except user_errors() as err:
        raise SystemExit(f"error: {err}") from None
