"""The Gradio QA page over a `QAService`: question box, top-k slider, answer, latency, retrieved passages.

`build_demo(service)` returns the Blocks (queued, with a concurrency limit); `launch_kwargs(...)` holds the
serving policy: bind 127.0.0.1 unless told otherwise, no server-side rendering, and no files served beyond
Gradio's own assets (no allowed paths; the checkpoint, corpus and working folders explicitly blocked).
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import gradio as gr

from app.qa import InvalidQuestion, QAService

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
CONCURRENCY_LIMIT = 2  # two CPU-bound requests at a time; the rest wait in the queue instead of thrashing
QUEUE_MAX_SIZE = 64

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


def respond(service: QAService, question: str, k: float) -> tuple[str, str, str]:
    """(answer, latency line, passages HTML) for the page; refused input gives a message, never a trace."""
    try:
        result = service.answer(question, int(k))
    except InvalidQuestion as err:
        return "", f"⚠️ {err}", ""
    latency = f"{result['latency_ms']:.0f} ms · top-{result['k']} passages"
    return result["answer"], latency, passages_html(result)


def build_demo(service: QAService, concurrency_limit: int = CONCURRENCY_LIMIT) -> gr.Blocks:
    """The page; the answer endpoint is exposed to API clients as `/answer`."""
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
        latency = gr.Markdown(elem_id="latency")
        passages = gr.HTML(elem_id="passages")
        if service.examples:
            gr.Examples(examples=[[q] for q in service.examples], inputs=[question], label="Dev questions")

        def on_ask(q: str, top_k: float):
            return respond(service, q, top_k)

        io = {"inputs": [question, k], "outputs": [answer, latency, passages]}
        ask.click(on_ask, **io, api_name="answer", concurrency_limit=concurrency_limit)
        question.submit(on_ask, **io, api_visibility="private", concurrency_limit=concurrency_limit)
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
