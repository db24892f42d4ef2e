"""`rlm index`: a faiss index over passage embeddings (a buffer folder or a .npy file) for inference."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlm.errors import UserError, check_output_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm index`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--buffer", help="buffer folder written by `rlm embed` (embed with the trained passage tower)"
    )
    source.add_argument("--embeddings", help="a [N, D] .npy file (needs --ids)")
    parser.add_argument("--ids", help="with --embeddings: text file with one passage id per line")
    parser.add_argument(
        "--out",
        required=True,
        help="index folder (index.faiss, ids.txt, index.json), replaced whole; a folder holding other files is "
        "refused",
    )
    parser.add_argument(
        "--factory", default="Flat", help="faiss index_factory string, e.g. Flat, IVF1024,Flat, HNSW32"
    )
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", dest="use_gpu", action="store_const", const=True, help="require a faiss GPU")
    gpu.add_argument("--cpu", dest="use_gpu", action="store_const", const=False, help="stay on CPU")
    parser.add_argument("--train-sample", type=int, default=262_144, help="vectors used to train IVF/PQ")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from retriever.buffer import PassageBuffer
    from retriever.index import INDEX_FILES, PassageIndex

    check_output_folder(args.out, INDEX_FILES, "rlm index")  # saving replaces the folder whole
    started = time.perf_counter()
    if args.buffer:
        buffer = PassageBuffer.load(args.buffer)
        index = PassageIndex.from_buffer(
            buffer, args.factory, use_gpu=args.use_gpu, train_sample=args.train_sample
        )
    else:
        if not args.ids:
            raise UserError("--embeddings needs --ids (a text file with one passage id per line)")
        for path in (args.embeddings, args.ids):
            if not Path(path).exists():
                raise FileNotFoundError(f"{path} does not exist")
        embeddings = np.load(args.embeddings, mmap_mode="r")
        ids = Path(args.ids).read_text(encoding="utf-8").splitlines()
        if len(ids) != embeddings.shape[0]:
            raise UserError(
                f"{args.ids} has {len(ids)} ids but {args.embeddings} has {embeddings.shape[0]} rows"
            )
        index = PassageIndex.build(
            embeddings, ids, args.factory, use_gpu=args.use_gpu, train_sample=args.train_sample
        )
    index.save(args.out)
    seconds = time.perf_counter() - started
    print(f"index {args.out}: {index.ntotal} vectors x {index.dim}, {args.factory}, built in {seconds:.1f} s")
    return 0
