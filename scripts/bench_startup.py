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
in both versions; only its ids are measured here). Writes a table to stdout, JSON to `--out` and Markdown to
`--md` (default docs/results/bench_startup.{json,md}).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atomicio import atomic_open, atomic_write_text
from rlm.experiments.benchmarking import cpu_name

ROOT = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "331c0cd479c4340f9b3f1af453156133f9f51bc2"
DPR_PASSAGES = 21_015_324  # rows of psgs_w100.tsv


def write_dpr_tsv(path: Path, passages: int, seed: int = 0, words: int = 100) -> None:
    """A DPR-layout TSV with `passages` rows; every text is a `words`-word window of one random word pool."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "va", "sel", "dor", "an", "is", "um", "pe", "ro", "li", "no"]
    vocab = [
        "".join(syllables[int(j)] for j in rng.integers(0, len(syllables), 1 + int(rng.integers(0, 3))))
        for _ in range(5000)
    ]
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
                s = int(first[k])
                text = pool[starts[s] : starts[s + words] - 1]
                if b'"' in text:
                    text = b'"' + text.replace(b'"', b'""') + b'"'
                rows.append(b"%d\t%s\t%s\n" % (lo + k + 1, text, titles[int(title_ix[k])].encode()))
            f.write(b"".join(rows))


def _peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM on Linux, whose exec'd address space starts its own high-water mark;
    `getrusage(RUSAGE_SELF).ru_maxrss` keeps the parent's across fork + exec, so a child would report at least
    what the parent had reached."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def _before_corpus_module(commit: str):
    """rlm/data/corpus.py as it was at `commit` (stdlib + numpy only, so it imports on its own)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:rlm/data/corpus.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as folder:
        (Path(folder) / "corpus_before.py").write_text(source)
        spec = importlib.util.spec_from_file_location("corpus_before", Path(folder) / "corpus_before.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["corpus_before"] = module
        spec.loader.exec_module(module)
    return module


class _Clock:
    """Wall and CPU (user + system) seconds of this process since `start`. On a 2-core machine shared with
    other jobs wall time swings by 2x with their load; CPU time is what the work itself costs."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> dict[str, float]:
        return {"wall": time.perf_counter() - self.wall, "cpu": time.process_time() - self.cpu}


def child(args) -> dict:
    """One measurement, in this (fresh) process: phase -> seconds, plus the process's peak RSS."""
    # Every import happens before the clock starts, the same ones in every variant.
    import faiss

    from retriever.buffer import corpus_fingerprint
    from rlm.data.corpus import load_corpus
    from rlm.inference import evaluation

    Corpus = _before_corpus_module(args.before_commit).Corpus
    corpus_path, times, result = Path(args.corpus), {}, {}
    baseline = _peak_rss_mb()
    total = _Clock()
    if args.child.startswith("before"):
        corpus = Corpus(corpus_path)
        times["scan"] = total.elapsed()
        if args.child in ("before_fingerprint", "before_demo"):
            clock = _Clock()
            result["fingerprint"] = corpus_fingerprint(corpus.ids, corpus.retrieval_texts())
            times["fingerprint"] = clock.elapsed()
        if args.child == "before_demo":
            clock = _Clock()
            # PassageIndex.load + load_index_for as they were: a list of str, then a row-by-row loop.
            index = faiss.read_index(str(Path(args.index) / "index.faiss"))
            ids = (Path(args.index) / "ids.txt").read_text(encoding="utf-8").split("\n")[: index.ntotal]
            mismatch = next((row for row, (a, b) in enumerate(zip(ids, corpus.ids)) if a != b), None)
            assert mismatch is None and len(ids) == len(corpus)
            times["index ids"] = clock.elapsed()
    elif args.child == "after_scan":
        corpus = load_corpus(corpus_path)  # scan and fingerprint in one pass
        times["scan"] = total.elapsed()
        result["fingerprint"] = corpus.fingerprint
    elif args.child == "after_demo":
        corpus = load_corpus(corpus_path, fingerprint_cache=args.cache)
        times["scan"] = total.elapsed()
        result["fingerprint"] = corpus.fingerprint
        clock = _Clock()
        evaluation.load_index_for(args.index, corpus.ids)
        times["index ids"] = clock.elapsed()
    else:
        raise ValueError(args.child)
    times["total"] = total.elapsed()
    assert len(corpus) > 0
    return {"times": times, "peak_rss_mb": _peak_rss_mb(), "import_rss_mb": baseline, **result}


def run_child(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--corpus", str(args.corpus_path)]
    cmd += ["--before-commit", args.before_commit, "--index", str(args.index_dir), "--cache", str(args.cache)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    phases = ", ".join(f"{k} {v['wall']:.1f} s ({v['cpu']:.1f} CPU)" for k, v in out["times"].items())
    print(f"  {name}: {phases}; peak RSS {out['peak_rss_mb']:.0f} MB", flush=True)
    return out


def prepare_index(corpus_path: Path, index_dir: Path) -> None:
    """A dimension-1 Flat index saved with the corpus ids (what a cached demo index holds, minus vectors)."""
    import numpy as np

    from retriever.index import PassageIndex
    from rlm.data.corpus import load_corpus

    corpus = load_corpus(corpus_path)
    PassageIndex.build(np.zeros((len(corpus), 1), dtype=np.float32), corpus.ids).save(index_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=5_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/bench_startup")
    parser.add_argument("--before-commit", default=BEFORE_COMMIT)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_startup.json"))
    parser.add_argument("--md", default=str(ROOT / "docs" / "results" / "bench_startup.md"))
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the Markdown from the JSON of an earlier run"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--index", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "index":
        prepare_index(Path(args.corpus), Path(args.index))
        return
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.report_only:
        saved = json.loads(Path(args.out).read_text())
        args.passages, args.before_commit = saved["meta"]["passages"], saved["meta"]["before_commit"]
        report(args, saved["runs"], saved["meta"]["corpus_gb"])
        return

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    args.corpus_path = work / f"psgs_synthetic_{args.passages}_s{args.seed}.tsv"
    args.index_dir = work / f"index_{args.passages}_s{args.seed}"
    args.cache = work / f"fingerprint_cache_{args.passages}_s{args.seed}.json"
    if not args.corpus_path.is_file():
        t = time.perf_counter()
        write_dpr_tsv(args.corpus_path, args.passages, args.seed)
        print(f"generated {args.corpus_path} in {time.perf_counter() - t:.0f} s", flush=True)
    if not (args.index_dir / "index.faiss").is_file():
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "index",
                "--corpus",
                str(args.corpus_path),
                "--index",
                str(args.index_dir),
            ],
            check=True,
        )
    size_gb = args.corpus_path.stat().st_size / 1e9
    print(f"corpus: {args.passages:,} passages, {size_gb:.2f} GB", flush=True)

    runs = {}
    runs["before_scan"] = run_child("before_scan", args)
    runs["before_fingerprint"] = run_child("before_fingerprint", args)
    runs["before_demo"] = run_child("before_demo", args)
    runs["after_scan"] = run_child("after_scan", args)
    # Warm the demo's fingerprint cache (a first demo start), then measure a second start.
    args.cache.unlink(missing_ok=True)
    runs["after_demo_first"] = run_child("after_demo", args)
    runs["after_demo"] = run_child("after_demo", args)
    assert runs["after_demo"]["fingerprint"] == runs["after_scan"]["fingerprint"]
    report(args, runs, size_gb)


def report(args, runs: dict, size_gb: float) -> None:
    scale = DPR_PASSAGES / args.passages
    b_scan, b_fp, b_demo = runs["before_scan"], runs["before_fingerprint"], runs["before_demo"]
    a_scan, a_demo1, a_demo = runs["after_scan"], runs["after_demo_first"], runs["after_demo"]
    zero = {"wall": 0.0, "cpu": 0.0}
    specs = [
        ("corpus load (scan)", b_scan, "scan", a_scan, "scan", True),
        ("corpus fingerprint (extra pass)", b_fp, "fingerprint", None, zero, False),
        ("training start, corpus side (scan + fingerprint)", b_fp, "total", a_scan, "total", True),
        ("demo start, first (scan + fingerprint + index ids)", b_demo, "total", a_demo1, "total", True),
        ("demo start, again (fingerprint from the cache)", b_demo, "total", a_demo, "total", True),
        ("  of which: index ids load + check", b_demo, "index ids", a_demo, "index ids", False),
    ]
    rows = []
    for step, b_run, b_key, a_run, a_key, rss in specs:
        before = b_run["times"][b_key]
        after = a_key if a_run is None else a_run["times"][a_key]
        rows.append(
            {
                "step": step,
                "before_wall_s": before["wall"],
                "before_cpu_s": before["cpu"],
                "after_wall_s": after["wall"],
                "after_cpu_s": after["cpu"],
                "before_peak_rss_mb": b_run["peak_rss_mb"] if rss else None,
                "after_peak_rss_mb": a_run["peak_rss_mb"] if rss else None,
                "before_cpu_s_21m": before["cpu"] * scale,
                "after_cpu_s_21m": after["cpu"] * scale,
            }
        )
    command = "python scripts/bench_startup.py" + (
        f" --passages {args.passages}" if args.passages != 5_000_000 else ""
    )
    meta = {
        "command": command,
        "passages": args.passages,
        "corpus_gb": size_gb,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "before_commit": args.before_commit,
        "import_rss_mb": b_scan["import_rss_mb"],
        "extrapolation": f"CPU s at 21M = CPU s at N x {DPR_PASSAGES:,} / N (every step is linear in N)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.out), json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2) + "\n")

    def fmt(x, digits=1):
        return "-" if x is None else f"{x:,.{digits}f}"

    head = (
        f"| step ({args.passages:,} passages, {size_gb:.1f} GB) | before wall s | before CPU s | after wall s | "
        "after CPU s | before peak RSS MB | after peak RSS MB | before CPU s at 21M | after CPU s at 21M |"
    )
    lines = [head, "| --- |" + " ---: |" * 8]
    for r in rows:
        cells = [r["before_wall_s"], r["before_cpu_s"], r["after_wall_s"], r["after_cpu_s"]]
        lines.append(
            f"| {r['step']} | "
            + " | ".join(fmt(c) for c in cells)
            + f" | {fmt(r['before_peak_rss_mb'], 0)} | {fmt(r['after_peak_rss_mb'], 0)} | "
            f"{fmt(r['before_cpu_s_21m'], 0)} | {fmt(r['after_cpu_s_21m'], 0)} |"
        )
    table = "\n".join(lines)
    print(table)
    hash_cpu = a_demo1["times"]["scan"]["cpu"] - a_demo["times"]["scan"]["cpu"]
    scan_cpu = a_scan["times"]["scan"]["cpu"] - b_scan["times"]["scan"]["cpu"]
    md = f"""# Start-up: corpus scan, corpus fingerprint, demo restart

Command: `{command}`
CPU: {meta["cpu"]}, {meta["cores"]} cores shared with other jobs; Python {meta["python"]}.
Corpus: synthetic DPR `psgs_w100.tsv` layout, {args.passages:,} passages of 100 words, {size_gb:.2f} GB.
Before = commit `{args.before_commit[:10]}` (`Corpus` scan, then `corpus_fingerprint(ids, texts)` over every
passage, index ids as a list of str); after = this code (fingerprint = sha256 of the bytes the scan reads;
the demo remembers it by the file's path, size and mtime; ids as one blob). Each measurement is one fresh
process. Wall seconds swing with the load of the other jobs on the shared cores; CPU seconds (user + system of the process) are the cost of the work itself and are what
the 21M columns extrapolate. Peak RSS is the process's VmHWM, including {meta["import_rss_mb"]:.0f} MB of
imports (torch, via `retriever.buffer`).

{table}

The 21M columns extrapolate linearly: {meta["extrapolation"]}. DPR's real file has longer lines
(about 650 bytes against {size_gb * 1e9 / args.passages:.0f} here), so its scan and hashing take somewhat
longer than the extrapolation.

* The fingerprint pass is gone: the fingerprint is the sha256 of the blocks the scan reads anyway. Its
  cost inside the scan: {hash_cpu:+.1f} CPU s between the first demo start (hashes) and the second (takes
  the fingerprint from the cache); the "after" scan (hashing) minus the "before" scan: {scan_cpu:+.1f} CPU s.
  sha256 runs at over 1 GB/s on this CPU (SHA extensions): a few seconds for the 13 GB DPR file.
* Peak RSS is lower after: the id hashes for duplicate detection are computed during the scan instead of
  from two Python int lists of every offset afterwards, and the index's ids stay one blob (the "before"
  demo start builds a list of {args.passages:,} str for them and compares it with the corpus's in a loop).
* The scan (parse every line; record offsets, ids and id hashes) is the same work before and after and is
  what a start still pays; caching its arrays by the same file stamp would remove it from a demo restart.
"""
    atomic_write_text(Path(args.md), md)
    print(f"wrote {args.out} and {args.md}")


if __name__ == "__main__":
    main()
