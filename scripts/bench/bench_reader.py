"""Benchmark the offline FiD reader on CPU: tokens/s of a train step and of score_passages, plus peak memory.

    .venv/bin/python scripts/bench/bench_reader.py                 # B=4, K=32, L=192, default SmallT5Config
    .venv/bin/python scripts/bench/bench_reader.py --threads 2 --steps 5

Each variant (fp32, fp32 + gradient checkpointing, bf16 autocast) runs in its own process, so its peak RSS
is its own. bf16 autocast is in the default variants only on a CPU with native bf16 (AVX512-BF16 or AMX,
`rlm.precision`); elsewhere it is emulated (~18x slower) and `--variants fp32,bf16-autocast` asks for it. Passages are real Wikipedia text (../shared/data/wiki_sample), two passages joined so every one
fills L tokens after truncation; the BPE tokenizer (vocab 8000) is trained on the same text. Writes a
Markdown table and JSON to scripts/bench/reports/bench_reader/.

It also probes the activation memory of a random-init T5-base (K x 256 tokens, B=1, one forward+backward
per process at two values of K, `--t5-base-probe 1,2`; '' skips it): the per-passage slope is the number
behind the GPU arithmetic in docs/reader.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import psutil
from lab import reporting
from lab.benchmarking import best_of, median_of, peak_rss_mb

from rlm.precision import cpu_bf16_support

VARIANTS = {"fp32": {}, "fp32+checkpointing": {"gradient_checkpointing": True}}
VARIANTS["bf16-autocast"] = {"bf16": True}
T5_BASE = {"vocab_size": 32128, "d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64}
CHILD_OPTIONS = ["batch", "passages", "length", "steps", "threads", "vocab_size", "score_batch_size"]
CHILD_OPTIONS += ["corpus"]  # the settings a measurement's child process is given


def peak_rss_mib() -> float:

    return peak_rss_mb()


def run_variant(args: argparse.Namespace) -> dict:
    """Build the default reader, time `steps` train steps, score_passages calls and a greedy generation."""
    import torch

    from rlm.reader.fid import FiDConfig, FiDReader
    from rlm.reader.scoring import score_passages
    from rlm.reader.small_t5 import SmallT5Config
    from rlm.reader.tokenizer import train_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # pyserini/FlashRAG layout: `contents` is `"Title"\ntext`.
    lines = Path(args.corpus).read_text(encoding="utf-8").splitlines()
    wiki = [(t.strip('"'), x) for t, _, x in (json.loads(line)["contents"].partition("\n") for line in lines)]
    texts = (f"{t}. {x}" for t, x in wiki)
    tokenizer_s, tok = best_of(1, lambda: train_tokenizer(texts, vocab_size=args.vocab_size))
    b, k, n = args.batch, args.passages, len(wiki)
    questions = [f"who or what is {wiki[i][0]}?" for i in range(b)]
    answers = [" ".join(wiki[i][1].split()[:4]) for i in range(b)]
    # Two passages joined, so that every one fills L tokens after truncation.
    joined = [(title, f"{text} {wiki[(j + 1) % n][1]}") for j, (title, text) in enumerate(wiki)]
    passages = [[joined[(i * k + j) % n] for j in range(k)] for i in range(b)]
    config = FiDConfig(max_passage_length=args.length)
    reader = FiDReader.from_config(tok, SmallT5Config(), config, seed=0, **VARIANTS[args.variant])
    pairs = (questions, passages, answers)
    batch = reader.collator(*pairs)
    tokens = int(batch["attention_mask"].sum())
    opt = torch.optim.AdamW(reader.parameters(), lr=1e-3)

    def train_step():
        reader.train()
        reader(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # The baseline is taken before the warm-up step: after it, the allocator keeps freed activation memory,
    # which would hide most of the step's footprint. The increase includes gradients and AdamW state.
    rss_before = psutil.Process().memory_info().rss / 2**20
    train_s = median_of(args.steps, train_step)[0]
    train_peak = peak_rss_mib() - rss_before
    score = functools.partial(score_passages, reader, *pairs, batch_size=args.score_batch_size)
    score_s = median_of(args.steps, score)[0]
    reader.eval()
    with torch.no_grad():
        ids, mask = batch["input_ids"], batch["attention_mask"]
        generate_s, _ = best_of(1, lambda: reader.generate(ids, mask, max_new_tokens=16, min_new_tokens=16))
    out = {"variant": args.variant, "params": sum(p.numel() for p in reader.parameters()), "batch": b}
    out |= {"passages": k, "length": int(batch["input_ids"].shape[-1]), "encoder_tokens": tokens}
    out |= {"train_step_s": train_s, "train_tokens_per_s": tokens / train_s}
    out |= {"train_step_peak_rss_mib": train_peak, "process_peak_rss_mib": peak_rss_mib()}
    out |= {"score_passages_s": score_s, "score_tokens_per_s": tokens / score_s}
    return out | {"greedy_16_tokens_s": generate_s, "tokenizer_train_s": tokenizer_s}


def run_t5_base_probe(args: argparse.Namespace) -> dict:
    """Peak RSS of one FiD forward+backward of a (random-init) T5-base at K passages x 256 tokens, B=1, and the
    activations autograd saves for backward (exact and allocator-independent: what a GPU must hold). Run at
    two values of K, the difference is the activation memory per passage (docs/reader.md's GPU arithmetic)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from rlm.reader.fid import FiDReader
    from rlm.reader.tokenizer import packaged_wordpiece_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, **T5_BASE))
    reader = FiDReader(model, packaged_wordpiece_tokenizer(), **VARIANTS[args.probe_variant]).train()
    ids = torch.randint(3, T5_BASE["vocab_size"], (1, args.probe_passages, 256))
    params, saved = {p.untyped_storage().data_ptr() for p in reader.parameters()}, {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    rss_before, start = peak_rss_mib(), time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = reader(ids, torch.ones_like(ids), labels=torch.randint(3, T5_BASE["vocab_size"], (1, 16))).loss
    loss.backward()
    out = {"variant": args.probe_variant, "passages": args.probe_passages}
    out |= {"params": sum(p.numel() for p in reader.parameters()), "step_s": time.perf_counter() - start}
    out["peak_rss_increase_mib"] = peak_rss_mib() - rss_before
    return out | {"saved_for_backward_mib": sum(saved.values()) / 2**20}


COLUMNS = [("variant", "variant", ""), ("train step s", "train_step_s", ".2f")]
COLUMNS += [("train tokens/s", "train_tokens_per_s", ".0f")]
COLUMNS += [("train step RSS increase MiB", "train_step_peak_rss_mib", ".1f")]
COLUMNS += [("score_passages s", "score_passages_s", ".2f"), ("score tokens/s", "score_tokens_per_s", ".0f")]
COLUMNS += [("greedy 16 tokens s", "greedy_16_tokens_s", ".2f")]
PROBE_COLUMNS = [("variant", "variant", ""), ("K", "passages", "d"), ("step s", "step_s", ".1f")]
PROBE_COLUMNS += [("saved for backward MiB", "saved_for_backward_mib", ".1f")]
PROBE_COLUMNS += [("peak RSS increase MiB", "peak_rss_increase_mib", ".1f")]


def markdown(results: dict) -> str:
    first, probe, bf16 = results["rows"][0], results["t5_base_probe"], results["cpu_bf16"]
    text = (
        f"FiD reader, default SmallT5Config ({first['params'] / 1e6:.2f}M parameters), B={first['batch']} "
        f"K={first['passages']} L={first['length']} ({first['encoder_tokens']} encoder tokens a step). Command: "
        f"`{results['command']}`; {reporting.machine_line(results['machine'])}. bf16 {'native' if bf16['native'] else 'emulated'} "
        f"on this CPU ({bf16['reason']}; a bf16 matmul takes {bf16['probe_ratio']:.3g}x the float32 time)."
        + "\n\n"
        + reporting.table(results["rows"], COLUMNS)
    )
    if not probe:
        return text
    text += (
        f"\n\nT5-base ({probe[0]['params'] / 1e6:.1f}M parameters, random init) FiD forward+backward, B=1, "
        f"K passages x 256 tokens:\n\n{reporting.table(probe, PROBE_COLUMNS)}\n\n"
        "Activations saved for backward per 256-token passage (difference between the two K; the RSS column "
        "is allocator-noisy and includes the gradients):\n"
    )
    for v in dict.fromkeys(r["variant"] for r in probe):
        pts = sorted((r["passages"], r["saved_for_backward_mib"]) for r in probe if r["variant"] == v)
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            per = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            text += f"\n- {v}: {per:.1f} MiB per passage, so {per * 32 / 1024:.2f} GiB per question at K=32"
    return text


def main() -> int:
    p = reporting.arguments(__doc__)
    add = p.add_argument
    add("--batch", type=int, default=4, help="questions per step (B)")
    add("--passages", type=int, default=32, help="passages per question (K)")
    add("--length", type=int, default=192, help="tokens per (question, passage) pair (L)")
    add("--steps", type=int, default=2, help="timed repetitions after one warm-up (median reported)")
    add("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    add("--vocab-size", type=int, default=8000)
    add("--score-batch-size", type=int, default=None, help="pairs per score_passages pass")
    default_corpus = reporting.ROOT.parent / "shared" / "data" / "wiki_sample" / "passages.jsonl"
    add("--corpus", default=str(default_corpus), help="pyserini-style jsonl of passages")
    native = "(default: all; bf16-autocast only where the CPU has native bf16)"
    add("--variants", default=None, help=f"comma-separated subset of {list(VARIANTS)} {native}")
    add("--out", default=reporting.results_path("bench_reader"), help="output path stem")
    probe = "passage counts K for the T5-base activation-memory probe (K x 256 tokens, B=1); '' skips it"
    add("--t5-base-probe", default="1,2", help=probe)
    add("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    add("--probe-variant", help=argparse.SUPPRESS)
    add("--probe-passages", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not Path(args.corpus).is_file():
        raise SystemExit(f"error: passage file {args.corpus} not found; pass --corpus PATH (pyserini jsonl)")
    if args.variant or args.probe_variant:
        print(json.dumps(run_variant(args) if args.variant else run_t5_base_probe(args)))
        return 0
    bf16 = cpu_bf16_support()
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    if not args.variants and not bf16.native:
        # Emulated bf16 would take most of the run and measure the emulation, not the reader.
        variants.remove("bf16-autocast")
        print(f"skipping bf16-autocast: {bf16.describe()}", file=sys.stderr)
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"error: unknown variant(s) {sorted(unknown)}; choose from {list(VARIANTS)}")
    me = [sys.executable, __file__]
    for name in CHILD_OPTIONS:
        if getattr(args, name) is not None:
            me += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    results = {"command": reporting.command("bench_reader.py")}
    results["machine"] = {**reporting.machine(), "threads": args.threads}
    results["cpu_bf16"] = {"native": bf16.native, "probe_ratio": bf16.ratio, "reason": bf16.reason}
    results["rows"] = [reporting.run_json([*me, "--variant", v], what=v) for v in variants]
    ks = [int(x) for x in args.t5_base_probe.split(",") if x.strip()]
    probes = [(v, ["--probe-variant", v, "--probe-passages", str(k)]) for v in variants for k in ks]
    results["t5_base_probe"] = [reporting.run_json([*me, *extra], what=f"{v} probe") for v, extra in probes]
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
