"""`rlm calibrate`: fit a checkpoint's answer policy (calibrated confidence + abstention) on questions it owns.

The policy is fitted on what the demo serves: the checkpoint's `QAService` (the corpus embedded with the
trained passage tower, the reader's answers) answers the fit questions, and `rlm.inference.answer_policy` turns what it
knew into P(correct) and a threshold, saved as `<checkpoint>/answer_policy.json`. This command, like `rlm
demo`, uses the app's `QAService`: the answers calibrated are the ones the page shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlm.inference.answer_policy import DEFAULT_KEEP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm calibrate`."""
    parser.add_argument("--checkpoint", required=True, help="the final/ folder of a run")
    parser.add_argument("--dataset", default="toy", help="QA dataset of the fit questions")
    parser.add_argument("--split", default="dev", help="the split to fit on; never the one you report on")
    parser.add_argument(
        "--data-path", help="dataset file or folder (default for toy: the checkpoint's toy world folder)"
    )
    parser.add_argument(
        "--unanswerable",
        default="auto",
        help="questions the corpus does not answer, fitted as wrong answers: a QA JSONL file, 'none', or "
        "'auto' (for toy: <split>_unanswerable, made beside the world)",
    )
    parser.add_argument("--max-examples", type=int, default=None, help="at most this many fit questions")
    parser.add_argument("--k", type=int, default=None, help="passages read (default: the checkpoint's)")
    parser.add_argument(
        "--keep",
        type=float,
        default=DEFAULT_KEEP,
        help="share of correct fit answers the threshold keeps",
    )


def calibrate_checkpoint(
    checkpoint: str | Path,
    examples,
    unanswerable=(),
    k: int | None = None,
    keep: float = DEFAULT_KEEP,
    fitted_on: dict | None = None,
    service=None,
):
    """Answer `examples` (answerable) and `unanswerable` with the checkpoint's QAService, fit the policy,
    save it into the checkpoint and return it."""
    from rlm.app.service import QAService, ServiceOptions
    from rlm.inference.answer_policy import fit_answer_policy
    from rlm.inference.metrics import exact_match

    service = service or QAService.from_checkpoint(checkpoint, options=ServiceOptions(load_policy=False))
    questions = [*examples, *unanswerable]
    if not examples:
        from rlm.errors import UserError

        raise UserError("calibration needs answerable questions with gold answers")
    signals, correct = [], []
    batch = 32
    for start in range(0, len(questions), batch):
        part = questions[start : start + batch]
        answered = service.answer_with_signals([q.question for q in part], k, best_guess=True)
        for ex, (result, answer_signals) in zip(part, answered):
            signals.append(answer_signals)
            correct.append(bool(ex.answers) and bool(exact_match(result["best_guess"], ex.answers)))
    answerable = [True] * len(examples) + [False] * len(unanswerable)
    gold = [ex.answers for ex in questions]
    policy = fit_answer_policy(
        signals, correct, answerable, keep=keep, fitted_on=fitted_on, gold_answers=gold
    )
    policy.save(checkpoint)
    service.policy = policy
    return policy


def describe(policy) -> str:
    """A few lines on the fitted policy and what it measured on its own fit questions."""
    fit = policy.fitted_on
    lines = [
        f"answer policy fitted on {fit.get('questions')} questions ({fit.get('answerable')} answerable, "
        f"{fit.get('correct')} answered correctly; {fit.get('source', '')})",
        f"  threshold P(correct) >= {policy.threshold:.3f}; out-of-corpus cut: best passage score < "
        f"{policy.min_top_score:.3f}",
        f"  on these questions: correct answers kept {100 * fit['kept_correct']:.1f}%"
        + (
            f", unanswerable abstained {100 * fit['abstained_unanswerable']:.1f}%"
            if fit.get("abstained_unanswerable") is not None
            else ""
        )
        + f", ECE {fit['ece']:.3f}"
        + (f", AUROC {fit['auroc']:.3f}" if fit.get("auroc") is not None else ""),
    ]
    return "\n".join(lines)


def fit_questions(checkpoint: Path, dataset: str, split: str, data_path, unanswerable: str, limit):
    """(answerable fit questions, unanswerable ones, a label saying where they came from)."""
    import yaml

    from rlm.data.qa import load_qa_dataset, read_qa_jsonl
    from rlm.errors import UserError

    if dataset == "toy" and data_path is None:
        config = (
            yaml.safe_load((checkpoint / "config.yaml").read_text())
            if (checkpoint / "config.yaml").is_file()
            else {}
        )
        world = ((config or {}).get("data") or {}).get("toy_world", {}).get("dir")
        if not world:
            raise UserError(f"{checkpoint}/config.yaml names no toy world; pass --data-path")
        from rlm.inference.checkpoint import corpus_from_config

        data_path = str(corpus_from_config(config, checkpoint).parent)
    examples = load_qa_dataset(dataset, split, data_path)[:limit]
    if unanswerable == "none":
        extra = []
    elif unanswerable == "auto":
        extra = load_qa_dataset("toy", f"{split}_unanswerable", data_path) if dataset == "toy" else []
    else:
        extra = read_qa_jsonl(unanswerable, allow_empty_answers=True)
    extra = extra[:limit]
    source = f"{dataset}/{split}" + (f" + {len(extra)} unanswerable" if extra else "")
    return examples, extra, source


def run(args: argparse.Namespace) -> int:
    """Fit, save, print."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {checkpoint}")
    examples, extra, source = fit_questions(
        checkpoint, args.dataset, args.split, args.data_path, args.unanswerable, args.max_examples
    )
    policy = calibrate_checkpoint(
        checkpoint, examples, extra, k=args.k, keep=args.keep, fitted_on={"source": source}
    )
    print(describe(policy))
    print(f"wrote {checkpoint / 'answer_policy.json'}")
    return 0
