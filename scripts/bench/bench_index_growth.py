"""Index growth study (issue 47): how the search setting `tune` keeps grows with the corpus, and the 21M figures
that follow from the measured trend, not from holding nprobe constant.

At each size N, an index is built as `rlm index` builds it (IVF lists = N/1,000 rounded to a power of two:
`bench_index.nlist_for`, which gives IVF16384 at 21M, as the recommendation scales them), tuned by
`PassageIndex.tune` to its default target (99.5% of the answers exact search finds in its top 20, on 1,000 rows
made question-like), and measured on held-out questions: the tuned value as a share of the lists (IVF) or as
efSearch (HNSW), the codes scanned per question (faiss's own count), the answer's recall@20 lost against exact
search, p50 of one question on one core and on every core (faiss `parallel_mode` 1: the lists of one question
split over the cores), RAM and build time.

Corpora:
  synthetic  the index study's model (scripts/bench/bench_index.py's docstring), 768-d, its held-out queries
  toy        the toy world's passages (rlm.data.toy_world: generated sentences) embedded by the packaged
             all-MiniLM-L6-v2 (384-d; a real encoder on text with real structure, not Wikipedia); its dev
             questions are the held-out ones (gold passage known), its test questions a second tuning run
             (`tune(query_vectors=...)`: what the index is asked)

The trend: share = a + b log2(N), least squares over the largest three sizes of one corpus and factory; at 21M the share is
that fit (clipped to [1/lists, 1]), nprobe the power of two `tune` would reach, p50 the measured time per code
scanned (its spread over the sizes printed: the projection holds it constant) x the codes scanned at 21M, plus
the coarse quantizer's search at 16,384 lists. The assumption is written in the report: the share's fit over
the measured sizes holds to 21M.

    OMP_NUM_THREADS=2 python scripts/bench/bench_index_growth.py --corpus synthetic --sizes 250000,1000000,4000000
    OMP_NUM_THREADS=2 python scripts/bench/bench_index_growth.py --corpus toy --sizes 62500,250000,1000000
    python scripts/bench/bench_index_growth.py --quick                   # 4k and 16k synthetic rows, a minute
    python scripts/bench/bench_index_growth.py --render scripts/bench/reports/bench_index_growth/bench_index_growth.json

Each size's rows are added to `--out`'s JSON as they finish (a long run stopped part way keeps them; a size run
again replaces its rows), and the report is rendered from all of them.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from lab import reporting

SCRIPTS = Path(__file__).resolve().parent
TARGET_N = 21_000_000
FACTORIES = {"synthetic": "IVF{nlist},PQ256np+rescore5", "toy": "IVF{nlist},Flat"}
QUICK_FACTORIES = {"synthetic": "IVF{nlist},PQ32x4np+rescore5;HNSW32,SQ8", "toy": "IVF{nlist},Flat"}
RESCORED = "+rescore"
K = 20
# The fit uses the largest sizes only: the nearest to 21M, and three, the fewest a constant is claimed from.
FIT_SIZES = 3
GOAL_POINTS = 1.0  # the goal's recall: gold recall@20 within a point of exact search's
TOY_QUESTIONS = 1000  # dev (held out) and test (a second tuning) questions of each toy world


def bench_index():
    """scripts/bench/bench_index.py as a module (its model, list rule, latency and cost helpers): loaded from its
    file, since scripts/ is not a package and must not shadow the libraries on sys.path."""
    spec = importlib.util.spec_from_file_location("bench_index", SCRIPTS / "bench_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = bench_index()


def synthetic_corpus(n: int, queries: int) -> dict:
    passages, held_out, gold = BENCH.synthetic(n, queries)
    return {"rows": passages, "held_out": held_out, "gold": gold, "questions": None, "dim": BENCH.D}


def toy_corpus(n: int, work: Path) -> dict:
    """A toy world of n passages embedded by MiniLM (kept in `work`: a second run reuses it), its dev
    questions' embeddings with their gold rows, and its test questions' embeddings."""
    import torch

    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.data.toy_world import build_toy_world
    from rlm.retriever.buffer import build_passage_buffer
    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    world = work / f"toy_{n}"
    if not (world / "world.json").is_file():
        build_toy_world(
            world, num_passages=n, seed=0, max_questions={"dev": TOY_QUESTIONS, "test": TOY_QUESTIONS}
        )
    corpus = load_corpus(world / "corpus.jsonl")
    encoder = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=128)
    buffer = build_passage_buffer(
        corpus.ids,
        corpus.retrieval_texts(),
        encoder,
        work / f"toy_{n}_minilm",
        batch_size=256,
        show_progress=True,
    )
    rows = buffer.rows(torch.arange(len(buffer))).float().numpy()
    dev = [q for q in load_qa_dataset("toy", "dev", world) if q.gold_passage_ids]
    test = load_qa_dataset("toy", "test", world)
    gold = np.array([corpus.index_of(q.gold_passage_ids[0]) for q in dev])
    held_out = encoder.encode([q.question for q in dev], batch_size=256).numpy()
    questions = encoder.encode([q.question for q in test], batch_size=256).numpy()
    return {"rows": rows, "held_out": held_out, "gold": gold, "questions": questions, "dim": rows.shape[1]}


def exact_top(rows: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Exact search's top-k rows of `queries` (`corrected_topk` over the rows, not copied)."""
    import torch

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.search import corrected_topk

    buffer = PassageBuffer.from_embeddings(range(len(rows)), torch.from_numpy(rows))
    return corrected_topk(torch.from_numpy(queries), buffer, None, k).indices.numpy()


def codes_scanned(index, queries: np.ndarray) -> float:
    """Codes an IVF search compares per query (faiss's `indexIVF_stats.ndis`), or HNSW's distance count."""
    import faiss

    stats = faiss.cvar.indexIVF_stats if "IVF" in index.factory else faiss.cvar.hnsw_stats
    stats.reset()
    index.search_rows(queries, K)
    return float(stats.ndis) / len(queries)


def p50_ms(index, queries: np.ndarray, cores: int, budget_s: float) -> float:
    """p50 of one question per search on `cores` faiss threads (IVF: one question's lists split over them)."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index.index)
    if ivf is not None:
        ivf.parallel_mode = 1 if cores > 1 else 0
    faiss.omp_set_num_threads(cores)
    index.search_rows(queries[:1], K)  # warm-up
    seconds = BENCH.latencies(index, queries, 1, budget_s)
    return 1e3 * float(np.median(seconds))


def measure(corpus: dict, factory: str, args) -> dict:
    """One factory at one size: build, tune, recall against exact search, codes scanned, p50, bytes."""
    import faiss
    import torch

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex

    rows, n = corpus["rows"], len(corpus["rows"])
    template, _, k_factor = factory.partition(RESCORED)
    nlist = lists_for(template, n)
    name = template.format(nlist=BENCH.nlist_for(n), nlist4=4 * BENCH.nlist_for(n))
    start = time.perf_counter()
    with BENCH.TimedTraining() as training:
        index = PassageIndex.build(
            rows, [str(i) for i in range(n)], name, use_gpu=False, train_sample=max(40 * nlist, 39 * 256)
        )
    build_s = time.perf_counter() - start
    buffer = PassageBuffer.from_embeddings(range(n), torch.from_numpy(rows))
    if k_factor:
        index.rescore_from(buffer, int(k_factor))
    start = time.perf_counter()
    tuned = index.tune(buffer, queries=args.tune_queries)
    tune_s = time.perf_counter() - start
    on_questions = None
    if corpus["questions"] is not None:  # the same index tuned on real questions, then set back
        on_questions = dict(index.tune(buffer, query_vectors=corpus["questions"]))
        index.set_search_params({tuned["parameter"]: tuned["value"]})
        index.tuning = tuned
    held_out, gold = corpus["held_out"], corpus["gold"]
    _, found = index.search_rows(held_out, K)
    exact = corpus["exact"]
    lost = 100 * float((exact == gold[:, None]).any(-1).mean() - (found == gold[:, None]).any(-1).mean())
    goal = smallest_within_a_point(index, held_out, gold, exact, tuned)
    latency = held_out[: args.latency_queries]
    one_core = p50_ms(index, latency, 1, args.latency_seconds)
    all_cores = p50_ms(index, latency, args.cores, args.latency_seconds)
    scanned = codes_scanned(index, held_out[:200])
    rescoring, index.rescoring = index.rescoring, None
    index_bytes = len(faiss.serialize_index(index.index))
    index.rescoring = rescoring
    ivf = faiss.try_extract_index_ivf(index.index)
    return {
        "corpus": args.corpus,
        "n": n,
        "dim": corpus["dim"],
        "factory": name + (f"{RESCORED}{k_factor}" if k_factor else ""),
        "factory_template": factory,
        "nlist": None if ivf is None else int(ivf.nlist),
        "parameter": tuned["parameter"],
        "value": tuned["value"],
        "share": tuned["value"] / ivf.nlist if ivf is not None else None,
        "tune_recall": tuned["recall"],
        "on_questions": None
        if on_questions is None
        else {"value": on_questions["value"], "recall": on_questions["recall"]},
        "gold_points_lost": lost,
        # The held-out questions' own answer: the smallest setting within 1 point of exact search's gold recall@20.
        "goal_value": goal,
        "goal_share": goal / ivf.nlist if goal is not None and ivf is not None else None,
        "codes_per_query": scanned,
        "p50_ms_1_core": one_core,
        "p50_ms_all_cores": all_cores,
        "us_per_code": 1e3 * one_core / scanned if scanned else None,
        "bytes_per_passage": index_bytes / n,
        "index_bytes": index_bytes,
        "quantizer_bytes": 0 if ivf is None else len(faiss.serialize_index(ivf.quantizer)),
        "build_s": build_s,
        "train_s": training.seconds,
        "tune_s": tune_s,
    }


def lists_for(template: str, n: int) -> int:
    """IVF lists of a factory template at n rows: `{nlist}` N/1,000 (16,384 at 21M), `{nlist4}` four times as
    many (65,536 at 21M: autofaiss's pick for 21M x 768 in 8 GB, with an HNSW coarse quantizer)."""
    return (4 if "{nlist4}" in template else 1) * BENCH.nlist_for(n)


def trend(x: np.ndarray, values: list[float]) -> tuple[float, float]:
    """(intercept, slope) of values against log2 N, least squares."""
    slope, intercept = np.polyfit(x, values, 1)
    return float(intercept), float(slope)


def smallest_within_a_point(index, held_out: np.ndarray, gold: np.ndarray, exact: np.ndarray, tuned: dict):
    """The smallest value of the tuned parameter (`tune`'s own steps, on past the one it chose to the last it
    has: every list, or the largest efSearch) whose gold recall@20 on the held-out questions is within
    `GOAL_POINTS` of exact search's; None if none is (the codes cap it). The tuned value is set again after."""
    name, chosen = tuned["parameter"], tuned["value"]
    exact_gold = float((exact == gold[:, None]).any(-1).mean())
    found_value = None
    import faiss

    from rlm.retriever.index import EF_SEARCH_VALUES

    ivf = faiss.try_extract_index_ivf(index.index)
    values = EF_SEARCH_VALUES if ivf is None else [2**i for i in range(int(math.log2(ivf.nlist)) + 1)]
    for value in values:
        index.set_search_params({name: value})
        _, found = index.search_rows(held_out, K)
        if 100 * (exact_gold - float((found == gold[:, None]).any(-1).mean())) <= GOAL_POINTS:
            found_value = value
            break
    index.set_search_params({name: chosen})
    return found_value


def fit(rows: list[dict]) -> dict | None:
    """One series (corpus, factory) over its largest `FIT_SIZES` sizes, fitted in log2 N, and what it gives at
    21M: IVF's share of the lists, or HNSW's efSearch and the distances a question computes."""
    from rlm.retriever.index import EF_SEARCH_VALUES

    all_rows = sorted(rows, key=lambda r: r["n"])
    rows = all_rows[-FIT_SIZES:]
    if len(rows) < 2:
        return None
    x, at = np.log2([r["n"] for r in rows]), math.log2(TARGET_N)
    template = rows[0]["factory_template"].partition(RESCORED)[0]
    if rows[0]["share"] is not None:
        lists = lists_for(template, TARGET_N)
        a, b = trend(x, [r["share"] for r in rows])
        share = float(np.clip(a + b * at, 1 / lists, 1.0))
        value = min(lists, 2 ** math.ceil(math.log2(max(1.0, share * lists))))
        codes = value / lists * TARGET_N
        setting, measured = f"nprobe={value:,} of {lists:,}", [f"{r['share']:.3f}" for r in rows]
        # A flat coarse quantizer is searched whole (768-d: measured); an HNSW one walks a few hundred centroids.
        flat_quantizer = "HNSW" not in template.split(",")[0] and rows[0]["dim"] == BENCH.D
        coarse = BENCH.coarse_costs(lists)["query_ms"] if flat_quantizer else 0.0
        last = rows[-1]
        grows = last["index_bytes"] - last["quantizer_bytes"]
        ram_gb = (grows / last["n"] * TARGET_N + last["quantizer_bytes"] * lists / last["nlist"]) / 1e9
    else:
        a, b = trend(x, [r["value"] for r in rows])
        value = next((v for v in EF_SEARCH_VALUES if v >= a + b * at), EF_SEARCH_VALUES[-1])
        c, d = trend(x, [r["codes_per_query"] for r in rows])
        codes, coarse = c + d * at, 0.0
        setting, measured = f"efSearch={value:,}", [f"{r['value']:,}" for r in rows]
        ram_gb = rows[-1]["bytes_per_passage"] * TARGET_N / 1e9
    ram_gb += TARGET_N * BENCH.ID_BYTES / 1e9
    per_code = [r["us_per_code"] for r in rows]
    p50 = float(np.mean(per_code)) * codes / 1e3 + coarse
    speedup = float(np.mean([r["p50_ms_1_core"] / r["p50_ms_all_cores"] for r in rows]))
    goal = None  # the same fit of what the held-out questions need (within a point of exact search)
    swept = [r for r in all_rows if r.get("goal_share") is not None][-FIT_SIZES:]
    if rows[0]["share"] is not None and len(swept) >= 2:
        c, d = trend(np.log2([r["n"] for r in swept]), [r["goal_share"] for r in swept])
        goal_share = float(np.clip(c + d * at, 1 / lists, 1.0))
        goal_value = min(lists, 2 ** math.ceil(math.log2(max(1.0, goal_share * lists))))
        goal = {
            "constant": len(swept) >= FIT_SIZES and len({r["goal_share"] for r in swept}) == 1,
            "setting": f"nprobe={goal_value:,} of {lists:,}",
            "measured": [f"{r['goal_share']:.3f} ({r['n']:,})" for r in swept],
            "p50_ms_1_core": float(np.mean(per_code)) * goal_value / lists * TARGET_N / 1e3 + coarse,
        }
    held = [r["share"] if r["share"] is not None else r["value"] for r in rows]
    return {
        "goal": goal,
        # The rule of a projection: what it holds constant was measured constant at three sizes or more.
        "constant": len(rows) >= FIT_SIZES and len(set(held)) == 1,
        "sizes": [r["n"] for r in rows],
        "measured": measured,
        "slope_per_doubling": b,
        "setting_at_target": setting,
        "codes_at_target": codes,
        "us_per_code": per_code,
        "p50_ms_1_core": p50,
        "p50_ms_all_cores": p50 / speedup,
        "ram_gb": ram_gb,
        "gold_points_lost": [r["gold_points_lost"] for r in rows],
    }


def series(results: dict) -> dict[tuple[str, str], list[dict]]:
    found: dict[tuple[str, str], list[dict]] = {}
    for row in results["rows"]:
        found.setdefault((row["corpus"], row["factory_template"]), []).append(row)
    return {key: sorted(rows, key=lambda r: r["n"]) for key, rows in found.items()}


MEASURED = [
    ("corpus", "corpus", ""),
    ("N", "n", ","),
    ("factory", "factory", ""),
    ("tuned", lambda r: f"{r['parameter']}={r['value']}", ""),
    ("share of lists", "share", ".3f"),
    ("tuned on real questions", lambda r: r["on_questions"] and f"{r['on_questions']['value']}", ""),
    ("answers kept (tune)", "tune_recall", ".3f"),
    ("gold recall@20 lost (points)", "gold_points_lost", ".2f"),
    ("within 1 point from (held out)", lambda r: r.get("goal_value") and f"{r['goal_value']}", ""),
    ("its share of lists", "goal_share", ".3f"),
    ("codes scanned / question", "codes_per_query", ",.0f"),
    ("us per code", "us_per_code", ".4f"),
    ("p50 ms, 1 core", "p50_ms_1_core", ".2f"),
    ("p50 ms, all cores", "p50_ms_all_cores", ".2f"),
    ("bytes/passage", "bytes_per_passage", ",.0f"),
    ("build s", "build_s", ",.1f"),
    ("tune s", "tune_s", ",.1f"),
]
PROJECTED = [
    ("corpus, factory", lambda r: f"{r['corpus']}, {r['factory']}", ""),
    ("sizes", lambda r: ", ".join(f"{n:,}" for n in r["sizes"]), ""),
    ("tuned: share of lists, or efSearch", lambda r: ", ".join(r["measured"]), ""),
    ("its change per doubling of N", "slope_per_doubling", "+.3f"),
    ("constant at 3 sizes", lambda r: "yes" if r["constant"] else "no: a trend, extrapolated", ""),
    ("setting at 21M (fit)", "setting_at_target", ""),
    ("codes / question at 21M", "codes_at_target", ",.0f"),
    ("us per code (sizes)", lambda r: ", ".join(f"{u:.4f}" for u in r["us_per_code"]), ""),
    ("p50 ms at 21M, 1 core", "p50_ms_1_core", ",.0f"),
    ("p50 ms at 21M, all cores", "p50_ms_all_cores", ",.0f"),
    ("RAM GB at 21M", "ram_gb", ".1f"),
    ("points lost (sizes)", lambda r: ", ".join(f"{p:.2f}" for p in r["gold_points_lost"]), ""),
    ("held out within 1 point: share (sizes)", lambda r: r["goal"] and ", ".join(r["goal"]["measured"]), ""),
    (
        "constant at 3 sizes (held out)",
        lambda r: r["goal"] and ("yes" if r["goal"]["constant"] else "no"),
        "",
    ),
    ("its setting at 21M", lambda r: r["goal"] and r["goal"]["setting"], ""),
    ("its p50 ms at 21M, 1 core", lambda r: r["goal"] and r["goal"]["p50_ms_1_core"], ",.0f"),
]


def markdown(results: dict) -> str:
    projected = []
    for (corpus, template), rows in series(results).items():
        trend = fit(rows)
        if trend is not None:
            projected.append({"corpus": corpus, "factory": template, **trend})
    results["projections"] = projected
    return (
        "# Index growth: the tuned setting against the corpus size, and 21M from the trend\n\n"
        f"{reporting.machine_line(results['machine'])}; commands: "
        + "; ".join(f"`{c}`" for c in results["commands"])
        + ".\n\nEach size's index tuned by `PassageIndex.tune`'s default (99.5% of the answers exact search "
        "finds in its top 20, on rows made question-like); IVF lists = N/1,000 rounded to a power of two. "
        "Held-out questions: the synthetic model's queries, the toy world's dev questions (gold passage known). "
        "'tuned on real questions': the same index tuned on the toy world's test questions instead.\n\n"
        f"## Measured\n\n{reporting.table(results['rows'], MEASURED)}\n\n"
        "## Projected to 21M passages from the trend\n\n"
        "Assumption: what the tuning keeps follows a + b log2(N) fitted over the largest three measured sizes "
        "(the table shows what it was fitted on): an IVF index's share of its lists (then nprobe at 21M is that share of "
        "16,384 lists for `{nlist}`, 65,536 for `{nlist4}`, rounded up to a power of two as `tune` steps), an "
        "HNSW index's efSearch and the distances a question computes. The time per code scanned is held "
        "constant (shown per size). p50 = that time x the codes at 21M, + a flat coarse quantizer's search "
        "at 21M's lists (768-d only). RAM: the largest size's bytes per passage x 21M (with its quantizer at "
        "21M's lists) + ids.\n\n"
        f"{reporting.table(projected, PROJECTED)}\n"
    )


def plot(results: dict):
    fig, ax = reporting.figure()
    for (corpus, template), rows in series(results).items():
        ivf = [r for r in rows if r["share"] is not None]  # HNSW's efSearch is in the tables
        if ivf:
            ax.plot([r["n"] for r in ivf], [r["share"] for r in ivf], "o-", label=f"{corpus}: {template}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("passages N (lists: N/1,000, or 4x for {nlist4})")
    ax.set_ylabel("nprobe tuned / lists")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--corpus", choices=("synthetic", "toy"), default="synthetic")
    parser.add_argument("--sizes", type=reporting.int_list, default=None, help="passages, comma-separated")
    parser.add_argument(
        "--factories", default=None, help="faiss factories separated by ';' ({nlist}: N/1,000)"
    )
    parser.add_argument("--quick", action="store_true", help="4k and 16k synthetic rows, small settings")
    parser.add_argument("--queries", type=int, default=1000, help="held-out synthetic queries")
    parser.add_argument("--tune-queries", type=int, default=1000, help="PassageIndex.tune's made questions")
    parser.add_argument("--latency-queries", type=int, default=200, help="questions timed one at a time")
    parser.add_argument("--latency-seconds", type=float, default=20.0, help="wall budget of each latency run")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="faiss threads for 'all cores'")
    parser.add_argument("--work", default="/tmp/bench_index_growth", help="toy worlds and their embeddings")
    parser.add_argument("--out", default=reporting.results_path("bench_index_growth"), help="output stem")
    parser.add_argument("--render", default=None, help="redo the report from this JSON, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:
        results = reporting.load_results(args.render)
        reporting.write_report(
            Path(args.render).with_suffix(""), markdown(results), results, {".png": lambda: plot(results)}
        )
        return 0
    if args.quick:
        args.sizes = args.sizes or [4_000, 16_000]
        args.queries, args.tune_queries, args.latency_queries, args.latency_seconds = 200, 300, 20, 2.0
    sizes = args.sizes or (
        [250_000, 1_000_000, 4_000_000] if args.corpus == "synthetic" else [62_500, 250_000, 1_000_000]
    )
    chosen = args.factories or (QUICK_FACTORIES if args.quick else FACTORIES)[args.corpus]
    factories = [f for f in chosen.split(";") if f]
    stem = Path(args.out)
    results = reporting.load_results(stem.with_suffix(".json")) if stem.with_suffix(".json").is_file() else {}
    results.setdefault("rows", [])
    results["machine"] = reporting.machine()
    results.setdefault("commands", []).append(reporting.command("bench_index_growth.py", argv))
    for n in sizes:
        start = time.perf_counter()
        corpus = (
            synthetic_corpus(n, args.queries)
            if args.corpus == "synthetic"
            else toy_corpus(n, Path(args.work))
        )
        corpus["exact"] = exact_top(corpus["rows"], corpus["held_out"], K)
        print(
            f"{args.corpus} N={n:,}: corpus and exact search {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
        for factory in factories:
            row = measure(corpus, factory, args)
            results["rows"] = [
                r
                for r in results["rows"]
                if (r["corpus"], r["n"], r["factory_template"]) != (args.corpus, n, factory)
            ] + [row]
            reporting.write_report(
                stem, markdown(results), results, {".png": lambda: plot(results)}, echo=False
            )
            print(
                f"  {row['factory']}: {row['parameter']}={row['value']} (share {row['share']}), "
                f"{row['gold_points_lost']:.2f} points lost, p50 {row['p50_ms_1_core']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        del corpus
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
