"""A living corpus (issue 50): what `rlm corpus update` costs against rebuilding the index, and what it answers.

Synthetic part (`--n` rows, default 1M x 384, MiniLM's width): a buffer of clustered unit vectors written as
`rlm embed` writes one, a corpus file of as many short passages, and the index `rlm index` builds by default
(`IndexSpec()`: factory auto, search tuned). Then, for each share in `--shares` (0.1%, 1%, 10%), an update of
that many passages (half new, a quarter replacing, a quarter deleted) applied to a copy of the index through
`rlm.inference.corpus_update` (plan, index, the checks, the committed save), the new passages' rows drawn from
the same clusters by a stand-in encoder; against it, the index rebuilt from the edited rows as `rlm index` would
(train, add, tune). Both sides' embedding is projected from the packaged MiniLM's measured rate on real
passages (`--embed-sizes`: the rate is measured at three sizes to see it constant): an update embeds its new and
replacing passages, a rebuild every passage. Made questions (`question_like_rows`' way, at the tuned noise) on
new and on old rows: the share whose passage the tuned search ranks in its top 20, after the update and after
the rebuild; every answer checked for removed rows. Memory: a fresh process opening the updated index (and its
corpus edition) and searching, against one opening the rebuilt index.

Toy-world part (`--toy N`): a toy world, its buffer by the packaged MiniLM (real text, real encoder), the
`auto` index, the world's next edition (`rlm toy-world --next-edition-of`) applied by `rlm corpus update`'s
code with the real encoder; gold recall@20 of the edition's questions before the update, after it and after
re-embedding and re-indexing the edited corpus, and of the world's unchanged dev questions before and after.

    python scripts/bench/bench_corpus_update.py                       # 1M synthetic rows + toy world of 20k
    python scripts/bench/bench_corpus_update.py --quick               # 50k rows, toy world of 3k: a minute
    python scripts/bench/bench_corpus_update.py --render scripts/bench/reports/corpus_update/corpus_update.json
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from lab import reporting
from lab.benchmarking import clustered, peak_rss_mb, write_buffer

K = 20
QUESTIONS = 2000  # made questions per measurement (the update's own check asks 256)


class StandIn:
    """A `RowEncoder` for synthetic rows: the next rows of a clustered draw, whatever the texts."""

    fingerprint = "synthetic"

    def __init__(self, draw):
        self.draw = draw

    def embed(self, texts) -> np.ndarray:
        return self.draw(len(texts))


def write_corpus(path: Path, n: int) -> None:
    if path.is_file() and sum(1 for _ in path.open("rb")) == n:
        return
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": str(i), "title": f"Passage {i}", "text": f"Synthetic passage number {i}."})
                + "\n"
            )


def write_update(folder: Path, n: int, size: int, rng) -> tuple[Path, Path]:
    """`size` passages: half new, a quarter replacing base passages, a quarter deleting others."""
    folder.mkdir(parents=True, exist_ok=True)
    touched = rng.choice(n, size // 2, replace=False)
    replaced, deleted = touched[: size // 4], touched[size // 4 :]
    with (folder / "add.jsonl").open("w") as f:
        for i in range(size - size // 2):
            f.write(json.dumps({"id": f"new{i}", "title": "New", "text": f"New passage {i}."}) + "\n")
        for i in replaced:
            f.write(json.dumps({"id": str(i), "title": "Changed", "text": f"Changed passage {i}."}) + "\n")
    (folder / "delete.txt").write_text("".join(f"{i}\n" for i in deleted))
    return folder / "add.jsonl", folder / "delete.txt"


def build(buffer, work: Path, out: Path, factory: str | None = None) -> dict:
    """The index `rlm index --buffer` builds (by default, or of type `factory`), saved to `out`; its seconds."""
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.index_spec import IndexSpec

    spec = IndexSpec() if factory is None else IndexSpec(factory=factory)
    start = time.perf_counter()
    index = PassageIndex.from_buffer(buffer, spec.factory, use_gpu=False)
    index.apply_search(spec, buffer)
    index.save(out)
    return {"seconds": time.perf_counter() - start, "factory": index.factory, "search": index.search_params}


def embed_rate(sizes: list[int]) -> list[dict]:
    """Passages a second of the packaged MiniLM (`rlm embed`'s path, float32 on this CPU) on real passages
    (../shared/data/wiki_sample, else the toy world's), at each size."""
    from rlm.retriever.buffer import embed_passages
    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    sample = reporting.ROOT.parent / "shared" / "data" / "wiki_sample" / "passages.jsonl"
    if sample.is_file():
        from rlm.data.corpus import load_corpus

        texts = list(load_corpus(sample).retrieval_texts())
    else:
        texts = [f"Someone was born in a city number {i}, and works as a teacher there." for i in range(2048)]
    encoder = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=256)
    rates = []
    for size in sizes:
        chosen = (texts * (size // len(texts) + 1))[:size]
        start = time.perf_counter()
        embed_passages(encoder, chosen, batch_size=64)
        rates.append({"passages": size, "per_s": size / (time.perf_counter() - start)})
    return rates


def opened_memory(index_dir: Path, corpus: Path) -> dict:
    """Peak RSS (VmHWM) of a fresh process that opens the index (and its corpus edition) and answers 100
    searches."""
    code = (
        "import json, resource, sys, numpy as np\n"
        "from rlm.data.corpus import load_corpus\n"
        "from rlm.inference.indexing import load_index_for, served_corpus\n"
        f"base = load_corpus({str(corpus)!r})\n"
        f"index = load_index_for({str(index_dir)!r}, base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)\n"
        f"corpus = served_corpus(index, base, {str(index_dir)!r})\n"
        "q = np.random.default_rng(0).standard_normal((100, index.dim)).astype('float32')\n"
        "q /= np.linalg.norm(q, axis=1, keepdims=True)\n"
        "index.search(q, 20)\n"
        # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across exec, so a child reports its parent's peak.
        "peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(json.dumps({'peak_rss_mb': peak / 1024, 'passages': len(corpus)}))\n"
    )
    return reporting.run_json(
        [sys.executable, "-c", code], env={"OMP_NUM_THREADS": "1"}, what="opening the index"
    )


def found_share(index, rows: np.ndarray, numbers: np.ndarray, scale: float) -> float:
    from rlm.inference.corpus_update import _found_share

    return _found_share(index, rows, numbers, scale)


def rebuilt(
    args, work: Path, size: int, buffer, live_old: np.ndarray, new_rows: np.ndarray, add: Path, measure: bool
):
    """The edited corpus indexed from scratch as `rlm index` would: its rows (the base's live ones, then the
    update's) and, when `measure`, its corpus file, for the memory comparison. Returns (index folder, its build)."""
    import torch

    from rlm.retriever.buffer import PassageBuffer

    rows = np.concatenate([buffer.embeddings.numpy()[live_old], new_rows.astype(np.float16)])
    added = [json.loads(line) for line in add.read_text().splitlines()]
    ids = [str(i) for i in live_old] + [row["id"] for row in added if row["id"].startswith("new")]
    ids += [row["id"] for row in added if not row["id"].startswith("new")]
    edited = PassageBuffer.from_embeddings(ids, torch.from_numpy(rows))
    folder = work / f"rebuilt_{size}"
    made = build(edited, work, folder)
    if measure:
        with (work / f"rebuilt_{size}.jsonl").open("w") as f:
            for pid in ids:
                f.write(
                    json.dumps({"id": pid, "title": "Passage", "text": f"Synthetic passage {pid}."}) + "\n"
                )
    return folder, made


def one_share(args, share: float, buffer, work: Path, corpus: Path, base_index: Path, draw) -> dict:
    """Update a copy of the base index by `share` of the corpus; rebuild for comparison; measure both."""
    import torch

    from rlm.data.corpus import load_corpus
    from rlm.inference.corpus_update import _found_share, apply_update, plan_update
    from rlm.inference.indexing import check_index_for
    from rlm.retriever.index import PassageIndex

    size = max(4, int(round(share * args.n)))
    rng = np.random.default_rng(size)
    add, delete = write_update(work / f"update_{size}", args.n, size, rng)
    updated = work / f"updated_{size}"
    shutil.rmtree(updated, ignore_errors=True)
    shutil.copytree(base_index, updated)
    base = load_corpus(corpus)
    start = time.perf_counter()
    index = PassageIndex.load(updated, use_gpu=False)
    check_index_for(index, updated, base.ids, corpus_fingerprint=base.fingerprint)
    result = apply_update(updated, index, plan_update(updated, index, base, add, delete), StandIn(draw))
    update_s = time.perf_counter() - start - result.seconds["embed"]
    new_rows = np.load(updated / "updates" / "0001" / "rows.npy").astype(np.float32)
    # The replacing passages' rows follow the new ones in the update's file order: first `added` are new.
    live_old = np.setdiff1d(np.arange(args.n), index.removed)
    picked = np.sort(rng.choice(live_old, min(QUESTIONS, len(live_old)), replace=False))
    old_rows = buffer.rows(torch.from_numpy(picked)).float().numpy()
    scale = index.tuning.get("noise_scale", 0.5)
    found = {
        "new_rows": _found_share(
            index, new_rows, np.arange(args.n, args.n + len(new_rows)), scale, QUESTIONS
        ),
        "old_rows": _found_share(index, old_rows, picked, scale, QUESTIONS),
    }
    asked = np.concatenate(
        [new_rows[:QUESTIONS], old_rows]
    )  # every answer to these checked for a removed row
    _, answers = index.search_rows(asked, K)
    measure = share == max(args.shares)
    folder, made = rebuilt(args, work, size, buffer, live_old, new_rows, add, measure)
    again = PassageIndex.load(folder, use_gpu=False)
    position = np.searchsorted(live_old, picked)
    # The same questions of both (made at the base index's tuned noise), each index searched as it was tuned.
    new_numbers = np.arange(len(live_old), len(live_old) + len(new_rows))
    found_again = {
        "new_rows": _found_share(again, new_rows, new_numbers, scale, QUESTIONS),
        "old_rows": _found_share(again, old_rows, position, scale, QUESTIONS),
    }
    row = {"share": share, "passages": size, "added": result.added, "replaced": result.replaced}
    row |= {"deleted": result.deleted, "embedded": result.added + result.replaced, "update_s": update_s}
    row |= {"update_parts_s": result.seconds, "rebuild_s": made["seconds"], "checks": result.checks}
    row |= {"search_updated": index.search_params, "search_rebuilt": again.search_params}
    row |= {"found_after_update": found, "found_after_rebuild": found_again, "warnings": result.warnings}
    row |= {
        "removed_returned": int(np.isin(answers, index.removed).sum()),
        "answers_checked": int(answers.size),
    }
    if measure:
        row["memory_updated"] = opened_memory(updated, corpus)
        row["memory_rebuilt"] = opened_memory(folder, work / f"rebuilt_{size}.jsonl")
    return row


def synthetic(args, work: Path) -> dict:
    import torch

    from rlm.data.corpus import load_corpus
    from rlm.retriever.buffer import PassageBuffer

    torch.set_num_threads(args.threads)
    corpus = work / "corpus.jsonl"
    write_corpus(corpus, args.n)
    fingerprint = load_corpus(corpus).fingerprint
    shard, _ = clustered(args.n, args.dim, seed=0)
    claims = {"corpus_fingerprint": fingerprint, "max_length": 256}
    written = write_buffer(work / "buffer", args.n, args.dim, shard, fingerprint, claims)
    buffer = PassageBuffer.load(work / "buffer")
    base_index = work / "index"
    base = build(buffer, work, base_index)
    _, more = clustered(args.n, args.dim, seed=0)  # the same clusters: new passages like the old ones

    def draw(count: int) -> np.ndarray:
        return more(count).numpy().astype(np.float16)

    rows = [one_share(args, share, buffer, work, corpus, base_index, draw) for share in args.shares]
    return {"n": args.n, "dim": args.dim, "buffer": written, "base_build": base, "shares": rows}


def gold_recall(index, corpus, questions: list[dict], encoder) -> float:
    """Share of `questions` whose gold passages (all of them) are in the index's top 20, asked by `encoder`."""
    from rlm.inference.retrieval import encode_questions

    asked = [q for q in questions if q["gold_passage_ids"]]
    if not asked:
        return float("nan")
    queries = encode_questions(encoder, [q["question"] for q in asked], 64, False)
    _, ids = index.search(queries, K)
    return float(np.mean([set(q["gold_passage_ids"]) <= set(found) for q, found in zip(asked, ids)]))


def toy(args, work: Path) -> dict:
    """The toy world's next edition through `rlm corpus update`'s code with the packaged MiniLM."""
    from rlm.data.corpus import load_corpus
    from rlm.data.toy_world import build_toy_world
    from rlm.data.toy_world_edition import build_toy_world_edition
    from rlm.inference.corpus_update import RowEncoder, apply_update, plan_update
    from rlm.inference.indexing import load_index_for, served_corpus
    from rlm.retriever.buffer import build_passage_buffer
    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    world = build_toy_world(work / "toy", num_passages=args.toy, seed=0, kin_facts=5).root
    edition = build_toy_world_edition(world, work / "toy_edition", per_change=args.per_change, seed=1)
    encoder = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=64)
    base = load_corpus(world / "corpus.jsonl")
    start = time.perf_counter()
    buffer = build_passage_buffer(
        base.ids, base.retrieval_texts(), encoder, work / "toy_buffer", corpus_fingerprint=base.fingerprint
    )
    embed_all = time.perf_counter() - start
    index_dir = work / "toy_index"
    made = build(buffer, work, index_dir, args.toy_factory)
    questions = {
        name: [json.loads(line) for line in path.read_text().splitlines()]
        for name, path in (("edition", edition.dev), ("unchanged", edition.unchanged_dev))
    }
    index = load_index_for(index_dir, base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)
    before = {name: gold_recall(index, base, qs, encoder) for name, qs in questions.items()}
    plan = plan_update(index_dir, index, base, edition.add, edition.delete)
    result = apply_update(
        index_dir, index, plan, RowEncoder(encoder, buffer.meta["encoder_fingerprint"], "float32")
    )
    index = load_index_for(index_dir, base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)
    edited = served_corpus(index, base, index_dir)
    after = {name: gold_recall(index, edited, qs, encoder) for name, qs in questions.items()}
    deleted = set(edition.delete.read_text().split())
    from rlm.inference.retrieval import encode_questions

    every = [q["question"] for q in questions["edition"] + questions["unchanged"]]
    _, shown = index.search(encode_questions(encoder, every, 64, False), K)
    # The rebuild: the edited corpus written out, embedded whole and indexed.
    live = [edited[i] for i in range(len(edited)) if not edited.is_removed(i)]
    out = work / "toy_rebuilt.jsonl"
    out.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in live))
    rebuilt_corpus = load_corpus(out)
    start = time.perf_counter()
    rebuilt_buffer = build_passage_buffer(
        rebuilt_corpus.ids,
        rebuilt_corpus.retrieval_texts(),
        encoder,
        work / "toy_rebuilt_buffer",
        corpus_fingerprint=rebuilt_corpus.fingerprint,
    )
    rebuilt = build(rebuilt_buffer, work, work / "toy_rebuilt_index", args.toy_factory)
    rebuild_s = time.perf_counter() - start
    again = load_index_for(work / "toy_rebuilt_index", rebuilt_corpus.ids, use_gpu=False)
    after_rebuild = {name: gold_recall(again, rebuilt_corpus, qs, encoder) for name, qs in questions.items()}
    by_change = {}
    for change in sorted({q["meta"]["change"] for q in questions["edition"]}):
        asked = [q for q in questions["edition"] if q["meta"]["change"] == change]
        by_change[change] = {
            "questions": len(asked),
            "after_update": gold_recall(index, edited, asked, encoder),
            "after_rebuild": gold_recall(again, rebuilt_corpus, asked, encoder),
        }
    return {
        "passages": args.toy,
        "edition": json.loads(edition.manifest.read_text()),
        "embed_all_s": embed_all,
        "build": made,
        "update_s": sum(result.seconds.values()),
        "update_parts_s": result.seconds,
        "rebuild_s": rebuild_s,
        "rebuild_index_s": rebuilt["seconds"],
        "gold_recall_at_20": {"before_update": before, "after_update": after, "after_rebuild": after_rebuild},
        "by_change": by_change,
        "deleted_shown": sum(pid in deleted for row in shown for pid in row),
        "answers_checked": sum(len(row) for row in shown),
        "checks": result.checks,
        "warnings": result.warnings,
    }


def markdown(results: dict) -> str:
    rate = results["embed_rate"]
    per_s = float(np.median([r["per_s"] for r in rate]))
    lines = [
        "# A living corpus: `rlm corpus update` against a rebuild",
        "",
        f"Command: `{results['command']}`. Machine: {reporting.machine_line(results['machine'])}.",
        "",
        "Embedding rate of the packaged MiniLM (float32, batch 64, max length 256, real passages), by size: "
        + ", ".join(f"{r['passages']}: {r['per_s']:.1f}/s" for r in rate)
        + f"; the projection below holds it constant at the median, {per_s:.1f} passages/s.",
        "",
    ]
    if "synthetic" in results:
        s = results["synthetic"]
        n = s["n"]
        lines += [
            f"## Synthetic: {n:,} rows x {s['dim']}, index `{s['base_build']['factory']}` ({s['base_build']['search']}), "
            f"built in {s['base_build']['seconds']:.1f} s",
            "",
            "| share | passages | embedded | update, index side (s) | rebuild, index side (s) | update with embedding (s) "
            "| rebuild with embedding (s) | rebuild / update | made questions found, new rows: update / rebuild "
            "| old rows: update / rebuild | removed rows returned |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in s["shares"]:
            update_total = r["update_s"] + r["embedded"] / per_s
            rebuild_total = r["rebuild_s"] + (n - r["deleted"] + r["added"]) / per_s
            fu, fr = r["found_after_update"], r["found_after_rebuild"]
            lines.append(
                f"| {r['share']:.1%} | {r['passages']:,} | {r['embedded']:,} | {r['update_s']:.1f} | {r['rebuild_s']:.1f} "
                f"({r['search_rebuilt']}) "
                f"| {update_total:.0f} | {rebuild_total:.0f} | {rebuild_total / update_total:.0f}x "
                f"| {fu['new_rows']:.3f} / {fr['new_rows']:.3f} | {fu['old_rows']:.3f} / {fr['old_rows']:.3f} "
                f"| {r['removed_returned']} of {r['answers_checked']:,} |"
            )
        last = s["shares"][-1]
        if last.get("memory_updated"):
            mu, mr = last["memory_updated"]["peak_rss_mb"], last["memory_rebuilt"]["peak_rss_mb"]
            lines += [
                "",
                f"Memory after +{last['share']:.0%}: a fresh process opening the updated index and its corpus edition "
                f"and searching peaks at {mu:.0f} MB, one opening the rebuilt index and corpus at {mr:.0f} MB "
                f"({mu / mr - 1:+.1%}).",
            ]
        lines += [
            "",
            "Checks and warnings per share: "
            + "; ".join(f"{r['share']:.1%}: {r['checks']} {r['warnings']}" for r in s["shares"]),
        ]
    if "toy" in results:
        toy = results["toy"]
        g = toy["gold_recall_at_20"]
        lines += [
            "",
            f"## Toy world: {toy['passages']:,} passages, MiniLM, `{toy['build']['factory']}` ({toy['build']['search']}), "
            f"its next edition ({toy['edition']['added']} added, "
            f"{toy['edition']['replaced']} replaced, {toy['edition']['deleted']} deleted)",
            "",
            f"Update {toy['update_s']:.1f} s (embedding {toy['update_parts_s']['embed']:.1f} s) against re-embedding and "
            f"re-indexing the edited corpus {toy['rebuild_s']:.1f} s. Deleted passages shown: {toy['deleted_shown']} of "
            f"{toy['answers_checked']:,} answers.",
            "",
            "| questions | gold recall@20 before | after the update | after a rebuild |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name in ("edition", "unchanged"):
            lines.append(
                f"| {name} | {g['before_update'][name]:.3f} | {g['after_update'][name]:.3f} | {g['after_rebuild'][name]:.3f} |"
            )
        lines += [
            "",
            "| change | questions | after the update | after a rebuild |",
            "| --- | ---: | ---: | ---: |",
        ]
        for change, row in toy["by_change"].items():
            lines.append(
                f"| {change} | {row['questions']} | {row['after_update']:.3f} | {row['after_rebuild']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = reporting.arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="50k rows x 64, a toy world of 6,000 passages")
    parser.add_argument("--n", type=int, default=None, help="synthetic rows (default 1,000,000)")
    parser.add_argument("--dim", type=int, default=None, help="row width (default 384)")
    parser.add_argument("--shares", default="0.001,0.01,0.1", help="update sizes, shares of the corpus")
    parser.add_argument("--toy", type=int, default=None, help="toy world passages (default 20,000; 0: skip)")
    parser.add_argument(
        "--per-change",
        type=int,
        default=None,
        help="the edition's people per change (default: one per 2,000 passages)",
    )
    parser.add_argument(
        "--toy-factory",
        default="IVF128,SQfp16",
        help="the toy world's index (auto: exact at 20k, so trivially equal)",
    )
    parser.add_argument(
        "--embed-sizes", default="256,512,1024", help="passages the embedding rate is measured on"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--work", default="/tmp/rlm-bench-corpus-update", help="folder for buffers and indexes"
    )
    parser.add_argument("--out", default=str(reporting.results_path("corpus_update")), help="output stem")
    parser.add_argument("--render", default=None, help="redo the report from this JSON, measuring nothing")
    args = parser.parse_args(argv)
    if args.render:
        results = reporting.load_results(args.render)
        reporting.write_report(Path(args.render).with_suffix(""), markdown(results), results)
        return 0
    args.n = args.n or (50_000 if args.quick else 1_000_000)
    args.dim = args.dim or (64 if args.quick else 384)
    args.toy = args.toy if args.toy is not None else (6000 if args.quick else 20_000)
    args.per_change = args.per_change or max(2, args.toy // 2000)
    args.shares = [float(x) for x in args.shares.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {"command": reporting.command("bench_corpus_update.py", argv), "machine": reporting.machine()}
    results["embed_rate"] = embed_rate(
        [int(x) for x in args.embed_sizes.split(",")][: 2 if args.quick else 3]
    )
    results["synthetic"] = synthetic(args, work)
    if args.toy:
        results["toy"] = toy(args, work)
    results["peak_rss_mb"] = peak_rss_mb()
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
