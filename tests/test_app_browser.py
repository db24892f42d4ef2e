"""The demo served for real: headless Chromium (Debian's, driven by Playwright) asks a toy question and reads
the answer and passages; 20 concurrent API requests are all answered; no files are served.

Chromium comes from `make browser` (apt-get install -y chromium, run by `make test`). Without it the browser
test skips locally and fails in CI (CI=true). Set RLM_DEMO_SCREENSHOT=docs/demo.png to keep the screenshot,
RLM_DEMO_CHECKPOINT=DIR to drive a real checkpoint instead of the tiny one trained here, and
RLM_DEMO_QUESTION to ask something other than the first dev question.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from local_port import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def checkpoint(request) -> Path:
    if os.environ.get("RLM_DEMO_CHECKPOINT"):
        return Path(os.environ["RLM_DEMO_CHECKPOINT"])
    return request.getfixturevalue("tiny_quickstart") / "final"


@pytest.fixture(scope="module")
def served(checkpoint):
    """(url, service): the demo with its production settings, in this process, on a free local port."""
    import torch

    from rlm.app.demo import serve
    from rlm.app.service import QAService

    torch.set_num_threads(1)  # as `rlm demo` does
    service = QAService.from_checkpoint(checkpoint)
    demo, url = serve(service, port=free_port(), blocked=[checkpoint])  # `rlm demo`'s launch and warm-up
    yield url.rstrip("/"), service
    demo.close()


def _chromium() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    message = f"{CHROMIUM} not found: run `make browser` (apt-get install -y chromium) first"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def test_browser_asks_a_question_and_reads_answer_and_passages(served):
    from playwright.sync_api import sync_playwright

    url, service = served
    question = os.environ.get("RLM_DEMO_QUESTION") or service.examples[0]
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        # A fresh profile per run: Playwright takes the --user-data-dir as a persistent context's folder.
        browser = p.chromium.launch_persistent_context(
            profile,
            executable_path=_chromium(),
            args=CHROMIUM_FLAGS,
            headless=True,
            viewport={"width": 1200, "height": 900},
        )
        try:
            page = browser.new_page()
            page.goto(url, wait_until="networkidle")
            page.locator("#question textarea, #question input").first.fill(question)
            page.locator("#ask").click()
            page.locator("#passages .passage").first.wait_for(timeout=60_000)
            page.wait_for_function(
                "document.querySelector('#latency') && document.querySelector('#latency').innerText.includes('ms')"
            )
            answer = page.locator("#answer textarea, #answer input").first.input_value()
            passages = page.locator("#passages .passage").all_inner_texts()
            latency = page.locator("#latency").inner_text()
            shot = Path(os.environ.get("RLM_DEMO_SCREENSHOT") or Path(profile) / "demo.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            # Empty input: a message on the page, no error toast, no trace.
            page.locator("#question textarea, #question input").first.fill("")
            page.locator("#ask").click()
            page.wait_for_function("document.querySelector('#latency').innerText.includes('Type a question')")
            assert page.locator(".toast-body, .error").count() == 0
        finally:
            browser.close()

    expected = service.answer(question, service.default_k)
    assert answer == expected["answer"]
    assert len(passages) == service.default_k and "score" in passages[0]
    assert expected["passages"][0]["text"].split()[0] in passages[0]
    assert f"top-{service.default_k}" in latency


def test_twenty_concurrent_requests_are_all_answered(served):
    from concurrent.futures import ThreadPoolExecutor

    from gradio_client import Client

    url, service = served
    client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
    questions, k = service.examples[:5], service.default_k
    client.predict(questions[0], k, api_name="/answer")  # warm-up: opens the client's event stream

    def ask(i):
        return client.predict(questions[i % len(questions)], k, api_name="/answer")

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(ask, range(20)))
    assert len(results) == 20
    for _answer, latency_line, passages_html, _result in results:
        assert passages_html and re.search(r"\d+ ms\b", latency_line or ""), latency_line


def test_no_files_are_served_beyond_the_apps_assets(served, checkpoint):
    url, _ = served
    for path in (checkpoint / "config.yaml", Path("/etc/passwd"), ROOT / "pyproject.toml"):
        for prefix in ("/gradio_api/file=", "/file="):
            try:
                with urllib.request.urlopen(f"{url}{prefix}{path.resolve()}", timeout=10) as response:
                    status, body = response.status, response.read()
            except urllib.error.HTTPError as err:
                status, body = err.code, b""
            assert status >= 400 or path.read_bytes()[:50] not in body, f"{prefix}{path} was served"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200  # the page itself (its own assets) is served


def test_make_browser_target_is_idempotent():
    make = shutil.which("make")
    if make is None or not Path(CHROMIUM).exists():
        pytest.skip("needs make and an installed chromium")
    out = subprocess.run([make, "-s", "browser"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "apt-get" not in out.stdout


def test_rlm_demo_command_serves_on_localhost(checkpoint, tmp_path):
    """`rlm demo` as a user runs it: a child process that binds 127.0.0.1 and answers over HTTP."""
    import time

    port = free_port()
    log = (tmp_path / "demo.log").open("w")
    child = subprocess.Popen(
        [sys.executable, "-m", "rlm", "demo", "--checkpoint", str(checkpoint), "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The address is printed once the server is up and warmed (one request through its own queue).
        deadline, ready = time.time() + 120, False
        while time.time() < deadline and child.poll() is None and not ready:
            time.sleep(1)
            ready = f"http://127.0.0.1:{port}" in (tmp_path / "demo.log").read_text()
        assert ready, (tmp_path / "demo.log").read_text()[-2000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            assert response.status == 200
    finally:
        child.terminate()
        child.wait(timeout=30)
        log.close()
