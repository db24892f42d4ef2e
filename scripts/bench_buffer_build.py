"""Buffer build throughput (issue 29, item 4): the old embedding loop against the build's, and how close the
passage tower comes to this machine's matmul rate.

* old: what `embed_shards` did before: a shard sorted by characters, batches of `--batch-sizes`, each through
  `SentenceEncoder.embed_texts` with its default buckets of 16 rows (16 rows a forward), float32;
* new: `retriever.buffer.embed_shards` itself: the shard sorted by token length, one forward per batch padded
  to its own longest row, in the precision `build_passage_buffer` picks on the device ("auto": float32 on a
  CPU, bf16 autocast on a CUDA GPU).

For each: passages/s (best of `--reps`, the two paths interleaved so that load from other jobs hits both), the
tokens the forwards padded to against the real ones, and the tower's useful FLOP rate (2 x matmul weights x
real tokens + 4 x layers x width x tokens^2 for attention; padding not counted) as a fraction of one large
torch.matmul timed in the same process and precision. Also the tokenizer's own passages/s: on a GPU the build
tokenizes the next shard in a background thread because it would otherwise take about as long as the tower.

    python scripts/bench_buffer_build.py                 # ../shared/data/wiki_sample, batch 16, 64, 512
    python scripts/bench_buffer_build.py --device cuda   # the same on a GPU (new path in bf16)

Writes docs/results/bench_buffer_build/bench_buffer_build.{json,md} (`--out` for another stem).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rlm.experiments.benchmarking import cpu_name, load_average
from rlm.experiments.reporting import arguments, command, results_path, table, write_report

ROOT = Path(__file__).resolve().parents[1]
WIKI_SAMPLE = ROOT.parent / "shared" / "data" / "wiki_sample" / "passages.jsonl"
OLD_BUCKET = 16  # SentenceEncoder.embed_texts's default, which the old loop inherited
SHARD_ROWS = 100_000  # build_passage_buffer's default shard_size
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def load_passages(path: Path, count: int, work: Path) -> tuple[list[str], list[str], str]:
    """(ids, texts, source) of the first `count` passages of `path`, or of a generated toy world where `path`
    is missing (a clone without ../shared), so the benchmark runs anywhere."""
    from rlm.data.corpus import load_corpus

    if path.is_file():
        corpus, source = load_corpus(path), "wiki_sample" if path == WIKI_SAMPLE else path.name
    else:
        from rlm.data.toy_world import build_toy_world

        print(f"{path} not found: using a generated toy world", file=sys.stderr)
        corpus = load_corpus(build_toy_world(work / "toy_world", num_passages=max(count, 200), seed=0).corpus)
        source = "toy-world"
    count = min(count, len(corpus))
    texts = corpus.retrieval_texts()
    return [corpus.ids[i] for i in range(count)], [texts[i] for i in range(count)], source


def flops_per_passage(encoder, tokens: np.ndarray) -> np.ndarray:
    """Useful forward FLOPs of each passage of `tokens` real tokens: every matmul weight of the transformer
    layers twice per token, plus QK^T and AV (2 x 2 x tokens^2 x width a layer)."""
    config = encoder.model.config
    linear = sum(m.weight.numel() for m in encoder.model.encoder.modules() if isinstance(m, nn.Linear))
    width = getattr(config, "num_heads", 0) * getattr(config, "d_kv", 0) or config.hidden_size
    tokens = tokens.astype(np.float64)
    return 2 * linear * tokens + 4 * encoder.num_layers * width * tokens**2


def padded_tokens(
    lengths: np.ndarray, order: list[int], batch_size: int, bucket: int | None
) -> tuple[int, int]:
    """(tokens the forwards computed, forwards) for batches of `order`, each split into `bucket` rows by
    token length as embed_texts does (None: one forward per batch)."""
    total = forwards = 0
    for b in range(0, len(order), batch_size):
        rows = np.sort(lengths[order[b : b + batch_size]])[::-1]
        step = len(rows) if bucket is None or len(rows) <= bucket else bucket
        for s in range(0, len(rows), step):
            total += int(rows[s]) * len(rows[s : s + step])
            forwards += 1
    return total, forwards


def embed_old(encoder, texts: list[str], batch_size: int) -> np.ndarray:
    """The old `embed_shards` loop over one shard (float16 rows, as stored)."""
    from evalmode import eval_mode

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = np.empty((len(texts), encoder.dim), dtype=np.float16)
    with eval_mode(encoder), torch.inference_mode():
        for b in range(0, len(order), batch_size):
            rows = order[b : b + batch_size]
            out[rows] = encoder.embed_texts([texts[i] for i in rows]).float().cpu().numpy()
    return out


def embed_new(encoder, ids: list[str], texts: list[str], batch_size: int, precision: str) -> np.ndarray:
    """`embed_shards` over the texts as one shard, into a scratch folder (the shard write is timed too)."""
    from retriever.buffer import build_settings, embed_shards, shard_name

    settings = build_settings(
        ids, texts, encoder, shard_size=len(ids), corpus_fingerprint="bench:buffer_build", precision=precision
    )
    with tempfile.TemporaryDirectory(prefix="bench_buffer_build_") as tmp:
        embed_shards(ids, texts, encoder, tmp, settings, [0], batch_size=batch_size, show_progress=False)
        return np.load(Path(tmp) / shard_name(0))


def shard_padding(
    lengths: np.ndarray, chars: np.ndarray, batch_size: int, rows: int = SHARD_ROWS, seed: int = 0
) -> dict[str, float]:
    """Padded / real tokens of both paths over a full shard of `rows` passages drawn from these ones: the
    benchmark's few passages make a batch of 512 span most of their lengths, a 100k-row shard does not."""
    pick = np.random.default_rng(seed).integers(0, len(lengths), rows)
    tokens, real = lengths[pick], int(lengths[pick].sum())
    by_chars = np.argsort(-chars[pick], kind="stable").tolist()
    by_tokens = np.argsort(-tokens, kind="stable").tolist()
    return {
        "old": padded_tokens(tokens, by_chars, batch_size, OLD_BUCKET)[0] / real,
        "new": padded_tokens(tokens, by_tokens, batch_size, None)[0] / real,
    }


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 4096, reps: int = 5) -> float:
    """GFLOP/s of a [size, size] @ [size, size] matmul, best of `reps` after a warm-up."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call is the warm-up
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def machine(device: torch.device) -> dict:
    from rlm.precision import read_cpu_flags

    flags = read_cpu_flags() or set()
    info = {
        "cpu": cpu_name(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(args: argparse.Namespace) -> dict:
    from retriever.buffer import resolve_precision
    from retriever.encoder import SentenceEncoder, default_retriever_path

    device = torch.device(args.device)
    precision = resolve_precision(args.precision, device)
    work = Path(tempfile.mkdtemp(prefix="bench_buffer_build_corpus_"))
    ids, texts, source = load_passages(args.corpus, args.passages, work)
    encoder = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=args.max_length)
    encoder.to(device).eval()

    start = time.perf_counter()
    tokens = encoder.tokenize_unpadded(texts)
    tokenize_s = time.perf_counter() - start
    lengths = np.array([len(t) for t in tokens])
    chars = np.array([len(t) for t in texts])
    flops = flops_per_passage(encoder, lengths)
    char_order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    token_order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    measured = {name: [] for name in {"float32", precision}}

    def time_matmuls() -> None:
        # Again after every batch size: the best of them is the rate a quiet moment of the shared cores gives.
        for name in measured:
            measured[name].append(matmul_gflops(device, dtypes[name], args.matmul_size))

    time_matmuls()
    embed_new(encoder, ids[:8], texts[:8], 8, precision)  # warm-up (allocator, oneDNN primitives)

    load_before = load_average()
    rows = []
    for batch_size in args.batch_sizes:
        paths = {
            "old": (lambda b=batch_size: embed_old(encoder, texts, b), "float32", char_order, OLD_BUCKET),
            "new": (
                lambda b=batch_size: embed_new(encoder, ids, texts, b, precision),
                precision,
                token_order,
                None,
            ),
        }
        seconds = {name: [] for name in paths}
        vectors = {}
        for _ in range(args.reps):  # interleaved: a burst of load from other jobs hits both paths
            for name, (fn, _, _, _) in paths.items():
                start = time.perf_counter()
                vectors[name] = fn()
                seconds[name].append(time.perf_counter() - start)
        for name, (_, path_precision, order, bucket) in paths.items():
            best = min(seconds[name])
            computed, forwards = padded_tokens(lengths, order, batch_size, bucket)
            rows.append(
                {
                    "batch_size": batch_size,
                    "path": name,
                    "precision": path_precision,
                    "forwards": forwards,
                    "padded_over_real_tokens": computed / int(lengths.sum()),
                    "seconds": best,
                    "all_seconds": seconds[name],
                    "passages_per_s": len(texts) / best,
                    "gflops": float(flops.sum()) / best / 1e9,
                }
            )
        rows[-1]["speedup_over_old"] = rows[-2]["seconds"] / rows[-1]["seconds"]
        for row in rows[-2:]:
            row["padded_over_real_tokens_full_shard"] = shard_padding(lengths, chars, batch_size)[row["path"]]
        diff = np.abs(vectors["new"].astype(np.float32) - vectors["old"].astype(np.float32))
        rows[-1]["max_abs_diff_from_old"] = float(diff.max())
        print(
            f"batch {batch_size}: old {rows[-2]['passages_per_s']:.1f} psg/s, new {rows[-1]['passages_per_s']:.1f}",
            file=sys.stderr,
        )
        time_matmuls()
    rates = {name: max(values) for name, values in measured.items()}
    for row in rows:
        row["fraction_of_matmul"] = row["gflops"] / rates[row["precision"]]
    return {
        "command": command("bench_buffer_build.py"),
        "machine": machine(device),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "source": source,
        "passages": len(texts),
        "max_length": args.max_length,
        "mean_tokens": float(lengths.mean()),
        "max_tokens": int(lengths.max()),
        "new_precision": precision,
        "gflop_per_passage": float(flops.mean()) / 1e9,
        "matmul_size": args.matmul_size,
        "matmul_gflops": rates,
        "matmul_gflops_measured": measured,
        "tokenize_passages_per_s": len(texts) / tokenize_s,
        "rows": rows,
    }


def markdown(r: dict) -> str:
    m = r["machine"]
    names = {"old": f"old: buckets of {OLD_BUCKET}", "new": "new: one forward a batch"}
    columns = [
        ("batch", "batch_size", "d"),
        ("path", lambda row: names[row["path"]], ""),
        ("precision", "precision", ""),
    ]
    columns += [("forwards", "forwards", "d"), ("padded / real tokens", "padded_over_real_tokens", ".3f")]
    columns += [(f"same, {SHARD_ROWS:,}-row shard", "padded_over_real_tokens_full_shard", ".3f")]
    columns += [("passages/s", "passages_per_s", ".1f"), ("GFLOP/s", "gflops", ".1f")]
    columns += [
        ("of matmul rate", "fraction_of_matmul", ".2f"),
        ("speedup", lambda row: row.get("speedup_over_old"), ".2f"),
    ]
    rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in r["matmul_gflops"].items())
    diff = max(row["max_abs_diff_from_old"] for row in r["rows"] if "max_abs_diff_from_old" in row)
    return f"""# Buffer build: old loop vs full batches

Command: `{r["command"]}`; {m["cpu"]}, flags {", ".join(m["cpu_flags"]) or "none of " + str(CPU_FLAGS)}; {m["cores"]} cores,
{m["threads"]} torch threads, torch {m["torch"]}, device {m.get("gpu", m["device"])}; load average before
{r["load_average_before"]}, after {r["load_average_after"]}. Passages: {r["passages"]} from {r["source"]}, mean
{r["mean_tokens"]:.0f} tokens (max {r["max_tokens"]}, max_length {r["max_length"]}); tower all-MiniLM-L6-v2,
{r["gflop_per_passage"]:.2f} GFLOP a passage. Matmul rate {rates} (a {r["matmul_size"]}-square matmul, the best
of the timings spread over the run); tokenizer alone {r["tokenize_passages_per_s"]:,.0f} passages/s.

{table(r["rows"], columns)}

Padding: the forwards' tokens over the real ones for these passages, and for a {SHARD_ROWS:,}-row shard (the
build's default) drawn from their lengths, which is what a large corpus gives. GFLOP/s count real tokens only.
Largest difference of a stored (float16) value between the two paths: {diff:.2g}."""


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--corpus", type=Path, default=WIKI_SAMPLE, help="passages (default: wiki_sample)")
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 512])
    parser.add_argument("--max-length", type=int, default=256, help="the paper configs' passage_max_length")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--matmul-size", type=int, default=4096, help="side of the reference matmul")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="auto", help="the new path's: auto, float32 or bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=results_path("bench_buffer_build"), help="output stem")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args)
    write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
