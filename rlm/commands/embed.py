"""`rlm embed`: embed a corpus once with the passage tower into a fixed buffer (resumable, data-parallel)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rlm.config import RetrieverConfig
from rlm.errors import UserError, check_output_folder

# How long a process of an `accelerate launch` waits for the others at a collective before `rlm embed` or
# `rlm evaluate` fails (PyTorch's default is 30 minutes). The longest such wait is a resumed embedding's: a process
# whose shards were all written before the interruption waits while the others embed what is left of theirs (up
# to a whole share: 21M passages over 8 GPUs, about 2.6M each), then for the main process's check of every shard.
# The index an evaluation builds is no such wait: the others watch for it on disk (`rlm.inference.indexing`).
DIST_TIMEOUT_S, MIN_DIST_TIMEOUT_S = 6 * 3600, 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm embed`."""
    parser.add_argument(
        "--corpus", required=True, help="corpus file: JSONL {id,title,text}, DPR .tsv, or pyserini"
    )
    parser.add_argument(
        "--format", default=None, choices=["jsonl", "dpr_tsv", "pyserini"], help="default: detect"
    )
    parser.add_argument(
        "--encoder",
        default=None,
        help="sentence-transformers folder or hub name, or a saved dual encoder folder (its passage_tower is "
        "used); default: the packaged all-MiniLM-L6-v2",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="buffer folder (an unfinished build there is resumed; a folder holding other files is refused)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="passages per forward pass")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="passage token limit; must equal the run's retriever.passage_max_length for rlm train to accept "
        "the buffer (default: the length a trained dual encoder's passage tower was saved with, e.g. "
        "<checkpoint>/retriever; for any other encoder the config default, "
        f"{RetrieverConfig.passage_max_length})",
    )
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"], help="storage dtype")
    parser.add_argument("--shard-size", type=int, default=100_000, help="rows per .npy shard")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cache_argument(parser)
    add_dist_timeout_argument(parser)


def add_dist_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """`--dist-timeout`, as `rlm embed` and `rlm evaluate` take it."""
    parser.add_argument(
        "--dist-timeout",
        type=int,
        default=DIST_TIMEOUT_S,
        metavar="SECONDS",
        help="under `accelerate launch`: how long a process waits for the others at a collective before the "
        f"command fails (default {DIST_TIMEOUT_S} s, which covers a resumed embedding's unequal shares; an "
        f"index being built is waited for on disk, under no timeout; at least {MIN_DIST_TIMEOUT_S})",
    )


def check_dist_timeout(seconds: int) -> None:
    """Refuse a `--dist-timeout` below `MIN_DIST_TIMEOUT_S`, before anything loads."""
    if seconds < MIN_DIST_TIMEOUT_S:
        raise UserError(f"--dist-timeout is at least {MIN_DIST_TIMEOUT_S} seconds, got {seconds}")


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """`--cache-dir`: where `rlm embed`, `rlm evaluate` and `rlm demo` keep what they can rebuild."""
    from rlm.cache import CACHE_ENV

    parser.add_argument(
        "--cache-dir",
        help="where the corpus's fingerprint and scan are remembered between runs (and the demo's index), so "
        f"a second start neither hashes nor parses the corpus again (default: ${CACHE_ENV}, else "
        "$XDG_CACHE_HOME/rlm, else ~/.cache/rlm; never the checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    from rlm.cache import corpus_fingerprint_cache
    from rlm.data.corpus import load_corpus
    from rlm.retriever.buffer import BUILD_NAME, IDS_NAME, META_NAME, build_passage_buffer
    from rlm.retriever.encoder import SentenceEncoder, default_retriever_path

    # The buffer's files (retriever/buffer.py): an unfinished build holds some of them and is resumed.
    own = (META_NAME, BUILD_NAME, IDS_NAME, "shard_*.npy", "shard_*.json")
    check_output_folder(args.out, own, "rlm embed")
    check_dist_timeout(args.dist_timeout)
    if not Path(args.corpus).exists():
        raise FileNotFoundError(f"corpus file {args.corpus} does not exist")
    corpus = load_corpus(
        args.corpus, fmt=args.format, fingerprint_cache=corpus_fingerprint_cache(args.cache_dir)
    )
    encoder_path = args.encoder or default_retriever_path()
    max_length = args.max_length
    if (Path(encoder_path) / "passage_tower").is_dir():
        # A trained tower embeds at the length it was trained at, saved with it (None: read from there).
        encoder_path = str(Path(encoder_path) / "passage_tower")
    elif max_length is None:
        max_length = RetrieverConfig.passage_max_length  # what `rlm train` takes a buffer of this encoder at
    encoder = SentenceEncoder.from_pretrained(encoder_path, max_length=max_length)
    max_length = encoder.max_length
    import torch

    accelerator = launched_processes(args.dist_timeout)
    if accelerator is None:
        encoder.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    started = time.perf_counter()
    buffer = build_passage_buffer(
        corpus.ids,
        corpus.retrieval_texts(),
        encoder,
        args.out,
        batch_size=args.batch_size,
        dtype=args.dtype,
        shard_size=args.shard_size,
        accelerator=accelerator,
        show_progress=not args.no_progress,
        corpus_fingerprint=corpus.fingerprint,  # from the scan: no second pass over the passages
    )
    seconds = time.perf_counter() - started
    if accelerator is None or accelerator.is_main_process:
        print(
            f"buffer {args.out}: {len(buffer)} passages x {buffer.dim} ({args.dtype}) from {encoder_path} "
            f"at max length {max_length} in {seconds:.1f} s; encoder {buffer.meta['encoder_fingerprint']}, "
            f"corpus {buffer.meta['corpus_fingerprint']}"
        )
    return 0


def launched_processes(timeout_s: int = DIST_TIMEOUT_S):
    """The accelerate state of an `accelerate launch` (or torchrun) with several processes, else None; its
    process group waits `timeout_s` seconds at a collective before it fails (`DIST_TIMEOUT_S`)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None
    import datetime

    import torch
    from accelerate import PartialState

    # Without cpu=True accelerate treats a CPU-only torchrun as one process per rank, each doing it all.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(seconds=timeout_s))
    if state.num_processes != world_size:
        raise UserError(
            f"WORLD_SIZE={world_size} but accelerate set up {state.num_processes} process(es); "
            "launch with `accelerate launch` or `torchrun --nproc_per_node N`"
        )
    return state
