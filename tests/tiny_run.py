"""The tiny training run the end-to-end tests share: a 120-passage toy world, a tiny random-init retriever in
the packaged MiniLM's layout (its tokenizer, 4 BERT layers 32 wide) with short inputs, a one-layer T5 reader,
two questions per process per micro-step; and how those tests train it (`train_args`, `train_here`,
`launch_two`) and compare runs (`read_log`, `same_losses`).

The tiny retriever is for tests of training mechanics (schedules, resume, processes, checkpoints), which hold
for any retriever: with MiniLM's 22M parameters its forward and backward passes were most of those tests'
time. What needs MiniLM's weights (the quickstart, the toy world's premise, the demo) loads the packaged model.
With `tokenizer=TINY_TOKENIZER` the tiny retriever needs no package at all (the GPU smoke run's tiny path, on
nodes without the packaged MiniLM).
"""

from __future__ import annotations

import json
from pathlib import Path

# BERT, as all-MiniLM-L6-v2 is, with the same vocabulary and mean pooling; 4 layers so that a light query tower
# (`retriever.query_path=layers:2`) is a strict subset.
TINY_RETRIEVER = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
}


# A WordPiece tokenizer kept in the repo (`vocab.txt`, 1,963 tokens, and its `tokenizer_config.json`), so
# that the tiny retriever can be built where the packaged MiniLM is not installed. Trained once by
# `tokenizers`' BertWordPieceTokenizer (lowercase, vocab_size 2000, min_frequency 2) on the titles, texts,
# questions and answers of the default toy world (2,000 passages, seed 0), then every ASCII letter, digit and
# punctuation mark added alone and as a `##` continuation. Kept as a file, not trained at run time: two
# trainings on the same text gave two token orders, and a retriever's token ids must not change between runs.
TINY_TOKENIZER = Path(__file__).with_name("tiny_tokenizer")


def tiny_retriever(folder: Path, tokenizer: Path | None = None) -> Path:
    """Write the tiny retriever to `folder` once (random weights from seed 0, so every test gets the same one)
    and return it; a folder already there is reused. `tokenizer`: a tokenizer folder (`TINY_TOKENIZER`) instead
    of the packaged MiniLM's."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    folder = Path(folder)
    if (folder / "modules.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or default_retriever_path()))
    config = BertConfig(vocab_size=len(tokenizer), **TINY_RETRIEVER)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random stream as it was
        torch.manual_seed(0)
        model = BertModel(config)  # with the pooler MiniLM ships, so it loads without warnings
    SentenceEncoder(model, tokenizer, max_length=128).save_pretrained(folder)  # atomic: a rename
    return folder


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


# The tiny `rlm quickstart`, small enough for a 2-core CPU shared with others: 150 passages, 3 steps of 4
# questions (one per phase of the quickstart's recipe: reader on the gold passages, the shared prefix;
# Algorithm 2 with the corrector; reader alone at the end), 8 dev questions.
TINY_QUICKSTART = [
    "data.toy_world.num_passages=150",
    "data.toy_world.options.kin_facts=0",  # 150 passages of people with 10 relatives' facts: too few questions
    "optim.max_steps=3",
    "schedule.gold_passage_steps=1",
    "schedule.reader_only_steps=1",
    "schedule.final_reader_only_steps=1",
    "optim.batch_size=4",
    "optim.warmup_steps=1",
    "data.max_dev_examples=8",
    "save_every=0",
]


def tiny_overrides(
    root: Path, out: str | Path, *extra: str, minilm: bool = False, tokenizer: Path | None = None
) -> list[str]:
    """`--set` values of a tiny run writing to root/out (`out` may be a folder elsewhere: an absolute path);
    runs under one root share the toy world, the tiny retriever and its buffer. `minilm`: the packaged
    all-MiniLM-L6-v2 instead (the default retriever), with its own buffer. `tokenizer`: the tiny retriever's
    (`tiny_retriever`), which then has its own folder and buffer."""
    root = Path(root)
    if minilm:
        retriever = [f"buffer.dir={root / 'buffer_minilm'}"]
    else:
        own = "" if tokenizer is None else f"_{Path(tokenizer).name}"
        retriever = [
            f"buffer.dir={root / f'buffer{own}'}",
            f"retriever.path={tiny_retriever(root / f'tiny_retriever{own}', tokenizer)}",
        ]
    paths = [f"output_dir={root / out}", f"data.toy_world.dir={root / 'toy'}", *retriever]
    return [*paths, *TINY_RUN, *extra]


def runs_beside(world: Path, folder: Path) -> Path:
    """`folder`, with links to the inputs of the session's tiny world (conftest's `tiny_world`: `toy/`,
    `tiny_retriever/`, `buffer/`): runs under it (`tiny_overrides(folder, out)`, `train_args(folder, out)`) read
    the world built once per worker and write only their own folders."""
    for name in ("toy", "tiny_retriever", "buffer"):
        (folder / name).symlink_to(world / name, target_is_directory=True)
    return folder


def as_set_args(overrides: list[str]) -> list[str]:
    """["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for item in overrides for arg in ("--set", item)]


def train_args(root: Path, out: str, *extra: str, steps: int = 6) -> list[str]:
    """`python -m rlm.train` arguments of a tiny run of `steps` steps (warm-up 2, a log line every step, a
    checkpoint every 2 steps, the last 2 kept) writing to root/out: the run the lifecycle, two-process,
    two-machine and tracking tests train, stop and resume."""
    schedule = [
        f"optim.max_steps={steps}",
        "optim.warmup_steps=2",
        "log_every=1",
        "save_every=2",
        "keep_last=2",
    ]
    return as_set_args(tiny_overrides(root, out, *schedule, "cpu=true", *extra))


def train_here(argv: list[str]) -> int:
    """`python -m rlm.train ARGV` in this process (accelerate's process-wide state reset around it), on one
    thread as the runs in subprocesses (`OMP_NUM_THREADS=1`): their losses must agree to the last digit."""
    from accelerate.state import AcceleratorState

    from rlm.quickstart.concurrent_runs import one_thread
    from rlm.train import main

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with one_thread():
            return main(argv)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def launch_two(root: Path, out: str, *extra: str) -> list[str]:
    """`rlm.train` on two CPU processes of one machine (`accelerate launch`, cpu_2proc.yaml), no checkpoints."""
    from local_port import two_processes

    return two_processes("-m", "rlm.train", *train_args(root, out, "save_every=0", *extra))


def read_log(path: Path) -> dict[int, dict]:
    """A run's log.jsonl by step."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if r}


LOSS_KEYS = ("loss", "reader_loss", "retriever_loss", "corrector_loss")


def same_losses(got: dict, reference: dict) -> None:
    """Two logs (`read_log`) hold the same steps with the same losses, to float32's last digits."""
    import pytest

    assert sorted(got) == sorted(reference)
    for step, record in reference.items():
        for key in (k for k in LOSS_KEYS if k in record):
            assert got[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-6), (step, key)
