"""Benchmark the offline FiD reader on CPU: tokens/s of a train step and of score_passages, plus peak memory.

    .venv/bin/python scripts/bench_reader.py                 # B=4, K=32, L=192, default SmallT5Config
    .venv/bin/python scripts/bench_reader.py --threads 2 --steps 5

Each variant (fp32, fp32 + gradient checkpointing, bf16 autocast) runs in its own process, so its peak RSS
is its own. bf16 autocast is in the default variants only on a CPU with native bf16 (AVX512-BF16 or AMX,
`rlm.precision`); elsewhere it is emulated (~18x slower) and `--variants fp32,bf16-autocast` asks for it. Passages are real Wikipedia text (../shared/data/wiki_sample), two passages joined so every one
fills L tokens after truncation; the BPE tokenizer (vocab 8000) is trained on the same text. Writes a
Markdown table and JSON to docs/results/bench_reader.{md,json}.

It also probes the activation memory of a random-init T5-base (K x 256 tokens, B=1, one forward+backward
per process at two values of K, `--t5-base-probe 1,2`; '' skips it): the per-passage slope is the number
behind the GPU arithmetic in docs/reader.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from atomicio import atomic_write_json, atomic_write_text
from rlm.experiments.benchmarking import cpu_name
from rlm.precision import cpu_bf16_support

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "wiki_sample" / "passages.jsonl"
VARIANTS = {
    "fp32": {},
    "fp32+checkpointing": {"gradient_checkpointing": True},
    "bf16-autocast": {"bf16": True},
}


def load_wiki_passages(path: Path) -> list[tuple[str, str]]:
    """(title, text) pairs from the pyserini/FlashRAG layout: `contents` is `"Title"\\ntext`."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            title, _, text = json.loads(line)["contents"].partition("\n")
            out.append((title.strip('"'), text))
    return out


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if platform.system() == "Darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_variant(args: argparse.Namespace) -> dict:
    """Build the default reader, time `steps` train steps, score_passages calls and a greedy generation."""
    import torch

    from reader.fid import FiDConfig, FiDReader
    from reader.scoring import score_passages
    from reader.small_t5 import SmallT5Config
    from reader.tokenizer import train_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    wiki = load_wiki_passages(Path(args.corpus))
    t0 = time.perf_counter()
    tok = train_tokenizer((f"{t}. {x}" for t, x in wiki), vocab_size=args.vocab_size)
    tokenizer_s = time.perf_counter() - t0

    b, k = args.batch, args.passages
    questions = [f"who or what is {wiki[i][0]}?" for i in range(b)]
    answers = [" ".join(wiki[i][1].split()[:4]) for i in range(b)]
    passages = [
        [(wiki[(i * k + j) % len(wiki)][0], wiki[(i * k + j) % len(wiki)][1] + " " + wiki[(i * k + j + 1) % len(wiki)][1])
         for j in range(k)]
        for i in range(b)
    ]  # fmt: skip
    reader = FiDReader.from_config(
        tok,
        SmallT5Config(),
        FiDConfig(max_passage_length=args.length),
        seed=0,
        **VARIANTS[args.variant],
    )
    params = sum(p.numel() for p in reader.parameters())
    batch = reader.collator(questions, passages, answers)
    tokens = int(batch["attention_mask"].sum())
    opt = torch.optim.AdamW(reader.parameters(), lr=1e-3)

    def train_step() -> float:
        start = time.perf_counter()
        reader.train()
        loss = reader(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    # The baseline is taken before the warm-up step: after it, the allocator keeps freed activation memory,
    # which would hide most of the step's footprint. The increase includes gradients and AdamW state.
    rss_before = rss_bytes()
    train_step()
    train_s = statistics.median(train_step() for _ in range(args.steps))
    train_peak = peak_rss_bytes() - rss_before
    peak_total = peak_rss_bytes()

    def score() -> float:
        start = time.perf_counter()
        score_passages(reader, questions, passages, answers, batch_size=args.score_batch_size)
        return time.perf_counter() - start

    score()
    score_s = statistics.median(score() for _ in range(args.steps))

    reader.eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = reader.generate(
            batch["input_ids"], batch["attention_mask"], max_new_tokens=16, min_new_tokens=16
        )
    generate_s = time.perf_counter() - start
    return {
        "variant": args.variant,
        "params": params,
        "batch": b,
        "passages": k,
        "length": int(batch["input_ids"].shape[-1]),
        "encoder_tokens": tokens,
        "train_step_s": round(train_s, 3),
        "train_tokens_per_s": round(tokens / train_s),
        "train_step_peak_rss_mib": round(train_peak / 2**20, 1),
        "rss_before_step_mib": round(rss_before / 2**20, 1),
        "process_peak_rss_mib": round(peak_total / 2**20, 1),
        "score_passages_s": round(score_s, 3),
        "score_tokens_per_s": round(tokens / score_s),
        "greedy_16_tokens_s": round(generate_s, 3),
        "generated_tokens": int(out.shape[1] - 1),
        "tokenizer_train_s": round(tokenizer_s, 2),
    }


T5_BASE = {"vocab_size": 32128, "d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64}


def run_t5_base_probe(args: argparse.Namespace) -> dict:
    """Peak RSS of one FiD forward+backward of a (random-init) T5-base at K passages x 256 tokens, B=1.

    Run at two values of K, the difference is the activation memory per passage: the number that sets how
    many questions of K=32 fit on a GPU (docs/reader.md).
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from reader.fid import FiDReader
    from reader.tokenizer import packaged_wordpiece_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, **T5_BASE))
    reader = FiDReader(model, packaged_wordpiece_tokenizer(), **VARIANTS[args.probe_variant]).train()
    k, length = args.probe_passages, 256
    ids = torch.randint(3, T5_BASE["vocab_size"], (1, k, length))
    labels = torch.randint(3, T5_BASE["vocab_size"], (1, 16))
    rss_before = rss_bytes()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(*saved_tensor_meter(reader, saved := {})):
        loss = reader(ids, torch.ones_like(ids), labels=labels).loss
    loss.backward()
    return {
        "variant": args.probe_variant,
        "passages": k,
        "length": length,
        "params": sum(p.numel() for p in reader.parameters()),
        "step_s": round(time.perf_counter() - start, 2),
        "peak_rss_increase_mib": round((peak_rss_bytes() - rss_before) / 2**20, 1),
        "saved_for_backward_mib": round(sum(saved.values()) / 2**20, 1),
    }


def saved_tensor_meter(model, saved: dict[int, int]):
    """Pack/unpack hooks that record every distinct storage autograd keeps for the backward pass.

    Unlike RSS, this is exact and allocator-independent: it is the activation memory a GPU must hold
    (parameters excluded; transient buffers of the backward pass not included).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    return pack, lambda tensor: tensor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="questions per step (B)")
    p.add_argument("--passages", type=int, default=32, help="passages per question (K)")
    p.add_argument("--length", type=int, default=192, help="tokens per (question, passage) pair (L)")
    p.add_argument(
        "--steps", type=int, default=2, help="timed repetitions after one warm-up (median reported)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--score-batch-size", type=int, default=None, help="pairs per score_passages pass")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="pyserini-style jsonl of passages")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {list(VARIANTS)} (default: all; bf16-autocast only where the CPU "
        "has native bf16)",
    )
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_reader"), help="output path stem")
    p.add_argument(
        "--t5-base-probe",
        default="1,2",
        help="passage counts K for the T5-base activation-memory probe (K x 256 tokens, B=1); '' skips it",
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    p.add_argument("--probe-variant", help=argparse.SUPPRESS)
    p.add_argument("--probe-passages", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    if not Path(args.corpus).is_file():
        raise FileNotFoundError(f"passage file {args.corpus} not found; pass --corpus PATH (pyserini jsonl)")
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    if args.probe_variant:
        print(json.dumps(run_t5_base_probe(args)))
        return 0

    bf16 = cpu_bf16_support()
    if args.variants is None:
        variants = list(VARIANTS)
        if not bf16.native:
            # Emulated bf16 would take most of the run and measure the emulation, not the reader.
            variants.remove("bf16-autocast")
            print(f"skipping bf16-autocast: {bf16.describe()}", file=sys.stderr)
    else:
        variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
    rows = [run_subprocess(["--variant", variant, *forwarded_args(args)]) for variant in variants]
    probe_ks = [int(x) for x in args.t5_base_probe.split(",") if x.strip()]
    probe = [
        run_subprocess(["--probe-variant", variant, "--probe-passages", str(k), *forwarded_args(args)])
        for variant in variants
        for k in probe_ks
    ]

    meta = {
        "command": " ".join([".venv/bin/python scripts/bench_reader.py", *sys.argv[1:]]),
        "threads": args.threads,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_bf16": {"native": bf16.native, "probe_ratio": round(bf16.ratio, 3), "reason": bf16.reason},
        "python": platform.python_version(),
    }
    write_results(Path(args.out), meta, rows, probe)
    print(render_table(meta, rows, probe))
    return 0


def run_subprocess(extra: list[str]) -> dict:
    """Run this script on one measurement in a fresh process (its own peak RSS); return its JSON line."""
    print("measuring", " ".join(extra[:4]), "...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, *extra], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measurement {extra[:4]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The settings a variant subprocess needs, as command-line arguments."""
    names = ["batch", "passages", "length", "steps", "threads", "vocab_size", "score_batch_size", "corpus"]
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def render_table(meta: dict, rows: list[dict], probe: list[dict]) -> str:
    """Markdown tables: the default reader's variants, then the T5-base memory probe."""
    first = rows[0]
    lines = [
        f"FiD reader, default SmallT5Config ({first['params'] / 1e6:.2f}M parameters), "
        f"B={first['batch']} K={first['passages']} L={first['length']} ({first['encoder_tokens']} encoder tokens "
        f"a step), {meta['threads']} torch thread(s) on {meta['cpu_count']} CPU cores. Command: `{meta['command']}`",
    ]
    if "cpu_bf16" in meta:  # bf16 figures mean little without knowing whether the CPU has bf16 instructions
        bf16 = meta["cpu_bf16"]
        lines[-1] += (
            f". bf16 {'native' if bf16['native'] else 'emulated'} on this CPU ({bf16['reason']}; a bf16 matmul "
            f"takes {bf16['probe_ratio']}x the float32 time)."
        )
    lines += [
        "",
        "| variant | train step s | train tokens/s | train step RSS increase MiB | score_passages s | score tokens/s "
        "| greedy 16 tokens s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['train_step_s']:.2f} | {r['train_tokens_per_s']} | {r['train_step_peak_rss_mib']} "
            f"| {r['score_passages_s']:.2f} | {r['score_tokens_per_s']} | {r['greedy_16_tokens_s']:.2f} |"
        )
    if probe:
        lines += [
            "",
            f"T5-base ({probe[0]['params'] / 1e6:.1f}M parameters, random init) FiD forward+backward, B=1, "
            "K passages x 256 tokens:",
            "",
            "| variant | K | step s | saved for backward MiB | peak RSS increase MiB |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['variant']} | {r['passages']} | {r['step_s']:.1f} | {r['saved_for_backward_mib']} "
            f"| {r['peak_rss_increase_mib']} |"
            for r in probe
        ]
        lines += [
            "",
            "Activations saved for backward per 256-token passage (difference between the two K; exact, from "
            "autograd's saved-tensor hooks; the RSS column is allocator-noisy and includes the gradients):",
            "",
        ]
        for variant in dict.fromkeys(r["variant"] for r in probe):
            pts = sorted(
                (r["passages"], r["saved_for_backward_mib"]) for r in probe if r["variant"] == variant
            )
            if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
                per = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
                lines.append(
                    f"- {variant}: {per:.1f} MiB per passage, so {per * 32 / 1024:.2f} GiB per question at K=32"
                )
    return "\n".join(lines) + "\n"


def write_results(stem: Path, meta: dict, rows: list[dict], probe: list[dict]) -> None:
    """Write `<stem>.json` and `<stem>.md` atomically."""
    atomic_write_json(stem.with_suffix(".json"), {"meta": meta, "rows": rows, "t5_base_probe": probe})
    atomic_write_text(stem.with_suffix(".md"), render_table(meta, rows, probe))


if __name__ == "__main__":
    sys.exit(main())
