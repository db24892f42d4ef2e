"""Evaluation of a trained checkpoint: retrieve, read, score EM/F1 and recall@k, and write predictions and
metrics; `run_evaluation` is all of it, data-parallel under `accelerate launch` (`IndexOptions.accelerator`:
every process evaluates its share of the questions).

The trainer's validation, the hard-subcorpus tracker and `rlm evaluate` share its scores
(`retrieval_metrics`, `evaluate_reader`, `selective_scores`) and `format_table`. The parts it runs are
modules of their own: loading a checkpoint (`rlm.inference.checkpoint`), the device and precision
(`rlm.inference.device`), embedding and indexing the corpus (`rlm.inference.indexing`), retrieval
(`rlm.inference.retrieval`) and reading with the answer policy (`rlm.inference.reading`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlm.base.atomicio import atomic_write_text
from rlm.data.qa import QAExample
from rlm.inference.metrics import first_answer_hit, first_gold_hit, qa_scores, recall_from_first_hits
from rlm.inference.reading import decide_all, read, with_gold_passages
from rlm.inference.retrieval import Retrieved, encode_questions, search_index
from rlm.retriever.index_spec import TUNE_K, IndexSpec

RECALL_KS = (1, 5, 20, 100)


@dataclass
class EvaluationResult:
    """Metrics (fractions in [0, 1]), per-question records and where they were written."""

    metrics: dict[str, float]
    mode: str = "retrieve+read"
    records: list[dict] = field(default_factory=list)
    predictions_path: Path | None = None
    metrics_path: Path | None = None
    # What the questions are (`rlm.data.qa.QASplit.record`: dataset, split, size, source), for metrics.json.
    data: dict = field(default_factory=dict)


def retrieval_metrics(
    corpus, examples: Sequence[QAExample], retrieved: Retrieved, ks: Sequence[int] = RECALL_KS
) -> dict[str, float]:
    """Answer recall@k (DPR `has_answer` over passage texts) and, where gold ids are known, gold recall@k."""
    return recall_from_hits(retrieval_hits(corpus, examples, retrieved), examples, ks)


def retrieval_hits(
    corpus, examples: Sequence[QAExample], retrieved: Retrieved
) -> list[tuple[int | None, int | None]]:
    """Per question, the rank of its first answer-bearing passage (DPR `has_answer` over the passages' texts)
    and of its first gold passage (None: none retrieved): what recall@k counts, the costly part of it."""
    if len(retrieved.ids) != len(examples):
        raise ValueError(f"{len(retrieved.ids)} retrieval lists for {len(examples)} questions")
    return [
        (
            first_answer_hit([corpus[corpus.index_of(pid)].text for pid in ids], ex.answers),
            first_gold_hit(ids, ex.gold_passage_ids),
        )
        for ex, ids in zip(examples, retrieved.ids)
    ]


def recall_from_hits(
    hits: Sequence[tuple[int | None, int | None]], examples: Sequence[QAExample], ks: Sequence[int]
) -> dict[str, float]:
    """Answer recall@k over every question and, over the questions with gold ids (none: left out), gold
    recall@k, from their `retrieval_hits`."""
    metrics = recall_from_first_hits([answer for answer, _ in hits], ks)
    gold = [hit for (_, hit), ex in zip(hits, examples) if ex.gold_passage_ids]
    if gold:
        metrics.update({f"gold_{key}": value for key, value in recall_from_first_hits(gold, ks).items()})
    return metrics


def selective_scores(
    predictions: Sequence[str], examples: Sequence[QAExample], decisions
) -> dict[str, float]:
    """Coverage (share answered), EM over the answered questions, and the mean confidence."""
    answered = [i for i, d in enumerate(decisions) if not d.abstained]
    out = {"coverage": len(answered) / len(examples) if examples else 0.0}
    if answered:
        out["answered_exact_match"] = evaluate_reader(
            [predictions[i] for i in answered], [examples[i] for i in answered]
        )["exact_match"]
    out["mean_confidence"] = sum(d.confidence for d in decisions) / len(decisions) if decisions else 0.0
    return out


def evaluate_reader(predictions: Sequence[str], examples: Sequence[QAExample]) -> dict[str, float]:
    """Exact match and F1 of predictions against the examples' gold answers."""
    return qa_scores(list(predictions), [ex.answers for ex in examples])


def majority_answer_baseline(train: Sequence[QAExample], examples: Sequence[QAExample]) -> dict[str, float]:
    """EM/F1 of answering every question with the most frequent train answer of its type (`meta["type"]`).

    The best a closed-book reader can do on held-out entities without reading: the floor that retrieval
    must clear.
    """
    from collections import Counter, defaultdict

    counts: dict[str, Counter] = defaultdict(Counter)
    for ex in train:
        counts[ex.meta.get("type", "")][ex.answers[0]] += 1
    overall = Counter(a for c in counts.values() for a in c.elements())
    guesses = []
    for ex in examples:
        by_type = counts.get(ex.meta.get("type", ""))
        guesses.append((by_type or overall).most_common(1)[0][0] if (by_type or overall) else "")
    return evaluate_reader(guesses, examples)


def _check_evaluation_mode(reader, retriever, corpus, closed_book: bool, gold_passages: bool) -> None:
    """Refuse a combination of modes and inputs that `run_evaluation` cannot run."""
    if closed_book and reader is None:
        raise ValueError("closed-book evaluation needs a reader")
    if closed_book and gold_passages:
        raise ValueError("closed-book and gold-passage reading exclude each other")
    if gold_passages and (reader is None or corpus is None):
        raise ValueError("gold-passage reading needs a reader and the corpus holding the gold passages")
    if not closed_book and not gold_passages and (retriever is None or corpus is None):
        raise ValueError("retrieval needs a retriever and a corpus (or use closed-book mode)")


def _retrieve_for_evaluation(
    questions: list[str],
    corpus,
    retriever,
    index,
    k: int,
    options: IndexOptions,
    show_progress: bool,
    timings,
) -> Retrieved:
    """The top `k` for every question, embedding and indexing the corpus first when no `index` is given
    (`rlm.inference.indexing.index_corpus` with `options`); the seconds each stage took go into `timings`."""
    start = time.perf_counter()
    queries = encode_questions(retriever.query_tower, questions, options.batch_size, show_progress)
    encoding = time.perf_counter() - start
    start = time.perf_counter()
    if index is None:
        from rlm.inference.device import index_on_gpu
        from rlm.inference.indexing import index_corpus

        tune_on = _every_question(queries, options.processes())
        tower = retriever.passage_tower
        index = index_corpus(
            tower,
            corpus,
            options.embeddings_dir,
            options.spec,
            use_gpu=index_on_gpu(tower.device, options.spec.device),
            batch_size=options.batch_size,
            precision=options.precision,
            accelerator=options.accelerator,
            tune_queries=tune_on,  # an approximate index is tuned on what it will be asked
            show_progress=show_progress,
            tune_k=tuning_k(k, options.spec.tune_k),  # and at the k it will be searched at
        )
        if options.save_dir is not None and (
            options.accelerator is None or options.accelerator.is_main_process
        ):
            index.save(options.save_dir)
        timings["embed_seconds"] = time.perf_counter() - start
    else:
        warn_if_tuned_below(index, k)
    start = time.perf_counter()
    retrieved = search_index(index, queries, k) if questions else Retrieved([], [])
    timings["retrieve_seconds"] = encoding + time.perf_counter() - start
    return retrieved


def tuning_k(k: int, tune_k: int = TUNE_K) -> int:
    """The recall@k an index built for an evaluation that retrieves `k` passages is tuned for: `k` itself, so
    the recall@k reported is what exact search would give, and never below `tune_k` (the spec's)."""
    return max(k, tune_k)


def warn_if_tuned_below(index, k: int) -> None:
    """Warn when a prebuilt `index`'s search was tuned for a recall@k' below the `k` it is about to be searched
    at: its recall@k may fall short of exact search's by more than the target allowed at k'. Not when the
    search parameter was set over the tuned one (--nprobe, --ef-search): the user chose it."""
    tuning = getattr(index, "tuning", None) or {}
    tuned = tuning.get("k")
    kept = tuning and index.search_params.get(tuning["parameter"]) == tuning["value"]
    if kept and tuned < k:
        warnings.warn(
            f"the index was tuned for recall@{tuned} ({index.tuning['parameter']}={index.tuning['value']}) and "
            f"is searched at k = {k}: recall@{k} may fall below exact search's; rebuild it with `rlm index "
            f"--tune-k {k}`, or pass a larger --nprobe / --ef-search",
            stacklevel=2,
        )


def _every_question(queries: np.ndarray, procs) -> np.ndarray:
    """Every process's query embeddings, in question order: the main process tunes the index it builds on all the
    questions evaluated, as one process alone would, not on its own share."""
    if procs.world == 1:
        return queries
    return np.concatenate(procs.gather_object([queries]))


@dataclass
class IndexOptions:
    """How `run_evaluation` embeds and indexes a corpus it is given no index for (`index_corpus`): the folder
    of the float16 shards (None: a temporary one), the index (`IndexSpec`: the one default every command
    shares), passages per forward, the precision of the passage tower ("auto": bf16 on a CUDA GPU), the
    accelerate state whose processes share the work, and a folder to save the index in."""

    embeddings_dir: str | os.PathLike | None = None
    spec: IndexSpec = field(default_factory=IndexSpec)
    batch_size: int = 64
    precision: str = "auto"
    accelerator: object | None = None
    save_dir: str | os.PathLike | None = None  # where the main process saves the index built (None: nowhere)

    def processes(self):
        """`accelerator`'s processes (`rlm.retriever.distributed.Processes`), or one process alone."""
        from rlm.retriever.distributed import Processes

        return Processes.of(self.accelerator)


@dataclass
class _Reading:
    """What the reader answered: (answer, reader probability) per question, the passage ids it read when the
    gold passages were swapped in (else None: it read the retrieved top, or nothing), and the decisions."""

    answered: list[tuple[str, float]]
    read_ids: list | None
    decisions: list

    @property
    def predictions(self) -> list[str]:
        return [answer for answer, _ in self.answered]

    def gathered(self, procs) -> _Reading:
        """Every process's readings, in process order."""
        read_ids = None if self.read_ids is None else procs.gather_object(self.read_ids)
        return _Reading(procs.gather_object(self.answered), read_ids, procs.gather_object(self.decisions))


def _read_for_evaluation(
    reader,
    examples,
    corpus,
    retrieved,
    num_passages: int,
    gold_passages: bool,
    policy,
    timings,
    **read_options,
) -> _Reading:
    """Read every question (`read_options`: `read`'s batch_size, num_beams and show_progress) and apply the
    answer policy; the reading's seconds go into `timings`."""
    start = time.perf_counter()
    read_ids = with_gold_passages(examples, retrieved, num_passages) if gold_passages else None
    answered = read(
        reader,
        examples,
        corpus,
        retrieved,
        num_passages,
        passage_ids=read_ids,
        with_confidence=True,
        **read_options,
    )
    timings["read_seconds"] = time.perf_counter() - start
    questions = [ex.question for ex in examples]
    decisions = decide_all(answered, questions, retrieved, corpus, num_passages, policy, read_ids is None)
    return _Reading(answered, read_ids, decisions)


def _reading_scores(reading: _Reading, examples, reader_passages: int) -> dict[str, float]:
    """EM/F1 at full coverage, the selective scores, and how many passages the reader read."""
    predictions = reading.predictions
    return {
        **evaluate_reader(predictions, examples),
        **selective_scores(predictions, examples, reading.decisions),
        "reader_passages": reader_passages,
    }


def _evaluation_record(ex: QAExample, i: int, reading: _Reading | None, retrieved: Retrieved | None) -> dict:
    """Question `i`'s line of predictions.jsonl."""
    record = {"id": ex.id, "question": ex.question, "answers": ex.answers}
    if reading is not None:
        prediction, probability = reading.answered[i]
        decision = reading.decisions[i]
        record["prediction"] = prediction
        record["exact_match"] = evaluate_reader([prediction], [ex])["exact_match"]
        record["reader_probability"] = round(probability, 5)
        record["confidence"] = round(decision.confidence, 5)
        record["abstained"] = decision.abstained
        if decision.reason:
            record["reason"] = decision.reason
        if reading.read_ids is not None:
            record["read_ids"] = list(reading.read_ids[i])
    if retrieved is not None:
        record["retrieved_ids"] = retrieved.ids[i]
        record["retrieved_scores"] = [round(s, 5) for s in retrieved.scores[i]]
    if ex.gold_passage_ids:
        record["gold_passage_ids"] = ex.gold_passage_ids
    if ex.meta:
        record["meta"] = ex.meta
    return record


def _evaluation_mode(closed_book: bool, gold_passages: bool, retriever, reader) -> str:
    if closed_book:
        return "closed_book"
    if gold_passages:
        return "gold_passages" if retriever is None else "retrieve+gold_swapped_in"
    return "retrieval_only" if reader is None else "retrieve+read"


def _write_evaluation(result: EvaluationResult, out_dir: str | os.PathLike) -> None:
    """predictions.jsonl and metrics.json into `out_dir`, atomically; their paths are set on `result`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.predictions_path, result.metrics_path = out / "predictions.jsonl", out / "metrics.json"
    atomic_write_text(
        result.predictions_path,
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.records),
    )
    atomic_write_text(
        result.metrics_path,
        json.dumps({"mode": result.mode, "data": result.data, **result.metrics}, indent=2) + "\n",
    )


def _described(data: dict | None, corpus) -> dict:
    """What the questions are (`data`) and which corpus, or edition of one after corpus updates, answered."""
    data = dict(data or {})
    if getattr(corpus, "fingerprint", None):
        data["corpus"] = {"passages": len(corpus), "fingerprint": corpus.fingerprint}
    return data


def run_evaluation(
    examples: Sequence[QAExample],
    corpus=None,
    retriever=None,
    reader=None,
    index=None,
    k: int = 100,
    num_passages: int = 10,
    closed_book: bool = False,
    gold_passages: bool = False,
    batch_size: int = 16,
    num_beams: int = 1,
    out_dir: str | os.PathLike | None = None,
    show_progress: bool = False,
    policy=None,
    index_options: IndexOptions | None = None,
    data: dict | None = None,
) -> EvaluationResult:
    """Retrieve (unless closed book), read (when a reader is given), score, and write the results.

    Modes: full (retriever + reader), retrieval-only (no reader), closed book (no passages), gold passages (the
    gold passages swapped into the top `num_passages`, `with_gold_passages`, or alone without a retriever).
    `index` is reused when given, else the corpus is embedded and indexed as `index_options` says. With
    `out_dir`: `predictions.jsonl` and `metrics.json`, atomically. Data-parallel when `index_options.accelerator`
    has several processes: each answers and scores its share, gathered once; only the main one writes.

    Each prediction records its `confidence` and whether it was `abstained`: with `policy` (the checkpoint's
    `AnswerPolicy`) the calibrated P(correct) and the policy's verdict, else the reader's own probability.
    `exact_match` is EM at full coverage; `coverage` the share answered, `answered_exact_match` their EM.
    `data` says what the questions are (`QASplit.record()`: dataset, split, size), written to metrics.json.
    """
    _check_evaluation_mode(reader, retriever, corpus, closed_book, gold_passages)
    options = index_options or IndexOptions()
    procs = options.processes()
    mine = list(examples[slice(*procs.part(len(examples)))])
    timings: dict[str, float] = {}
    metrics: dict[str, float] = {"num_questions": len(examples)}
    retrieved = reading = None  # this process's share of the questions
    if not closed_book and retriever is not None:
        questions = [ex.question for ex in mine]
        retrieved = _retrieve_for_evaluation(
            questions, corpus, retriever, index, k, options, show_progress, timings
        )
    if reader is not None:
        read_options = {"batch_size": batch_size, "num_beams": num_beams, "show_progress": show_progress}
        reading = _read_for_evaluation(
            reader, mine, corpus, retrieved, num_passages, gold_passages, policy, timings, **read_options
        )
    records = _scored_shares(
        procs, examples, mine, corpus, retrieved, reading, k, 0 if closed_book else num_passages, metrics
    )
    # Timings last: metrics.json and the printed table list the scores first. Each the slowest process's.
    for key, value in timings.items():
        metrics[key] = round(max(procs.gather_object([value])), 2)
    mode = _evaluation_mode(closed_book, gold_passages, retriever, reader)
    result = EvaluationResult(metrics=metrics, mode=mode, records=records, data=_described(data, corpus))
    if out_dir is not None and procs.rank == 0:
        _write_evaluation(result, out_dir)
    procs.barrier()  # the files are written before any process goes on
    return result


def _scored_shares(
    procs, examples, mine, corpus, retrieved, reading, k: int, passages_read: int, metrics: dict
):
    """Every process's records, gathered, with the recall and reading scores added to `metrics`. Each question is
    scored by the process that answered it (`mine`): its passages' texts are read for recall once, and what is
    gathered is their ranks and the records, not the retrieved lists for every process to score again."""
    records = procs.gather_object(
        [_evaluation_record(ex, i, reading, retrieved) for i, ex in enumerate(mine)]
    )
    if retrieved is not None:
        hits = procs.gather_object(retrieval_hits(corpus, mine, retrieved))
        metrics.update(recall_from_hits(hits, examples, [kk for kk in RECALL_KS if kk <= k]))
    if reading is not None:
        metrics.update(_reading_scores(reading.gathered(procs), examples, passages_read))
    return records


def format_table(metrics: dict[str, float], title: str | None = None) -> str:
    """A two-column markdown table of the metrics (fractions shown as percentages)."""
    lines = [f"**{title}**", ""] if title else []
    lines += ["| metric | value |", "| --- | --- |"]
    for key, value in metrics.items():
        if key.startswith(("recall@", "gold_recall@")) or key in (
            "exact_match",
            "f1",
            "coverage",
            "answered_exact_match",
        ):
            shown = f"{100 * value:.1f}"
        elif isinstance(value, float):
            shown = f"{value:g}"
        else:
            shown = str(value)
        lines.append(f"| {key} | {shown} |")
    return "\n".join(lines)
