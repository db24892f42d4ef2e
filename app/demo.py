"""The Gradio QA page over a `QAService`: question box, top-k slider, answer (or an abstention and its reason),
confidence and latency, retrieved passages, and the whole result as JSON.

The `/answer` API endpoint returns four named outputs: `Answer`, `status`, `passages` (HTML) and `result`
(the `QAService.answer` dict: answer, confidence, abstained, reason, best_guess, passages, ...).

`build_demo(service, answers)` returns the Blocks, whose questions go through `answers`, the batching queue of
`answer_queue(service)` (questions of several users answered in one pass); `launch_kwargs(...)` holds the
serving policy: bind 127.0.0.1 unless told otherwise, no server-side rendering, and no files served beyond
Gradio's own assets (no allowed paths; the checkpoint, corpus and working folders explicitly blocked).
"""

from __future__ import annotations

import functools
import html
import math
import os
import re
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.app.service import InvalidQuestion, QAService
from rlm.inference.batching import BatchingQueue

if TYPE_CHECKING:
    import gradio as gr

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
QUEUE_MAX_SIZE = 64
# The batching queue's defaults (`rlm demo --max-batch`, `--batch-window-ms`), from the table of docs/demo.md, "A
# paper-size reader": on a CPU one question already keeps every core at 1.1-1.2x of the matmul bound (float32,
# T5-base shapes), so a pass of 8 answered 0.77-1.02x the questions a second of one at a time and made each
# user wait for all 8: one question a pass. On a GPU a pass of 8 costs little more than one: 8. The window is
# what a question waits for others when the worker is idle: users who click together arrive within it, and it
# is a tenth of the quickstart reader's 0.14 s answer (docs/demo.md, "Load test").
MAX_BATCH = {"cpu": 1, "cuda": 8}
BATCH_WINDOW_S = 0.01


def default_max_batch(device) -> int:
    """`MAX_BATCH` for the device the reader answers on (`torch.device` or its name); 8 on any accelerator."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return MAX_BATCH.get(kind, MAX_BATCH["cuda"])


# Below this confidence the page warns that the answer is probably wrong. With a calibrated checkpoint the
# confidence is the estimated chance that the answer is right, so below one half it is more likely wrong than
# right (and answers below the policy's own threshold are abstained, not shown); without calibration it is
# the reader's own probability of its answer, and the same figure is a rougher guide.
LOW_CONFIDENCE = 0.5

CSS = """
#passages .passage { border: 1px solid #ddd; border-radius: 6px; padding: 8px 10px; margin: 6px 0; }
#passages .passage .meta { color: #666; font-size: 0.85em; }
#passages mark { background: #ffe066; padding: 0 2px; border-radius: 2px; }
"""


def highlight(text: str, answer: str) -> str:
    """`text` HTML-escaped, with every case-insensitive occurrence of `answer` wrapped in <mark>."""
    answer = answer.strip()
    if not answer:
        return html.escape(text)
    parts = re.split(f"({re.escape(answer)})", text, flags=re.IGNORECASE)
    return "".join(
        f"<mark>{html.escape(part)}</mark>" if i % 2 else html.escape(part) for i, part in enumerate(parts)
    )


def passages_html(result: dict) -> str:
    """The retrieved passages as HTML cards: rank, title, retrieval score, text with the answer marked."""
    cards = []
    for rank, p in enumerate(result["passages"], start=1):
        cards.append(
            '<div class="passage">'
            f'<div class="meta">#{rank} · score {p["score"]:.3f}{" · contains the answer" if p["has_answer"] else ""}'
            "</div>"
            f'<div class="title"><b>{highlight(p["title"], result["answer"])}</b></div>'
            f'<div class="text">{highlight(p["text"], result["answer"])}</div>'
            "</div>"
        )
    return "".join(cards) or "<p>No passages retrieved.</p>"


def confidence_note(confidence: float, calibrated: bool = True) -> str:
    """The confidence as the page states it; below LOW_CONFIDENCE it says plainly not to trust the answer."""
    what = "chance of being right" if calibrated else "reader's probability, uncalibrated"
    if confidence < LOW_CONFIDENCE:
        return f"⚠️ low confidence ({100 * confidence:.0f}% {what}): this answer may well be wrong"
    return f"confidence {100 * confidence:.0f}% ({what})"


def render(result: dict) -> tuple[str, str, str, dict]:
    """(answer, status line, passages HTML, the result as JSON) of one `QAService` result.

    An abstention is shown as such: no answer, and the reason in the status line."""
    batch_size = result.get("batch_size", 1)
    shared = f" (batch of {batch_size})" if batch_size > 1 else ""
    tail = f"{result['latency_ms']:.0f} ms{shared} · top-{result['k']} passages"
    if result.get("corpus_edition"):  # which corpus, or edition of one after `rlm corpus update`, answered
        tail += f" · corpus {result['corpus_edition'].rpartition(':')[2][:12]}"
    if result.get("abstained"):
        status = f"🚫 No answer: {result['reason']} · {tail}"
    else:
        status = f"{confidence_note(result['confidence'], result.get('calibrated', False))} · {tail}"
    return result["answer"], status, passages_html(result), result


def answer_queue(
    service: QAService, max_batch: int | None = None, window_s: float = BATCH_WINDOW_S
) -> BatchingQueue:
    """The page's questions answered in batches: (question, k) requests from any number of users, up to
    `max_batch` of them (None: `default_max_batch` of the reader's device) in one `QAService.answer_requests`
    pass (retrieval and reading) on all of torch's threads, gathered while the previous pass runs or within
    `window_s` of the first one's arrival."""
    answer = functools.partial(service.answer_requests, best_guess=True)
    if max_batch is None:
        max_batch = default_max_batch(service.reader.device)
    return BatchingQueue(answer, max_batch=max_batch, window_s=window_s, name="demo-answers")


def respond(
    service: QAService, question: str, k: float, answers: BatchingQueue | None = None
) -> tuple[str, str, str, dict]:
    """(answer, status line, passages HTML, result JSON) for the page, answered through `answers` (the page's
    `answer_queue` over `service`; None: answered here, alone).

    Refused input (a question that is empty, too long or not text; a k that is not a number) gets its message,
    never a trace. A question that breaks the service (a bug) gets a message, and its traceback goes to the
    server's console; in a batch, the queue answers the others again without it, so they get their answers.
    """
    try:
        if question is not None and not isinstance(question, str):
            raise InvalidQuestion(f"The question must be text; got {question!r}.")
        request = (service.check_question(question), requested_k(service, k))
        result = answers(request) if answers is not None else service.answer(*request, best_guess=True)
    except InvalidQuestion as err:
        return _refused(str(err))
    except Exception:
        traceback.print_exc()
        return _refused("Something went wrong answering this question; the server's log has the details.")
    return render(result)


def requested_k(service: QAService, k) -> int:
    """The top-k a request asked for, as the service takes it (the default when None or 0, clamped to the
    slider's range); InvalidQuestion, with a message for the user, for anything but a finite number. The
    slider sends numbers, but an API client can send any JSON value."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int | float) or not math.isfinite(k)):
        raise InvalidQuestion(f"Passages (top-k) must be a number from 1 to {service.max_k}; got {k!r}.")
    return service.clamp_k(k)


def _refused(message: str) -> tuple[str, str, str, dict]:
    return "", f"⚠️ {message}", "", {"error": message}


def build_demo(service: QAService, answers: BatchingQueue | None = None) -> gr.Blocks:
    """The page, its questions answered through `answers` (None: a new `answer_queue` over `service` with the
    default settings); the answer endpoint is exposed to API clients as `/answer`."""
    import gradio as gr  # here, not above: the answering and rendering need none of its imports, which take seconds

    with gr.Blocks(title="rlm: retrieval-augmented QA") as demo:
        gr.Markdown(
            "## Retrieval-augmented QA\n"
            "A FiD reader and a dual-encoder retriever trained jointly with a corrector over a stale "
            "passage buffer (Algorithm 2). Ask about the corpus the checkpoint was trained on."
        )
        with gr.Row():
            question = gr.Textbox(
                label="Question",
                placeholder="e.g. " + (service.examples[0] if service.examples else "Where was ... born?"),
                max_length=service.max_question_chars,
                lines=1,
                elem_id="question",
                scale=4,
            )
            k = gr.Slider(
                1, service.max_k, value=service.default_k, step=1, label="Passages (top-k)", elem_id="top-k"
            )
        ask = gr.Button("Answer", variant="primary", elem_id="ask")
        answer = gr.Textbox(label="Answer", interactive=False, elem_id="answer")
        # Labels name the API's outputs (`/answer` returns Answer, status, passages, result), shown or not.
        status = gr.Markdown(label="status", elem_id="latency")
        passages = gr.HTML(label="passages", elem_id="passages")
        with gr.Accordion("Result as JSON", open=False):
            result = gr.JSON(label="result", elem_id="result")
        if service.examples:
            gr.Examples(examples=[[q] for q in service.examples], inputs=[question], label="Dev questions")

        answers = answers or answer_queue(service)

        def on_ask(asked: str, top_k: float):
            return respond(service, asked, top_k, answers)

        # Gradio only waits here: the batching queue answers. Twice its batch may wait at once, so that the
        # next batch is gathered while one runs and starts the moment the worker is free.
        waiting = 2 * answers.max_batch
        io = {"inputs": [question, k], "outputs": [answer, status, passages, result]}
        ask.click(on_ask, **io, concurrency_limit=waiting, api_name="answer")
        question.submit(on_ask, **io, concurrency_limit=waiting, api_visibility="private")
    demo.queue(default_concurrency_limit=waiting, max_size=QUEUE_MAX_SIZE)
    return demo


def launch_kwargs(
    host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, blocked: list[str | os.PathLike] = ()
) -> dict:
    """Arguments for `Blocks.launch`: where to bind and which files may never be served."""
    return {
        "server_name": host,
        "server_port": port,
        "ssr_mode": False,
        "mcp_server": False,
        "allowed_paths": [],
        # A non-empty list also overrides GRADIO_BLOCKED_PATHS; Gradio only serves its own assets anyway,
        # this makes the data folders off-limits even if someone sets GRADIO_ALLOWED_PATHS.
        "blocked_paths": sorted({str(Path(p).resolve()) for p in (*blocked, Path.cwd())}),
        "max_file_size": "1kb",
        "css": CSS,
        "show_error": False,
        "quiet": True,
    }


def warm_up_server(url: str, question: str, k: int) -> float:
    """Send one question through the running server's own queue; returns its latency in seconds.

    A fresh Gradio server's first request pays for its lazy start-up (several times the next one's,
    whichever client sends it: docs/demo.md), which should not land on the first user.
    """
    from gradio_client import Client

    start = time.perf_counter()
    client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
    client.predict(question, k, api_name="/answer")
    return time.perf_counter() - start


def serve(
    service: QAService,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    blocked: list[str | os.PathLike] = (),
    max_batch: int | None = None,
    window_s: float = BATCH_WINDOW_S,
) -> tuple[gr.Blocks, str]:
    """Launch the page without blocking and warm it up; returns (demo, local URL). `demo.block_thread()` waits.
    Its questions are answered in batches of up to `max_batch` (`answer_queue`)."""
    demo = build_demo(service, answer_queue(service, max_batch, window_s))
    _, url, _ = demo.launch(prevent_thread_lock=True, **launch_kwargs(host, port, blocked=blocked))
    try:
        warm_up_server(url, service.examples[0] if service.examples else "warm up", service.default_k)
    except Exception as err:  # the page still works; only its first user waits for the lazy start-up
        print(f"warning: warm-up request to {url} failed ({type(err).__name__}: {err}); serving anyway")
    return demo, url
