"""Index study (issue 39): which faiss index serves 21M passages in at most 8 GB of RAM, with recall@20 within
1 point of exact search and a retrieval p50 under 100 ms on CPU?

Each factory is built over N synthetic passages (D=768) through `rlm.retriever.index.PassageIndex` as `rlm index`
builds one: `build` (trained on `--train-per-list` rows per IVF list), then `tune` to the default target (the
smallest nprobe / efSearch whose top 20 holds the source row of 99.5% of the 1,000 indexed rows made question-like
whose source exact search ranks in its top 20). Measured: bytes per passage (the saved index.faiss / N), build and tune seconds, recall@1/20/100
of held-out queries against Flat's top-k, the gold passage's recall@20 (each query is drawn around one passage:
"within 1 point of Flat" is measured on it), and the latency of one query per search, p50/p95, alone and with
20 concurrent searchers (20 threads each searching single queries; run it with OMP_NUM_THREADS=1, so that
faiss's OpenMP threads neither add to nor fight the 20). Each factory is projected to 21M passages.

Vectors: unit vectors of a three-level mixture in a random basis with a decaying spectrum (each level's
variance along basis direction i is proportional to 1/i: an effective dimension near 30, as text embeddings
have): a direction shared by every passage (random pairs have cosine ~0.2), a topic per 1,000 passages, a
document per 10 consecutive passages, each passage's own part. A query is one passage plus noise of the same
spectrum, scaled so that exact search ranks that passage in its top 20 for about 80% of queries (DPR's top-20
on NQ is 79%). Real embeddings may compress better or worse: the recall columns are this model's.

A factory ending in `+rescore<f>` (e.g. `IVF{nlist},PQ256np+rescore5`) is that index with each search's top
f x k re-scored exactly from the float16 rows, as `rlm index --rescore f` builds it; its codes are built once
for the bare entry and the re-scored one.

IVF types get N/1,000 lists rounded to a power of two ({nlist} in a factory; 1,024 at 1M), so a list holds
~1,000 rows at any N; at 21M the same list size is IVF16384. The exact top-100 of the tuning queries is the
same for every factory (same rows, same seed): it is computed once and reused, its time reported apart.

    OMP_NUM_THREADS=1 python scripts/bench/bench_index.py                # N = 1M, every factory (hours on 1 core)
    OMP_NUM_THREADS=1 python scripts/bench/bench_index.py --n 500000 --factories 'Flat;IVF{nlist},PQ64'
    python scripts/bench/bench_index.py --quick                          # N = 20k, four factories (under a minute)
    python scripts/bench/bench_index.py --render scripts/bench/reports/bench_index/bench_index.json
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from lab import reporting
from lab.benchmarking import latency_ms, timings

D = 768
TARGET_N = 21_000_000
GOAL_RAM_GB, GOAL_RECALL_POINTS, GOAL_P50_MS = 8.0, 1.0, 100.0
ROWS_PER_LIST = 1_000
KMEANS_ITERATIONS = 25  # faiss's default for an IVF index's coarse quantizer
# DPR's passage ids ("1" .. "21015324"): up to 8 digits and a newline in ids.txt, an int64 offset in memory.
ID_BYTES = 9 + 8
K_READ, K_MAX = 20, 100  # a reader's passages; the deepest recall measured
CONCURRENT = 20
# The mixture's weights: shared direction, topic, document, passage; the query's noise.
MEAN_W, TOPIC_W, DOC_W, OWN_W, QUERY_NOISE = 0.5, 1.0, 0.6, 0.5, 1.25
PASSAGES_PER_DOC, PASSAGES_PER_TOPIC = 10, 1_000
# The families (Flat, IVF-Flat, IVF-PQ, OPQ-IVF-PQ, HNSW-SQ8) and the candidate default first. "np": no
# polysemous training, which faiss's factory turns on for 8-bit PQ and which only serves Hamming filtering
# (off unless asked for): minutes of simulated annealing that change no search result.
FACTORIES = [
    "Flat",
    "IVF{nlist},Flat",
    "IVF{nlist},PQ256np",
    "HNSW32,SQ8",
    "IVF{nlist},PQ64np",
    "OPQ64_256,IVF{nlist},PQ64np",
]
RESCORED = (
    "+rescore"  # a factory's suffix: its codes re-scored from the float16 rows (the module's docstring)
)
# 4-bit PQ trains in a second where 8-bit PQ takes a minute.
QUICK_FACTORIES = [
    "Flat",
    "IVF{nlist},SQ8",
    "IVF{nlist},PQ32x4np",
    "IVF{nlist},PQ32x4np+rescore5",
    "HNSW32,SQ8",
]


def nlist_for(n: int) -> int:
    """IVF lists for n rows: n / ROWS_PER_LIST rounded to a power of two (at least 4)."""
    return max(4, 2 ** round(math.log2(max(1, n / ROWS_PER_LIST))))


def kind(factory: str) -> str:
    """The family a factory belongs to, as the issue names them."""
    factory, _, k_factor = factory.partition(RESCORED)
    if k_factor:
        return f"{kind(factory)}, re-scored"
    if factory == "Flat":
        return "Flat (exact)"
    if factory.startswith("HNSW"):
        return "HNSW-SQ8" if "SQ8" in factory else "HNSW"
    opq = "OPQ-" if factory.startswith("OPQ") else ""
    codes = factory.rsplit(",", 1)[-1]
    return f"{opq}IVF-{'Flat' if codes == 'Flat' else codes}"


def synthetic(n: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(passages [n, D], queries [queries, D], the passage each query was drawn around): the module's model."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
    scale = np.arange(1, D + 1, dtype=np.float32) ** -0.5
    scale /= np.linalg.norm(scale)  # each level's expected squared norm is 1

    def level(count: int) -> np.ndarray:
        return (rng.standard_normal((count, D), dtype=np.float32) * scale) @ basis

    shared = MEAN_W * level(1)[0]
    topics = TOPIC_W * level(max(1, n // PASSAGES_PER_TOPIC))
    docs = -(-n // PASSAGES_PER_DOC)
    doc_centres = shared + topics[rng.integers(0, len(topics), docs)] + DOC_W * level(docs)
    passages = np.empty((n, D), dtype=np.float32)
    for lo in range(0, n, 65_536):  # filled in place: no second whole-corpus array
        hi = min(n, lo + 65_536)
        part = doc_centres[np.arange(lo, hi) // PASSAGES_PER_DOC] + OWN_W * level(hi - lo)
        passages[lo:hi] = part / np.linalg.norm(part, axis=1, keepdims=True)
    gold = rng.integers(0, n, queries)
    asked = passages[gold] + QUERY_NOISE * level(queries)
    return passages, asked / np.linalg.norm(asked, axis=1, keepdims=True), gold


class ExactOnce:
    """`rlm.retriever.search.corrected_topk` for `PassageIndex.tune`, its exact top-k kept per query sample: every
    factory is tuned on the same rows with the same seed, so the exact search is the same each time."""

    def __init__(self):
        import rlm.retriever.search

        self.module, self.topk, self.cache, self.seconds = (
            rlm.retriever.search,
            rlm.retriever.search.corrected_topk,
            {},
            0.0,
        )

    def __call__(self, queries, rows, corrector, k, **kwargs):
        key = (tuple(queries.shape), k, float(queries.double().sum()), corrector is None)
        if key not in self.cache:
            start = time.perf_counter()
            self.cache[key] = self.topk(queries, rows, corrector, k, **kwargs)
            self.seconds += time.perf_counter() - start
        return self.cache[key]

    def __enter__(self):
        self.module.corrected_topk = self
        return self

    def __exit__(self, *exc):
        self.module.corrected_topk = self.topk


def latencies(index, queries: np.ndarray, threads: int, budget_s: float) -> list[float]:
    """Seconds of each single-query search (k=K_READ), `threads` searchers at once over `queries`; a searcher
    stops after its first query once `budget_s` has passed (a Flat scan of 1M rows takes ~0.3 s)."""
    seconds: list[float] = []
    lock, deadline = threading.Lock(), [0.0]

    def searcher(mine: np.ndarray):
        if start.wait() == 0:
            deadline[0] = time.perf_counter() + budget_s
        start.wait()
        for i, q in enumerate(mine):
            if i and time.perf_counter() > deadline[0]:
                break
            t = time.perf_counter()
            index.search_rows(q[None], K_READ)
            t = time.perf_counter() - t
            with lock:
                seconds.append(t)

    start = threading.Barrier(threads)
    workers = [threading.Thread(target=searcher, args=(part,)) for part in np.array_split(queries, threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return seconds


class TimedTraining:
    """Seconds spent in `train` by the indexes `faiss.index_factory` makes inside the block: `PassageIndex.build`
    trains, then adds, and the two grow differently to 21M."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        import faiss

        self.faiss, self.index_factory = faiss, faiss.index_factory

        def index_factory(*args, **kwargs):
            index, timer = self.index_factory(*args, **kwargs), self
            train = index.train

            def timed_train(x):
                start = time.perf_counter()
                try:
                    return train(x)
                finally:
                    timer.seconds += time.perf_counter() - start

            index.train = timed_train
            return index

        faiss.index_factory = index_factory
        return self

    def __exit__(self, *exc):
        self.faiss.index_factory = self.index_factory


def recall(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    """Mean share of exact search's top-k that `found`'s top-k holds."""
    hits = (found[:, :k, None] == exact[:, None, :k]).any(-1) & (found[:, :k] >= 0)
    return float(hits.sum(-1).mean() / k)


def measure(
    factory: str,
    passages,
    queries,
    gold,
    exact,
    flat_gold: float,
    args,
    exact_once: ExactOnce,
    built: dict,
    stored_rows,
) -> dict:
    """Build (or take the same codes from `built`, {name: (faiss index, build s, train s)}), tune, size,
    recall and latency of one factory; `stored_rows()` is the float16 buffer a re-scored entry reads."""
    import faiss

    from rlm.retriever.index import PassageIndex

    n, nlist = len(passages), nlist_for(len(passages))
    template, _, k_factor = factory.partition(RESCORED)
    name = template.format(nlist=nlist)
    if name not in built:
        start = time.perf_counter()
        with TimedTraining() as training:
            made = PassageIndex.build(
                passages,
                [str(i) for i in range(n)],
                name,
                use_gpu=False,
                train_sample=train_sample(nlist, args),
            )
        built[name] = (made.index, time.perf_counter() - start, training.seconds)
    codes, build_s, train_s = built[name]
    index = PassageIndex(faiss.clone_index(codes), [str(i) for i in range(n)], name)
    if k_factor:
        index.rescore_from(stored_rows(), int(k_factor))
    exact_before, start = exact_once.seconds, time.perf_counter()
    tuning = index.tune(passages, queries=args.tune_queries)
    tune_s = time.perf_counter() - start - (exact_once.seconds - exact_before)
    rescoring, index.rescoring = index.rescoring, None  # the index's own bytes (the rows are the buffer's)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        index.save(tmp)
        index_bytes = (Path(tmp) / "index.faiss").stat().st_size
    index.rescoring = rescoring
    ivf = faiss.try_extract_index_ivf(index.index)
    _, found = index.search_rows(queries, K_MAX)
    index.search_rows(queries[:1], K_READ)  # warm-up
    alone = latencies(index, queries[: args.latency_queries], 1, args.latency_seconds)
    together = latencies(index, queries[: args.concurrent_queries], CONCURRENT, args.latency_seconds)
    together_ms = latency_ms(together)
    swept = sweep(index, queries, gold, exact, flat_gold, args)
    return {
        "factory": name + (f"{RESCORED}{k_factor}" if k_factor else ""),
        "factory_template": factory,
        "rescore_k_factor": int(k_factor or 0),
        "kind": kind(factory),
        "n": n,
        "nlist": None if ivf is None else int(ivf.nlist),
        "build_s": build_s,
        "train_s": train_s,
        "train_rows": min(n, train_sample(nlist, args)),
        "tune_s": tune_s,
        "tuned": tuning,
        "search_params": dict(index.search_params),
        "index_bytes": index_bytes,
        # What does not grow with N: all of an IVF index but its lists' codes and ids (the coarse quantizer,
        # PQ's codebooks, OPQ's rotation), and within it the coarse quantizer (nlist x D floats).
        "fixed_bytes": 0 if ivf is None else index_bytes - n * (ivf.code_size + 8),
        "quantizer_bytes": 0 if ivf is None else int(faiss.serialize_index(ivf.quantizer).size),
        "bytes_per_passage": index_bytes / n,
        "recall_at_1": recall(found, exact, 1),
        "recall_at_20": recall(found, exact, K_READ),
        "recall_at_100": recall(found, exact, K_MAX),
        "gold_recall_at_20": float((found[:, :K_READ] == gold[:, None]).any(-1).mean()),
        **latency_ms(alone),
        "p50_concurrent_ms": together_ms["p50_ms"],
        "p95_concurrent_ms": together_ms["p95_ms"],
        "searches_timed": [len(alone), len(together)],
        "sweep": swept,
    }


def sweep(index, queries, gold, exact, flat_gold: float, args) -> dict | None:
    """The search parameter `tune` sets, raised step by step (its own values) on the held-out queries until
    the gold passage's recall@20 is within GOAL_RECALL_POINTS of Flat's: each step's recall, and the latency
    of the first step that meets the goal (None when none does: the codes cap recall)."""
    from rlm.retriever.index import EF_SEARCH_VALUES

    name = index.tunable_parameter()
    if name is None:
        return None
    saved = dict(index.search_params)
    nlist = index.tuning.get("value") if name == "nprobe" else None
    lists = nlist_for(index.ntotal) if nlist is not None else 0
    values = (
        list(EF_SEARCH_VALUES) if name == "efSearch" else [2**i for i in range(int(math.log2(lists)) + 1)]
    )
    steps, met = [], None
    for value in values:
        index.set_search_params({name: value})
        _, found = index.search_rows(queries, K_MAX)
        gold_20 = float((found[:, :K_READ] == gold[:, None]).any(-1).mean())
        steps.append(
            {"value": value, "recall_at_20": recall(found, exact, K_READ), "gold_recall_at_20": gold_20}
        )
        if 100 * (flat_gold - gold_20) <= GOAL_RECALL_POINTS:
            met = steps[-1] | {
                "recall_at_1": recall(found, exact, 1),
                "recall_at_100": recall(found, exact, K_MAX),
            }
            alone = latencies(index, queries[: args.latency_queries], 1, args.latency_seconds)
            met |= latency_ms(alone)
            break
    index.set_search_params(saved)
    return {"parameter": name, "steps": steps, "goal": met}


def train_sample(nlist: int, args) -> int:
    """Rows an index is trained on: `--train-per-list` per IVF list, and at least the 39 per centroid that
    faiss asks of PQ's 256-centroid codebooks."""
    return max(args.train_per_list * nlist, 39 * 256)


def coarse_costs(nlist: int, rows: int = 1024) -> dict:
    """A flat coarse quantizer of `nlist` centroids: ms for one query (an IVF search's first step) and seconds
    per row of assigning a batch (an IVF add's first step); both grow with the list count."""
    import faiss

    rng = np.random.default_rng(1)
    flat = faiss.IndexFlatIP(D)
    flat.add(rng.standard_normal((nlist, D), dtype=np.float32))
    batch = rng.standard_normal((rows, D), dtype=np.float32)
    one_s, _ = timings(30, lambda: flat.search(batch[:1], 8))
    batch_s, _ = timings(2, lambda: flat.search(batch, 1))
    return {"query_ms": 1e3 * float(np.median(one_s)), "assign_s_per_row": min(batch_s) / rows}


def project(row: dict, flat: dict, coarse: dict, target_n: int = TARGET_N) -> dict:
    """The row at `target_n` passages, each figure by the structure of its cost.

    RAM and disk: the bytes that grow with N (an IVF list's code and id per row; all of Flat and HNSW) x
    target_n / n, plus what does not (PQ codebooks, OPQ's rotation), with the coarse quantizer at target_n /
    ROWS_PER_LIST lists; RAM adds the ids.
    p50: Flat scans every row (x target_n / n); IVF probes the same number of lists of about the same size
    (lists are kept at ~1,000 rows: where the corpus at 21M looks like this one at the scale of a list, as
    the synthetic model does, the same nprobe finds the same share), plus the larger coarse quantizer's
    search; HNSW's walk grows with log N.
    Build, one core: the coarse k-means (25 iterations over `--train-per-list` rows per list, each row
    compared with every centroid: measured per row in `coarse`) at the larger list count, the rest of the
    training as measured (PQ's codebooks and OPQ train on a capped sample), each row's assignment to a list at
    the larger list count and its encoding x target_n / n; HNSW's insertion x N log N; Flat's copy x N."""
    n, scale = row["n"], target_n / row["n"]
    nlist = nlist_for(target_n) if row["nlist"] else None
    grows = row["index_bytes"] - row["fixed_bytes"]
    quantizer = row["quantizer_bytes"] * nlist / row["nlist"] if nlist else 0  # nlist x (D after any OPQ/PCA)
    index_gb = (grows * scale + row["fixed_bytes"] - row["quantizer_bytes"] + quantizer) / 1e9
    add_s = row["build_s"] - row["train_s"]
    setting, gold_here, p50_here = search_setting(row)
    if nlist:
        here, there = coarse[str(row["nlist"])], coarse[str(nlist)]
        # k-means: iterations x training rows (a fixed number per list) x one row's comparison with every list.
        kmeans_here = KMEANS_ITERATIONS * row["train_rows"] * here["assign_s_per_row"]
        kmeans_there = (
            KMEANS_ITERATIONS * row["train_rows"] * (nlist / row["nlist"]) * there["assign_s_per_row"]
        )
        other_train = max(0.0, row["train_s"] - kmeans_here)
        encode_s = max(0.0, add_s - n * here["assign_s_per_row"])
        build_s = kmeans_there + other_train + encode_s * scale
        build_s += target_n * there["assign_s_per_row"]
        rows_per_list = (target_n / nlist) / (n / row["nlist"])

        def at_target(ms: float) -> float:
            return max(0.0, ms - here["query_ms"]) * rows_per_list + there["query_ms"]

    elif row["factory"] == "Flat":
        build_s = row["build_s"] * scale

        def at_target(ms: float) -> float:
            return ms * scale

    else:
        growth = math.log(target_n) / math.log(n)
        build_s = row["train_s"] + add_s * scale * growth

        def at_target(ms: float) -> float:
            return ms * growth

    ram_gb = index_gb + target_n * ID_BYTES / 1e9
    lost = 100 * (flat["gold_recall_at_20"] - gold_here)
    return {
        "factory": row["factory_template"].format(nlist=nlist),
        # A re-scored index reads its candidates' float16 rows from the buffer on disk (`rlm embed`'s shards).
        "rows_on_disk_gb": target_n * D * 2 / 1e9 if row.get("rescore_k_factor") else 0.0,
        "setting": setting,
        "index_gb": index_gb,
        "ram_gb": ram_gb,
        "build_core_h": build_s / 3600,
        "p50_ms": at_target(p50_here),
        # What a user of `rlm index` without search flags gets: the tuned setting, projected the same way.
        "p50_as_tuned_ms": at_target(row["p50_ms"]),
        "gold_points_lost_as_tuned": 100 * (flat["gold_recall_at_20"] - row["gold_recall_at_20"]),
        "gold_points_lost": lost,
        "meets_ram": ram_gb <= GOAL_RAM_GB,
        "meets_recall": lost <= GOAL_RECALL_POINTS,
        "meets_p50": at_target(p50_here) < GOAL_P50_MS,
    }


def search_setting(row: dict) -> tuple[str, float, float]:
    """(the search setting a row is projected at, its gold recall@20, its p50 ms here). The first setting of
    the held-out sweep that meets the recall goal; when none does (the codes cap recall), the first whose gold
    recall is within half a point of the best the sweep saw, its p50 estimated from the tuned one's in
    proportion to the parameter (an IVF search scans nprobe lists, HNSW explores efSearch candidates: both
    linear); an exact index or one without a sweep, as tuned."""
    swept = row.get("sweep")
    if not swept:
        return "as built", row["gold_recall_at_20"], row["p50_ms"]
    if swept["goal"]:
        return (
            f"{swept['parameter']}={swept['goal']['value']}",
            swept["goal"]["gold_recall_at_20"],
            swept["goal"]["p50_ms"],
        )
    best = max(step["gold_recall_at_20"] for step in swept["steps"])
    knee = next(step for step in swept["steps"] if step["gold_recall_at_20"] >= best - 0.005)
    tuned = row["search_params"][swept["parameter"]]
    p50 = row["p50_ms"] * knee["value"] / tuned
    return f"{swept['parameter']}={knee['value']} (p50 est.)", knee["gold_recall_at_20"], p50


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


MEASURED = [
    ("factory", "factory", ""),
    ("kind", "kind", ""),
    ("bytes/passage", "bytes_per_passage", ",.0f"),
    ("build s", "build_s", ",.1f"),
    ("of which train s", "train_s", ",.1f"),
    ("tune s", "tune_s", ",.1f"),
    ("tuned", lambda r: ", ".join(f"{k}={v}" for k, v in r["search_params"].items()) or "-", ""),
    ("tune recall (its measure, `tune`'s queries)", lambda r: r["tuned"].get("recall"), ".3f"),
    ("recall@1", "recall_at_1", ".3f"),
    ("recall@20", "recall_at_20", ".3f"),
    ("recall@100", "recall_at_100", ".3f"),
    ("gold recall@20", "gold_recall_at_20", ".3f"),
    ("p50 ms", "p50_ms", ".2f"),
    ("p95 ms", "p95_ms", ".2f"),
    (f"p50 ms, {CONCURRENT} at once", "p50_concurrent_ms", ".1f"),
    (f"p95 ms, {CONCURRENT} at once", "p95_concurrent_ms", ".1f"),
]
PROJECTED = [
    ("factory at 21M", lambda r: r["projection"]["factory"], ""),
    ("search setting", lambda r: r["projection"]["setting"], ""),
    ("index GB", lambda r: r["projection"]["index_gb"], ".1f"),
    ("RAM GB (with ids)", lambda r: r["projection"]["ram_gb"], ".1f"),
    ("re-scored rows on disk GB", lambda r: r["projection"].get("rows_on_disk_gb") or "-", ".0f"),
    ("build core-hours", lambda r: r["projection"]["build_core_h"], ",.1f"),
    ("p50 ms", lambda r: r["projection"]["p50_ms"], ",.1f"),
    ("gold recall@20 lost (points)", lambda r: r["projection"]["gold_points_lost"], ".1f"),
    ("<= 8 GB", lambda r: yes(r["projection"]["meets_ram"]), ""),
    ("within 1 point", lambda r: yes(r["projection"]["meets_recall"]), ""),
    ("p50 < 100 ms", lambda r: yes(r["projection"]["meets_p50"]), ""),
    ("as tuned: setting", lambda r: ", ".join(f"{k}={v}" for k, v in r["search_params"].items()) or "-", ""),
    ("as tuned: p50 ms", lambda r: r["projection"]["p50_as_tuned_ms"], ",.1f"),
    ("as tuned: points lost", lambda r: r["projection"]["gold_points_lost_as_tuned"], ".1f"),
]

GOAL_SETTING = [
    ("factory", "factory", ""),
    ("tuned (rlm index)", lambda r: ", ".join(f"{k}={v}" for k, v in r["search_params"].items()), ""),
    ("gold recall@20 at tuned", "gold_recall_at_20", ".3f"),
    (
        "steps (value: recall@20 / gold recall@20)",
        lambda r: "; ".join(
            f"{x['value']}: {x['recall_at_20']:.3f} / {x['gold_recall_at_20']:.3f}"
            for x in r["sweep"]["steps"]
        ),
        "",
    ),
    (
        "meets the goal at",
        lambda r: (g := r["sweep"]["goal"]) and f"{r['sweep']['parameter']}={g['value']}",
        "",
    ),
    ("recall@1", lambda r: (g := r["sweep"]["goal"]) and g["recall_at_1"], ".3f"),
    ("recall@100", lambda r: (g := r["sweep"]["goal"]) and g["recall_at_100"], ".3f"),
    ("p50 ms", lambda r: (g := r["sweep"]["goal"]) and g["p50_ms"], ".2f"),
    ("p95 ms", lambda r: (g := r["sweep"]["goal"]) and g["p95_ms"], ".2f"),
]


def markdown(results: dict) -> str:
    rows, s = results["rows"], results["settings"]
    return (
        f"# Index study: bytes, recall and latency per faiss factory\n\n"
        f"Command: `{results['command']}`; {reporting.machine_line(results['machine'])}; "
        f"OMP_NUM_THREADS={s['omp_threads']}.\n\n"
        f"N = {s['n']:,} synthetic passages x {D} (the model in `scripts/bench/bench_index.py`'s docstring), "
        f"{s['queries']:,} held-out queries; IVF lists = {s['nlist']:,}, trained on {s['train_per_list']} rows "
        f"per list; tuned by `PassageIndex.tune` ({tuning_rule(rows, s['target_recall'])}, on "
        f"{s['tune_queries']} {tuned_on(rows)}); exact search of the tuning rows (once, shared) "
        f"{s['exact_tune_s']:.1f} s. "
        f"Latency: one query per search, k={K_READ}, {s['latency_queries']} queries alone, "
        f"{s['concurrent_queries']} over {CONCURRENT} threads.\n\n"
        f"## Measured\n\n{reporting.table(rows, MEASURED)}\n\n"
        f"## Projected to {TARGET_N / 1e6:.0f}M passages\n\n"
        f"Goal: RAM <= {GOAL_RAM_GB:g} GB, gold recall@20 within {GOAL_RECALL_POINTS:g} point of Flat, "
        f"p50 < {GOAL_P50_MS:g} ms on CPU. RAM = the index's per-passage bytes x 21M + its coarse quantizer at "
        f"{nlist_for(TARGET_N):,} lists + ids ({ID_BYTES} B/passage); a `{RESCORED}<f>` row re-scores the codes' "
        f"top f x k exactly from the float16 rows (`PassageIndex.rescore_from`: the buffer's shards, memory-mapped, "
        f"read by offset: on disk, not in the RAM column; here they were in the page cache, and reads from disk "
        f"at 21M are not measured). p50: see `project`. Each row at the search "
        f"setting that meets the recall goal on held-out queries, or where its recall stops growing (below); "
        f"the recall lost is measured at that setting here. 'As tuned': at the setting `tune` chose (what `rlm "
        f"index` without search flags saves), projected the same way.\n\n"
        f"{reporting.table(rows, PROJECTED)}\n" + goal_section(rows)
    )


def tuning_rule(rows: list[dict], target: float) -> str:
    """What `tune` aimed for in these results."""
    tuned = next((r["tuned"] for r in rows if r.get("tuned")), {})
    if tuned.get("measure") == "source rows kept":
        return (
            f"the smallest setting whose top {tuned['k']} holds the source row of >= {target:.1%} of the made "
            f"questions whose source exact search ranks in its top {tuned['k']}"
        )
    return f"recall@{tuned.get('k', 100)} against exact search >= {target}"  # reports before 2026-11-28


def tuned_on(rows: list[dict]) -> str:
    """What `tune` took as queries in these results: bare indexed rows (before question_like_rows) or rows made
    question-like."""
    made = next((r["tuned"] for r in rows if r.get("tuned")), {})
    if made.get("queries_from", "rows") == "rows":
        return "indexed rows used as queries, each finding its own list or neighbourhood at once"
    return (
        f"indexed rows made question-like by `question_like_rows`, each row plus {made['noise_scale']:.2f} x the "
        f"difference of two random rows, found in its exact top {made['found_within']} for "
        f"{made['found_share']:.0%} of them"
    )


def goal_section(rows: list[dict]) -> str:
    """Each tunable factory's search parameter raised on the held-out queries until the goal's recall is met."""
    swept = [r for r in rows if r.get("sweep")]
    if not swept:
        return ""
    return (
        f"\n## The setting that meets the recall goal\n\n`tune` chooses on {tuned_on(rows)}; here the parameter "
        f"is raised on the held-out queries until the "
        f"gold passage's recall@20 is within {GOAL_RECALL_POINTS:g} point of Flat's ('-': never, the codes cap "
        f"it):\n\n{reporting.table(swept, GOAL_SETTING)}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 20k, four factories, fewer queries")
    parser.add_argument("--n", type=int, default=None, help="passages (default 1,000,000; --quick 20,000)")
    parser.add_argument(
        "--factories", default=None, help="faiss factories separated by ';' ({nlist}: N/1,000)"
    )
    parser.add_argument(
        "--queries", type=int, default=None, help="held-out queries for recall (default 1,000)"
    )
    parser.add_argument(
        "--latency-queries", type=int, default=None, help="single searches timed (default 200)"
    )
    parser.add_argument("--concurrent-queries", type=int, default=None, help="searches over 20 threads (400)")
    parser.add_argument("--latency-seconds", type=float, default=30.0, help="wall budget of each latency run")
    parser.add_argument("--tune-queries", type=int, default=1000, help="PassageIndex.tune's queries")
    parser.add_argument("--train-per-list", type=int, default=64, help="training rows per IVF list")
    parser.add_argument(
        "--scratch", default=None, help="folder for the saved indexes (default: the system's)"
    )
    parser.add_argument("--out", default=reporting.results_path("bench_index"), help="output stem")
    parser.add_argument("--render", default=None, help="redo the report from this JSON, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:  # the projections too: they are functions of the measurements
        results = reporting.load_results(args.render)
        flat = {"gold_recall_at_20": results["settings"]["flat_gold_recall_at_20"]}
        for row in results["rows"]:
            row["projection"] = project(row, flat, results["coarse"])
        reporting.write_report(Path(args.render).with_suffix(""), markdown(results), results)
        return 0
    if args.scratch is not None:  # a folder named for the indexes is made, as --out's is
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    import faiss
    import torch

    from rlm.retriever.index import DEFAULT_TARGET_RECALL, PassageIndex

    quick = args.quick
    n = args.n or (20_000 if quick else 1_000_000)
    factories = [f for f in (args.factories or "").split(";") if f] or (
        QUICK_FACTORIES if quick else FACTORIES
    )
    args.queries = args.queries or (200 if quick else 1_000)
    args.latency_queries = args.latency_queries or (40 if quick else 200)
    args.concurrent_queries = args.concurrent_queries or (80 if quick else 400)
    if quick:
        args.tune_queries = min(args.tune_queries, 300)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()))
    passages, queries, gold = synthetic(n, args.queries)
    flat = PassageIndex.build(passages, [str(i) for i in range(n)], "Flat", use_gpu=False)
    _, exact = flat.search_rows(queries, K_MAX)
    del flat
    flat_gold = float((exact[:, :K_READ] == gold[:, None]).any(-1).mean())
    settings = {
        "n": n,
        "nlist": nlist_for(n),
        "queries": len(queries),
        "latency_queries": args.latency_queries,
        "concurrent_queries": args.concurrent_queries,
        "tune_queries": args.tune_queries,
        "train_per_list": args.train_per_list,
        "target_recall": DEFAULT_TARGET_RECALL,
        "omp_threads": faiss.omp_get_max_threads(),
    }
    results = {"command": reporting.command("bench_index.py", argv), "machine": reporting.machine()}
    results |= {"settings": settings, "rows": []}
    ivf = any("IVF" in f for f in factories)
    results["coarse"] = {
        str(lists): coarse_costs(lists) for lists in {nlist_for(n), nlist_for(TARGET_N)} if ivf
    }
    settings["flat_gold_recall_at_20"] = flat_gold
    built, stored = {}, []

    def stored_rows():  # the float16 rows `rlm embed` would have written, made once when asked for
        if not stored:
            from rlm.retriever.buffer import PassageBuffer

            stored.append(
                PassageBuffer.from_embeddings(range(n), torch.from_numpy(passages.astype(np.float16)))
            )
        return stored[0]

    with ExactOnce() as exact_once:
        for factory in factories:
            row = measure(
                factory, passages, queries, gold, exact, flat_gold, args, exact_once, built, stored_rows
            )
            row["projection"] = project(row, {"gold_recall_at_20": flat_gold}, results["coarse"])
            results["rows"].append(row)
            settings["exact_tune_s"] = exact_once.seconds
            # Written after each factory: a long run stopped part way still leaves its report.
            reporting.write_report(args.out, markdown(results), results, echo=False)
            print(
                f"{row['factory']}: {row['bytes_per_passage']:.0f} B/passage, build {row['build_s']:.1f} s, "
                f"tune {row['tune_s']:.1f} s {row['search_params']}, recall@20 {row['recall_at_20']:.3f}, "
                f"p50 {row['p50_ms']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
