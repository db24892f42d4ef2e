"""The demo at scale (issue 39): what `rlm demo --index` costs over 1M passages and more, and what it would cost
over DPR's 21M: resident memory, start-up time, the latency of an answer alone and at 20 concurrent.

Built once in `--work` (reused by later runs): a corpus of N passages of 100 words each (DPR's passage length),
`{id, title, text}` JSONL whose texts recombine the sentences of `--sentences` (any corpus file: the toy world,
or real Wikipedia passages), and a faiss index over it as `rlm index` writes one (`PassageIndex.from_buffer`,
tuned for the default recall, saved with the checkpoint's passage-tower fingerprint), whose rows are SYNTHETIC
unit vectors of the passage tower's dimension (`lab.benchmarking.clustered`: clusters of 200 rows),
not embeddings of the texts: the answers are meaningless, what is measured is memory and time.

Measured: the service started as `rlm demo --checkpoint C --corpus X --index I` starts it (one torch thread,
`QAService.from_checkpoint(C, X, ServiceOptions(index_path=I, ...))`) in a fresh process, twice: a first start
(no corpus fingerprint remembered beside the checkpoint: the scan also hashes the file) and a second (the
fingerprint cached), each `--repeats` times (the fastest reported). The checkpoint is copied into the work
folder first, so its own folder is not written to.
Start-up runs from before the interpreter starts to the service ready (warm-up answer included); its phases are
timed by wrapping the library functions the service calls (models, corpus scan, index read, index checks,
warm-up). Resident memory after start and its peak, with what grows with N: the corpus's offset/id arrays and
the index (its file size, its ids). Latency p50/p95 of index search alone, retrieval (query encoding, search,
passage reads) and `answer`: alone, from 20 threads at once, and for 20 users served as the Gradio page serves
them (its batching queue, `rlm.app.demo.answer_queue`: one pass at a time, up to 8 questions in it). Then the search
parameter is swept (nprobe or efSearch), and each figure is projected to 21M passages.

    python scripts/bench/bench_demo_scale.py --sentences ../shared/data/wiki_sample/passages.jsonl  # N = 1M
    python scripts/bench/bench_demo_scale.py --quick                  # N = 5,000 and a few questions (a minute)
    python scripts/bench/bench_demo_scale.py --render scripts/bench/reports/demo_scale_rescore/demo_scale.json

`--checkpoint` is the `final/` folder of a run (`rlm quickstart --no-serve` makes runs/quickstart/final).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from lab import reporting
from lab.benchmarking import latency_ms, peak_rss_mb

TARGET_N = 21_015_324  # DPR's psgs_w100.tsv
GOAL_P50_MS = 100.0
WORDS = 100  # DPR's passages are 100 words
CONCURRENT = 20
# IVF lists for `{nlist}`: N / 1,000 rounded to a power of two, as scripts/bench/bench_index.py.
ROWS_PER_LIST = 1_000
CLUSTER = 200  # synthetic rows per cluster: more than tune's k=100, so a row's top-100 are its cluster's
DEFAULT_CHECKPOINT = "runs/quickstart/final"  # what `rlm quickstart` / `make demo` leaves
DEFAULT_OUT = reporting.RESULTS / "demo_scale"
MB = 2**20
LATENCY_KINDS = ("search", "retrieval", "answer")
# What the last start measures of the running service (the others measure only their start).
SERVING_KEYS = ("latency", "sweep_parameter", "sweep", "quantizer_p50_ms", "faiss_omp_threads", "demo_queue")
# How many questions each measurement asks: (alone, per thread of the 20); quick runs ask a handful.
COUNTS = {
    "full": {"search": (200, 20), "retrieval": (100, 10), "answer": (50, 5), "sweep": 100},
    "quick": {"search": (20, 2), "retrieval": (10, 1), "answer": (5, 1), "sweep": 10},
}


# ---- the corpus and the index, built once in the work folder ------------------------------------------------


def nlist_for(n: int) -> int:
    """IVF lists for n rows: n / 1,000 rounded to a power of two (at least 4), as scripts/bench/bench_index.py."""
    return max(4, 2 ** round(math.log2(max(1, n / ROWS_PER_LIST))))


def source_sentences(path: Path) -> tuple[list[list[str]], list[str]]:
    """(each sentence's words, the title of the passage it came from) of every passage of the corpus `path`."""
    from rlm.data.corpus import load_corpus

    sentences, titles = [], []
    for passage in load_corpus(path):
        for sentence in re.split(r"(?<=[.!?])\s+", passage.text):
            if words := sentence.split():
                sentences.append(words)
                titles.append(passage.title)
    if not sentences:
        raise SystemExit(f"error: {path} has no sentences to build passages from")
    return sentences, titles


def build_corpus(work: Path, n: int, sentences_file: Path, seed: int = 0) -> dict:
    """`work/corpus-<n>-<source>.jsonl`: n passages `{id: "0".., title, text}` of WORDS words each, sentences of
    `sentences_file` drawn at random (the title is the first sentence's passage's); reused when present."""
    tag = hashlib.sha256(f"{sentences_file.resolve()}:{seed}".encode()).hexdigest()[:8]
    path = work / f"corpus-{n}-{tag}.jsonl"
    meta_file = path.with_suffix(".meta.json")
    if path.is_file() and meta_file.is_file():
        return {**json.loads(meta_file.read_text()), "reused": True}
    from rlm.base.atomicio import atomic_open, atomic_write_json

    sentences, titles = source_sentences(sentences_file)
    rng = np.random.default_rng(seed)
    picks, used = rng.integers(len(sentences), size=1 << 20), 0
    start = time.perf_counter()
    with atomic_open(path, "w") as f:
        for i in range(n):
            words: list[str] = []
            first = None
            while len(words) < WORDS:
                if used == len(picks):
                    picks, used = rng.integers(len(sentences), size=1 << 20), 0
                j, used = int(picks[used]), used + 1
                first = j if first is None else first
                words += sentences[j]
            record = {"id": str(i), "title": titles[first], "text": " ".join(words[:WORDS])}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    meta = {
        "path": str(path),
        "passages": n,
        "bytes": path.stat().st_size,
        "words_per_passage": WORDS,
        "sentences_from": str(sentences_file),
        "source_sentences": len(sentences),
        "build_s": time.perf_counter() - start,
    }
    atomic_write_json(meta_file, meta)
    return {**meta, "reused": False}


def file_fingerprint(path: Path) -> str:
    """The corpus fingerprint `rlm.data.corpus.Corpus` computes for a JSONL file (the sha256 of its bytes)."""
    from rlm.data.corpus import file_fingerprint as fingerprint

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return fingerprint("jsonl", digest)


def build_index(work: Path, corpus: dict, factory: str, checkpoint: Path, rescore: int = 0) -> dict:
    """`work/index-...`: the faiss index `factory` over synthetic vectors of the checkpoint passage tower's
    dimension, one row per corpus passage, as `rlm index --buffer [--rescore F]` builds one (from a buffer
    written as `rlm embed` writes one, claiming the tower's and the corpus's fingerprints so that the demo
    accepts the index and its re-scoring rows, then tuned and saved); reused when present."""
    from rlm.retriever.encoder import DualEncoder

    tower = DualEncoder.from_pretrained(str(checkpoint / "retriever")).passage_tower
    tower_fp, n, dim = tower.fingerprint(), corpus["passages"], tower.dim
    tag = hashlib.sha256(f"{corpus['path']}:{factory}:{tower_fp}:{rescore}".encode()).hexdigest()[:8]
    folder = work / f"index-{n}-{re.sub(r'[^A-Za-z0-9]+', '_', factory)}-{rescore}-{tag}"
    build_file = folder.with_suffix(".build.json")
    if (folder / "index.faiss").is_file() and build_file.is_file():
        return {**json.loads(build_file.read_text()), "reused": True}
    from lab.benchmarking import clustered, write_buffer

    from rlm.base.atomicio import atomic_write_json
    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex

    shard, _ = clustered(n, dim, cluster=CLUSTER)
    vectors = work / f"vectors-{n}-{dim}"
    claims = {
        "encoder_fingerprint": tower_fp,
        "corpus_fingerprint": file_fingerprint(Path(corpus["path"])),
        "max_length": tower.max_length,
    }
    source = f"clustered(n={n}, dim={dim}, cluster={CLUSTER}, seed=0)"
    written = write_buffer(vectors, n, dim, shard, source, claims)
    buffer = PassageBuffer.load(vectors)
    start = time.perf_counter()
    index = PassageIndex.from_buffer(buffer, factory)
    build_s = time.perf_counter() - start
    index.rescore_from(buffer, rescore)
    start = time.perf_counter()
    tuning = index.tune(buffer)
    tune_s = time.perf_counter() - start
    index.save(folder)
    meta = {
        "path": str(folder),
        "factory": factory,
        "rescore_k_factor": rescore,
        "dim": dim,
        "rows": n,
        "bytes": (folder / "index.faiss").stat().st_size,
        "ids_bytes": (folder / "ids.txt").stat().st_size,
        "vectors": f"synthetic: clustered unit vectors ({CLUSTER} rows a cluster), not embeddings of the texts",
        "vectors_s": written["seconds"],
        "build_s": build_s,
        "tune_s": tune_s,
        "tuning": tuning,
    }
    atomic_write_json(build_file, meta)
    return {**meta, "reused": False}


def checkpoint_copy(checkpoint: Path, work: Path) -> Path:
    """The checkpoint copied into `work` without the caches earlier versions of the demo wrote into it (its
    index, its corpus fingerprints), which the service would still read. Its own caches go to
    `service_cache(copy)`, not the user's cache folder."""
    from rlm.inference.index_cache import INDEX_CACHE

    copy = work / "checkpoint"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(checkpoint, copy, ignore=shutil.ignore_patterns(INDEX_CACHE, "demo_corpus_fingerprint*"))
    return copy


def service_cache(checkpoint: Path) -> Path:
    """The cache folder of the service started over the checkpoint copy `checkpoint` (`--cache-dir`)."""
    return checkpoint.parent / "demo_cache"


# ---- the service in a fresh process ------------------------------------------------------------------------


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / MB


@contextlib.contextmanager
def timed_phases(phases: dict) -> Iterator[None]:
    """Time the library calls `QAService.from_checkpoint` makes, without changing them: each wrapped function
    adds its seconds to `phases[name]` and records the RSS after it; the originals are restored on exit."""
    import rlm.app.service
    import rlm.data.corpus
    import rlm.inference.checkpoint
    import rlm.inference.indexing
    from rlm.retriever.encoder import SentenceEncoder
    from rlm.retriever.index import PassageIndex

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = phases.get(name, {}).get("seconds", 0.0) + time.perf_counter() - start
                phases[name] = {"seconds": seconds, "rss_mb": rss_mb()}

        return timed

    targets = [
        (rlm.inference.checkpoint, "load_checkpoint", "models"),
        (rlm.data.corpus, "load_corpus", "corpus scan"),
        (rlm.inference.indexing, "prebuilt_index", "index read and checks"),
        (rlm.app.service.QAService, "warm_up", "warm-up"),
        # The tower's weights hashed to check the index's provenance: a constant part of the index checks.
        (SentenceEncoder, "fingerprint", "tower fingerprint"),
    ]
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in targets]
    read = PassageIndex.__dict__["load"]
    try:
        for owner, attr, name in targets:
            setattr(owner, attr, wrap(name, getattr(owner, attr)))
        PassageIndex.load = classmethod(wrap("index read", read.__func__))
        yield
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
        PassageIndex.load = read


def percentiles(seconds: Sequence[float]) -> dict:
    return {"count": len(seconds), **latency_ms(seconds), "mean_ms": 1e3 * float(np.mean(seconds))}


def alone(fn: Callable, items: Sequence) -> tuple[list[float], list]:
    """Wall seconds of `fn(item)` for each item, one after another, and the results."""
    times, results = [], []
    for item in items:
        start = time.perf_counter()
        results.append(fn(item))
        times.append(time.perf_counter() - start)
    return times, results


def concurrently(
    fn: Callable, items: Sequence, threads: int, per_thread: int
) -> tuple[list[float], list, float]:
    """`threads` threads started together, each calling `fn` on its own `per_thread` items one after another:
    (each call's wall seconds, the results, the whole run's seconds)."""
    times, results, lock = [], [], threading.Lock()
    barrier = threading.Barrier(threads)

    def user(t: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            start = time.perf_counter()
            out = fn(items[(t * per_thread + j) % len(items)])
            took = time.perf_counter() - start
            with lock:
                times.append(took)
                results.append(out)

    pool = [threading.Thread(target=user, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return times, results, time.perf_counter() - start


def served_as_the_demo(
    service, questions: Sequence[str], users: int, per_user: int
) -> tuple[list, list, float]:
    """`users` users, each asking `per_user` questions one after another, answered as the Gradio page answers
    them: through its batching queue (`rlm.app.demo.answer_queue`: one pass at a time, up to `default_max_batch` waiting
    questions in it). Each latency includes the wait in the queue."""
    from rlm.app.demo import answer_queue

    with answer_queue(service) as answers:
        return concurrently(lambda question: answers((question, None)), questions, users, per_user)


def retrieval(service) -> Callable[[str], dict]:
    """What `QAService.answer_with_signals` does before the reader, timed by part: the query encoded, the index
    searched, the passages read by offset."""
    import torch

    from rlm.inference.device import autocast

    def retrieve(question: str) -> dict:
        with torch.inference_mode(), autocast(service.reader.device, service.bf16):
            t0 = time.perf_counter()
            query = service.retriever.query_tower.encode([question]).numpy()
            t1 = time.perf_counter()
            _, ids = service.index.search(query, service.default_k)
            t2 = time.perf_counter()
            passages = [service.corpus[service.corpus.index_of(pid)] for pid in ids[0]]
            t3 = time.perf_counter()
        return {"encode": t1 - t0, "search": t2 - t1, "read": t3 - t2, "passages": len(passages)}

    return retrieve


def answered(results: Sequence[dict], k: int) -> dict:
    """How many answers came back whole (an answer field and k passages) and how many were abstentions."""
    whole = sum("answer" in r and len(r["passages"]) == k for r in results)
    return {"returned": whole, "abstained": sum(bool(r["abstained"]) for r in results)}


def search_sweep(service, queries: np.ndarray, count: int) -> tuple[str | None, list[dict]]:
    """p50/p95 of one-query searches at several values of the index's search parameter (restored after)."""
    index = service.index
    name = index.tunable_parameter()
    if name is None:
        return None, []
    tuned = index.search_params.get(name)
    if name == "nprobe":
        lists = int(re.search(r"IVF(\d+)", index.factory).group(1))
        values = {v for v in (1, 4, 16, 64, 256, lists) if v <= lists}
    else:
        values = {16, 64, 256}
    values = sorted(values | ({tuned} if tuned else set()))
    rows = []
    for value in values:
        index.set_search_params({name: value})
        times, _ = alone(lambda q: index.search(q[None], service.default_k), queries[:count])
        rows.append({"value": value, "tuned": value == tuned, **percentiles(times)})
    if tuned:
        index.set_search_params({name: tuned})
    return name, rows


def quantizer_ms(service, queries: np.ndarray) -> float | None:
    """p50 of an IVF index's coarse quantizer alone (choosing the lists to probe): the part that grows with
    the number of lists."""
    import faiss

    if "IVF" not in service.index.factory:
        return None
    ivf = faiss.extract_index_ivf(service.index.index)
    times, _ = alone(lambda q: ivf.quantizer.search(q[None], ivf.nprobe), queries)
    return percentiles(times)["p50_ms"]


def memory_parts(service) -> dict:
    """Bytes of what grows with N in the running service: the corpus's arrays, the index's ids."""
    corpus = service.corpus
    arrays = {
        name: int(getattr(corpus, attr).nbytes)
        for name, attr in (
            ("offsets", "_offsets"),
            ("line_numbers", "_line_numbers"),
            ("id_hash_order", "_order"),
            ("sorted_id_hashes", "_sorted_hashes"),
        )
        if hasattr(corpus, attr)
    }
    arrays["ids"] = int(corpus.ids.nbytes()) if hasattr(corpus.ids, "nbytes") else None
    index_ids = service.index.ids
    return {
        "corpus_arrays_bytes": arrays,
        "index_ids_bytes": int(index_ids.nbytes()) if hasattr(index_ids, "nbytes") else None,
        "model_parameter_bytes": {
            "retriever": sum(p.numel() * p.element_size() for p in service.retriever.parameters()),
            "reader": sum(p.numel() * p.element_size() for p in service.reader.parameters()),
        },
    }


def serve_and_measure(args: argparse.Namespace) -> dict:
    """In the fresh process: start the service as `rlm demo` does, then measure it (with `--latency`)."""
    import torch
    from lab.benchmarking import PeakRSS

    from rlm.app.demo import BATCH_WINDOW_S, default_max_batch
    from rlm.app.service import QAService, ServiceOptions
    from rlm.data.qa import read_qa_jsonl

    # One thread, as `rlm demo` ran before issue 47 (this study's reports were measured so); it now runs on
    # all cores, one pass at a time (rlm.commands.demo.start_demo).
    torch.set_num_threads(1)
    # After the line above, as the demo imports it (on the index's first use): counted with the imports
    # here, not with the index read that grows with N.
    import faiss

    imported = time.time()
    phases: dict = {}
    with timed_phases(phases), PeakRSS() as peak:
        options = ServiceOptions(
            device=args.device,
            index_path=args.index,
            examples_path=args.questions,
            cache_dir=service_cache(Path(args.checkpoint)),
        )
        service = QAService.from_checkpoint(args.checkpoint, args.corpus, options)
    ready = time.time()
    read = phases.pop("index read")
    checks = phases.pop("index read and checks")
    phases["index read"] = read
    fingerprint = phases.get("tower fingerprint", {"seconds": 0.0})["seconds"]
    phases["index checks"] = {
        "seconds": checks["seconds"] - read["seconds"] - fingerprint,
        "rss_mb": checks["rss_mb"],
    }
    phases["imports"] = {"seconds": imported - args.started, "rss_mb": peak.start / MB}
    known = sum(p["seconds"] for p in phases.values())
    record = {
        "startup_s": ready - args.started,
        "phases": phases,
        "other_s": ready - args.started - known,
        "rss_mb": rss_mb(),
        "peak_rss_mb": peak.peak / MB,
        "max_rss_mb": peak_rss_mb(),
        "faiss_factory": service.index.factory,
        "search_params": dict(service.index.search_params),
        "k": service.default_k,
        "threads": torch.get_num_threads(),
        **memory_parts(service),
    }
    if not args.latency:
        return record
    # torch.set_num_threads(1) set OpenMP's thread count for this thread only: the threads that serve
    # requests (Gradio's, the 20 here) keep the default.
    in_thread: list[int] = []
    probe = threading.Thread(target=lambda: in_thread.append(faiss.omp_get_max_threads()))
    probe.start()
    probe.join()
    record["faiss_omp_threads"] = {"main thread": faiss.omp_get_max_threads(), "other threads": in_thread[0]}
    counts = COUNTS["quick" if args.quick else "full"]
    asked = [ex.question for ex in read_qa_jsonl(args.questions)]
    # As many questions as the largest measurement asks, the file's repeated when it has fewer.
    most = max(
        max(single, CONCURRENT * per_thread) for single, per_thread in (counts[m] for m in LATENCY_KINDS)
    )
    questions = [asked[i % len(asked)] for i in range(most)]
    k = service.default_k
    latency: dict = {}
    # Search alone: the queries encoded first, so only faiss is timed.
    n_alone, per_thread = counts["search"]
    queries = service.retriever.query_tower.encode(questions[: max(n_alone, CONCURRENT * per_thread)]).numpy()
    search = lambda q: service.index.search(q[None], k)  # noqa: E731
    times, _ = alone(search, queries[:n_alone])
    latency["search alone"] = percentiles(times)
    times, _, wall = concurrently(search, queries, CONCURRENT, per_thread)
    latency[f"search, {CONCURRENT} threads"] = {**percentiles(times), "wall_s": wall}
    retrieve = retrieval(service)
    n_alone, per_thread = counts["retrieval"]
    times, parts = alone(retrieve, questions[:n_alone])
    latency["retrieval alone"] = percentiles(times) | {
        f"{part}_p50_ms": statistics.median(p[part] for p in parts) * 1000
        for part in ("encode", "search", "read")
    }
    times, _, wall = concurrently(retrieve, questions, CONCURRENT, per_thread)
    latency[f"retrieval, {CONCURRENT} threads"] = {**percentiles(times), "wall_s": wall}
    n_alone, per_thread = counts["answer"]
    times, results = alone(service.answer, questions[:n_alone])
    latency["answer alone"] = percentiles(times) | answered(results, k)
    times, results, wall = concurrently(service.answer, questions, CONCURRENT, per_thread)
    latency[f"answer, {CONCURRENT} threads"] = {**percentiles(times), "wall_s": wall} | answered(results, k)
    times, results, wall = served_as_the_demo(service, questions, CONCURRENT, per_thread)
    record["demo_queue"] = {"max_batch": default_max_batch(service.reader.device), "window_s": BATCH_WINDOW_S}
    latency[f"answer, {CONCURRENT} users through the demo's queue"] = {
        **percentiles(times),
        "wall_s": wall,
    } | answered(results, k)
    record["latency"] = latency
    record["sweep_parameter"], record["sweep"] = search_sweep(service, queries, counts["sweep"])
    record["quantizer_p50_ms"] = quantizer_ms(service, queries[: counts["sweep"]])
    return record


def start_service(args: argparse.Namespace, paths: dict, latency: bool) -> dict:
    """`serve_and_measure` in a fresh process (its own memory figures), timed from before it starts."""
    cmd = [sys.executable, __file__, "--worker", "--checkpoint", str(paths["checkpoint"])]
    cmd += [
        "--corpus",
        str(paths["corpus"]),
        "--index",
        str(paths["index"]),
        "--questions",
        str(paths["questions"]),
    ]
    cmd += (
        ["--started", repr(time.time())]
        + (["--latency"] if latency else [])
        + (["--quick"] if args.quick else [])
    )
    cmd += ["--device", args.device] if args.device else []
    return reporting.run_json(cmd, what="the demo service")


# ---- the projection to 21M passages ------------------------------------------------------------------------


def mean_id_bytes(n: int) -> float:
    """Mean bytes of the ids "1".."n" (DPR's) written with a newline."""
    total, low = 0, 1
    while low <= n:
        high = min(n, low * 10 - 1)
        total += (high - low + 1) * (len(str(low)) + 1)
        low *= 10
    return total / n


def search_at(factory: str, ms: float, quantizer: float | None, n: int, target: int) -> dict:
    """One-query search time projected from n to `target` rows. IVF: lists grown with N (`{nlist}`: the same
    rows per list, so the lists probed cost the same at the same nprobe) and only the coarse quantizer growing;
    and, as a bound, the same lists each `target / n` times longer. HNSW: with the graph's depth, log N.
    Anything else (Flat, bare PQ/SQ): linear."""
    scale = target / n
    if "IVF" in factory and quantizer is not None:
        return {
            "ms": ms + quantizer * (scale - 1),
            "same_lists_ms": quantizer + (ms - quantizer) * scale,
            "how": "IVF: lists x21 (the same rows per list), coarse quantizer x21",
        }
    if "HNSW" in factory:
        return {"ms": ms * math.log(target) / math.log(n), "how": "HNSW: x log(21M) / log(N)"}
    return {"ms": ms * scale, "how": "exhaustive: x21M / N"}


def growing_bytes(results: dict) -> dict:
    """What the running service holds per passage: the corpus's offset, line, id-hash and id arrays, the
    index's ids and the index itself (faiss reads index.faiss whole into memory)."""
    warm = results["starts"]["second"]
    return {
        "corpus arrays": sum(b for b in warm["corpus_arrays_bytes"].values() if b),
        "index ids": warm["index_ids_bytes"] or 0,
        "index": results["index"]["bytes"],
    }


def measured_growth_mb(start: dict) -> dict:
    """RSS growth over the corpus scan and over the index read and checks (faiss's libraries are imported
    before, the tower's hashing is a constant part)."""
    phases = start["phases"]
    return {
        "corpus scan": phases["corpus scan"]["rss_mb"] - phases["models"]["rss_mb"],
        "index read and checks": phases["index checks"]["rss_mb"] - phases["corpus scan"]["rss_mb"],
    }


def project(results: dict, target: int = TARGET_N) -> dict:
    """Each measured figure at `target` passages: what grows with N scaled linearly, the rest kept."""
    n = results["corpus"]["passages"]
    scale = target / n
    cold, warm = results["starts"]["first"], results["starts"]["second"]
    grows = growing_bytes(results)
    # The ids here are shorter than DPR's 8 digits; the corpus and the index each hold them once.
    id_extra_mb = 2 * (mean_id_bytes(target) - mean_id_bytes(n)) * target / MB
    rss = warm["rss_mb"] + sum(grows.values()) / MB * (scale - 1) + id_extra_mb
    # What the start holds for a while above what stays (the scan's growing arrays and their copies).
    peak = rss + (warm["peak_rss_mb"] - warm["rss_mb"]) * scale
    growing_phases = ("corpus scan", "index read", "index checks")
    starts = {
        name: start["startup_s"] + sum(start["phases"][p]["seconds"] for p in growing_phases) * (scale - 1)
        for name, start in (("first", cold), ("second", warm))
    }
    serving = results["serving"]
    latency = serving["latency"]
    search_ms = latency["search alone"]["p50_ms"]
    search = search_at(results["index"]["factory"], search_ms, serving["quantizer_p50_ms"], n, target)
    added = search["ms"] - search_ms
    retrieval_ms = latency["retrieval alone"]["p50_ms"] + added
    answer_ms = latency["answer alone"]["p50_ms"] + added
    # At 20 at once the CPU is the bottleneck: each latency grows as one request's work does.
    work = answer_ms / latency["answer alone"]["p50_ms"]
    concurrent = {
        name: stats["p50_ms"] * work for name, stats in latency.items() if name.startswith("answer, ")
    }
    sweep = []
    for row in serving["sweep"]:
        at = search_at(results["index"]["factory"], row["p50_ms"], serving["quantizer_p50_ms"], n, target)
        # Retrieval at this value: the encoding and the reads as measured, this search instead.
        retrieval_at = latency["retrieval alone"]["p50_ms"] - search_ms + at["ms"]
        sweep.append(
            {"value": row["value"], "p50_ms": at["ms"], "same_lists_p50_ms": at.get("same_lists_ms")}
            | {"retrieval_p50_ms": retrieval_at}
        )
    meeting = [row["value"] for row in sweep if row["retrieval_p50_ms"] < GOAL_P50_MS]
    return {
        "passages": target,
        "scale": scale,
        "rss_mb": rss,
        "peak_rss_mb": peak,
        "grows_mb_at_n": {name: b / MB for name, b in grows.items()},
        "index_file_mb": results["index"]["bytes"] / n * target / MB,
        "id_length_extra_mb": id_extra_mb,
        "startup_s": starts,
        "first_answer_s": {name: s + answer_ms / 1000 for name, s in starts.items()},
        "search_p50_ms": search,
        "retrieval_p50_ms": retrieval_ms,
        "answer_p50_ms": answer_ms,
        "answer_concurrent_p50_ms": concurrent,
        "sweep": sweep,
        "meets_retrieval_goal": retrieval_ms < GOAL_P50_MS,
        "meets_search_goal": search["ms"] < GOAL_P50_MS,
        "largest_swept_value_meeting_goal": max(meeting) if meeting else None,
    }


# ---- the report ---------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    n, corpus, index = results["corpus"]["passages"], results["corpus"], results["index"]
    first, second, proj = results["starts"]["first"], results["starts"]["second"], results["projection"]
    serving = results["serving"]
    latency = serving["latency"]
    start_rows = []
    for name, start in (("first (fingerprint hashed)", first), ("second (fingerprint cached)", second)):
        row = {"start": name, "total": start["startup_s"], "other": start["other_s"]}
        row |= {p: v["seconds"] for p, v in start["phases"].items()}
        row |= {"rss": start["rss_mb"], "peak": start["peak_rss_mb"]}
        row["all"] = ", ".join(f"{t:.1f}" for t in start.get("all_startup_s", [start["startup_s"]]))
        start_rows.append(row)
    phase_columns = [(f"{p} s", p, ".1f") for p in ("imports", "models", "corpus scan", "index read")]
    phase_columns += [(f"{p} s", p, ".2f") for p in ("tower fingerprint", "index checks", "warm-up")]
    start_table = reporting.table(
        start_rows,
        [("start", "start", ""), ("start-up s", "total", ".1f"), *phase_columns, ("rest s", "other", ".1f")]
        + [
            ("RSS after MB", "rss", ",.0f"),
            ("peak RSS MB", "peak", ",.0f"),
            ("every run's start-up s", "all", ""),
        ],
    )
    arrays = second["corpus_arrays_bytes"]
    memory_rows = [
        {"part": f"corpus: {name} (per passage: {b / n:.1f} B)", "mb": b / MB}
        for name, b in arrays.items()
        if b is not None
    ]
    memory_rows += [
        {
            "part": f"index: ids (per passage: {second['index_ids_bytes'] / n:.1f} B)",
            "mb": second["index_ids_bytes"] / MB,
        },
        {
            "part": f"index: index.faiss on disk (per passage: {index['bytes'] / n:.0f} B)",
            "mb": index["bytes"] / MB,
        },
    ]
    memory_rows += [
        {"part": f"{name} parameters", "mb": b / MB} for name, b in second["model_parameter_bytes"].items()
    ]
    memory_rows += [
        {"part": f"RSS growth over the {name} (measured)", "mb": mb}
        for name, mb in measured_growth_mb(second).items()
    ]
    memory_table = reporting.table(memory_rows, [("part", "part", ""), ("MB", "mb", ",.1f")])
    latency_rows = [{"what": name, **stats} for name, stats in latency.items()]
    latency_table = reporting.table(
        latency_rows,
        [
            ("what", "what", ""),
            ("calls", "count", "d"),
            ("p50 ms", "p50_ms", ",.1f"),
            ("p95 ms", "p95_ms", ",.1f"),
        ]
        + [("answers whole", "returned", "d"), ("abstained", "abstained", "d")],
    )
    parts = latency["retrieval alone"]
    sweep_rows = [
        {
            **row,
            "p50_21m": projected["p50_ms"],
            "retrieval_21m": projected["retrieval_p50_ms"],
            "same_lists_21m": projected.get("same_lists_p50_ms"),
            "mark": " (tuned)" if row["tuned"] else "",
        }
        for row, projected in zip(serving["sweep"], proj["sweep"])
    ]
    sweep_table = reporting.table(
        sweep_rows,
        [(serving["sweep_parameter"] or "-", lambda r: f"{r['value']}{r['mark']}", "")]
        + [
            ("p50 ms", "p50_ms", ".2f"),
            ("p95 ms", "p95_ms", ".2f"),
            ("p50 ms at 21M (projected)", "p50_21m", ".2f"),
            ("retrieval p50 ms at 21M (projected)", "retrieval_21m", ".1f"),
            (f"search p50 ms at 21M, {nlist_name(index['factory'])} kept", "same_lists_21m", ".1f"),
        ],
    )
    search = proj["search_p50_ms"]
    same_lists = (
        f" (the same {nlist_name(index['factory'])} lists, each x{proj['scale']:.0f} longer: "
        f"{search['same_lists_ms']:.1f} ms)"
        if "same_lists_ms" in search
        else ""
    )
    projection_rows = [
        {"what": "resident memory after start, MB", "n": second["rss_mb"], "t": proj["rss_mb"]},
        {
            "what": "peak resident memory while starting, MB",
            "n": second["peak_rss_mb"],
            "t": proj["peak_rss_mb"],
        },
        {"what": "start-up, first start, s", "n": first["startup_s"], "t": proj["startup_s"]["first"]},
        {"what": "start-up, second start, s", "n": second["startup_s"], "t": proj["startup_s"]["second"]},
        {
            "what": "time to the first answer (second start), s",
            "n": second["startup_s"] + latency["answer alone"]["p50_ms"] / 1000,
            "t": proj["first_answer_s"]["second"],
        },
        {"what": "index search p50 alone, ms", "n": latency["search alone"]["p50_ms"], "t": search["ms"]},
        {
            "what": "retrieval p50 alone (encode + search + read), ms",
            "n": parts["p50_ms"],
            "t": proj["retrieval_p50_ms"],
        },
        {"what": "answer p50 alone, ms", "n": latency["answer alone"]["p50_ms"], "t": proj["answer_p50_ms"]},
    ]
    projection_rows += [
        {"what": f"{name} p50, ms", "n": latency[name]["p50_ms"], "t": ms}
        for name, ms in proj["answer_concurrent_p50_ms"].items()
    ]
    projection_table = reporting.table(
        projection_rows,
        [("", "what", ""), (f"measured at {n:,}", "n", ",.1f"), ("projected at 21M", "t", ",.1f")],
    )
    verdict = "meets" if proj["meets_retrieval_goal"] else "misses"
    omp = ", ".join(f"{v} in the {k}" for k, v in serving["faiss_omp_threads"].items())
    queued = serving.get("demo_queue")  # absent from reports measured before the demo's batching queue
    served = (
        f"its batching queue: one pass at a time, up to {queued['max_batch']} waiting questions in one "
        f"`answer_requests`, a {1000 * queued['window_s']:g} ms window"
        if queued
        else "2 requests at a time, up to 8 waiting questions in one `answer_many`"
    )
    from rlm.retriever.index import describe_tuning

    tuning = index.get("tuning") or {}
    tuned = (
        f"tuned by `PassageIndex.tune`: {describe_tuning(tuning)}"
        if tuning
        else "no search parameter to tune"
    )
    # The 1-minute load average at the start: above 1 on 2 cores, other jobs ran beside this one.
    busy = float(results["machine"]["load_average"].split(",")[0]) > 1.0
    shared = (
        "The cores were shared with other jobs: timings are slower than on an idle machine, and comparable "
        "only within this report."
        if busy
        else "The machine was idle but for this run at its start."
    )
    factor = index.get("rescore_k_factor")
    rescored = f", each search's top {factor} x k re-scored from the float16 rows on disk" if factor else ""
    return f"""# The demo at scale: memory, start-up and latency over {n:,} passages, projected to 21M

Question (issue 39): what does `rlm demo --index` cost a user who serves a prebuilt index over 1M passages and
more (resident memory, start-up time, p50 alone and at {CONCURRENT} concurrent), and what would it cost over
DPR's 21M passages; does retrieval stay under {GOAL_P50_MS:.0f} ms p50 on CPU?

Command: `{results["command"]}`
Machine: {reporting.machine_line(results["machine"])}. {shared}

**The index's vectors are synthetic** (clustered unit vectors, {index["dim"]}-d as the checkpoint's passage
tower, not embeddings of the passages): the answers are meaningless; what is measured is memory and time.
The corpus is real-length text: {n:,} passages of {corpus["words_per_passage"]} words
({corpus["bytes"] / MB:,.0f} MB of JSONL, {corpus["bytes"] / n:.0f} B a passage; DPR's psgs_w100.tsv is
about 620 B a passage), sentences of `{corpus["sentences_from"]}` recombined. Index `{index["factory"]}`, built
as `rlm index` builds one in {index["build_s"]:.0f} s, {tuned}; {index["bytes"] / MB:,.0f} MB on disk{rescored}. The
service: `QAService.from_checkpoint` as `rlm demo --checkpoint C --corpus X --index I` calls it (one torch
thread), on {results["machine"]["cpu"]}, in a fresh process for each start; the checkpoint
(`{results["args"]["checkpoint"]}`) copied into the work folder so that the first start finds no corpus
fingerprint cached beside it. Each start is timed from before the interpreter starts to the service ready
(its warm-up answer included); each kind ran {results["args"]["repeats"]} time(s), and the table shows the fastest
(the least disturbed by other jobs), every run's start-up in its last column.

## Start-up and memory

{start_table}

What grows with N (second start):

{memory_table}

## Latency (the last second start; k={second["k"]}, faiss OpenMP threads {omp})

Retrieval alone, by part (p50): encode {parts["encode_p50_ms"]:.1f} ms, search {parts["search_p50_ms"]:.2f} ms,
passage reads {parts["read_p50_ms"]:.2f} ms. "{CONCURRENT} threads": {CONCURRENT} threads call the service at
once; "through the demo's queue": {CONCURRENT} users served as the Gradio page serves them ({served}), the
wait in the queue included.

{latency_table}

Index search alone at each value of its search parameter:

{sweep_table}

## Projection to 21M passages

What grows with N is scaled by {proj["scale"]:.1f}: in memory, the corpus's arrays, the index's ids and the
index (index.faiss, read whole), with ids as long as DPR's (8 digits: +{proj["id_length_extra_mb"]:,.0f} MB for
the corpus's and the index's copies), and what the start holds above that for a while (peak minus RSS after);
in time, the corpus scan, the index read and the index checks (the tower's fingerprint not). The models,
imports and warm-up stay. Index search: {search["how"]}, at the same
{serving["sweep_parameter"] or "parameter"}{same_lists}. Answers at {CONCURRENT} concurrent grow as one
answer's work does (the CPU is the bottleneck). The index alone at 21M: {proj["index_file_mb"]:,.0f} MB
({index["bytes"] / n:.0f} B a passage x 21M).

{projection_table}

Goal "retrieval p50 under {GOAL_P50_MS:.0f} ms on CPU": the projected retrieval p50 at 21M is
{proj["retrieval_p50_ms"]:.1f} ms (index search {search["ms"]:.1f} ms): it **{verdict}** the goal at the tuned
search parameter; of the values swept, the largest that meets it is
{serving["sweep_parameter"]}={proj["largest_swept_value_meeting_goal"]} (the sweep's last column).

{reporting.FINDINGS_START}
{reporting.FINDINGS_END}
"""


def nlist_name(factory: str) -> str:
    match = re.search(r"IVF\d+", factory)
    return match.group(0) if match else factory


def write(results: dict, out: Path, report: bool = True) -> None:
    """`out/demo_scale.json` and (`report`) `out/README.md` made from it."""
    from rlm.base.atomicio import atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "demo_scale.json", json.loads(json.dumps(results, default=str)))
    if report:
        reporting.write_report(out / "README", markdown(results), None)


# ---- main ---------------------------------------------------------------------------------------------------


def default_questions(checkpoint: Path) -> Path:
    """dev.jsonl next to the corpus the checkpoint's run trained on (a quickstart's toy world)."""
    import yaml

    from rlm.inference.checkpoint import corpus_from_config

    config = yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}
    try:
        return corpus_from_config(config, checkpoint).parent / "dev.jsonl"
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(
            f"error: no questions found from {checkpoint} ({err}); pass --questions FILE"
        ) from None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = reporting.arguments(__doc__)
    parser.add_argument(
        "--checkpoint", default=DEFAULT_CHECKPOINT, help="a run's final/ folder (any checkpoint)"
    )
    parser.add_argument("--passages", type=int, default=1_000_000, help="corpus size N")
    parser.add_argument("--factory", default="IVF{nlist},SQ8", help="faiss factory; {nlist} = N / 1,000, 2^k")
    parser.add_argument(
        "--rescore",
        type=int,
        default=0,
        help="re-score the top F x k from the rows on disk (rlm index --rescore)",
    )
    parser.add_argument("--sentences", help="corpus whose sentences make the passages (default: the run's)")
    parser.add_argument("--questions", help="QA JSONL asked (default: dev.jsonl by the run's corpus)")
    parser.add_argument("--work", default="/tmp/rlm-demo-scale", help="where the corpus and index are built")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="report folder (README.md, demo_scale.json)")
    parser.add_argument(
        "--device", help="the service's device (default: as `rlm demo`, the accelerator if any)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="starts of each kind (the fastest reported)")
    parser.add_argument(
        "--quick", action="store_true", help="N = 5,000, a few questions, one start of each kind"
    )
    parser.add_argument("--render", help="redo the report from this JSON, measuring nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--index", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps(serve_and_measure(args)))
        return 0
    if args.render:
        results = reporting.load_results(args.render)
        results["projection"] = project(results)
        write(results, Path(args.out))
        return 0
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "retriever").is_dir() or not (checkpoint / "reader").is_dir():
        raise SystemExit(
            f"error: {checkpoint} is no checkpoint (retriever/ and reader/): `rlm quickstart --no-serve` makes "
            "runs/quickstart/final; pass it with --checkpoint"
        )
    n = 5_000 if args.quick else args.passages
    questions = Path(args.questions) if args.questions else default_questions(checkpoint)
    sentences = Path(args.sentences) if args.sentences else questions.parent / "corpus.jsonl"
    for path in (questions, sentences):
        if not path.is_file():
            raise SystemExit(f"error: {path} not found (see --questions, --sentences)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    factory = args.factory.replace("{nlist}", str(nlist_for(n)))
    results = {"command": reporting.command("bench_demo_scale.py", argv), "machine": reporting.machine()}
    repeats = 1 if args.quick else args.repeats
    results["args"] = {"checkpoint": str(checkpoint), "passages": n, "factory": factory, "quick": args.quick}
    results["args"]["rescore"] = args.rescore
    results["args"]["repeats"] = repeats
    print(f"corpus of {n:,} passages in {work}", file=sys.stderr)
    results["corpus"] = build_corpus(work, n, sentences)
    print(f"index {factory} ({results['corpus']['build_s']:.0f} s for the corpus)", file=sys.stderr)
    results["index"] = build_index(work, results["corpus"], factory, checkpoint, args.rescore)
    paths = {
        "checkpoint": checkpoint_copy(checkpoint, work),
        "corpus": results["corpus"]["path"],
        "index": results["index"]["path"],
        "questions": questions,
    }
    from rlm.cache import corpus_fingerprint_cache

    runs: dict[str, list[dict]] = {"first": [], "second": []}
    for name in runs:
        for r in range(repeats):
            print(f"{name} start of the service ({r + 1} of {repeats})", file=sys.stderr)
            if name == "first":  # what the previous start remembered, forgotten
                corpus_fingerprint_cache(service_cache(paths["checkpoint"])).unlink(missing_ok=True)
            runs[name].append(start_service(args, paths, latency=name == "second" and r == repeats - 1))
    # The latency is measured once, after the last start; each start's figures are its fastest run's (the
    # least disturbed by other jobs on the shared cores), every run's start-up kept.
    results["serving"] = {key: runs["second"][-1].pop(key) for key in SERVING_KEYS}
    results["starts"] = {
        name: {
            **min(records, key=lambda r: r["startup_s"]),
            "all_startup_s": [r["startup_s"] for r in records],
        }
        for name, records in runs.items()
    }
    results["machine"]["load_average_after"] = reporting.load_average()
    write(results, Path(args.out), report=False)  # the measurements kept, whatever comes next
    results["projection"] = project(results)
    write(results, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
