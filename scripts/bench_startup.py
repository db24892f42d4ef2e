"""Start-up cost of the corpus side of training and of the demo, before and after the scan-time fingerprint.

    .venv/bin/python scripts/bench_startup.py                      # 5,000,000 passages
    .venv/bin/python scripts/bench_startup.py --passages 1000000   # smaller

Generates a synthetic DPR `psgs_w100.tsv` (`id<TAB>text<TAB>title`, 100-word texts, csv-style quoting when a
text holds a quote; deterministic from `--seed`) under `--workdir` (default /tmp/bench_startup; never commit
it), then runs every measurement in a fresh Python process and records its wall seconds and the process's
peak RSS (VmHWM from /proc/self/status; `ru_maxrss` elsewhere):

* before (the code at `--before-commit`, the commit this change started from): `rlm.data.corpus.Corpus` of
  that commit (loaded from `git show`), then `retriever.buffer.corpus_fingerprint(corpus.ids,
  corpus.retrieval_texts())` (unchanged: the old (id, text) pair hash), then the demo's cached-index id check
  as it was (`ids.txt` read into a list of str, compared with the corpus ids in a Python loop);
* after: `load_corpus` (one pass: scan + file sha256), the same with the fingerprint taken from the demo's
  stat-keyed cache (no hashing), and `rlm.inference.evaluation.load_index_for` (ids as one blob, compared as bytes).

The "index" is a faiss Flat index of dimension 1 over the corpus's rows (the real one's vectors are the same
in both versions; only its ids are measured here). Writes docs/results/bench_startup/bench_startup.{json,md};
`--render JSON` rewrites the Markdown from a saved run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atomicio import atomic_open
from rlm.experiments import reporting

BEFORE_COMMIT = "331c0cd479c4340f9b3f1af453156133f9f51bc2"
DPR_PASSAGES = 21_015_324  # rows of psgs_w100.tsv


def write_dpr_tsv(path: Path, passages: int, seed: int = 0, words: int = 100) -> None:
    """A DPR-layout TSV with `passages` rows; every text is a `words`-word window of one random word pool."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "va", "sel", "dor", "an", "is", "um", "pe", "ro", "li", "no"]
    pick = lambda n: "".join(syllables[int(j)] for j in rng.integers(0, len(syllables), n))  # noqa: E731
    vocab = [pick(1 + int(rng.integers(0, 3))) for _ in range(5000)]
    # Common short words, a number and a quoted word (DPR quotes such texts csv-style: "...""x""...").
    vocab += ["the", "of", "and", "in", "a", "was", "to", "is", "1984", '"so-called"'] * 30
    pool_words = rng.integers(0, len(vocab), 2_000_000)
    pool = " ".join(vocab[int(w)] for w in pool_words).encode()
    starts = np.zeros(len(pool_words) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(vocab[int(w)]) + 1 for w in pool_words])
    titles = [
        " ".join(vocab[int(j)].capitalize() for j in rng.integers(0, 5000, 1 + int(rng.integers(0, 3))))
        for _ in range(100_000)
    ]
    with atomic_open(path, "wb") as f:
        f.write(b"id\ttext\ttitle\n")
        for lo in range(0, passages, 100_000):
            n = min(100_000, passages - lo)
            first, title_ix = rng.integers(0, len(pool_words) - words, n), rng.integers(0, len(titles), n)
            rows = []
            for k in range(n):
                text = pool[starts[int(first[k])] : starts[int(first[k]) + words] - 1]
                if b'"' in text:
                    text = b'"' + text.replace(b'"', b'""') + b'"'
                rows.append(b"%d\t%s\t%s\n" % (lo + k + 1, text, titles[int(title_ix[k])].encode()))
            f.write(b"".join(rows))


def peak_rss_mb() -> float:
    """This process's VmHWM: an exec'd process starts its own high-water mark, where `ru_maxrss` keeps the
    parent's across fork + exec (Linux only: this benchmark's numbers come from /proc)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def before_corpus_class(commit: str):
    """`Corpus` of rlm/data/corpus.py as it was at `commit` (stdlib + numpy only, so it imports on its own)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:rlm/data/corpus.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as folder:
        (Path(folder) / "corpus_before.py").write_text(source)
        spec = importlib.util.spec_from_file_location("corpus_before", Path(folder) / "corpus_before.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["corpus_before"] = module
        spec.loader.exec_module(module)
    return module.Corpus


def child(args) -> dict:
    """One measurement in this fresh process: phase -> wall and CPU seconds (on shared cores wall time swings
    with the other jobs' load; CPU time is what the work costs), plus the process's peak RSS."""
    import faiss  # every import before the clock starts, the same ones in every variant

    from retriever.buffer import corpus_fingerprint
    from rlm.data.corpus import load_corpus
    from rlm.inference import evaluation

    Corpus = before_corpus_class(args.before_commit)
    times, result, baseline = {}, {}, peak_rss_mb()
    started = (time.perf_counter(), time.process_time())

    def lap(name: str, since=started):
        times[name] = {"wall": time.perf_counter() - since[0], "cpu": time.process_time() - since[1]}
        return time.perf_counter(), time.process_time()

    if args.child.startswith("before"):
        corpus = Corpus(Path(args.corpus))
        now = lap("scan")
        if args.child != "before_scan":
            result["fingerprint"] = corpus_fingerprint(corpus.ids, corpus.retrieval_texts())
            now = lap("fingerprint", now)
        if args.child == "before_demo":
            # PassageIndex.load + load_index_for as they were: a list of str, then a row-by-row loop.
            index = faiss.read_index(str(Path(args.index) / "index.faiss"))
            ids = (Path(args.index) / "ids.txt").read_text(encoding="utf-8").split("\n")[: index.ntotal]
            assert len(ids) == len(corpus) and all(a == b for a, b in zip(ids, corpus.ids))
            lap("index ids", now)
    else:  # after_scan: scan and fingerprint in one pass; after_demo: the fingerprint from the demo's cache
        corpus = load_corpus(
            Path(args.corpus), fingerprint_cache=args.cache if args.child == "after_demo" else None
        )
        now = lap("scan")
        result["fingerprint"] = corpus.fingerprint
        if args.child == "after_demo":
            evaluation.load_index_for(args.index, corpus.ids)
            lap("index ids", now)
    lap("total")
    return {"times": times, "peak_rss_mb": peak_rss_mb(), "import_rss_mb": baseline, **result}


def prepare_index(corpus_path: Path, index_dir: Path) -> None:
    """A dimension-1 Flat index saved with the corpus ids (what a cached demo index holds, minus vectors)."""
    import numpy as np

    from retriever.index import PassageIndex
    from rlm.data.corpus import load_corpus

    corpus = load_corpus(corpus_path)
    PassageIndex.build(np.zeros((len(corpus), 1), dtype=np.float32), corpus.ids).save(index_dir)


def rows_of(runs: dict, passages: int) -> list[dict]:
    scale, zero = DPR_PASSAGES / passages, {"wall": 0.0, "cpu": 0.0}
    specs = [  # (step, before run and phase, after run and phase, peak RSS shown)
        ("corpus load (scan)", "before_scan", "scan", "after_scan", "scan", True),
        ("corpus fingerprint (extra pass)", "before_fingerprint", "fingerprint", None, None, False),
        (
            "training start, corpus side (scan + fingerprint)",
            "before_fingerprint",
            "total",
            "after_scan",
            "total",
            True,
        ),
        (
            "demo start, first (scan + fingerprint + index ids)",
            "before_demo",
            "total",
            "after_demo_first",
            "total",
            True,
        ),
        (
            "demo start, again (fingerprint from the cache)",
            "before_demo",
            "total",
            "after_demo",
            "total",
            True,
        ),
        ("  of which: index ids load + check", "before_demo", "index ids", "after_demo", "index ids", False),
    ]
    rows = []
    for step, b_run, b_key, a_run, a_key, rss in specs:
        before, after = runs[b_run]["times"][b_key], runs[a_run]["times"][a_key] if a_run else zero
        rows.append(
            {
                "step": step,
                "before_wall_s": before["wall"],
                "before_cpu_s": before["cpu"],
                "after_wall_s": after["wall"],
            }
            | {
                "after_cpu_s": after["cpu"],
                "before_cpu_s_21m": before["cpu"] * scale,
                "after_cpu_s_21m": after["cpu"] * scale,
            }
            | {"before_peak_rss_mb": runs[b_run]["peak_rss_mb"] if rss else None}
            | {"after_peak_rss_mb": runs[a_run]["peak_rss_mb"] if rss else None}
        )
    return rows


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    passages, size_gb = meta["passages"], meta["corpus_gb"]
    columns = [(f"step ({passages:,} passages, {size_gb:.1f} GB)", "step", "")]
    for when in ("before", "after"):
        columns += [(f"{when} wall s", f"{when}_wall_s", ",.1f"), (f"{when} CPU s", f"{when}_cpu_s", ",.1f")]
    columns += [(f"{when} peak RSS MB", f"{when}_peak_rss_mb", ",.0f") for when in ("before", "after")]
    columns += [(f"{when} CPU s at 21M", f"{when}_cpu_s_21m", ",.0f") for when in ("before", "after")]
    hash_cpu = runs["after_demo_first"]["times"]["scan"]["cpu"] - runs["after_demo"]["times"]["scan"]["cpu"]
    scan_cpu = runs["after_scan"]["times"]["scan"]["cpu"] - runs["before_scan"]["times"]["scan"]["cpu"]
    return f"""# Start-up: corpus scan, corpus fingerprint, demo restart

Command: `{meta["command"]}`; {reporting.machine_line(meta["machine"])}.
Corpus: synthetic DPR `psgs_w100.tsv` layout, {passages:,} passages of 100 words, {size_gb:.2f} GB.
Before = commit `{meta["before_commit"][:10]}` (`Corpus` scan, then `corpus_fingerprint(ids, texts)` over every
passage, index ids as a list of str); after = this code (fingerprint = sha256 of the bytes the scan reads;
the demo remembers it by the file's path, size and mtime; ids as one blob). Each measurement is one fresh
process; CPU seconds (user + system) are what the 21M columns extrapolate, linearly: CPU s at N x
{DPR_PASSAGES:,} / N. Peak RSS is the process's VmHWM, including {runs["before_scan"]["import_rss_mb"]:.0f} MB of
imports. The fingerprint's cost inside the scan: {hash_cpu:+.1f} CPU s (first demo start, hashing, minus the
second, cached); the "after" scan minus the "before" scan: {scan_cpu:+.1f} CPU s.

{reporting.table(rows_of(runs, passages), columns)}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=5_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_startup"))
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    parser.add_argument(
        "--out", type=Path, default=reporting.results_path("bench_startup"), help="output stem"
    )
    parser.add_argument("--render", type=Path, help="rewrite the Markdown from the JSON of an earlier run")
    for hidden in ("--child", "--corpus", "--index", "--cache"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "index":
        return prepare_index(Path(args.corpus), Path(args.index))
    if args.child:
        return print(json.dumps(child(args)))
    if args.render:
        results = reporting.load_results(args.render)
        return reporting.write_report(args.render.with_suffix(""), markdown(results))

    args.workdir.mkdir(parents=True, exist_ok=True)
    name = f"{args.passages}_s{args.seed}"
    corpus, index, cache = (
        args.workdir / f
        for f in (f"psgs_synthetic_{name}.tsv", f"index_{name}", f"fingerprint_cache_{name}.json")
    )
    if not corpus.is_file():
        write_dpr_tsv(corpus, args.passages, args.seed)
    common = [
        "--corpus",
        str(corpus),
        "--before-commit",
        args.before_commit,
        "--index",
        str(index),
        "--cache",
        str(cache),
    ]
    if not (index / "index.faiss").is_file():
        subprocess.run([sys.executable, __file__, "--child", "index", *common], check=True)
    runs = {}
    for key in (
        "before_scan",
        "before_fingerprint",
        "before_demo",
        "after_scan",
        "after_demo_first",
        "after_demo",
    ):
        if key == "after_demo_first":  # the first demo start fills the fingerprint cache; the second reads it
            cache.unlink(missing_ok=True)
        runs[key] = reporting.run_json(
            [sys.executable, __file__, "--child", key.removesuffix("_first"), *common], what=key
        )
        print(f"  {key}: {runs[key]['times']['total']['wall']:.1f} s", flush=True)
    assert runs["after_demo"]["fingerprint"] == runs["after_scan"]["fingerprint"]
    meta = {
        "command": reporting.command("bench_startup.py"),
        "machine": reporting.machine(),
        "passages": args.passages,
    }
    meta |= {"corpus_gb": corpus.stat().st_size / 1e9, "before_commit": args.before_commit}
    results = {"meta": meta, "rows": rows_of(runs, args.passages), "runs": runs}
    reporting.write_report(args.out, markdown(results), results)


if __name__ == "__main__":
    main()
