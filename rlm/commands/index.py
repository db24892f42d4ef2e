"""`rlm index`: a faiss index over passage embeddings (a buffer folder or a .npy file) for inference."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlm.errors import UserError, check_output_folder
from rlm.retriever.index import (
    INDEX_FILES,
    QUESTION_FOUND_SHARE,
    QUESTION_FOUND_WITHIN,
    TRAIN_ROWS_PER_LIST,
    TRAIN_SAMPLE,
    TUNE_QUERIES,
    describe_tuning,
)
from rlm.retriever.index_spec import AUTO_FACTORY_HELP, IndexSpec, IndexSpecError

# The flag of each `IndexSpec` field (`add_index_spec_arguments`); `device` is each command's own.
SPEC_FLAGS = {
    "factory": "--factory",
    "target_recall": "--target-recall",
    "tune_k": "--tune-k",
    "nprobe": "--nprobe",
    "ef_search": "--ef-search",
    "rescore": "--rescore",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm index`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--buffer", help="buffer folder written by `rlm embed` (embed with the trained passage tower)"
    )
    source.add_argument("--embeddings", help="a [N, D] .npy file (needs --ids)")
    source.add_argument(
        "--retrain",
        metavar="DIR",
        help="rebuild the codebooks of the index in DIR from its current rows (the buffer it was built from and "
        "the rows `rlm corpus update` appended), keeping its rows, updates and removed rows, and tune it again; "
        "what an update says to do when the index has outgrown its codebooks",
    )
    parser.add_argument("--ids", help="with --embeddings: text file with one passage id per line")
    parser.add_argument(
        "--out",
        default=None,
        help="index folder (index.faiss, ids.txt, index.json), replaced whole; a folder holding other files is "
        "refused",
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
    spec = parser.add_argument_group(
        "the index (the description `rlm evaluate`, `rlm demo` and training share)"
    )
    add_index_spec_arguments(spec, "the index")
    spec.add_argument(
        "--rescore",
        type=int,
        default=IndexSpec().rescore,
        metavar="K_FACTOR",
        help="with --buffer: re-score each search's top K_FACTOR x k candidates exactly from the buffer's float16 "
        "rows, read from disk by offset (lifts the recall PQ codes cap at the RAM of the codes; the index "
        "records the buffer's folder relative to itself: copy or move the two together, or point to it with "
        "`--rescore-buffer` where the index is used). 0: off",
    )
    add_tuning_arguments(parser.add_argument_group("tuning the search (IVF, HNSW)"))


def add_index_spec_arguments(parser, builds: str = "the index built here") -> None:
    """The index description's options (`rlm.retriever.index_spec.IndexSpec`: --factory, --target-recall,
    --tune-k, --nprobe, --ef-search), each default and its help read from `IndexSpec()`: `rlm index`,
    `rlm evaluate` and `rlm demo` take them alike, and training's `strategy.two_stage.index` has the same
    defaults. `index_spec(args)` makes the spec back."""
    default = IndexSpec()
    parser.add_argument(
        "--factory",
        default=default.factory,
        help=f"faiss index_factory string of {builds}, e.g. Flat (exact), IVF1024,Flat, HNSW32, IVF4096,PQ64 "
        f"(default {default.factory}; {AUTO_FACTORY_HELP})",
    )
    parser.add_argument(
        "--target-recall",
        type=float,
        default=default.target_recall,
        help="IVF and HNSW types: nprobe / efSearch is the smallest whose recall@--tune-k against exact search "
        f"reaches this (default {default.target_recall:g}), measured on indexed rows made question-like (the share "
        "whose source row exact search ranks in its top k that the index ranks there too: the answers kept) or on "
        "the questions asked (the share of exact search's top k found); saved with the index and applied when it "
        "is loaded (0: faiss's defaults, 1 probed list / efSearch 16). --nprobe / --ef-search fix it instead",
    )
    parser.add_argument(
        "--tune-k",
        type=int,
        default=default.tune_k,
        help=f"the k of the recall the search is tuned for: the k it will be searched at (default {default.tune_k}; "
        "`rlm evaluate` tunes at its --k when larger)",
    )
    parser.add_argument(
        "--nprobe",
        type=int,
        default=default.nprobe,
        help="IVF index: inverted lists probed per query (default: tuned)",
    )
    parser.add_argument(
        "--ef-search",
        type=int,
        default=default.ef_search,
        help="HNSW index: candidates explored per query (default: tuned)",
    )


def index_spec(args: argparse.Namespace, device: str = "auto") -> IndexSpec:
    """The `IndexSpec` the command line names (`add_index_spec_arguments`; `--rescore` where the command has
    it); a value it refuses is told by its flag."""
    try:
        return IndexSpec(
            factory=args.factory,
            target_recall=args.target_recall,
            tune_k=args.tune_k,
            nprobe=args.nprobe,
            ef_search=args.ef_search,
            rescore=getattr(args, "rescore", IndexSpec().rescore),
            device=device,
        )
    except IndexSpecError as err:
        raise UserError(
            f"{SPEC_FLAGS.get(err.field, err.field)} must be {err.wanted}, got {err.value!r}"
        ) from None


def building_flags(spec: IndexSpec) -> str:
    """The flags of `spec`'s settings that build an index, set away from their defaults, in one string."""
    return ", ".join(SPEC_FLAGS[name] for name in spec.build_settings_changed())


def add_tuning_arguments(parser) -> None:
    """How `rlm index` tunes nprobe / efSearch beyond the spec: on what queries."""
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


def run(args: argparse.Namespace) -> int:
    if args.retrain:
        return retrain(args)
    if not args.out:
        raise UserError("--out is required (the index folder to write)")
    check_output_folder(args.out, INDEX_FILES, "rlm index")  # saving replaces the folder whole
    device = {None: "auto", True: "gpu", False: "cpu"}[args.use_gpu]
    spec = index_spec(args, device)
    if spec.rescore and not args.buffer:
        raise UserError("--rescore re-scores from the float16 rows of a buffer folder: it goes with --buffer")
    started = time.perf_counter()
    index, rows = _built(args, spec)
    if not spec.search_params and index.tunable_parameter() and spec.target_recall:
        asked = question_vectors(args, index.dim)
        tuning = index.apply_search(spec, rows, query_vectors=asked, queries=args.tune_queries)
        print(f"search tuned: {describe_tuning(tuning)}")
    else:
        index.apply_search(spec, rows)
    index.save(args.out)
    seconds = time.perf_counter() - started
    params = ", ".join(f"{k}={v}" for k, v in index.search_params.items()) or "no search parameters"
    if index.rescoring is not None:
        params += f", the top {spec.rescore} x k re-scored from {args.buffer}"
    print(
        f"index {args.out}: {index.ntotal} vectors x {index.dim}, {index.factory}, {params}, built in "
        f"{seconds:.1f} s"
    )
    return 0


def retrain(args: argparse.Namespace) -> int:
    """`rlm index --retrain DIR`: the index rebuilt from its current rows as the next generation of DIR."""
    from rlm.inference.corpus_update import orphans_removed, retrained

    if args.out:
        raise UserError("--retrain DIR rebuilds the index in DIR: leave out --out")
    orphans_removed(args.retrain)
    started = time.perf_counter()
    index = retrained(args.retrain, train_sample=args.train_sample)
    params = ", ".join(f"{k}={v}" for k, v in index.search_params.items()) or "no search parameters"
    print(
        f"index {args.retrain} retrained from its {index.ntotal:,} rows ({len(index.removed):,} removed): "
        f"{index.factory}, {params}, in {time.perf_counter() - started:.1f} s"
    )
    return 0


def _built(args: argparse.Namespace, spec: IndexSpec):
    """(the index built as `spec` says from `--buffer` or `--embeddings`, the rows it holds)."""
    import numpy as np

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex

    if args.buffer:
        rows = PassageBuffer.load(args.buffer)
        index = PassageIndex.from_buffer(
            rows, spec.factory, use_gpu=spec.use_gpu, train_sample=args.train_sample
        )
        index.rescore_from(rows, spec.rescore)
        return index, rows
    if not args.ids:
        raise UserError("--embeddings needs --ids (a text file with one passage id per line)")
    for path in (args.embeddings, args.ids):
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} does not exist")
    # Memory-mapped (copy-on-write: torch can view it, nothing is written back): the index reads it a block
    # at a time, and tuning's exact search a chunk at a time, never as one float32 copy.
    embeddings = np.load(args.embeddings, mmap_mode="c")
    if embeddings.ndim != 2:
        raise UserError(f"{args.embeddings} holds an array of shape {embeddings.shape}, not [passages, dim]")
    ids = id_file(args.ids, len(embeddings), args.embeddings)
    index = PassageIndex.build(
        embeddings, ids, spec.factory, use_gpu=spec.use_gpu, train_sample=args.train_sample
    )
    return index, embeddings


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
