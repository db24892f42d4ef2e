"""How far a checkpoint's answers can be trusted: the reader's ceilings, coverage, calibration, abstention.

    python scripts/bench/answer_quality.py --checkpoint runs/quickstart/final \
        --out-of-corpus ../shared/data/nq_open/NQ-open.dev.jsonl --out scripts/bench/reports/answer_quality/answer_quality

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

from pathlib import Path

import numpy as np
from lab.reporting import arguments, cpu_name, figure, table, write_report


def reader_rows(checkpoint: Path, world: Path, k: int) -> dict:
    """Dev EM from the retriever's top-k, with the gold swapped in, with the gold ranked last (below k - 1
    others: what the reader makes of a retriever that ranks the answering passage low), and from the gold
    passage alone."""
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.inference import evaluation, indexing
    from rlm.inference.checkpoint import load_checkpoint
    from rlm.inference.reading import read
    from rlm.inference.retrieval import retrieve

    retriever, reader, _ = load_checkpoint(checkpoint)
    corpus, dev = load_corpus(world / "corpus.jsonl"), load_qa_dataset("toy", "dev", str(world))
    embeddings = indexing.embed_corpus(retriever.passage_tower, corpus.retrieval_texts())
    index = indexing.build_index(embeddings, corpus.ids)
    common = {"corpus": corpus, "reader": reader, "index": index, "k": 20, "num_passages": k}
    top = evaluation.run_evaluation(dev, retriever=retriever, **common)
    swapped = evaluation.run_evaluation(dev, retriever=retriever, gold_passages=True, **common)
    alone = evaluation.run_evaluation(dev, retriever=None, gold_passages=True, **{**common, "index": None})
    retrieved = retrieve(retriever.query_tower, index, [q.question for q in dev], 20)
    gold = [ex.gold_passage_ids[0] for ex in dev]
    last = [[p for p in ids if p != g][: k - 1] + [g] for g, ids in zip(gold, retrieved.ids)]
    answers = read(reader, dev, corpus, None, num_passages=k, passage_ids=last)
    return {
        f"the trained retriever's top-{k}": top.metrics["exact_match"],
        f"top-{k} with the gold passage swapped in": swapped.metrics["exact_match"],
        "the gold passage alone": alone.metrics["exact_match"],
        f"top-{k} with the gold passage ranked last": evaluation.evaluate_reader(answers, dev)["exact_match"],
        "gold_ranked_first": top.metrics.get("gold_recall@1"),
    }


def answer_all(service, examples, k) -> list[dict]:
    questions, answers = [q.question for q in examples], []
    for start in range(0, len(questions), 32):
        answers += service.answer_many(questions[start : start + 32], k, best_guess=True)
    return answers


def bootstrap_se(conf: np.ndarray, correct: np.ndarray, draws: int = 500, seed: int = 0) -> float:
    from rlm.inference.answer_policy import expected_calibration_error

    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, len(conf), len(conf)) for _ in range(draws)]
    return float(np.std([expected_calibration_error(conf[pick], correct[pick]) for pick in picks]))


# Questions asking for a kind of answer the world never states (a year, a date, a number, a person) about the
# test split's own people and organisations, in wordings neither the fit (dev) nor the test's unanswerable
# questions use, that share words with facts the world does state ("born", "located", "work"): a reader that
# knows only birthplaces and jobs answers them with one, from the subject's own passage.
KIND_PROBES = {
    "person": (
        "When was {s} born?",
        "What year was {s} born in?",
        "On what date was {s} born?",
        "Who was born in the same year as {s}?",
        "How many years has {s} worked?",
        "Who did {s} work with?",
    ),
    "org": (
        "When was {s} located in its city?",
        "In what year did {s} move its headquarters?",
        "How many cities is {s} located in?",
        "Who located {s} in its city?",
    ),
}


def kind_probe_questions(test, count: int = 100, seed: int = 0):
    """`count` questions of `KIND_PROBES` about the subjects of the test questions (a third about
    organisations, when the world asks about any); none of them is answered by the corpus."""
    import random

    from rlm.data.qa import QAExample
    from rlm.data.unanswerable import asked_subjects

    subjects = asked_subjects(test)
    rng, out = random.Random(seed), []
    for n in range(count):
        kind = "org" if subjects["org"] and (not subjects["person"] or n % 3 == 0) else "person"
        question = rng.choice(KIND_PROBES[kind]).format(s=rng.choice(subjects[kind]))
        out.append(QAExample(f"kind-probe-{n}", question, [], [], {"type": "kind_probe"}))
    return out


def policy_rows(checkpoint: Path, world: Path, outside: Path | None, num_out: int, k) -> tuple[dict, list]:
    from rlm.app.service import QAService
    from rlm.data.qa import load_qa_dataset, read_qa_jsonl
    from rlm.inference.answer_kinds import asked_kind
    from rlm.inference.answer_policy import auroc, expected_calibration_error, reliability_bins
    from rlm.inference.metrics import exact_match

    service = QAService.from_checkpoint(checkpoint)
    if service.policy is None:
        raise SystemExit(f"{checkpoint} has no answer policy: run `rlm calibrate --checkpoint {checkpoint}`")
    test = load_qa_dataset("toy", "test", str(world))
    unanswerable = load_qa_dataset("toy", "test_unanswerable", str(world))
    answered, refused = answer_all(service, test, k), answer_all(service, unanswerable, k)
    right = np.array([bool(exact_match(r["best_guess"], q.answers)) for r, q in zip(answered, test)])
    kept = np.array([not r["abstained"] for r in answered])
    conf = np.array([r["confidence"] for r in answered + refused])
    correct = np.concatenate([right, np.zeros(len(refused), dtype=bool)])
    rows = {"test_questions": len(test), "coverage": float(kept.mean())}
    rows["answered_exact_match"] = float(right[kept].mean()) if kept.any() else None
    rows["full_coverage_exact_match"] = float(right.mean())
    rows["correct_kept"] = float(kept[right].mean()) if right.any() else None
    rows |= {"held_out_questions": len(conf), "ece": expected_calibration_error(conf, correct)}
    rows |= {"ece_bootstrap_se": bootstrap_se(conf, correct), "auroc": auroc(conf, correct)}
    rows |= {"threshold": service.policy.threshold, "fitted_on": service.policy.fitted_on}
    for kind in sorted({q.meta["type"] for q in unanswerable}):
        picked = [r for r, q in zip(refused, unanswerable) if q.meta["type"] == kind]
        rows[f"abstained_{kind}"] = float(np.mean([r["abstained"] for r in picked]))
    # The unstated facts that ask for a kind of answer the world's own questions never ask for (a year, a date,
    # a number, a person): a reader that knows birthplaces and jobs answers them with one of those.
    known = {asked_kind(q.question) for q in test}
    unstated = [(r, q) for r, q in zip(refused, unanswerable) if q.meta["type"] == "unstated_fact"]
    other = [r for r, q in unstated if asked_kind(q.question) not in known]
    rows["abstained_unstated_fact_of_a_kind_never_asked"] = (
        float(np.mean([r["abstained"] for r in other])) if other else None
    )
    rows["unstated_fact_of_a_kind_never_asked_questions"] = len(other)
    probes = kind_probe_questions(test)
    probed = answer_all(service, probes, k)
    rows["abstained_held_out_wordings_of_a_kind_never_asked"] = float(
        np.mean([r["abstained"] for r in probed])
    )
    rows["held_out_wordings_answered"] = [
        {"question": q.question, "answer": r["best_guess"], "confidence": r["confidence"]}
        for r, q in zip(probed, probes)
        if not r["abstained"]
    ]
    rows["unstated_fact_answered"] = [
        {"question": q.question, "answer": r["best_guess"], "confidence": r["confidence"]}
        for r, q in unstated
        if not r["abstained"]
    ]
    if outside is not None:
        questions = read_qa_jsonl(outside, allow_empty_answers=True)[:num_out]
        rows |= {"out_of_corpus_questions": len(questions), "out_of_corpus_source": str(outside)}
        abstained = [r["abstained"] for r in answer_all(service, questions, k)]
        rows["abstained_out_of_corpus"] = float(np.mean(abstained))
    return rows, reliability_bins(conf, correct)


def percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def markdown(report: dict) -> str:
    p, reader = report["policy"], report["reader"]
    ece = f"{p['ece']:.3f} ({p['ece_bootstrap_se']:.3f})"
    policy = [
        (f"coverage (share of {p['test_questions']} answerable questions answered)", percent(p["coverage"])),
        ("EM of the answered questions", percent(p["answered_exact_match"])),
        ("EM at full coverage (every best guess)", percent(p["full_coverage_exact_match"])),
        ("correct answers kept", percent(p["correct_kept"])),
        (f"ECE over {p['held_out_questions']} questions (bootstrap s.e.)", ece),
        ("AUROC, correct vs wrong", None if p["auroc"] is None else f"{p['auroc']:.3f}"),
    ]
    for key, value in p.items():
        if key.startswith("abstained_"):
            policy.append((f"abstained: {key.removeprefix('abstained_').replace('_', ' ')}", percent(value)))
    dev = [(key, percent(value)) for key, value in reader.items() if key != "gold_ranked_first"]
    what, value = (lambda r: r[0]), (lambda r: r[1])
    return (
        f"{table(dev, [('what the reader reads (dev)', what, ''), ('EM', value, '.1f')])}\n\ngold passage ranked "
        f"first for {100 * reader['gold_ranked_first']:.1f}% of dev questions\n\n"
        + table(policy, [("answer policy, held-out test", what, ""), ("value", value, ".1f")])
    )


def plot(bins: list[dict]):
    fig, ax = figure(1, (4.5, 4.5))
    full = [b for b in bins if b["count"]]
    centres = [(b["low"] + b["high"]) / 2 for b in full]
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    ax.bar(centres, [b["accuracy"] for b in full], width=0.09, alpha=0.7, label="accuracy in the bin")
    for x, b in zip(centres, full):
        ax.annotate(str(b["count"]), (x, b["accuracy"]), ha="center", va="bottom", fontsize=7)
    ax.set(xlabel="confidence", ylabel="share correct", xlim=(0, 1), ylim=(0, 1.05))
    ax.set_title("Reliability (held-out test)")
    ax.legend(loc="upper left", fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> int:
    import yaml

    from rlm.inference.checkpoint import corpus_from_config, reader_passages_from_config

    parser = arguments(__doc__)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--world", type=Path, help="its toy world folder (default: from its config)")
    parser.add_argument("--out-of-corpus", type=Path, help="a QA JSONL of questions from outside the world")
    parser.add_argument("--num-out", type=int, default=300)
    parser.add_argument("--k", type=int, default=None, help="passages read (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, help="write OUT.md, OUT.json and OUT.png")
    args = parser.parse_args(argv)
    config = yaml.safe_load((args.checkpoint / "config.yaml").read_text())
    world = args.world or corpus_from_config(config, args.checkpoint).parent
    k = args.k or reader_passages_from_config(config, 4)
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
