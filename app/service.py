"""The demo's answering logic as a plain object: question -> retrieved passages -> FiD answer.

`QAService.from_checkpoint(DIR, corpus_path, ServiceOptions(...))` loads a trained checkpoint (the `final/`
folder of a run: `retriever/`, `reader/`, `config.yaml`) through `rlm.inference.checkpoint` onto a device (the
accelerator when there is one), finds the corpus the run trained on, and embeds it once with the trained
passage tower into a faiss index cached outside the checkpoint (`rlm.cache`). `ServiceOptions` says how: the device and
precision, which index (cached, prebuilt, or over h(B)), the example questions, whether to apply the
checkpoint's answer policy; it refuses a bad value when made, before anything loads.
`QAService.answer(question, k)` answers one question, and `answer_requests` several users' questions in one
pass (what the Gradio page's batching queue calls, `rlm.app.demo.answer_queue`); it has no UI code so it can be
tested (and reused) without a browser.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.errors import UserError
from rlm.inference.answer_policy import AnswerPolicy, AnswerSignals, Decision
from rlm.inference.checkpoint import corpus_from_config
from rlm.inference.index_cache import cached_corrected_index, cached_index
from rlm.inference.indexing import EMBED_LIMIT
from rlm.inference.metrics import has_answer
from rlm.retriever.index_spec import IndexSpec

if TYPE_CHECKING:  # torch, transformers and faiss load with the checkpoint, not with this module
    from rlm.data.corpus import Corpus
    from rlm.reader.fid import FiDReader
    from rlm.retriever.encoder import DualEncoder
    from rlm.retriever.index import PassageIndex

MAX_QUESTION_CHARS = 300
MAX_K = 20


class InvalidQuestion(ValueError):
    """A question the demo refuses (empty or too long); the message is meant for the user."""


@dataclass(frozen=True)
class ServiceOptions:
    """How `QAService.from_checkpoint` loads a checkpoint and indexes its corpus (`rlm demo`'s option in
    brackets). Made with a bad value or a combination that cannot run, it raises `UserError` at once."""

    # Where the towers, the reader and the corrector run (--device; None: the accelerator when there is one).
    device: str | None = None
    # Answer (and embed the corpus) under bf16 autocast where it pays (--bf16; `rlm.inference.device`).
    bf16: bool = False
    # A prebuilt index of the corpus under the trained passage tower (--index; `rlm embed` then `rlm index`),
    # instead of the one embedded here and cached (`cache_dir`).
    index_path: str | os.PathLike | None = None
    # The index built here (--factory, --target-recall, --tune-k, --nprobe, --ef-search; the one default all
    # commands share): its type and search. With `index_path`, its fixed search parameters override the saved ones.
    index_spec: IndexSpec = field(default_factory=IndexSpec)
    # Retrieve over h(B), the run's fixed buffer through its trained corrector (--corrected-buffer), the buffer
    # at `buffer_path` (--buffer; None: the one its config names).
    corrected_buffer: bool = False
    buffer_path: str | os.PathLike | None = None
    # The page's example questions: the first `num_examples` of `examples_path` (--examples; None: dev.jsonl
    # beside the corpus).
    examples_path: str | os.PathLike | None = None
    num_examples: int = 8
    # False ignores the checkpoint's answer policy (what `rlm calibrate` does before it fits a new one).
    load_policy: bool = True
    show_progress: bool = False  # (--no-progress turns it off)
    # Where the corpus's fingerprint and scan and the index embedded here are kept between starts (--cache-dir;
    # None: `rlm.cache.cache_dir()`, never the checkpoint, which stays as training wrote it).
    cache_dir: str | os.PathLike | None = None
    # Above this many passages the corpus is not embedded here (--embed-limit; 0: no limit): it needs an index
    # built once (`rlm.inference.indexing.check_embed_limit` names the commands).
    embed_limit: int = EMBED_LIMIT
    # The buffer a prebuilt index re-scores its candidates from, when it is not where the index finds it
    # (--rescore-buffer; None: as its index.json records).
    rescore_buffer: str | os.PathLike | None = None
    # With `index_path`: every this many seconds, look for a corpus update of the index (`rlm corpus update` on
    # this machine) and serve it without a restart (--follow-updates; 0: never).
    follow_updates_s: float = 2.0

    def __post_init__(self) -> None:
        if self.index_path is not None and self.corrected_buffer:
            raise UserError("--index and --corrected-buffer exclude each other: pick one index")
        if self.buffer_path is not None and not self.corrected_buffer:
            raise UserError("--buffer only goes with --corrected-buffer")
        built = ["--" + name.replace("_", "-") for name in self.index_spec.build_settings_changed()]
        if built and self.index_path is not None:
            raise UserError(f"{', '.join(built)} build an index: they go without --index")
        if self.index_spec.rescore:
            raise UserError(
                "the demo builds its index from a temporary folder: re-score with a prebuilt index "
                "(`rlm index --buffer DIR --rescore K`, then --index)"
            )
        if self.rescore_buffer is not None and self.index_path is None:
            raise UserError(
                "--rescore-buffer goes with --index (a prebuilt index that re-scores its candidates)"
            )
        if not isinstance(self.embed_limit, int) or self.embed_limit < 0:
            raise UserError(f"--embed-limit is a number of passages (0: no limit), got {self.embed_limit!r}")
        if not isinstance(self.num_examples, int) or self.num_examples < 0:
            raise UserError(f"num_examples must be a whole number >= 0, got {self.num_examples!r}")
        if self.device is not None:
            from rlm.inference.device import inference_device

            inference_device(self.device)  # a device torch does not know is refused before anything loads


def _prebuilt(options: ServiceOptions, retriever, corpus, use_gpu: bool | None):
    """(the prebuilt index `options` name, checked against the checkpoint and corpus; the corpus it answers
    from: `corpus`, with the corpus updates the index holds, if any)."""
    from rlm.inference import indexing

    spec = options.index_spec
    index = indexing.prebuilt_index(
        options.index_path, retriever, corpus, use_gpu, spec.search_params, options.rescore_buffer
    )
    return index, indexing.served_corpus(index, corpus, options.index_path)


@dataclass
class QAService:
    """Retrieve with the trained towers and a faiss index, read with the FiD reader."""

    retriever: DualEncoder
    reader: FiDReader
    corpus: Corpus
    index: PassageIndex  # over the corpus, same row order
    default_k: int = 4
    max_k: int = MAX_K
    max_question_chars: int = MAX_QUESTION_CHARS
    examples: list[str] = field(default_factory=list)
    # The checkpoint's calibrated confidence and abstention rule (`rlm calibrate`); None: uncalibrated, every
    # question is answered and `confidence` is the reader's own probability.
    policy: AnswerPolicy | None = None
    # The towers and the reader answer under bf16 autocast (`rlm.inference.device.inference_bf16`).
    bf16: bool = False
    # The fingerprint of the corpus (or edition of one, after corpus updates) `index` and `corpus` serve.
    edition: str = ""
    _serving: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | os.PathLike,
        corpus_path: str | os.PathLike | None = None,
        options: ServiceOptions | None = None,
    ) -> QAService:
        """Load reader + retriever from `checkpoint` (`rlm.inference.checkpoint.load_checkpoint`) onto
        `options.device`, the corpus from `corpus_path` or the run's config, and its index as `options` say.

        The faiss index is read from `<cache>/demo_index/<key>` when present (`options.cache_dir`, or
        `rlm.cache.cache_dir()`), else built and saved there atomically; the key hashes the passage tower's and the
        corpus's fingerprints (the corpus's remembered in the same cache by the file's path and stamp, so a
        restart neither hashes nor parses it again). A corpus above `options.embed_limit` passages is refused
        unless its index is cached. `options.index_path` uses a prebuilt index instead (`rlm embed --encoder
        <checkpoint>/retriever` then `rlm index`: the way for a corpus too large to embed here), refused unless
        built for this corpus under this passage tower. `options.corrected_buffer` retrieves over h(B) instead:
        nothing is re-embedded (`rlm.inference.corrected_index`); that index is cached in `demo_index/` too.
        Nothing is written into the checkpoint.
        The index is on the GPU when the models are and faiss sees one (`rlm.inference.device.index_on_gpu`).
        """
        import rlm.inference.checkpoint  # by module: the loading can be watched (scripts/bench/bench_demo_scale.py)
        from rlm.cache import cache_dir
        from rlm.inference.device import index_on_gpu, inference_bf16, inference_device

        options = options or ServiceOptions()
        root = _checkpoint_folder(checkpoint)
        cache = cache_dir(options.cache_dir)
        device = inference_device(options.device)
        bf16 = inference_bf16(device, options.bf16)
        retriever, reader, config = rlm.inference.checkpoint.load_checkpoint(root, device=device)
        corpus_file, corpus = _checkpoint_corpus(root, config, corpus_path, cache)
        retriever.eval()
        reader.eval()
        progress = options.show_progress
        spec = options.index_spec
        if options.index_path is not None:
            index, corpus = _prebuilt(options, retriever, corpus, index_on_gpu(device, spec.device))
        elif options.corrected_buffer:
            index = cached_corrected_index(root, corpus, options.buffer_path, device, progress, cache, spec)
        else:
            limit, tower = options.embed_limit, retriever.passage_tower
            index = cached_index(cache, tower, corpus, progress, bf16, limit, checkpoint=root, spec=spec)
        examples = options.examples_path
        examples_file = Path(examples) if examples else corpus_file.parent / "dev.jsonl"
        service = cls(
            retriever,
            reader,
            corpus,
            index,
            default_k=min(rlm.inference.checkpoint.reader_passages_from_config(config, default=4), MAX_K),
            examples=example_questions(examples_file, options.num_examples),
            policy=AnswerPolicy.load(root) if options.load_policy else None,
            bf16=bf16,
            edition=getattr(corpus, "fingerprint", "") or "",
        )
        service.warm_up()
        if options.index_path is not None and options.follow_updates_s:
            UpdateFollower(service, options, index_on_gpu(device, spec.device), _base_corpus(corpus)).start()
        return service

    def serving(self) -> tuple[PassageIndex, Corpus, str]:
        """(index, corpus, edition) as one: an answer takes all three at its start and finishes on them, whatever
        update is taken meanwhile."""
        with self._serving:
            return self.index, self.corpus, self.edition

    def take_update(self, index: PassageIndex, corpus, edition: str) -> None:
        """Serve `index` over `corpus` (a new edition of the corpus) from the next question on."""
        with self._serving:
            self.index, self.corpus, self.edition = index, corpus, edition

    def check_question(self, question: str | None) -> str:
        """The stripped question, or InvalidQuestion with a message for the user."""
        text = (question or "").strip()
        if not text:
            raise InvalidQuestion("Type a question first.")
        if len(text) > self.max_question_chars:
            raise InvalidQuestion(
                f"The question is {len(text)} characters long; the limit is {self.max_question_chars}."
            )
        return text

    def clamp_k(self, k: int | float | None) -> int:
        """`k` within [1, max_k] (and the corpus size); the default when None or 0."""
        return max(1, min(int(k or self.default_k), self.max_k, self.index.ntotal))

    def answer(self, question: str, k: int | None = None, best_guess: bool = False) -> dict:
        """Answer one question from its top-k passages, or abstain when the corpus does not answer it.

        Returns {"question", "answer", "confidence", "abstained", "reason", "calibrated", "reader_probability",
        "k", "latency_ms", "batch_size", "passages": [{"id", "title", "text", "score", "has_answer"}]}, passages
        best first (`latency_ms` is the pass's, which answered `batch_size` questions).
        With the checkpoint's answer policy (`rlm calibrate`), `confidence` is the estimated probability that
        the answer is right and `abstained` is true (with `reason` in plain words, and `answer` empty) when the
        corpus does not answer the question; without one, `confidence` is the reader's own probability of its
        answer and nothing is abstained (`calibrated` false). `best_guess=True` adds "best_guess": the reader's
        answer whether or not it was abstained. Raises InvalidQuestion for empty or oversized input.
        """
        return self.answer_many([question], k, best_guess=best_guess)[0]

    def answer_many(self, questions: list[str], k: int | None = None, best_guess: bool = False) -> list[dict]:
        """`answer` for several questions in one batched pass (one query encoding, one faiss search, one
        FiD generation); `latency_ms` is the batch's. Raises InvalidQuestion if any question is refused."""
        return [result for result, _ in self.answer_with_signals(questions, k, best_guess)]

    def answer_requests(
        self, requests: Sequence[tuple[str, int | None]], best_guess: bool = False
    ) -> list[dict | Exception]:
        """Results for (question, k) requests that may ask for different k, in request order: one `answer_many`
        per distinct k (after `clamp_k`). A refused question gets its `InvalidQuestion` in its place, and the
        others are answered as if it had not been sent. What the demo's batching queue runs
        (`rlm.app.demo.answer_queue`), so questions from several users are answered in one pass."""
        results: list[dict | Exception | None] = [None] * len(requests)
        by_k: dict[int, list[int]] = {}
        for i, (question, k) in enumerate(requests):
            try:
                self.check_question(question)
            except InvalidQuestion as err:
                results[i] = err
                continue
            by_k.setdefault(self.clamp_k(k), []).append(i)
        for k, members in by_k.items():
            for i, result in zip(members, self.answer_many([requests[i][0] for i in members], k, best_guess)):
                results[i] = result
        return results

    def answer_with_signals(
        self, questions: list[str], k: int | None = None, best_guess: bool = False
    ) -> list[tuple[dict, AnswerSignals]]:
        """`answer_many`, each result with the unrounded signals the policy decided on (what `rlm calibrate`
        fits the policy to, so it is fitted on exactly what it will be applied to)."""
        import torch

        from rlm.inference.device import autocast

        texts = [self.check_question(q) for q in questions]
        k = self.clamp_k(k)
        index, corpus, edition = self.serving()
        start = time.perf_counter()
        # no_grad, not inference_mode: under inference_mode autocast keeps no cache of its bf16 weight copies and
        # casts the weights again at each decoder step (a T5-base's decoder and LM head: 138M, per answer token).
        with torch.no_grad(), autocast(self.reader.device, self.bf16):
            # `encode` hands back host float32 whatever the tower's device: what faiss takes.
            queries = self.retriever.query_tower.encode(texts).numpy()
            # Index row r is corpus row r (checked when the index was loaded): no id lookups.
            scores, rows = index.search_rows(queries, k)
            passages = [[corpus[int(r)] for r in row if r >= 0] for row in rows]
            answers = self.reader.answer_with_confidence(
                texts, [[(p.title, p.text) for p in row] for row in passages]
            )
        latency_ms = round((time.perf_counter() - start) * 1000, 1)
        results = []
        for text, (answer, probability), row, row_scores in zip(texts, answers, passages, scores):
            row_scores = [float(s) for s in row_scores[: len(row)]]
            signals = AnswerSignals.of(
                answer, probability, row_scores, [f"{p.title} {p.text}" for p in row], text
            )
            decision = self.decide(signals)
            shown = "" if decision.abstained else answer
            result = {
                "question": text,
                "answer": shown,
                "confidence": round(decision.confidence, 4),
                "abstained": decision.abstained,
                "reason": decision.reason,
                "calibrated": self.policy is not None,
                "reader_probability": round(probability, 4),
                "k": k,
                "latency_ms": latency_ms,
                "batch_size": len(texts),  # the questions answered in this pass, this one among them
                "corpus_edition": edition,
                "passages": [
                    {
                        "id": p.id,
                        "title": p.title,
                        "text": p.text,
                        "score": round(score, 4),
                        "has_answer": bool(shown.strip()) and has_answer(f"{p.title} {p.text}", shown),
                    }
                    for p, score in zip(row, row_scores)
                ],
            }
            if best_guess:
                result["best_guess"] = answer
            results.append((result, signals))
        return results

    def decide(self, signals: AnswerSignals) -> Decision:
        """The checkpoint's policy on one answer; without one, answer with the reader's own probability."""
        if self.policy is None:
            return Decision(signals.reader_probability, False, None)
        return self.policy.decide(signals)

    def warm_up(self) -> None:
        """Answer one question so the first user does not pay for lazy initialisation (about a second)."""
        self.answer(self.examples[0] if self.examples else "warm up", self.default_k)


def _base_corpus(corpus):
    """The corpus file an index's corpus updates start from: `corpus` itself, or an edition's base."""
    return getattr(corpus, "base", corpus)


class UpdateFollower(threading.Thread):
    """Looks at a prebuilt index's index.json every `options.follow_updates_s` seconds; when a corpus update
    (`rlm corpus update`) has made a new generation, loads it and its corpus edition, checked as at start, and
    hands both to the service (`QAService.take_update`). Questions in flight finish on the edition they began
    on; one that fails to load is reported and the service keeps the edition it has."""

    def __init__(self, service: QAService, options: ServiceOptions, use_gpu: bool | None, base):
        super().__init__(daemon=True, name="index-update-follower")
        self.service, self.options, self.use_gpu, self.base = service, options, use_gpu, base
        self.seen = None
        self.seen = self.generation()

    def generation(self) -> object:
        meta = Path(self.options.index_path) / "index.json"
        try:
            return json.loads(meta.read_text()).get("generation", 0)
        except (OSError, ValueError):  # between a rename and the next read: looked at again next time
            return self.seen

    def run(self) -> None:
        while True:
            time.sleep(self.options.follow_updates_s)
            now = self.generation()
            if now == self.seen:
                continue
            self.seen = now
            try:
                index, corpus = _prebuilt(self.options, self.service.retriever, self.base, self.use_gpu)
            except Exception as err:  # a refused or unreadable update: keep serving what was served
                print(f"warning: corpus update of {self.options.index_path} not taken: {err}", flush=True)
                continue
            self.service.take_update(index, corpus, getattr(corpus, "fingerprint", "") or "")
            print(f"serving corpus edition {self.service.edition} ({len(corpus):,} passages)", flush=True)


def _checkpoint_folder(checkpoint: str | os.PathLike) -> Path:
    root = Path(checkpoint)
    if not root.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {root} not found: pass the final/ folder of a training run "
            "(e.g. runs/quickstart/final; `rlm quickstart --no-serve` makes one)"
        )
    return root


def _checkpoint_corpus(
    root: Path, config: dict, corpus_path: str | os.PathLike | None, cache: Path
) -> tuple[Path, Corpus]:
    """(corpus file, corpus): `corpus_path`, else the corpus the run trained on; its fingerprint and scan
    remembered in the `cache` folder."""
    from rlm.cache import corpus_fingerprint_cache
    from rlm.data.corpus import load_corpus

    corpus_file = Path(corpus_path) if corpus_path else corpus_from_config(config, root)
    if not corpus_file.is_file():
        raise FileNotFoundError(f"corpus file {corpus_file} not found: pass --corpus PATH")
    return corpus_file, load_corpus(corpus_file, fingerprint_cache=corpus_fingerprint_cache(cache))


def example_questions(path: Path, limit: int) -> list[str]:
    """The first `limit` questions of a QA JSONL file (the dev split next to the corpus); [] when absent."""
    from rlm.data.qa import read_qa_jsonl

    if limit <= 0 or not path.is_file():
        return []
    return [ex.question for ex in read_qa_jsonl(path)[:limit]]
