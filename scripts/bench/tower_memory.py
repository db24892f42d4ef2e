"""Activation memory of the passage tower: what K passages of 256 tokens through a GTR-base-shaped tower keep
for the backward pass, with and without activation checkpointing (`retriever.gradient_checkpointing`), in fp32
and under bf16 autocast.

    .venv/bin/python scripts/bench/tower_memory.py                  # K = 1 and 2 (a few minutes on 2 cores)
    .venv/bin/python scripts/bench/tower_memory.py --render scripts/bench/reports/tower_memory/tower_memory.json

The tower is sentence-transformers/gtr-t5-base's shape built from its config with random weights (a T5-base
encoder, 12 layers of 768, d_ff 3072, 12 heads, + a 768 x 768 Dense; nothing is downloaded), in train mode
with dropout 0.1 as training runs it. Saved-tensor hooks count the bytes of every distinct tensor autograd
keeps for the backward pass (parameters excluded): what an accelerator must hold between a step's forward and
its backward, independent of the allocator, so a CPU measures it. It grows linearly in K; the difference
between K=2 and K=1 is the cost per passage, projected to a question's 32 passages and to a GPU's micro-batch
of 4 questions (configs/base_gpu.yaml). Writes scripts/bench/reports/tower_memory/tower_memory.{md,json}.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from lab import reporting

GTR_BASE = {"vocab_size": 32128, "d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64}
LENGTH, PASSAGES_PER_QUESTION, QUESTIONS_PER_GPU = 256, 32, 4
VARIANTS = {
    "fp32": (False, False),
    "bf16 autocast": (False, True),
    "fp32 + checkpointing": (True, False),
    "bf16 autocast + checkpointing": (True, True),
}


def gtr_base_shaped_tower(checkpointing: bool):
    from transformers import T5Config, T5EncoderModel

    from rlm.retriever.encoder import SentenceEncoder

    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(dropout_rate=0.1, feed_forward_proj="relu", **GTR_BASE))
    tower = SentenceEncoder(
        model, tokenizer=None, dense=torch.nn.Linear(768, 768, bias=False), max_length=LENGTH
    )
    if checkpointing:
        tower.gradient_checkpointing_enable()
    return tower.train()


def saved_for_backward_mib(tower, passages: int, bf16: bool) -> float:
    """MiB of the distinct tensors autograd saves in one forward of `passages` x 256 tokens (no parameters)."""
    ids = torch.randint(3, GTR_BASE["vocab_size"], (passages, LENGTH))
    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        embeddings = tower(ids, torch.ones_like(ids))
    embeddings.float().sum().backward()
    tower.zero_grad(set_to_none=True)
    return sum(saved.values()) / 2**20


def measure(counts: list[int]) -> list[dict]:
    rows = []
    for name, (checkpointing, bf16) in VARIANTS.items():
        tower = gtr_base_shaped_tower(checkpointing)
        start = time.perf_counter()
        saved = {k: saved_for_backward_mib(tower, k, bf16) for k in counts}
        low, high = min(counts), max(counts)
        per_passage = (saved[high] - saved[low]) / (high - low)
        row = {"variant": name, "saved_mib": saved, "per_passage_mib": per_passage}
        row["per_question_gib"] = per_passage * PASSAGES_PER_QUESTION / 1024
        row["per_gpu_gib"] = row["per_question_gib"] * QUESTIONS_PER_GPU
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(row, file=sys.stderr)
    return rows


COLUMNS = [("variant", "variant", ""), ("MiB per passage", "per_passage_mib", ".1f")]
COLUMNS += [("GiB per question (32 passages)", "per_question_gib", ".2f")]
COLUMNS += [("GiB per GPU (4 questions)", "per_gpu_gib", ".1f")]
COLUMNS += [("+ one layer recomputed, GiB per GPU", "recompute_gpu_gib", ".1f")]


def markdown(results: dict) -> str:
    rows, layers = results["rows"], GTR_BASE["num_layers"]
    kept = {row["variant"]: row["per_passage_mib"] for row in rows}
    for row in rows:
        # Checkpointing's backward recomputes one layer at a time: that layer's activations for every passage.
        plain = kept.get(row["variant"].removesuffix(" + checkpointing"))
        if row["variant"].endswith("checkpointing") and plain is not None:
            row["recompute_gpu_gib"] = plain / layers * PASSAGES_PER_QUESTION * QUESTIONS_PER_GPU / 1024
    counts = ", ".join(map(str, results["passages"]))
    return (
        "# Activation memory of the passage tower\n\n"
        f"Command: `{results['command']}`. Machine: {reporting.machine_line(results['machine'])}.\n\n"
        "A GTR-base-shaped tower (T5-base encoder + Dense 768, random weights, dropout 0.1, train mode), "
        f"K = {counts} passages of {LENGTH} tokens, one forward + backward each. Saved for backward: the "
        "distinct tensors autograd keeps (saved-tensor hooks; parameters excluded), exact and independent of "
        "the allocator. Per passage: the difference between the largest and smallest K; per question and per "
        f"GPU: that times {PASSAGES_PER_QUESTION} and {PASSAGES_PER_QUESTION * QUESTIONS_PER_GPU} passages "
        "(projected, linear in K).\n\n"
        f"{reporting.table(rows, COLUMNS)}\n\n"
        "With checkpointing the backward pass recomputes one layer at a time, so it also holds, for a moment, "
        f"one layer's activations for every passage of the micro-batch: the variant's figure without "
        f"checkpointing / {layers} per passage (the last column, projected).\n"
    )


def main() -> int:
    p = reporting.arguments(__doc__)
    p.add_argument("--passages", type=reporting.int_list, default=[1, 2], help="K values (comma-separated)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=reporting.results_path("tower_memory"), help="output path stem")
    p.add_argument("--render", help="redo the report from this JSON, measuring nothing")
    args = p.parse_args()
    if args.render:
        reporting.write_report(args.out, markdown(reporting.load_results(args.render)))
        return 0
    torch.set_num_threads(args.threads)
    results = {"command": reporting.command("tower_memory.py"), "machine": reporting.machine()}
    results["passages"] = args.passages
    results["rows"] = measure(args.passages)
    reporting.write_report(args.out, markdown(results), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
