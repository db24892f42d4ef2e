"""Evaluation of a trained checkpoint: retrieve with the query tower from an index of the corpus, read with
the FiD reader, score EM/F1 and recall@k, and write predictions and metrics.

The pieces are separate functions so that the trainer's validation, the hard-subcorpus tracker and the
`rlm evaluate` command share them: `load_checkpoint`, `retrieve`, `retrieval_metrics`, `read`,
`evaluate_reader`, `run_evaluation` (all of it) and `format_table`. Embedding the corpus and its index are
`rlm.inference.indexing`'s.

Where it runs: `load_checkpoint` puts the towers and the reader on a device (`inference_device`: the
accelerator when there is one), every entry point after it follows their device, and a faiss index built for
models on a GPU goes to the GPU when faiss sees one (`rlm.inference.indexing.index_on_gpu`). `inference_bf16`
and `autocast` turn on bfloat16 autocast for the towers and the reader where it pays (an accelerator, or a CPU
with native bf16). Under `accelerate launch` every process evaluates its share of the questions
(`run_evaluation`'s `IndexOptions.accelerator`).

A checkpoint is a folder with `retriever/` (`DualEncoder.save_pretrained`) and `reader/`
(`FiDReader.save_pretrained`); `config.yaml` next to them (written by `rlm train`) supplies how many
passages the reader was trained to read.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from atomicio import atomic_write_text
from rlm.data.qa import QAExample
from rlm.errors import UserError
from rlm.inference.metrics import gold_recall_at_k, qa_scores, recall_at_k

RECALL_KS = (1, 5, 20, 100)


@dataclass
class Retrieved:
    """Top-k per question: passage ids (best first) and their inner-product scores."""

    ids: list[list[str]]
    scores: list[list[float]]

    def part(self, start: int, stop: int) -> Retrieved:
        """Questions [start, stop)."""
        return Retrieved(self.ids[start:stop], self.scores[start:stop])

    def gathered(self, procs) -> Retrieved:
        """Every process's questions, in process order (`retriever.distributed.Processes.gather_object`)."""
        return Retrieved(procs.gather_object(self.ids), procs.gather_object(self.scores))


@dataclass
class EvaluationResult:
    """Metrics (fractions in [0, 1]), per-question records and where they were written."""

    metrics: dict[str, float]
    mode: str = "retrieve+read"
    records: list[dict] = field(default_factory=list)
    predictions_path: Path | None = None
    metrics_path: Path | None = None


def inference_device(device=None):
    """`device` as a torch.device; None: the accelerator (CUDA) when there is one, else the CPU."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def inference_bf16(device, requested: bool, support=None) -> bool:
    """Whether to run the towers and the reader under bf16 autocast on `device` when `requested`.

    On an accelerator, yes. On a CPU only where bf16 is native (AVX512-BF16 or AMX, `rlm.precision`):
    elsewhere it is emulated and many times slower than float32, so the run stays in float32 with a
    `CpuBf16Warning`.
    `support`: the CPU's `Bf16Support` when already known (tests)."""
    from rlm.precision import CpuBf16Warning, cpu_bf16_support

    if not requested or inference_device(device).type != "cpu":
        return requested
    support = support or cpu_bf16_support(probe=False)
    if support.native:
        return True
    warnings.warn(
        f"--bf16 ignored: bf16 is slow on this CPU ({support.describe()}); running in float32",
        CpuBf16Warning,
        stacklevel=2,
    )
    return False


def autocast(device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device`'s type when `enabled`, else nothing (an autocast the caller opened stays)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=inference_device(device).type, dtype=torch.bfloat16)


def load_checkpoint(
    ckpt: str | os.PathLike | None,
    need_reader: bool = True,
    retriever_path: str | None = None,
    need_retriever: bool = True,
    device=None,
):
    """(DualEncoder | None, FiDReader | None, config dict) from a checkpoint folder, the models on `device`
    (None: the accelerator when there is one, `inference_device`).

    `retriever_path` replaces `<ckpt>/retriever` (e.g. the packaged MiniLM, to evaluate the initial
    retriever); `ckpt` may then be None for retrieval-only runs. `need_retriever=False` skips loading it
    (closed-book or gold-passage reading).
    """
    import yaml

    from reader.fid import FiDReader
    from retriever.encoder import DualEncoder

    root = Path(ckpt) if ckpt is not None else None
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {root}")
    config = {}
    if root is not None and (root / "config.yaml").is_file():
        config = yaml.safe_load((root / "config.yaml").read_text()) or {}
    retriever = None
    if need_retriever and retriever_path is not None:
        retriever = DualEncoder.from_pretrained(str(retriever_path))
    elif need_retriever and root is not None:
        if not (root / "retriever").is_dir():
            raise FileNotFoundError(
                f"{root / 'retriever'} not found: a checkpoint holds retriever/ and reader/ "
                "(rlm train writes them); or pass --retriever PATH"
            )
        retriever = DualEncoder.from_pretrained(str(root / "retriever"))
    reader = None
    if need_reader:
        if root is None or not (root / "reader").is_dir():
            raise FileNotFoundError(
                f"{(root or Path('<ckpt>')) / 'reader'} not found: pass a checkpoint with a reader/ folder, "
                "or use --retrieval-only"
            )
        reader = FiDReader.from_pretrained(str(root / "reader"))
    device = inference_device(device)
    for model in (retriever, reader):
        if model is not None:
            model.to(device)
    return retriever, reader, config


def reader_passages_from_config(config: dict, default: int = 10) -> int:
    """How many retrieved passages the reader reads: `reader.num_passages`, else `strategy.k`, else default."""
    reader_cfg = config.get("reader") or {}
    strategy_cfg = config.get("strategy") or {}
    return int(reader_cfg.get("num_passages") or strategy_cfg.get("k") or default)


def retrieve(
    query_tower,
    index,
    questions: Sequence[str],
    k: int = 100,
    batch_size: int = 64,
    show_progress: bool = False,
) -> Retrieved:
    """Top-k passages per question by inner product of the query tower's embeddings with the index."""
    if not questions:
        return Retrieved([], [])
    return search_index(index, encode_questions(query_tower, questions, batch_size, show_progress), k)


def encode_questions(
    query_tower, questions: Sequence[str], batch_size: int = 64, show_progress: bool = False
):
    """The questions' embeddings [Q, D] as host float32, whatever the tower's device and autocast: what faiss
    takes."""
    return query_tower.encode(list(questions), batch_size=batch_size, show_progress=show_progress).numpy()


def search_index(index, queries, k: int) -> Retrieved:
    """Top-k passages per query embedding ([Q, D] float32) from a `retriever.index.PassageIndex`."""
    scores, ids = index.search(queries, k)
    return Retrieved(ids=ids, scores=[row[: len(i)].tolist() for row, i in zip(scores, ids)])


def retrieval_metrics(
    corpus, examples: Sequence[QAExample], retrieved: Retrieved, ks: Sequence[int] = RECALL_KS
) -> dict[str, float]:
    """Answer recall@k (DPR `has_answer` over passage texts) and, where gold ids are known, gold recall@k."""
    texts = [[corpus[corpus.index_of(pid)].text for pid in ids] for ids in retrieved.ids]
    metrics = recall_at_k(texts, [ex.answers for ex in examples], ks)
    metrics.update(gold_recall_at_k(retrieved.ids, [ex.gold_passage_ids for ex in examples], ks))
    return metrics


def with_gold_passages(
    examples: Sequence[QAExample], retrieved: Retrieved | None, num_passages: int
) -> list[list[str]]:
    """Oracle reading lists: each question's top `num_passages` with its gold passages guaranteed among them.

    A gold passage already in the top keeps its rank; a missing one replaces the lowest-ranked non-gold
    passage, so the reader does not see gold at a fixed position. Without retrieval: the gold passages alone.
    """
    out = []
    for i, ex in enumerate(examples):
        if not ex.gold_passage_ids:
            raise UserError(f"question {ex.id} has no gold passage ids; oracle reading needs them")
        gold = list(dict.fromkeys(ex.gold_passage_ids))
        if retrieved is None or num_passages <= len(gold):
            out.append(gold[:num_passages] if retrieved is not None else gold)
            continue
        top, gold_set = list(retrieved.ids[i][:num_passages]), set(gold)
        for pid in gold:
            if pid in top:
                continue
            if len(top) < num_passages:
                top.append(pid)
            else:
                last = max(j for j, other in enumerate(top) if other not in gold_set)
                top[last] = pid
        out.append(top)
    return out


def read(
    reader,
    examples: Sequence[QAExample],
    corpus=None,
    retrieved: Retrieved | None = None,
    num_passages: int = 10,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    num_beams: int = 1,
    passage_ids: Sequence[Sequence[str]] | None = None,
    with_confidence: bool = False,
    show_progress: bool = False,
) -> list[str] | list[tuple[str, float]]:
    """The reader's answers from the top `num_passages` retrieved passages; closed book when `retrieved` is None.

    `passage_ids` (e.g. from `with_gold_passages`) replaces the retrieved lists. `with_confidence`: (answer,
    the reader's probability of it) pairs instead of answers. The reader runs on its own device.
    """
    questions = [ex.question for ex in examples]
    if passage_ids is None:
        passage_ids = [] if retrieved is None else [ids[:num_passages] for ids in retrieved.ids]
    if not passage_ids:
        passages = [[] for _ in examples]
    else:
        passages = [
            [(p.title, p.text) for p in (corpus[corpus.index_of(pid)] for pid in ids)] for ids in passage_ids
        ]
    answer = reader.answer_with_confidence if with_confidence else reader.answer
    step = batch_size or max(len(questions), 1)
    answers = []
    # Batch by batch here rather than in the reader, for a progress bar over a dev set's hours of generation.
    with tqdm(total=len(questions), desc="read", unit="q", disable=not show_progress) as bar:
        for start in range(0, len(questions), step):
            stop = start + step
            answers.extend(
                answer(
                    questions[start:stop],
                    passages[start:stop],
                    max_new_tokens=max_new_tokens,
                    num_beams=num_beams,
                    batch_size=step,
                )
            )
            bar.update(len(questions[start:stop]))
    return answers


def decide_all(
    answered, questions, retrieved, corpus, num_passages: int, policy, retrieved_reading: bool
) -> list:
    """The answer policy's decision on each (answer, reader probability); without a policy, or when what was
    read is not the retrieved top (closed book, gold passages), every answer stands with the reader's own
    probability as its confidence."""
    from rlm.inference.answer_policy import AnswerSignals, Decision

    if policy is None or retrieved is None or not retrieved_reading:
        return [Decision(probability, False, None) for _, probability in answered]
    decisions = []
    for (answer, probability), question, ids, scores in zip(
        answered, questions, retrieved.ids, retrieved.scores
    ):
        read = [corpus[corpus.index_of(pid)] for pid in ids[:num_passages]]
        texts = [f"{p.title} {p.text}" for p in read]
        signals = AnswerSignals.of(answer, probability, scores[:num_passages], texts, question)
        decisions.append(policy.decide(signals))
    return decisions


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
        from rlm.inference.indexing import index_corpus, index_on_gpu

        tower = retriever.passage_tower
        index = index_corpus(
            tower,
            corpus,
            options.embeddings_dir,
            options.factory,
            use_gpu=index_on_gpu(tower.device),
            batch_size=options.batch_size,
            precision=options.precision,
            accelerator=options.accelerator,
            tune_queries=queries,  # an approximate index is tuned on what it will be asked
            show_progress=show_progress,
        )
        if options.save_dir is not None and (
            options.accelerator is None or options.accelerator.is_main_process
        ):
            index.save(options.save_dir)
        timings["embed_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    retrieved = search_index(index, queries, k) if questions else Retrieved([], [])
    timings["retrieve_seconds"] = encoding + time.perf_counter() - start
    return retrieved


@dataclass
class IndexOptions:
    """How `run_evaluation` embeds and indexes a corpus it is given no index for (`index_corpus`): the folder
    of the float16 shards (None: a temporary one), the faiss factory, passages per forward, the precision of
    the passage tower ("auto": bf16 on a CUDA GPU), the accelerate state whose processes share the work, and
    a folder to save the index in."""

    embeddings_dir: str | os.PathLike | None = None
    factory: str = "Flat"
    batch_size: int = 64
    precision: str = "auto"
    accelerator: object | None = None
    save_dir: str | os.PathLike | None = None  # where the main process saves the index built (None: nowhere)

    def processes(self):
        """`accelerator`'s processes (`retriever.distributed.Processes`), or one process alone."""
        from retriever.distributed import Processes

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
        result.metrics_path, json.dumps({"mode": result.mode, **result.metrics}, indent=2) + "\n"
    )


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
) -> EvaluationResult:
    """Retrieve (unless closed book), read (when a reader is given), score, and write the results.

    Modes: full (retriever + reader), retrieval-only (no reader), closed book (no passages), gold passages (the
    gold passages swapped into the top `num_passages`, `with_gold_passages`, or alone without a retriever).
    `index` is reused when given, else the corpus is embedded and indexed as `index_options` says. With
    `out_dir`: `predictions.jsonl` and `metrics.json`, atomically. Data-parallel when
    `index_options.accelerator` has several processes: each retrieves and reads its share of the questions, the
    results are gathered once, every process returns the same metrics and only the main one writes.

    Each prediction records its `confidence` and whether it was `abstained`: with `policy` (the checkpoint's
    `AnswerPolicy`) the calibrated P(correct) and the policy's verdict, else the reader's own probability.
    `exact_match` is EM at full coverage; `coverage` the share answered, `answered_exact_match` their EM.
    """
    _check_evaluation_mode(reader, retriever, corpus, closed_book, gold_passages)
    options = index_options or IndexOptions()
    procs = options.processes()
    mine = list(examples[slice(*procs.part(len(examples)))])
    timings: dict[str, float] = {}
    metrics: dict[str, float] = {"num_questions": len(examples)}
    retrieved = reading = None
    if not closed_book and retriever is not None:
        questions = [ex.question for ex in mine]
        retrieved = _retrieve_for_evaluation(
            questions, corpus, retriever, index, k, options, show_progress, timings
        ).gathered(procs)
        metrics.update(retrieval_metrics(corpus, examples, retrieved, [kk for kk in RECALL_KS if kk <= k]))
    if reader is not None:
        read_options = {"batch_size": batch_size, "num_beams": num_beams, "show_progress": show_progress}
        mine_retrieved = None if retrieved is None else retrieved.part(*procs.part(len(examples)))
        reading = _read_for_evaluation(
            reader, mine, corpus, mine_retrieved, num_passages, gold_passages, policy, timings, **read_options
        ).gathered(procs)
        metrics.update(_reading_scores(reading, examples, 0 if closed_book else num_passages))
    # Timings last: metrics.json and the printed table list the scores first. Each the slowest process's.
    for key, value in timings.items():
        metrics[key] = round(max(procs.gather_object([value])), 2)
    records = [_evaluation_record(ex, i, reading, retrieved) for i, ex in enumerate(examples)]
    mode = _evaluation_mode(closed_book, gold_passages, retriever, reader)
    result = EvaluationResult(metrics=metrics, mode=mode, records=records)
    if out_dir is not None and procs.rank == 0:
        _write_evaluation(result, out_dir)
    procs.barrier()  # the files are written before any process goes on
    return result


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
