"""Evaluation of a trained checkpoint: embed the corpus with the passage tower, retrieve with a faiss index,
read with the FiD reader, score EM/F1 and recall@k, and write predictions and metrics.

The pieces are separate functions so that the trainer's validation, the hard-subcorpus tracker and the
`rlm evaluate` command share them: `load_checkpoint`, `embed_corpus`, `build_index`, `retrieve`,
`retrieval_metrics`, `read`, `evaluate_reader`, `run_evaluation` (all of it) and `format_table`.

Where it runs: `load_checkpoint` puts the towers and the reader on a device (`inference_device`: the
accelerator when there is one), every entry point after it follows their device, and a faiss index built for
models on a GPU goes to the GPU when faiss sees one (`index_on_gpu`). `inference_bf16` and `autocast` turn on
bfloat16 autocast for the towers and the reader where it pays (an accelerator, or a CPU with native bf16).

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

import numpy as np
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


def index_on_gpu(device) -> bool | None:
    """`use_gpu` of a faiss index serving models on `device`: on a GPU when they are on one and faiss sees one
    (None: faiss-cpu keeps it on the host), on the host otherwise (`--device cpu` keeps faiss off the GPU)."""
    return None if inference_device(device).type == "cuda" else False


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


def embed_corpus(
    passage_tower, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False
) -> np.ndarray:
    """Passage embeddings [N, D] float32 with the (trained) passage tower."""
    return passage_tower.encode(texts, batch_size=batch_size, show_progress=show_progress).numpy()


def build_index(
    embeddings: np.ndarray,
    ids: Sequence[str],
    factory: str = "Flat",
    use_gpu: bool | None = None,
    show_progress: bool = False,
):
    """A `retriever.index.PassageIndex` over the embeddings (inner product); `use_gpu`: `index_on_gpu`."""
    from retriever.index import PassageIndex

    # The ids as they are (a corpus's IdSequence stays one blob): no list of every id string.
    return PassageIndex.build(embeddings, ids, factory=factory, use_gpu=use_gpu, show_progress=show_progress)


def load_index_for(
    index_dir: str | os.PathLike,
    corpus_ids: Sequence[str],
    use_gpu: bool | None = None,
    search_params: dict[str, int] | None = None,
    passage_tower=None,
    corpus_fingerprint: str | None = None,
):
    """Load a saved `PassageIndex` and refuse it when its passage ids are not the corpus's, row for row, or
    when it records (built from a buffer: `rlm embed` then `rlm index --buffer`) another encoder than
    `passage_tower` (weights and max length) or another corpus than `corpus_fingerprint`. An index built from
    bare embeddings records neither, and only its ids are compared.
    `use_gpu`: as for `build_index`; `search_params` (e.g. {"nprobe": 64}) over the ones saved with it.
    """
    from retriever.ids import first_mismatch
    from retriever.index import PassageIndex

    index = PassageIndex.load(index_dir, use_gpu=use_gpu, search_params=search_params)
    recorded = index.provenance
    # A tower on the meta device (the device-placement tests load one there) has no weights to hash.
    weighed = passage_tower is not None and not any(p.is_meta for p in passage_tower.parameters())
    tower = passage_tower.fingerprint() if weighed else None
    if tower is not None and recorded.get("encoder_fingerprint") not in (None, tower):
        raise UserError(
            f"index {index_dir} was built from embeddings of another encoder (fingerprint "
            f"{recorded['encoder_fingerprint']}, max length {recorded.get('max_length')}) than this "
            f"checkpoint's passage tower ({tower}, max length {passage_tower.max_length}): embed the corpus "
            "with `rlm embed --encoder <checkpoint>/retriever` and index that"
        )
    if corpus_fingerprint is not None and recorded.get("corpus_fingerprint") not in (
        None,
        corpus_fingerprint,
    ):
        raise UserError(
            f"index {index_dir} was built for corpus {recorded['corpus_fingerprint']}, not this one "
            f"({corpus_fingerprint}); rebuild it for this corpus"
        )
    if index.ntotal != len(corpus_ids):
        raise UserError(
            f"index {index_dir} holds {index.ntotal} passages but the corpus has {len(corpus_ids)}; "
            "rebuild it for this corpus (omit --index)"
        )
    # One bytes comparison when both are IdSequences (a loaded index and a Corpus), not a 21M-string loop.
    mismatch = first_mismatch(index.ids, corpus_ids)
    if mismatch is not None:
        raise UserError(
            f"index {index_dir} row {mismatch} is passage {index.ids[mismatch]!r} but the corpus has "
            f"{corpus_ids[mismatch]!r}; it was built for another corpus"
        )
    return index


def prebuilt_index(index_dir, retriever, corpus, use_gpu: bool | None, search_params: dict[str, int] | None):
    """`load_index_for` a checkpoint's `retriever` and `corpus`: its ids, passage tower and corpus checked."""
    fingerprint = getattr(corpus, "fingerprint", None)  # a subcorpus has none of its own
    return load_index_for(index_dir, corpus.ids, use_gpu, search_params, retriever.passage_tower, fingerprint)


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
    # `encode` hands back host float32 whatever the tower's device and autocast: what faiss takes.
    queries = query_tower.encode(list(questions), batch_size=batch_size, show_progress=show_progress).numpy()
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
    embed_batch_size: int,
    show_progress: bool,
    timings,
) -> Retrieved:
    """The top `k` for every question, embedding the corpus first when no `index` is given; the seconds
    each stage took go into `timings`."""
    start = time.perf_counter()
    if index is None:
        tower = retriever.passage_tower
        embeddings = embed_corpus(tower, corpus.retrieval_texts(), embed_batch_size, show_progress)
        index = build_index(
            embeddings, corpus.ids, use_gpu=index_on_gpu(tower.device), show_progress=show_progress
        )
        timings["embed_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    retrieved = retrieve(retriever.query_tower, index, questions, k, embed_batch_size, show_progress)
    timings["retrieve_seconds"] = time.perf_counter() - start
    return retrieved


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
    embed_batch_size: int = 64,
    num_beams: int = 1,
    out_dir: str | os.PathLike | None = None,
    show_progress: bool = False,
    policy=None,
) -> EvaluationResult:
    """Retrieve (unless closed book), read (when a reader is given), score, and write the results.

    Modes: full (retriever + reader), retrieval-only (reader None: recall only), closed book (reader only,
    no passages), gold passages (the reader reads the top `num_passages` with the gold passages swapped in,
    `with_gold_passages`; or the gold passages alone when no retriever is given). `index` is reused when
    given, else the corpus is embedded with the passage tower (into a faiss index on the GPU when the tower is
    on one, `index_on_gpu`). The models run where they are (`load_checkpoint(device=...)`); `show_progress`:
    progress bars over the corpus, the index, the questions and the reading.
    With `out_dir`, writes `predictions.jsonl` (question, gold answers, prediction, retrieved ids and
    scores) and `metrics.json`, atomically.

    Every reading records each prediction's `confidence` and whether it was `abstained`: with `policy` (the
    checkpoint's `rlm.inference.answer_policy.AnswerPolicy`, applied when retrieving and reading) the calibrated
    P(correct) and the policy's verdict and reason, else the reader's own probability and never abstained.
    `exact_match` is EM at full coverage (every best guess counted); `coverage` is the share answered and
    `answered_exact_match` the EM over the answered questions.
    """
    _check_evaluation_mode(reader, retriever, corpus, closed_book, gold_passages)
    timings: dict[str, float] = {}
    metrics: dict[str, float] = {"num_questions": len(examples)}
    retrieved = reading = None
    if not closed_book and retriever is not None:
        questions = [ex.question for ex in examples]
        retrieved = _retrieve_for_evaluation(
            questions, corpus, retriever, index, k, embed_batch_size, show_progress, timings
        )
        metrics.update(retrieval_metrics(corpus, examples, retrieved, [kk for kk in RECALL_KS if kk <= k]))
    if reader is not None:
        options = {"batch_size": batch_size, "num_beams": num_beams, "show_progress": show_progress}
        reading = _read_for_evaluation(
            reader, examples, corpus, retrieved, num_passages, gold_passages, policy, timings, **options
        )
        metrics.update(_reading_scores(reading, examples, 0 if closed_book else num_passages))
    # Timings last: metrics.json and the printed table list the scores first.
    metrics.update({key: round(value, 2) for key, value in timings.items()})
    records = [_evaluation_record(ex, i, reading, retrieved) for i, ex in enumerate(examples)]
    mode = _evaluation_mode(closed_book, gold_passages, retriever, reader)
    result = EvaluationResult(metrics=metrics, mode=mode, records=records)
    if out_dir is not None:
        _write_evaluation(result, out_dir)
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
