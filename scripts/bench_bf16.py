"""Is bf16 worth it on this CPU? The figures behind docs/training.md's precision paragraph.

    .venv/bin/python scripts/bench_bf16.py               # ~1 minute where bf16 is native
    .venv/bin/python scripts/bench_bf16.py --no-minilm   # the CPU, the detection and the matmuls only

Prints the CPU (model name, whether its flags have avx512_bf16 / amx_bf16), what `rlm.precision` decides (and
so whether `rlm train` keeps `mixed_precision=bf16` on CPU), the detection's probe ratio, a 6144x384 @ 384x384
matmul in float32 and bf16, and the packaged MiniLM's forward+backward on 48 x 128 tokens in float32 and under
bf16 autocast (median of `--repeats` after one warm-up each). On a CPU without native bf16 the bf16 MiniLM
pass takes minutes (93 s against 5.4 s measured on an AVX2-only EPYC): `--no-minilm` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from rlm.experiments.benchmarking import cpu_name
from rlm.precision import NATIVE_BF16_FLAGS, cpu_bf16_support, read_cpu_flags


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (oneDNN primitives, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_times(repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6144, 384, generator=gen), torch.randn(384, 384, generator=gen)
    out = {"fp32_s": median_time(lambda: a @ b, repeats)}
    a16, b16 = a.bfloat16(), b.bfloat16()
    out["bf16_s"] = median_time(lambda: a16 @ b16, repeats)
    return out


def minilm_times(repeats: int, batch: int, tokens: int) -> dict[str, float]:
    from retriever.encoder import SentenceEncoder, default_retriever_path

    tower = SentenceEncoder.from_pretrained(default_retriever_path(), max_length=tokens).train()
    gen = torch.Generator().manual_seed(0)
    # Token ids above the special tokens, every row exactly `tokens` long: the cost of a full bucket of passages.
    ids = torch.randint(1000, tower.tokenizer.vocab_size, (batch, tokens), generator=gen)
    mask = torch.ones_like(ids)

    def step(precision):
        def run():
            tower.zero_grad(set_to_none=True)
            with precision():
                emb = tower(input_ids=ids, attention_mask=mask)
            emb.float().pow(2).sum().backward()

        return run

    bf16 = lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)  # noqa: E731
    return {
        "fp32_s": median_time(step(contextlib.nullcontext), repeats),
        "bf16_autocast_s": median_time(step(bf16), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--no-minilm", action="store_true", help="skip the MiniLM forward+backward")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    flags = read_cpu_flags() or set()
    support = cpu_bf16_support()
    result = {
        "command": " ".join(["python scripts/bench_bf16.py", *sys.argv[1:]]),
        "cpu": cpu_name(),
        "bf16_flags": [f for f in NATIVE_BF16_FLAGS if f in flags],
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "native": support.native,
        "reason": support.reason,
        "probe_ratio": round(support.ratio, 3),
        "matmul_6144x384x384": matmul_times(args.repeats),
    }
    if not args.no_minilm:
        result[f"minilm_fwd_bwd_{args.batch}x{args.tokens}"] = minilm_times(
            args.repeats, args.batch, args.tokens
        )
    for value in result.values():
        if isinstance(value, dict):  # a timing pair: add bf16 time / float32 time
            bf16 = next(v for k, v in value.items() if k.startswith("bf16"))
            value["bf16_over_fp32"] = bf16 / value["fp32_s"]
            value.update({k: round(v, 4) for k, v in value.items()})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
