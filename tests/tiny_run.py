"""The tiny training run the end-to-end tests share: a 120-passage toy world, the packaged MiniLM towers with
short inputs, a one-layer T5 reader, two questions per process per micro-step."""

from __future__ import annotations

from pathlib import Path

TINY_RUN = [
    "data.toy_world.num_passages=120",
    "data.dev=null",
    "strategy.k=4",
    "retriever.passage_max_length=40",
    "retriever.query_max_length=24",
    "reader.d_model=32",
    "reader.d_ff=64",
    "reader.num_layers=1",
    "reader.num_decoder_layers=1",
    "reader.num_heads=2",
    "reader.d_kv=16",
    "reader.vocab_size=500",
    "reader.max_passage_length=40",
    "reader.max_answer_length=8",
    "optim.batch_size=2",
]


# The tiny `rlm quickstart`, small enough for a 2-core CPU shared with others: 150 passages, 2 steps of 4
# questions, 8 dev questions.
TINY_QUICKSTART = [
    "data.toy_world.num_passages=150",
    "data.toy_world.options.kin_facts=0",  # 150 passages of people with 10 relatives' facts: too few questions
    "optim.max_steps=2",
    "optim.batch_size=4",
    "optim.warmup_steps=1",
    "data.max_dev_examples=8",
    "save_every=0",
]


def tiny_overrides(root: Path, out: str | Path, *extra: str) -> list[str]:
    """`--set` values of a tiny run writing to root/out (`out` may be a folder elsewhere: an absolute path);
    runs under one root share the toy world and buffer."""
    paths = [
        f"output_dir={root / out}",
        f"buffer.dir={root / 'buffer'}",
        f"data.toy_world.dir={root / 'toy'}",
    ]
    return [*paths, *TINY_RUN, *extra]


def as_set_args(overrides: list[str]) -> list[str]:
    """["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for item in overrides for arg in ("--set", item)]
