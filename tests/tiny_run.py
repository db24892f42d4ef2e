"""The tiny training run the end-to-end tests share: a 120-passage toy world, a tiny random-init retriever in
the packaged MiniLM's layout (its tokenizer, 4 BERT layers 32 wide) with short inputs, a one-layer T5 reader,
two questions per process per micro-step.

The tiny retriever is for tests of training mechanics (schedules, resume, processes, checkpoints), which hold
for any retriever: with MiniLM's 22M parameters its forward and backward passes were most of those tests'
time. What needs MiniLM's weights (the quickstart, the toy world's premise, the GPU smoke run, the demo) loads
the packaged model.
"""

from __future__ import annotations

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


def tiny_retriever(folder: Path) -> Path:
    """Write the tiny retriever to `folder` once (random weights from seed 0, so every test gets the same one)
    and return it; a folder already there is reused."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from retriever.encoder import SentenceEncoder, default_retriever_path

    folder = Path(folder)
    if (folder / "modules.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(default_retriever_path())
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


def tiny_overrides(root: Path, out: str | Path, *extra: str, minilm: bool = False) -> list[str]:
    """`--set` values of a tiny run writing to root/out (`out` may be a folder elsewhere: an absolute path);
    runs under one root share the toy world, the tiny retriever and its buffer. `minilm`: the packaged
    all-MiniLM-L6-v2 instead (the default retriever), with its own buffer."""
    root = Path(root)
    if minilm:
        retriever = [f"buffer.dir={root / 'buffer_minilm'}"]
    else:
        retriever = [
            f"buffer.dir={root / 'buffer'}",
            f"retriever.path={tiny_retriever(root / 'tiny_retriever')}",
        ]
    paths = [f"output_dir={root / out}", f"data.toy_world.dir={root / 'toy'}", *retriever]
    return [*paths, *TINY_RUN, *extra]


def as_set_args(overrides: list[str]) -> list[str]:
    """["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for item in overrides for arg in ("--set", item)]
