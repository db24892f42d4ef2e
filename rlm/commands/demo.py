"""`rlm demo`: serve the Gradio QA page over a trained checkpoint."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rlm.commands.evaluate import add_device_arguments
from rlm.commands.index import add_search_arguments, search_params
from rlm.errors import UserError

if TYPE_CHECKING:
    from app.service import ServiceOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `rlm demo`."""
    parser.add_argument(
        "--checkpoint", required=True, help="the final/ folder of a run (e.g. runs/quickstart/final)"
    )
    parser.add_argument("--corpus", help="corpus file; default: the one named in <checkpoint>/config.yaml")
    parser.add_argument(
        "--examples", help="QA JSONL with example questions; default: dev.jsonl by the corpus"
    )
    parser.add_argument(
        "--index",
        help="prebuilt faiss index folder (`rlm index`) of the corpus under the trained passage tower",
    )
    parser.add_argument(
        "--corrected-buffer",
        action="store_true",
        help="retrieve over h(B), the run's fixed buffer through its trained corrector: nothing re-embedded",
    )
    parser.add_argument(
        "--buffer", help="with --corrected-buffer: the run's buffer folder (default: its config)"
    )
    add_search_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on")
    parser.add_argument("--concurrency", type=int, default=2, help="requests answered at once")
    add_device_arguments(parser)


def serve_checkpoint(checkpoint, host: str = "127.0.0.1", port: int = 7860, **options) -> None:
    """Load the checkpoint (its index built and cached on first use), then serve the page until interrupted."""
    demo = start_demo(checkpoint, host=host, port=port, **options)
    print(f"demo on http://{host}:{port}  (Ctrl-C stops it)", flush=True)
    demo.block_thread()


def service_options(args: argparse.Namespace) -> ServiceOptions:
    """The `QAService` options `rlm demo`'s command line names (refused there when they cannot run)."""
    from app.service import ServiceOptions

    return ServiceOptions(
        device=args.device,
        bf16=args.bf16,
        index_path=args.index,
        index_search=search_params(args),
        corrected_buffer=args.corrected_buffer,
        buffer_path=args.buffer,
        examples_path=args.examples,
        show_progress=not args.no_progress,
    )


def start_demo(
    checkpoint,
    corpus: str | None = None,
    options: ServiceOptions | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    concurrency: int = 2,
):
    """Load the checkpoint as `options` say (None: the defaults, with progress bars) and serve its page
    without blocking (warmed up); returns the Gradio app, whose `block_thread()` waits until interrupted."""
    from pathlib import Path

    import torch

    from app.service import QAService, ServiceOptions

    if concurrency < 1:
        raise UserError(f"--concurrency must be >= 1, got {concurrency}")
    # One request is a few small forward passes: intra-op threads only add synchronisation on a busy CPU,
    # so requests run single-threaded and the queue runs `concurrency` of them side by side.
    torch.set_num_threads(1)
    service = QAService.from_checkpoint(checkpoint, corpus, options or ServiceOptions(show_progress=True))
    from app.demo import serve  # gradio takes seconds to import: only once loading worked

    demo, _ = serve(service, host, port, concurrency, blocked=[checkpoint, Path(service.corpus.path).parent])
    return demo


def run(args: argparse.Namespace) -> int:
    """Serve the demo of `--checkpoint`."""
    serve_checkpoint(
        args.checkpoint,
        host=args.host,
        port=args.port,
        corpus=args.corpus,
        options=service_options(args),
        concurrency=args.concurrency,
    )
    return 0
