"""The Gradio QA page over a `QAService`: question box, top-k slider, answer (or an abstention and its reason),
confidence and latency, retrieved passages, and the whole result as JSON.

The `/answer` API endpoint returns four named outputs: `Answer`, `status`, `passages` (HTML) and `result`
(the `QAService.answer` dict: answer, confidence, abstained, reason, best_guess, passages, ...).

`build_demo(service)` returns the Blocks (queued, with a concurrency limit); `launch_kwargs(...)` holds the
serving policy: bind 127.0.0.1 unless told otherwise, no server-side rendering, and no files served beyond
Gradio's own assets (no allowed paths; the checkpoint, corpus and working folders explicitly blocked).
"""

from __future__ import annotations

import html
import math
import os
import re
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from app.service import InvalidQuestion, QAService

if TYPE_CHECKING:
    import gradio as gr

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
CONCURRENCY_LIMIT = 2  # two CPU-bound requests at a time; the rest wait in the queue instead of thrashing
QUEUE_MAX_SIZE = 64
MAX_BATCH_SIZE = 8
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


def render(result: dict, batch_size: int = 1) -> tuple[str, str, str, dict]:
    """(answer, status line, passages HTML, the result as JSON) of one `QAService` result.

    An abstention is shown as such: no answer, and the reason in the status line."""
    shared = f" (batch of {batch_size})" if batch_size > 1 else ""
    tail = f"{result['latency_ms']:.0f} ms{shared} · top-{result['k']} passages"
    if result.get("abstained"):
        status = f"🚫 No answer: {result['reason']} · {tail}"
    else:
        status = f"{confidence_note(result['confidence'], result.get('calibrated', False))} · {tail}"
    return result["answer"], status, passages_html(result), result


def respond(service: QAService, question: str, k: float) -> tuple[str, str, str, dict]:
    """(answer, status line, passages HTML, result JSON) for the page; refused input gives a message, never a
    trace."""
    answers, statuses, passages, results = respond_batch(service, [question], [k])
    return answers[0], statuses[0], passages[0], results[0]


def requested_k(service: QAService, k) -> int:
    """The top-k a request asked for, as the service takes it (the default when None or 0, clamped to the
    slider's range); InvalidQuestion, with a message for the user, for anything but a finite number. The
    slider sends numbers, but an API client can send any JSON value."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int | float) or not math.isfinite(k)):
        raise InvalidQuestion(f"Passages (top-k) must be a number from 1 to {service.max_k}; got {k!r}.")
    return service.clamp_k(k)


def _refused(message: str) -> tuple[str, str, str, dict]:
    return "", f"⚠️ {message}", "", {"error": message}


def respond_batch(service: QAService, questions: list, ks: list) -> tuple[list, list, list, list]:
    """Gradio's batched handler: the queued requests answered in one pass per distinct k.

    Returns one list per output component (answers, status lines, passages HTML, result JSON), in request
    order. Each request is checked on its own (question and k): a refused one gets its message in its own
    row, and the others in its batch are answered as if it had not been sent.
    """
    rows: list[tuple[str, str, str, dict] | None] = [None] * len(questions)
    by_k: dict[int, list[int]] = {}
    for i, (question, k) in enumerate(zip(questions, ks)):
        try:
            if question is not None and not isinstance(question, str):
                raise InvalidQuestion(f"The question must be text; got {question!r}.")
            service.check_question(question)
            by_k.setdefault(requested_k(service, k), []).append(i)
        except InvalidQuestion as err:
            rows[i] = _refused(str(err))
    for k, members in by_k.items():
        for i, row in zip(members, _answer_together(service, [questions[i] for i in members], k)):
            rows[i] = row
    answers, statuses, passages, results = (list(column) for column in zip(*rows))
    return answers, statuses, passages, results


def _answer_together(service: QAService, questions: list[str], k: int) -> list[tuple[str, str, str, dict]]:
    """Rendered rows of questions answered in one pass. Should that pass fail, each question is answered
    alone, so a question that breaks the service (a bug: its traceback goes to the server's console) fails
    only its own row, not the other users' requests queued with it."""
    try:
        results = service.answer_many(questions, k, best_guess=True)
    except Exception:
        if len(questions) > 1:
            return [row for question in questions for row in _answer_together(service, [question], k)]
        traceback.print_exc()
        return [_refused("Something went wrong answering this question; the server's log has the details.")]
    return [render(result, len(questions)) for result in results]


def build_demo(
    service: QAService, concurrency_limit: int = CONCURRENCY_LIMIT, max_batch_size: int = MAX_BATCH_SIZE
) -> gr.Blocks:
    """The page; the answer endpoint is exposed to API clients as `/answer`."""
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

        def on_ask(questions: list[str], ks: list[float]):
            return respond_batch(service, questions, ks)

        # Requests waiting in the queue are answered together: one FiD pass for 8 questions costs far less
        # than 8 passes, which is what keeps p50 low when many users ask at once on a CPU.
        io = {
            "inputs": [question, k],
            "outputs": [answer, status, passages, result],
            "batch": True,
            "max_batch_size": max_batch_size,
            "concurrency_limit": concurrency_limit,
        }
        ask.click(on_ask, **io, api_name="answer")
        question.submit(on_ask, **io, api_visibility="private")
    demo.queue(default_concurrency_limit=concurrency_limit, max_size=QUEUE_MAX_SIZE)
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
    concurrency_limit: int = CONCURRENCY_LIMIT,
    blocked: list[str | os.PathLike] = (),
) -> tuple[gr.Blocks, str]:
    """Launch the page without blocking and warm it up; returns (demo, local URL). `demo.block_thread()` waits."""
    demo = build_demo(service, concurrency_limit=concurrency_limit)
    _, url, _ = demo.launch(prevent_thread_lock=True, **launch_kwargs(host, port, blocked=blocked))
    try:
        warm_up_server(url, service.examples[0] if service.examples else "warm up", service.default_k)
    except Exception as err:  # the page still works; only its first user waits for the lazy start-up
        print(f"warning: warm-up request to {url} failed ({type(err).__name__}: {err}); serving anyway")
    return demo, url
