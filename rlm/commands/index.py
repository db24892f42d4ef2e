"""`rlm index`: a faiss index over passage embeddings (a buffer folder or a .npy file) for inference."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlm.errors import UserError, check_output_folder
from rlm.retriever.index import (
    DEFAULT_TARGET_RECALL,
    QUESTION_FOUND_SHARE,
    QUESTION_FOUND_WITHIN,
    TRAIN_ROWS_PER_LIST,
    TRAIN_SAMPLE,
    TUNE_K,
    TUNE_QUERIES,
    describe_tuning,
)


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
    parser.add_argument(
        "--train-sample",
        type=int,
        default=None,
        help=f"vectors used to train IVF/PQ (default: {TRAIN_SAMPLE:,}, or {TRAIN_ROWS_PER_LIST} per IVF list when "
        "more)",
    )
    add_search_arguments(parser)
    parser.add_argument(
        "--rescore",
        type=int,
        default=0,
        metavar="K_FACTOR",
        help="with --buffer: re-score each search's top K_FACTOR x k candidates exactly from the buffer's float16 "
        "rows, read from disk by offset (lifts the recall PQ codes cap at the RAM of the codes; the index "
        "records the buffer's folder relative to itself: copy or move the two together, or point to it with "
        "`--rescore-buffer` where the index is used). 0: off",
    )
    add_tuning_arguments(parser.add_argument_group("tuning the search (IVF, HNSW)"))


def add_tuning_arguments(parser) -> None:
    """How `rlm index` chooses nprobe / efSearch."""
    parser.add_argument(
        "--target-recall",
        type=float,
        default=DEFAULT_TARGET_RECALL,
        help="IVF and HNSW types: choose nprobe / efSearch as the smallest whose recall@--tune-k reaches this, "
        "against exact search on --tune-queries indexed rows made question-like (the share of those whose "
        "source row exact search ranks in its top k that the index ranks there too: the answers kept) or on "
        "--tune-questions (the share of exact search's top k found); saved with the index and applied when it "
        "is loaded (0: keep faiss's defaults, 1 probed list / efSearch 16). --nprobe / --ef-search fix it",
    )
    parser.add_argument(
        "--tune-k",
        type=int,
        default=TUNE_K,
        help="the k of the recall the search is tuned for: the k it will be searched at (`rlm evaluate --k`)",
    )
    parser.add_argument("--tune-queries", type=int, default=TUNE_QUERIES, help="tuning queries, at most")
    parser.add_argument(
        "--tune-questions",
        help="tune on these questions (a text file, one per line, or JSONL with a 'question' field) embedded "
        "by --query-encoder: what the index will be asked. Default: indexed rows made question-like (each "
        "moved as far from itself as exact search allows while ranking it in its top "
        f"{QUESTION_FOUND_WITHIN} for {QUESTION_FOUND_SHARE * 100:.0f}%% of them)",
    )
    parser.add_argument(
        "--query-encoder",
        help="with --tune-questions: the query tower, a trained dual encoder folder (<checkpoint>/retriever) or "
        "a sentence-transformers folder",
    )


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """--nprobe / --ef-search: faiss search parameters over the ones saved with an index."""
    parser.add_argument("--nprobe", type=int, help="IVF index: inverted lists probed per query")
    parser.add_argument("--ef-search", type=int, help="HNSW index: candidates explored per query")


def search_params(args: argparse.Namespace) -> dict[str, int]:
    """The search parameters named on the command line, as faiss calls them."""
    named = {"nprobe": args.nprobe, "efSearch": args.ef_search}
    for name, value in named.items():
        if value is not None and value < 1:
            raise UserError(
                f"--{'ef-search' if name == 'efSearch' else name} must be at least 1, got {value}"
            )
    return {name: value for name, value in named.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import INDEX_FILES, PassageIndex

    check_output_folder(args.out, INDEX_FILES, "rlm index")  # saving replaces the folder whole
    if not 0.0 <= args.target_recall <= 1.0:
        raise UserError(f"--target-recall must be in [0, 1], got {args.target_recall}")
    fixed = search_params(args)
    if args.rescore < 0:
        raise UserError(
            f"--rescore is a number of candidates per result, at least 1 (0: off), got {args.rescore}"
        )
    if args.rescore and not args.buffer:
        raise UserError("--rescore re-scores from the float16 rows of a buffer folder: it goes with --buffer")
    started = time.perf_counter()
    if args.buffer:
        rows = PassageBuffer.load(args.buffer)
        index = PassageIndex.from_buffer(
            rows, args.factory, use_gpu=args.use_gpu, train_sample=args.train_sample
        )
        index.rescore_from(rows, args.rescore)
    else:
        if not args.ids:
            raise UserError("--embeddings needs --ids (a text file with one passage id per line)")
        for path in (args.embeddings, args.ids):
            if not Path(path).exists():
                raise FileNotFoundError(f"{path} does not exist")
        # Memory-mapped (copy-on-write: torch can view it, nothing is written back): the index reads it a block
        # at a time, and tuning's exact search a chunk at a time, never as one float32 copy.
        embeddings = rows = np.load(args.embeddings, mmap_mode="c")
        if embeddings.ndim != 2:
            raise UserError(
                f"{args.embeddings} holds an array of shape {embeddings.shape}, not [passages, dim]"
            )
        ids = id_file(args.ids, len(embeddings), args.embeddings)
        index = PassageIndex.build(
            embeddings, ids, args.factory, use_gpu=args.use_gpu, train_sample=args.train_sample
        )
    tunable = index.tunable_parameter()
    if fixed:
        index.set_search_params(fixed)
    elif tunable and args.target_recall > 0:
        asked = question_vectors(args, index.dim)
        tuning = index.tune(
            rows, args.target_recall, k=args.tune_k, queries=args.tune_queries, query_vectors=asked
        )
        print(f"search tuned: {describe_tuning(tuning)}")
    index.save(args.out)
    seconds = time.perf_counter() - started
    params = ", ".join(f"{k}={v}" for k, v in index.search_params.items()) or "no search parameters"
    if index.rescoring is not None:
        params += f", the top {args.rescore} x k re-scored from {args.buffer}"
    print(
        f"index {args.out}: {index.ntotal} vectors x {index.dim}, {args.factory}, {params}, built in "
        f"{seconds:.1f} s"
    )
    return 0


def id_file(path: str, rows: int, embeddings: str):
    """The ids of `path` (one per line, UTF-8; a file written on Windows too) as one `IdSequence`, never a list
    of 21M strings; refused unless there is one per row of `embeddings`."""
    import codecs

    from rlm.retriever.ids import IdSequence

    data = Path(path).read_bytes()
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for start in range(0, len(data), 1 << 20):  # a block at a time: no str of the whole file
            decoder.decode(data[start : start + (1 << 20)], final=start + (1 << 20) >= len(data))
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path}: not UTF-8 ({err.reason}); convert it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    count = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if count != rows:
        raise UserError(f"{path} has {count} ids but {embeddings} has {rows} rows")
    return IdSequence.from_lines(data, rows)


def question_vectors(args: argparse.Namespace, dim: int):
    """`--tune-questions` embedded by `--query-encoder` ([Q, D] float32), or None."""
    if not args.tune_questions:
        if args.query_encoder:
            raise UserError("--query-encoder goes with --tune-questions")
        return None
    if not args.query_encoder:
        raise UserError("--tune-questions needs --query-encoder (the query tower that embeds them)")
    import json

    from rlm.retriever.encoder import DualEncoder, SentenceEncoder

    lines = [
        line for line in Path(args.tune_questions).read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    questions = []
    for number, line in enumerate(lines, start=1):
        if not line.lstrip().startswith("{"):
            questions.append(line.strip())
            continue
        record = json.loads(line)
        if "question" not in record:
            raise UserError(f"{args.tune_questions}:{number}: a JSON line without a 'question' field")
        questions.append(record["question"])
    folder = Path(args.query_encoder)
    if (folder / "query_tower").is_dir():
        tower = DualEncoder.from_pretrained(str(folder)).query_tower
    else:
        tower = SentenceEncoder.from_pretrained(str(folder))
    if tower.dim != dim:
        raise UserError(f"--query-encoder embeds in {tower.dim} dimensions but the index holds {dim}")
    return tower.encode(questions[: args.tune_queries]).numpy()
