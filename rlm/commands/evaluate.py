"""`rlm evaluate`: retrieve with a checkpoint's retriever, read with its reader, write predictions + metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlm.commands.embed import (
    add_cache_argument,
    add_dist_timeout_argument,
    check_dist_timeout,
    launched_processes,
)
from rlm.commands.index import add_index_spec_arguments, building_flags, index_spec
from rlm.errors import UserError, check_output_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm evaluate`."""
    parser.add_argument("--checkpoint", help="folder with retriever/ and reader/ (e.g. runs/train/final)")
    parser.add_argument(
        "--retriever", help="retriever folder instead of <checkpoint>/retriever (e.g. MiniLM)"
    )
    add_question_arguments(parser.add_argument_group("questions and corpus"))
    index = parser.add_argument_group("index")
    index.add_argument(
        "--index",
        help="reuse a saved faiss index folder (`rlm index`) instead of embedding; `corrected`: retrieve over "
        "h(B), the run's fixed buffer through its trained corrector (nothing re-embedded)",
    )
    index.add_argument(
        "--buffer", help="with --index corrected: the run's buffer folder (default: from its config.yaml)"
    )
    add_index_spec_arguments(
        index,
        "the index built here (without --index, or with --index corrected); --nprobe and --ef-search also "
        "override a prebuilt one's",
    )
    add_rescore_buffer_argument(index)
    add_index_building_arguments(index)
    add_reading_arguments(parser.add_argument_group("retrieving and reading"))
    parser.add_argument(
        "--out",
        help="folder for predictions.jsonl and metrics.json (a folder holding other files is refused)",
    )
    add_device_arguments(parser)
    add_cache_argument(parser)
    add_dist_timeout_argument(parser)


def add_question_arguments(parser) -> None:
    """The questions `rlm evaluate` answers and the corpus it retrieves from."""
    parser.add_argument(
        "--dataset",
        default="toy",
        help="QA dataset: toy, nq_open (nq), trivia_qa (tqa), hotpot_qa (hotpotqa), multihop200, jsonl",
    )
    parser.add_argument(
        "--split",
        default="dev",
        help="train, dev or test as the literature names them: for nq_open, trivia_qa and hotpot_qa test is "
        "the hub's validation (the set papers report) and dev a fixed carve-out of its train (docs/data.md); "
        "another name is that published split as it is",
    )
    parser.add_argument("--data-path", help="local dataset file or folder (a toy world folder for 'toy')")
    parser.add_argument("--corpus", help="corpus file; default: corpus.jsonl in --data-path when present")
    parser.add_argument(
        "--corpus-format", choices=("jsonl", "dpr_tsv", "pyserini"), default=None, help="default: detect"
    )
    parser.add_argument(
        "--subcorpus", help="ids file (one per line) restricting the corpus, e.g. a hard subcorpus"
    )
    parser.add_argument("--max-examples", type=int, default=None, help="at most this many questions")


def add_reading_arguments(parser) -> None:
    """How many passages `rlm evaluate` retrieves and reads, and in which mode."""
    parser.add_argument(
        "--k", type=int, default=100, help="passages retrieved per question (recall@k up to k)"
    )
    parser.add_argument(
        "--num-passages", type=int, default=None, help="passages the reader reads (default: config)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="questions per batch")
    parser.add_argument("--num-beams", type=int, default=1, help="beam width of the reader's decoding")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--retrieval-only", action="store_true", help="no reader: recall@k only")
    mode.add_argument("--closed-book", action="store_true", help="reader only, no passages")
    mode.add_argument(
        "--gold-passages",
        action="store_true",
        help="oracle: the gold passages swapped into the top --num-passages (alone with --no-retriever)",
    )
    parser.add_argument(
        "--no-retriever", action="store_true", help="with --gold-passages: read the gold alone"
    )
    parser.add_argument(
        "--no-policy",
        action="store_true",
        help="ignore the checkpoint's answer policy (answer_policy.json, `rlm calibrate`): answer everything, "
        "with the reader's own probability as confidence",
    )


def add_rescore_buffer_argument(parser: argparse.ArgumentParser) -> None:
    """`--rescore-buffer`: where a prebuilt index that re-scores its candidates finds its buffer."""
    parser.add_argument(
        "--rescore-buffer",
        help="with --index DIR built with `rlm index --rescore`: the buffer folder it re-scores from, when it is "
        "neither where it was relative to the index nor where it was built (default: as index.json records)",
    )


def add_embed_limit_argument(parser: argparse.ArgumentParser, command: str) -> None:
    """`--embed-limit`: the corpus size above which `command` refuses to embed and index a corpus itself."""
    from rlm.inference.indexing import EMBED_LIMIT

    parser.add_argument(
        "--embed-limit",
        type=int,
        default=EMBED_LIMIT,
        help=f"without --index, `{command}` embeds and indexes the corpus itself only up to this many passages "
        "(a larger one: `rlm embed` then `rlm index`, once, and --index); 0: no limit",
    )


def add_index_building_arguments(parser: argparse.ArgumentParser) -> None:
    """How `rlm evaluate` embeds a corpus it is given no index for (the index: `add_index_spec_arguments`)."""
    add_embed_limit_argument(parser, "rlm evaluate")
    parser.add_argument(
        "--save-index",
        help="save the index built here to this folder for reuse (a folder holding other files is refused)",
    )
    parser.add_argument(
        "--embeddings",
        help="without --index: keep the corpus's float16 embeddings (a buffer folder, as `rlm embed` writes) "
        "here instead of a temporary folder: an interrupted run resumes, a second run reuses them; needed "
        "under `accelerate launch`, whose processes each embed their share into it",
    )


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--bf16` and `--no-progress`, as `rlm evaluate` and `rlm demo` take them."""
    parser.add_argument(
        "--device",
        default=None,
        help="where the towers, the reader and the corrector run: cpu, cuda, cuda:1 ... (default: cuda when "
        "available); on cuda the faiss index goes to the GPU too when faiss-gpu is installed",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast for the towers and the reader (on CPU only where bf16 is native, else float32 "
        "with a warning)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _default_corpus(args) -> str | None:
    if args.corpus:
        return args.corpus
    if args.data_path and (Path(args.data_path) / "corpus.jsonl").is_file():
        return str(Path(args.data_path) / "corpus.jsonl")
    return None


def _check_arguments(args: argparse.Namespace) -> None:
    """The options' combinations, before anything loads: --out would overwrite a run's own metrics.json,
    --save-index replaces its folder."""
    from rlm.retriever.index import INDEX_FILES

    if args.out:
        check_output_folder(args.out, ("predictions.jsonl", "metrics.json"), "rlm evaluate")
    if args.save_index:
        check_output_folder(args.save_index, INDEX_FILES, "rlm evaluate", option="--save-index")
    if args.buffer and args.index != "corrected":
        raise UserError("--buffer only goes with --index corrected")
    if args.rescore_buffer and args.index in (None, "corrected"):
        raise UserError(
            "--rescore-buffer goes with --index DIR (a prebuilt index that re-scores its candidates)"
        )
    if args.embed_limit < 0:
        raise UserError(f"--embed-limit is a number of passages (0: no limit), got {args.embed_limit}")
    if args.index and args.embeddings:
        raise UserError("--embeddings keeps the corpus embedded here; with --index nothing is embedded")
    built = building_flags(index_spec(args))
    if args.index not in (None, "corrected") and built:
        raise UserError(f"{built} build an index: they go without --index, or with --index corrected")
    check_dist_timeout(args.dist_timeout)
    if args.embeddings:
        from rlm.inference.indexing import HANDOFF_NAMES
        from rlm.retriever.buffer import BUILD_NAME, IDS_NAME, META_NAME

        own = (META_NAME, BUILD_NAME, IDS_NAME, "shard_*.npy", "shard_*.json", *HANDOFF_NAMES)
        check_output_folder(args.embeddings, own, "rlm evaluate", option="--embeddings")
    if not args.checkpoint and not args.retriever:
        raise UserError(
            "pass --checkpoint DIR (retriever/ + reader/) or --retriever PATH with --retrieval-only"
        )
    if args.closed_book and args.retriever:
        raise UserError("--closed-book uses no retriever; drop --retriever")
    if not args.retrieval_only and not args.checkpoint:
        raise UserError("reading needs --checkpoint with a reader/ folder; or pass --retrieval-only")
    if args.no_retriever and not args.gold_passages:
        raise UserError("--no-retriever only goes with --gold-passages")


def run(args: argparse.Namespace) -> int:
    """Load, evaluate, print the table."""
    from rlm.data.qa import load_qa_split
    from rlm.inference import checkpoint, evaluation
    from rlm.inference.device import autocast, inference_bf16, inference_device

    _check_arguments(args)
    need_reader = not args.retrieval_only
    questions = load_qa_split(args.dataset, args.split, args.data_path).limited(args.max_examples)
    corpus = None if args.closed_book else _corpus(args)
    without_retriever = args.closed_book or args.no_retriever
    if not without_retriever and not args.index:
        from rlm.inference.indexing import check_embed_limit

        encoder = args.retriever or str(Path(args.checkpoint) / "retriever")
        check_embed_limit(corpus, args.embed_limit, encoder, "rlm evaluate")
    state = launched_processes(args.dist_timeout)  # several under `accelerate launch`: a share each
    device = inference_device(args.device if state is None else state.device)
    is_main = state is None or state.is_main_process
    bf16 = inference_bf16(device, args.bf16)
    progress = not args.no_progress
    retriever, reader, config = checkpoint.load_checkpoint(
        args.checkpoint,
        need_reader=need_reader,
        retriever_path=None if without_retriever else args.retriever,
        need_retriever=not without_retriever,
        device=device,
    )
    if is_main:
        processes = "" if state is None else f" x {state.num_processes} processes"
        print(f"running on {device}{processes}" + (" under bf16 autocast" if bf16 else " in float32"))
    options = evaluation.IndexOptions(
        args.embeddings,
        index_spec(args),
        precision="bf16" if bf16 else "auto",
        accelerator=state,
        save_dir=None if args.index else args.save_index,
    )
    with autocast(device, bf16):
        result, policy = _evaluate(
            args, questions, corpus, retriever, reader, config, device, progress and is_main, options
        )
    if not is_main:
        return 0
    mode = (
        "closed book" if args.closed_book else "retrieval only" if args.retrieval_only else "retrieve + read"
    )
    print(evaluation.format_table(result.metrics, f"{questions.describe()} ({mode})"))
    if policy is None and reader is not None:
        print("(no answer policy in the checkpoint: nothing abstained; `rlm calibrate` fits one)")
    if result.metrics_path is not None:
        print(f"\nwrote {result.predictions_path} and {result.metrics_path}")
    return 0


def _corpus(args):
    """The corpus passages are retrieved from (`--corpus`, else corpus.jsonl in `--data-path`), restricted to
    `--subcorpus` when given."""
    from rlm.cache import corpus_fingerprint_cache
    from rlm.data.corpus import load_corpus

    corpus_path = _default_corpus(args)
    if corpus_path is None:
        raise UserError("no corpus: pass --corpus FILE (or a --data-path folder holding corpus.jsonl)")
    corpus = load_corpus(corpus_path, args.corpus_format, corpus_fingerprint_cache(args.cache_dir))
    if args.subcorpus:
        from rlm.training.hard_subcorpus import load_subcorpus

        corpus = load_subcorpus(corpus, args.subcorpus)
    return corpus


def _index(args, corpus, retriever, device, progress: bool, options):
    """The index `--index` names (a saved one, or over h(B) for `corrected`), or None: `run_evaluation` then
    builds it as `options` say (and saves it to `--save-index`)."""
    from rlm.inference import indexing
    from rlm.inference.device import index_on_gpu

    use_gpu = index_on_gpu(device)
    if args.index == "corrected":
        from rlm.inference.corrected_index import corrected_index

        if not args.checkpoint:
            raise UserError("--index corrected needs --checkpoint (its corrector/ and config.yaml)")
        from rlm.inference.evaluation import tuning_k

        built = corrected_index(
            args.checkpoint,
            corpus,
            args.buffer,
            options.spec,
            device=device,
            show_progress=progress,
            tune_k=tuning_k(args.k, options.spec.tune_k),  # the k it is searched at
        )
        print(
            f"index over h(B): {built.rows:,} rows of {built.buffer_dir} through the corrector in "
            f"{built.correct_s:.2f} s (+ {built.index_s:.2f} s faiss), no passage re-embedded"
        )
        if args.save_index:
            built.index.save(args.save_index)
        return built.index
    if args.index:
        # Under `accelerate launch` every process maps the one file: one copy in RAM, not one per process.
        launched = options.accelerator is not None
        search = options.spec.search_params
        return indexing.prebuilt_index(
            args.index, retriever, corpus, use_gpu, search, args.rescore_buffer, mmap=launched
        )
    return None  # built by `run_evaluation` as `options` say, tuned on the questions it evaluates


def _evaluate(args, questions, corpus, retriever, reader, config, device, progress: bool, options):
    """The index (`_index`), then `run_evaluation`: (its result, the answer policy used)."""
    from rlm.inference import evaluation
    from rlm.inference.checkpoint import reader_passages_from_config

    index = _index(args, corpus, retriever, device, progress, options) if retriever is not None else None
    if index is not None and args.index:  # an index corpus updates changed answers from their edition
        from rlm.inference.indexing import served_corpus

        corpus = served_corpus(index, corpus, args.index)
    num_passages = args.num_passages or reader_passages_from_config(config)
    policy = None
    if reader is not None and args.checkpoint and not args.no_policy:
        from rlm.inference.answer_policy import AnswerPolicy

        policy = AnswerPolicy.load(args.checkpoint)
    result = evaluation.run_evaluation(
        questions.examples,
        corpus=corpus,
        retriever=retriever,
        reader=reader,
        index=index,
        k=min(args.k, len(corpus)) if corpus is not None else args.k,
        num_passages=num_passages,
        closed_book=args.closed_book,
        gold_passages=args.gold_passages,
        batch_size=args.batch_size,
        num_beams=args.num_beams,
        out_dir=args.out,
        show_progress=progress,
        policy=policy,
        index_options=options,
        data=questions.record(),
    )
    return result, policy
