"""`rlm corpus update`: add, replace and delete passages of an indexed corpus, embedding only those
(`rlm.inference.corpus_update`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlm.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm corpus update`."""
    from rlm.inference.corpus_update import QUANTIZATION_LIMIT, RECALL_MARGIN

    actions = parser.add_subparsers(dest="action", required=True, metavar="update")
    update = actions.add_parser(
        "update",
        formatter_class=parser.formatter_class,
        help="add, replace and delete passages of the corpus an index serves or a training run's buffer holds",
        description=(
            "Embed only the added and changed passages, with the encoder the index's rows came from; add "
            "their rows to the index without retraining it; make the deleted and replaced ones unreachable. "
            "The corpus file and the buffer are left as they are: the update's passages and rows are kept in "
            "the index folder, and `rlm evaluate --index` / `rlm demo --index` with the same base corpus answer "
            "from the updated one. Says when the index has outgrown its codebooks (quantization error over "
            f"{QUANTIZATION_LIMIT} x the training sample's, or made questions on new rows found {RECALL_MARGIN} "
            "less often than on old ones): then `rlm index --retrain DIR`. With --buffer instead: the passages "
            "are embedded by the starting passage tower g0 that built the training run's buffer B and join it; "
            "the run, resumed (`--resume`), selects them through the corrector h and never the removed ones."
        ),
    )
    target = update.add_mutually_exclusive_group(required=True)
    target.add_argument("--index", help="the index folder to update (`rlm index --out`)")
    target.add_argument(
        "--buffer",
        help="or a training run's buffer folder (`buffer.dir`, else <output_dir>/buffer) to grow",
    )
    update.add_argument("--corpus", required=True, help="the corpus file it was built for (its base)")
    update.add_argument(
        "--add",
        default=None,
        help="JSONL {id, title, text}: new passages, and new text for an id the corpus has (it replaces it)",
    )
    update.add_argument("--delete", default=None, help="passage ids to delete, one a line")
    source = update.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        default=None,
        help="the trained run whose passage tower embedded the index's rows (for an index over h(B): whose "
        "corrector made them; its starting encoder and h embed the update); with --buffer: a checkpoint of the "
        "run the buffer belongs to (its starting encoder embeds the update)",
    )
    source.add_argument(
        "--encoder", default=None, help="or the encoder folder that embedded the rows (with --buffer: g0's)"
    )
    update.add_argument("--batch-size", type=int, default=64, help="passages a forward")
    update.add_argument(
        "--device", default=None, help="where the encoder runs (default: the accelerator, else CPU)"
    )


def run(args: argparse.Namespace) -> int:
    """Apply the update and print what it did and found."""
    from rlm.cache import corpus_fingerprint_cache
    from rlm.data.corpus import load_corpus
    from rlm.inference.corpus_update import update_buffer, update_index

    if not args.add and not args.delete:
        raise UserError("an update needs --add FILE, --delete FILE or both")
    for path in (args.add, args.delete, args.corpus):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
    started = time.perf_counter()
    base = load_corpus(args.corpus, fingerprint_cache=corpus_fingerprint_cache(None))
    how = {"checkpoint": args.checkpoint, "encoder": args.encoder, "device": args.device}
    update = update_buffer if args.buffer else update_index
    result, left = update(
        args.buffer or args.index, base, args.add, args.delete, **how, batch_size=args.batch_size
    )
    seconds = time.perf_counter() - started
    if left:
        print(f"removed what an interrupted update left: {', '.join(p.name for p in left)}")
    if args.buffer:
        print(
            f"update {result.number} of buffer {args.buffer}: {result.added} passages added, {result.replaced} "
            f"replaced, {result.deleted} deleted; {result.live:,} passages selectable ({result.rows:,} rows) in "
            f"{seconds:.1f} s (embedding by g0 {result.seconds['embed']:.1f} s); corpus edition "
            f"{result.fingerprint}. A run over this buffer takes it when it (re)starts: `--resume` goes on with "
            "the new rows selected through h."
        )
        return 0
    print(
        f"update {result.number} of {args.index}: {result.added} passages added, {result.replaced} replaced, "
        f"{result.deleted} deleted; {result.live:,} passages searchable ({result.rows:,} rows) in {seconds:.1f} s "
        f"(embedding {result.seconds['embed']:.1f} s, index {result.seconds['index']:.2f} s, saving "
        f"{result.seconds['save']:.2f} s); corpus edition {result.fingerprint}"
    )
    if result.checks:
        print(f"checks: {json.dumps(result.checks)}")
    for warning in result.warnings:
        print(f"warning: {warning}")
    return 0
