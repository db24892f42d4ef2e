"""`rlm demo`: serve the Gradio QA page over a trained checkpoint."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rlm.commands.embed import add_cache_argument
from rlm.commands.evaluate import add_device_arguments, add_embed_limit_argument, add_rescore_buffer_argument
from rlm.commands.index import add_index_spec_arguments, index_spec
from rlm.errors import UserError

if TYPE_CHECKING:
    from rlm.app.service import ServiceOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm demo`."""
    from rlm.app.demo import BATCH_WINDOW_S, MAX_BATCH  # the defaults, read where they are set

    parser.add_argument(
        "--checkpoint", required=True, help="the final/ folder of a run (e.g. runs/quickstart/final)"
    )
    parser.add_argument("--corpus", help="corpus file; default: the one named in <checkpoint>/config.yaml")
    parser.add_argument(
        "--examples", help="QA JSONL with example questions; default: dev.jsonl by the corpus"
    )
    add_index_source_arguments(parser.add_argument_group("what the demo retrieves from"))
    add_index_spec_arguments(
        parser.add_argument_group(
            "the index (the description `rlm index`, `rlm evaluate` and training share)"
        ),
        "the index built here and cached (without --index); --nprobe and --ef-search also override a prebuilt one's",
    )
    add_rescore_buffer_argument(parser)
    add_embed_limit_argument(parser, "rlm demo")
    add_cache_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads the answering uses (default: torch's own, all physical cores unless OMP_NUM_THREADS "
        "says otherwise)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        help="most questions (of all users) answered in one pass (default: "
        + ", ".join(f"{n} on {device}" for device, n in MAX_BATCH.items())
        + "; docs/demo.md)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=BATCH_WINDOW_S * 1000,
        help="how long a question waits for others to join its pass when the server is idle "
        f"(default {BATCH_WINDOW_S * 1000:g})",
    )
    parser.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)  # replaced: `run` says by what
    add_device_arguments(parser)


def add_index_source_arguments(parser) -> None:
    """A prebuilt index (and whether to follow its corpus updates), or h(B)."""
    from rlm.app.service import ServiceOptions

    parser.add_argument(
        "--index",
        help="prebuilt faiss index folder (`rlm index`) of the corpus under the trained passage tower",
    )
    parser.add_argument(
        "--follow-updates",
        type=float,
        default=ServiceOptions.follow_updates_s,
        metavar="SECONDS",
        help="with --index: look for a corpus update of it (`rlm corpus update`, run on this machine) this "
        "often and serve it without a restart, questions in flight finishing on their edition; 0: never",
    )
    parser.add_argument(
        "--corrected-buffer",
        action="store_true",
        help="retrieve over h(B), the run's fixed buffer through its trained corrector: nothing re-embedded",
    )
    parser.add_argument(
        "--buffer", help="with --corrected-buffer: the run's buffer folder (default: its config)"
    )


def serve_checkpoint(checkpoint, host: str = "127.0.0.1", port: int = 7860, **options) -> None:
    """Load the checkpoint (its index built and cached on first use), then serve the page until interrupted."""
    demo = start_demo(checkpoint, host=host, port=port, **options)
    print(f"demo on http://{host}:{port}  (Ctrl-C stops it)", flush=True)
    demo.block_thread()


def service_options(args: argparse.Namespace) -> ServiceOptions:
    """The `QAService` options `rlm demo`'s command line names (refused there when they cannot run)."""
    from rlm.app.service import ServiceOptions

    return ServiceOptions(
        device=args.device,
        bf16=args.bf16,
        index_path=args.index,
        index_spec=index_spec(args),
        corrected_buffer=args.corrected_buffer,
        buffer_path=args.buffer,
        examples_path=args.examples,
        show_progress=not args.no_progress,
        cache_dir=args.cache_dir,
        embed_limit=args.embed_limit,
        rescore_buffer=args.rescore_buffer,
        follow_updates_s=args.follow_updates,
    )


def start_demo(
    checkpoint,
    corpus: str | None = None,
    options: ServiceOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    threads: int | None = None,
    max_batch: int | None = None,
    batch_window_ms: float | None = None,
):
    """Load the checkpoint as `options` say (None: the defaults, with progress bars) and serve its page
    without blocking (warmed up); returns the Gradio app, whose `block_thread()` waits until interrupted.

    Questions are answered in passes of up to `max_batch` (None: `rlm.app.demo.default_max_batch` of the reader's
    device), on `threads` torch threads (None: torch's own count, all physical cores), one pass at a time
    (`rlm.app.demo.answer_queue`)."""
    from pathlib import Path

    import torch

    from rlm.app.demo import BATCH_WINDOW_S
    from rlm.app.service import QAService, ServiceOptions

    window_ms = BATCH_WINDOW_S * 1000 if batch_window_ms is None else batch_window_ms
    if threads is not None and threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    if max_batch is not None and max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {max_batch}")
    if not window_ms >= 0:  # NaN too
        raise UserError(f"--batch-window-ms must be >= 0, got {window_ms}")
    # One pass at a time takes every core (the batching queue's single worker), so the threads are torch's
    # whole pool, set before anything runs so that the worker thread the queue starts takes it from the start.
    if threads is not None:
        torch.set_num_threads(threads)
    service = QAService.from_checkpoint(checkpoint, corpus, options or ServiceOptions(show_progress=True))
    from rlm.app.demo import serve  # gradio takes seconds to import: only once loading worked

    blocked = [checkpoint, Path(service.corpus.path).parent]
    demo, _ = serve(service, host, port, blocked=blocked, max_batch=max_batch, window_s=window_ms / 1000)
    return demo


def run(args: argparse.Namespace) -> int:
    """Serve the demo of `--checkpoint`."""
    if args.concurrency is not None:
        raise UserError(
            "--concurrency is gone: the demo answers one pass at a time on all cores, with the questions of "
            "several users batched; use --max-batch (questions a pass) and --threads instead"
        )
    serve_checkpoint(
        args.checkpoint,
        host=args.host,
        port=args.port,
        corpus=args.corpus,
        options=service_options(args),
        threads=args.threads,
        max_batch=args.max_batch,
        batch_window_ms=args.batch_window_ms,
    )
    return 0
