"""The demo's answer latency with a paper-size reader (issue 47): a random-init FiD reader of T5-base's shapes
(vocab 32128, d_model 768, d_ff 3072, 12 + 12 layers, 12 heads of 64; the cost is the shapes, not the weights)
built through `rlm.reader.fid.FiDReader`, answering through the demo's own code, against the bound the CPU's
matmul speed sets.

For each k passages of L tokens (default k = 8, 16, 20, 32; L = 256) and each precision (float32, and bf16
autocast where the CPU runs bf16 natively):
* 1 user: p50/p95 of questions asked one after another through the demo's batching queue
  (`rlm.app.demo.answer_queue` over `QAService.answer_requests`, the page's path), after one untimed answer;
* `--users` at once (default 8), each asking `--per-user` questions one after another: p50/p95 (the wait in the
  queue included), questions/s against one user's, and the mean batch the queue formed;
* the bound: one answer's FLOPs counted from the shapes (the FiD encoder over k x L tokens, the decoder's
  cross-attention keys and values of them, and the decoder for an answer of `--answer-tokens` tokens) over a
  bare `torch.matmul`'s FLOP/s at the encoder's feed-forward shape [k L, d_model] @ [d_model, d_ff], in the same
  precision on the same threads. The goal: 1 user's p50 within 1.5x of it.
Retrieval is stubbed: every question reads the same k made-up passages, each long enough that its (question,
passage) pair is cut to exactly L tokens (bench_demo_scale.py measures retrieval). Random weights would stop an
answer anywhere, so every answer is made exactly `--answer-tokens` tokens long.

With `--checkpoint` (a quickstart's final/), also: do bf16 answers match float32's on its dev set (the share of
identical answers, and each precision's exact match)? Without one the report says it was not checked.

    python scripts/bench/bench_demo_reader.py --checkpoint runs/quickstart/final     # the full table
    python scripts/bench/bench_demo_reader.py --layers 1 --k 2 --length 32 --repeats 1 --users 2   # a smoke run
    python scripts/bench/bench_demo_reader.py --render scripts/bench/reports/demo_reader/demo_reader.json
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from lab import reporting
from lab.benchmarking import T5_BASE, latency_ms

GOAL_BOUND_RATIO = 1.5  # 1 user's p50 at most this many times the FLOP bound
GOAL_THROUGHPUT = 2.0  # `--users` at once: at least this many times one user's questions/s
MIN_AGREEMENT = 0.98  # bf16 "matches" float32 when at least this share of the dev answers is identical
# Dense bf16 tensor-core peaks (vendor data sheets) for the GPU projection; `--gpu-utilization` of it is assumed.
GPU_BF16_TFLOPS = {"A100": 312.0, "H100 SXM": 989.0}


def answer_flops(shape, k: int, length: int, answer_tokens: int) -> dict:
    """FLOPs of one FiD answer (a multiply-add is 2): the encoder over k x `length` tokens (each passage's
    self-attention alone), the decoder's cross-attention keys and values of those k x `length` states (computed
    once), and `answer_tokens` decoder steps with a cache (self-attention over the answer so far, cross-attention
    over every encoded token, the LM head). Layer norms, softmax and position biases are left out (O(tokens))."""
    d, f, layers, tokens = shape.d_model, shape.d_ff, shape.num_layers, k * length
    encoder = layers * (2 * (4 * d * d + 2 * d * f) * tokens + 4 * k * length * length * d)
    cross_kv = layers * 2 * (2 * d * d) * tokens
    steps = range(1, answer_tokens + 1)
    decoder = sum(
        layers * (2 * (6 * d * d + 2 * d * f) + 4 * t * d + 4 * tokens * d) + 2 * d * shape.vocab_size
        for t in steps
    )
    return {
        "encoder": encoder,
        "cross_kv": cross_kv,
        "decoder": decoder,
        "total": encoder + cross_kv + decoder,
    }


def matmul_flops_per_s(rows: int, inner: int, cols: int, bf16: bool, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` bare `torch.matmul` calls of [rows, inner] @ [inner, cols] (after a
    warm-up), in bf16 or float32, on torch's threads."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    a, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((rows, inner), (inner, cols)))
    torch.matmul(a, b)
    best = min(_seconds(lambda: torch.matmul(a, b)) for _ in range(repeats))
    return 2 * rows * inner * cols / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class SamePassages:
    """The service's index, stubbed: every question's top k are corpus rows 0..k-1, scored 1 down to 0.5."""

    def __init__(self, rows: int):
        self.ntotal = rows

    def search_rows(self, queries, k: int):
        scores = np.tile(np.linspace(1.0, 0.5, k, dtype=np.float32), (len(queries), 1))
        return scores, np.tile(np.arange(k), (len(queries), 1))


def reader_service(args):
    """A `QAService` over a random-init FiD reader of T5-base's shapes (`--layers` each side) and the stubbed
    retrieval, and the questions it is asked."""
    import torch
    from lab.benchmarking import (
        SyntheticCorpus,
        synthetic_examples,
        synthetic_tokenizer,
        synthetic_words,
        t5_reader,
    )

    from rlm.app.service import QAService
    from rlm.reader.fid import FiDConfig

    torch.manual_seed(0)
    words = synthetic_words(1000)
    shape = dataclasses.replace(T5_BASE, num_layers=args.layers)
    config = FiDConfig(max_passage_length=args.length, max_answer_length=args.answer_tokens)
    reader = t5_reader(shape, synthetic_tokenizer(words), config).eval()
    reader.model.generation_config.min_new_tokens = args.answer_tokens  # the answer's length is fixed
    # Passages of L words (one token each): every (question, passage) pair is cut to exactly L tokens.
    corpus = SyntheticCorpus(max(args.k), args.length, words)
    query_tower = SimpleNamespace(encode=lambda texts: torch.zeros(len(texts), 1))
    retriever = SimpleNamespace(query_tower=query_tower)
    service = QAService(retriever, reader, corpus, SamePassages(len(corpus)), max_k=max(args.k))
    count = 1 + max(args.repeats, args.users * args.per_user)
    questions = [ex.question for ex in synthetic_examples(count, 12, 2, words)]
    return service, shape, questions


def users_at_once(answers, questions: list[str], k: int, users: int, per_user: int):
    """`users` threads started together, each asking its `per_user` questions one after another through
    `answers`: (every question's seconds, results, wall seconds)."""
    times, results, lock, barrier = [], [], threading.Lock(), threading.Barrier(users)

    def user(u: int) -> None:
        barrier.wait()
        for question in questions[u * per_user : (u + 1) * per_user]:
            start = time.perf_counter()
            result = answers((question, k))
            with lock:
                times.append(time.perf_counter() - start)
                results.append(result)

    pool = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return times, results, time.perf_counter() - start


def measure(args, service, shape, questions: list[str], precision: str, k: int) -> dict:
    from rlm.app.demo import answer_queue

    service.bf16 = precision == "bf16"
    flops = answer_flops(shape, k, args.length, args.answer_tokens)
    throughput = matmul_flops_per_s(k * args.length, shape.d_model, shape.d_ff, service.bf16)
    row = {"precision": precision, "k": k, "tokens": k * args.length, "flops": flops}
    row |= {"matmul_flops_per_s": throughput, "bound_ms": 1e3 * flops["total"] / throughput}
    with answer_queue(service, args.max_batch, args.window_ms / 1000) as answers:
        answers((questions[0], k))  # untimed: the allocator's and autocast's first use
        alone = [_seconds(lambda q=q: answers((q, k))) for q in questions[1 : 1 + args.repeats]]
        times, results, wall = users_at_once(answers, questions[1:], k, args.users, args.per_user)
    row["one_user"] = latency_ms(alone) | {"questions_per_s": len(alone) / sum(alone)}
    many = latency_ms(times) | {"questions_per_s": len(times) / wall, "wall_s": wall}
    row["users"] = many | {"mean_batch": statistics.mean(r["batch_size"] for r in results)}
    row["p50_over_bound"] = row["one_user"]["p50_ms"] / row["bound_ms"]
    row["throughput_ratio"] = many["questions_per_s"] / row["one_user"]["questions_per_s"]
    print(
        f"{precision} k={k}: p50 {row['one_user']['p50_ms']:.0f} ms, bound {row['bound_ms']:.0f} ms",
        flush=True,
    )
    return row


def precision_check(checkpoint: str, dev: str | None, limit: int | None) -> dict:
    """Answers of the checkpoint's service to its dev questions in float32 and under bf16 autocast (policy off,
    the reader's own answers): the share that are identical, and each precision's exact match."""
    from rlm.app.service import QAService, ServiceOptions
    from rlm.data.qa import read_qa_jsonl
    from rlm.inference.metrics import exact_match

    service = QAService.from_checkpoint(checkpoint, options=ServiceOptions(device="cpu", load_policy=False))
    path = Path(dev) if dev else Path(service.corpus.path).parent / "dev.jsonl"
    examples = read_qa_jsonl(path)[:limit]
    answers = {}
    for precision in ("fp32", "bf16"):
        service.bf16 = precision == "bf16"
        answers[precision] = [
            r["answer"]
            for i in range(0, len(examples), 16)
            for r in service.answer_many([ex.question for ex in examples[i : i + 16]])
        ]
    same = [a == b for a, b in zip(answers["fp32"], answers["bf16"])]
    em = {
        p: statistics.mean(exact_match(a, ex.answers) for a, ex in zip(answers[p], examples)) for p in answers
    }
    return {
        "checkpoint": str(checkpoint),
        "dev": str(path),
        "questions": len(examples),
        "k": service.default_k,
        "identical": statistics.mean(same),
        "exact_match": em,
    }


def lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"lscpu failed: {err}"


COLUMNS = [
    ("precision", "precision", ""),
    ("k", "k", "d"),
    ("GFLOP an answer", lambda r: r["flops"]["total"] / 1e9, ".1f"),
]
COLUMNS += [
    ("matmul GFLOP/s", lambda r: r["matmul_flops_per_s"] / 1e9, ".0f"),
    ("bound ms", "bound_ms", ",.0f"),
]
COLUMNS += [
    ("1 user p50 ms", lambda r: r["one_user"]["p50_ms"], ",.0f"),
    ("p95 ms", lambda r: r["one_user"]["p95_ms"], ",.0f"),
]
COLUMNS += [("p50 / bound", "p50_over_bound", ".2f")]
COLUMNS += [
    ("users p50 ms", lambda r: r["users"]["p50_ms"], ",.0f"),
    ("users p95 ms", lambda r: r["users"]["p95_ms"], ",.0f"),
]
COLUMNS += [
    ("q/s 1 user", lambda r: r["one_user"]["questions_per_s"], ".3f"),
    ("q/s users", lambda r: r["users"]["questions_per_s"], ".3f"),
]
COLUMNS += [
    ("throughput x", "throughput_ratio", ".2f"),
    ("mean batch", lambda r: r["users"]["mean_batch"], ".1f"),
]


def gpu_rows(results: dict) -> list[dict]:
    """Each k's FLOPs over each GPU's dense bf16 peak at the assumed utilization."""
    use = results["args"]["gpu_utilization"]
    rows = {}
    for r in results["rows"]:
        rows.setdefault(r["k"], {"k": r["k"], "gflop": r["flops"]["total"] / 1e9})
    for row in rows.values():
        row |= {gpu: 1e3 * row["gflop"] / (tflops * 1e3 * use) for gpu, tflops in GPU_BF16_TFLOPS.items()}
    return list(rows.values())


def served_precision(results: dict) -> tuple[str, str]:
    """The fastest precision measured whose answers match float32's, and why."""
    check, measured = results["precision_check"], {r["precision"] for r in results["rows"]}
    if "bf16" not in measured:
        return "fp32", "bf16 was not measured"
    if check is None:
        return "bf16", "bf16's answers were not checked against float32's: an assumption"
    if check["identical"] >= MIN_AGREEMENT:
        return "bf16", f"{100 * check['identical']:.1f}% of its dev answers are float32's"
    return "fp32", f"only {100 * check['identical']:.1f}% of bf16's dev answers are float32's"


def verdicts(results: dict) -> str:
    """Each k in the served precision against the two goals."""
    precision, why = served_precision(results)
    lines = [f"Served precision: {precision} ({why})."]
    for r in (r for r in results["rows"] if r["precision"] == precision):
        bound = "meets" if r["p50_over_bound"] <= GOAL_BOUND_RATIO else "misses"
        users = "meets" if r["throughput_ratio"] >= GOAL_THROUGHPUT else "misses"
        lines.append(
            f"- k={r['k']}: p50 {r['p50_over_bound']:.2f}x the bound ({bound} {GOAL_BOUND_RATIO}x); "
            f"{results['args']['users']} users {r['throughput_ratio']:.2f}x one user's questions/s "
            f"({users} {GOAL_THROUGHPUT}x)"
        )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    a, check = results["args"], results["precision_check"]
    if check:
        agree = (
            f"on {check['questions']} dev questions of `{check['checkpoint']}` (k={check['k']}), "
            f"{100 * check['identical']:.1f}% of the bf16 answers are identical to float32's (exact match "
            f"{100 * check['exact_match']['fp32']:.1f} float32, {100 * check['exact_match']['bf16']:.1f} bf16); "
            f"bf16 counts as matching at {100 * MIN_AGREEMENT:.0f}% or more"
        )
    else:
        agree = "not checked (no `--checkpoint`)"
    gpu_columns = [("k", "k", "d"), ("GFLOP an answer", "gflop", ".1f")]
    gpu_columns += [(f"{g} ms", g, ".2f") for g in GPU_BF16_TFLOPS]
    peaks = ", ".join(f"{g} {t:g} TFLOP/s" for g, t in GPU_BF16_TFLOPS.items())
    return f"""# The demo's answer with a T5-base-shaped FiD reader: latency against the FLOP bound

Command: `{results["command"]}`

- Machine: {reporting.machine_line(results["machine"])}; bf16: {results["cpu_bf16"]["reason"]}.
- Reader: random-init T5 of T5-base's widths, {a["layers"]} + {a["layers"]} layers; k passages of {a["length"]} tokens;
  answers of {a["answer_tokens"]} tokens; retrieval stubbed (the same k passages for every question).
- Asked through the demo's batching queue (max batch {a["max_batch"]}, window {a["window_ms"]:g} ms): 1 user,
  {a["repeats"]} questions after a warm-up; {a["users"]} users at once, {a["per_user"]} questions each.
- Bound: the answer's FLOPs over a bare matmul [k x {a["length"]}, d_model] @ [d_model, d_ff] in the same precision
  and threads. Goals: p50 / bound at most {GOAL_BOUND_RATIO}; throughput x (users' questions/s over one user's)
  at least {GOAL_THROUGHPUT}.
- bf16 against float32: {agree}.

{reporting.table(results["rows"], COLUMNS)}

{verdicts(results)}

GPU projection: the FLOPs of an answer at {100 * a["gpu_utilization"]:.0f}% of each GPU's dense bf16 peak ({peaks}).
A floor: the decoder's {a["answer_tokens"]} steps are counted by their FLOPs, but on a GPU each step's time is set
by kernel launches and weight reads, which this figure does not hold.

{reporting.table(gpu_rows(results), gpu_columns)}

<details><summary>lscpu</summary>

```
{results["lscpu"].rstrip()}
```
</details>
"""


def main(argv: list[str] | None = None) -> int:
    p = reporting.arguments(__doc__)
    add = p.add_argument
    add(
        "--k", type=reporting.int_list, default=[8, 16, 20, 32], help="passages per question, comma-separated"
    )
    add("--length", type=int, default=256, help="tokens per (question, passage) pair")
    add("--layers", type=int, default=T5_BASE.num_layers, help="encoder (and decoder) layers")
    add("--answer-tokens", type=int, default=8, help="tokens every answer is made to have")
    add("--repeats", type=int, default=5, help="1 user: timed questions after a warm-up")
    add("--users", type=int, default=8, help="users asking at once")
    add("--per-user", type=int, default=2, help="questions each of them asks, one after another")
    add("--precisions", help="comma-separated fp32,bf16 (default: bf16 only where the CPU has native bf16)")
    add("--threads", type=int, help="torch threads (default: torch's own, all physical cores)")
    add("--max-batch", type=int, help="the queue's max batch (default: the demo's)")
    add("--window-ms", type=float, help="the queue's window (default: the demo's)")
    add(
        "--checkpoint",
        help="a quickstart's final/ folder: check bf16 answers against float32's on its dev set",
    )
    add("--dev", help="QA JSONL for that check (default: dev.jsonl beside the checkpoint's corpus)")
    add("--dev-limit", type=int, help="at most this many dev questions")
    add(
        "--gpu-utilization", type=float, default=0.5, help="share of a GPU's bf16 peak the projection assumes"
    )
    add("--out", default=reporting.results_path("demo_reader"), help="output path stem")
    add("--render", help="a JSON this script wrote: redo its markdown without measuring")
    args = p.parse_args(argv)
    if args.render:
        results = reporting.load_results(args.render)
        reporting.write_report(Path(args.render).with_suffix(""), markdown(results))
        return 0

    import torch

    from rlm.app.demo import BATCH_WINDOW_S, default_max_batch
    from rlm.precision import cpu_bf16_support

    if args.threads:
        torch.set_num_threads(args.threads)
    args.max_batch = args.max_batch or default_max_batch("cpu")
    args.window_ms = BATCH_WINDOW_S * 1000 if args.window_ms is None else args.window_ms
    bf16 = cpu_bf16_support()
    precisions = (
        args.precisions.split(",") if args.precisions else ["fp32", "bf16"] if bf16.native else ["fp32"]
    )
    if unknown := set(precisions) - {"fp32", "bf16"}:
        raise SystemExit(f"error: unknown precision(s) {sorted(unknown)}; choose from fp32, bf16")
    results = {"command": reporting.command("bench_demo_reader.py", argv), "machine": reporting.machine()}
    results |= {"lscpu": lscpu(), "args": {k: v for k, v in vars(args).items() if k not in ("out", "render")}}
    results["cpu_bf16"] = {"native": bf16.native, "probe_ratio": bf16.ratio, "reason": bf16.describe()}
    if args.checkpoint:
        results["precision_check"] = precision_check(args.checkpoint, args.dev, args.dev_limit)
    else:
        results["precision_check"] = None
        print("no --checkpoint: bf16 answers are not checked against float32's", file=sys.stderr)
    service, shape, questions = reader_service(args)
    results["rows"] = [measure(args, service, shape, questions, p, k) for p in precisions for k in args.k]
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
