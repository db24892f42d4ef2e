"""The demo's batching queue (`rlm.inference.batching.BatchingQueue` over `QAService.answer_requests`, built by
`rlm.app.demo.answer_queue`) with the tiny quickstart's real reader and retriever: several users' questions answered
in one pass, each caller handed its own answer, as asking alone would; batches capped; one question's error kept
to itself; a clean close. And `rlm demo`'s settings for it.

No test depends on timing: a gate holds the worker's first batch until the test has queued what it wants behind
it, so every batch's members are known."""

from __future__ import annotations

import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlm.app.demo import answer_queue, respond
from rlm.app.service import InvalidQuestion, QAService
from rlm.errors import UserError
from rlm.inference.batching import BatchingQueue, QueueClosed

pytestmark = pytest.mark.learning  # answers with a trained checkpoint (make test-kernels)

SAFETY_S = 120  # only so that a broken queue fails the test instead of hanging it


@pytest.fixture(scope="module")
def service(tiny_quickstart) -> QAService:
    return QAService.from_checkpoint(tiny_quickstart / "final")


class Gate:
    """An `answer_batch` wrapper that records every batch's items and holds each batch until `opened` is set."""

    def __init__(self, answer_batch):
        self.answer_batch, self.batches = answer_batch, []
        self.started, self.opened = threading.Event(), threading.Event()

    def __call__(self, items, **options):
        self.batches.append(list(items))
        self.started.set()
        assert self.opened.wait(SAFETY_S), "the test never opened the gate"
        return self.answer_batch(items, **options)


def wait_until(condition) -> None:
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        assert time.monotonic() < deadline, "the queue never got there"
        time.sleep(0.005)


def queued_behind_the_first(queue: BatchingQueue, gate: Gate, first, rest, submit=None):
    """Submit `first`, wait until the worker holds it at the gate, then `rest` (each by `submit`, default
    `queue.submit`, from threads of their own when given), wait until all of it waits, and open the gate.
    Returns what each submit returned, `first`'s first."""
    submit = submit or queue.submit
    with ThreadPoolExecutor(max_workers=len(rest) + 1) as pool:
        head = pool.submit(submit, first)
        assert gate.started.wait(SAFETY_S)
        tail = [pool.submit(submit, item) for item in rest]
        wait_until(lambda: queue.waiting == len(rest))
        gate.opened.set()
        return [head.result(SAFETY_S), *(t.result(SAFETY_S) for t in tail)]


def same_as_alone(service: QAService, result: dict, question: str, k: int) -> None:
    alone = service.answer(question, k, best_guess=True)
    assert result["question"] == question and result["k"] == k
    assert result["answer"] == alone["answer"] and result["best_guess"] == alone["best_guess"]
    assert [p["id"] for p in result["passages"]] == [p["id"] for p in alone["passages"]]
    # Padding to the batch's longest passage moves the reader's probability in the last float bits only.
    assert result["confidence"] == pytest.approx(alone["confidence"], abs=1e-3)


def test_concurrent_callers_each_get_their_own_answer_as_if_they_asked_alone(service):
    requests = [(q, 2 + i % 2) for i, q in enumerate(service.examples[:8])]
    assert len({q for q, _ in requests}) == 8
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    with BatchingQueue(gate, max_batch=8) as queue:
        # Eight callers, each blocked on its own question (`queue(item)` waits for the result).
        results = queued_behind_the_first(queue, gate, requests[0], requests[1:], submit=queue)
    assert [len(batch) for batch in gate.batches] == [
        1,
        7,
    ]  # the seven that came during the first went together
    for (question, k), result in zip(requests, results):
        same_as_alone(service, result, question, k)
    # One pass per distinct k: the second batch held 3 questions at k=2 and 4 at k=3.
    assert (
        sorted(r["batch_size"] for r in results[1:]) == [3, 3, 3, 4, 4, 4, 4]
        and results[0]["batch_size"] == 1
    )


def test_a_batch_never_holds_more_than_max_batch_questions(service):
    questions = [service.examples[i % 8] for i in range(9)]
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    with BatchingQueue(gate, max_batch=3) as queue:
        futures = queued_behind_the_first(queue, gate, (questions[0], 2), [(q, 2) for q in questions[1:]])
        results = [f.result(SAFETY_S) for f in futures]
    assert [len(batch) for batch in gate.batches] == [1, 3, 3, 2]
    assert [r["question"] for r in results] == questions
    assert all(r["batch_size"] <= 3 for r in results)


def test_an_idle_worker_waits_the_window_for_more_and_goes_once_the_batch_is_full(service):
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    gate.opened.set()
    requests = [(q, 2) for q in service.examples[:4]]
    # A window far longer than the test: only a full batch, or close(), sends the worker off before it ends.
    with BatchingQueue(gate, max_batch=3, window_s=3600) as queue:
        first = queue.submit(requests[0])
        time.sleep(0.2)  # time for a worker that did not wait to send the question off alone (none is timed)
        assert gate.batches == [] and not first.done()
        futures = [first, *(queue.submit(r) for r in requests[1:3])]
        assert [f.result(SAFETY_S)["question"] for f in futures] == [q for q, _ in requests[:3]]
        last = queue.submit(requests[3])  # alone: it would wait the hour for two more...
        queue.close()  # ...but close() sends it off at once
        assert last.result(0)["question"] == requests[3][0]
    assert [len(batch) for batch in gate.batches] == [3, 1]


def test_a_refused_question_fails_alone_and_its_batch_is_answered(service):
    good = service.examples[:3]
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    with BatchingQueue(gate, max_batch=8) as queue:
        first, *rest = queued_behind_the_first(
            queue, gate, (good[0], 2), [(good[1], 2), ("  ", 2), (good[2], 2)]
        )
    with pytest.raises(InvalidQuestion, match="Type a question"):
        rest[1].result(SAFETY_S)
    assert gate.batches[1] == [
        (good[1], 2),
        ("  ", 2),
        (good[2], 2),
    ]  # answered in one pass, the refused one aside
    for question, future in zip(good, [first, rest[0], rest[2]]):
        same_as_alone(service, future.result(SAFETY_S), question, 2)
    assert rest[0].result()["batch_size"] == 2


def test_a_question_that_breaks_the_pass_fails_alone_and_the_others_are_answered(service, monkeypatch):
    answer_many = service.answer_many

    def breaks_on(questions, k=None, best_guess=False):
        if "boom?" in questions:
            raise RuntimeError("simulated bug")
        return answer_many(questions, k, best_guess=best_guess)

    monkeypatch.setattr(service, "answer_many", breaks_on)
    good = service.examples[:3]
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    with BatchingQueue(gate, max_batch=8) as queue:
        first, *rest = queued_behind_the_first(
            queue, gate, (good[0], 2), [(good[1], 2), ("boom?", 2), (good[2], 2)]
        )
        with pytest.raises(RuntimeError, match="simulated bug"):
            rest[1].result(SAFETY_S)
        answered = [rest[0].result(SAFETY_S), rest[2].result(SAFETY_S)]
    # The pass of three failed, so each of its questions was asked again on its own.
    assert [len(batch) for batch in gate.batches] == [1, 3, 1, 1, 1]
    monkeypatch.undo()
    for question, result in zip([good[1], good[2]], answered):
        same_as_alone(service, result, question, 2)
    same_as_alone(service, first.result(), good[0], 2)


def test_close_answers_what_was_queued_then_refuses_new_questions_and_stops_the_worker(service):
    gate = Gate(lambda items: service.answer_requests(items, best_guess=True))
    queue = BatchingQueue(gate, max_batch=8)
    first = queue.submit((service.examples[0], 2))
    assert gate.started.wait(SAFETY_S)
    queued = [queue.submit((q, 2)) for q in service.examples[1:3]]
    closing = threading.Thread(target=queue.close)
    closing.start()
    wait_until(lambda: queue.closed)
    with pytest.raises(QueueClosed, match="closed"):
        queue.submit((service.examples[3], 2))
    gate.opened.set()
    closing.join(SAFETY_S)
    assert not closing.is_alive() and not queue.running
    results = [f.result(0) for f in (first, *queued)]  # all answered before close returned
    assert [r["question"] for r in results] == service.examples[:3]
    assert [len(batch) for batch in gate.batches] == [1, 2]
    queue.close()  # closing again is harmless


def test_the_page_answers_users_through_the_queue_and_refuses_bad_input_before_it(service, monkeypatch):
    """`respond` with the page's queue (`answer_queue`): concurrent users each get their own row, batched with
    the others; a refused question or k gets its message without ever reaching the queue."""
    gate = Gate(service.answer_requests)
    monkeypatch.setattr(service, "answer_requests", gate)
    answers = answer_queue(service, max_batch=8, window_s=0.0)
    good = service.examples[:4]

    def page(request):
        return respond(service, *request, answers)

    try:
        rows = queued_behind_the_first(answers, gate, (good[0], 2), [(q, 2) for q in good[1:]], submit=page)
        bad = [("", 2), (good[0], math.nan), (good[0], "three"), (good[0], math.inf), (["not", "text"], 2)]
        refused = [page(request) for request in bad]
    finally:
        answers.close()
    assert [len(batch) for batch in gate.batches] == [1, 3]
    for question, (answer, status, passages, result) in zip(good, rows):
        assert result["question"] == question and answer == result["answer"]
        assert passages.count('class="passage"') == 2 and "top-2 passages" in status
    assert all("(batch of 3)" in status for _, status, _, _ in rows[1:]) and "batch of" not in rows[0][1]
    k_refused = r"Passages \(top-k\) must be a number from 1 to \d+; got "
    messages = [
        "Type a question",
        k_refused + "nan",
        k_refused + "'three'",
        k_refused + "inf",
        "must be text",
    ]
    for (answer, status, passages, result), message in zip(refused, messages):
        assert answer == passages == "" and re.search(message, status) and re.search(message, result["error"])


def test_the_page_shows_a_message_for_a_question_that_breaks_the_service(service, monkeypatch, capsys):
    def broken(requests, best_guess=False):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(service, "answer_requests", broken)
    with answer_queue(service) as answers:
        answer, status, passages, result = respond(service, service.examples[0], 2, answers)
    assert status.startswith("⚠️ Something went wrong") and answer == passages == "" and "error" in result
    assert "simulated bug" in capsys.readouterr().err  # the traceback stays on the server's console


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_rlm_demo_keeps_torchs_threads_unless_told_and_batches_as_told(
    service, tiny_quickstart, monkeypatch, torch_threads
):
    import rlm.app.demo
    import rlm.app.service
    from rlm.commands.demo import start_demo

    served = []
    monkeypatch.setattr(
        rlm.app.service.QAService, "from_checkpoint", classmethod(lambda cls, *a, **kw: service)
    )
    monkeypatch.setattr(rlm.app.demo, "serve", lambda svc, *a, **kw: served.append(kw) or ("demo", "url"))
    torch.set_num_threads(2)  # what torch chose for this machine; the demo used to force 1
    start_demo(tiny_quickstart / "final")
    assert torch.get_num_threads() == 2
    # The batch is left to the queue, which takes the device's default: one question a pass on a CPU.
    assert served[-1]["max_batch"] is None and served[-1]["window_s"] == rlm.app.demo.BATCH_WINDOW_S
    assert rlm.app.demo.answer_queue(service).max_batch == rlm.app.demo.default_max_batch("cpu") == 1
    assert rlm.app.demo.default_max_batch("cuda:1") == 8
    start_demo(tiny_quickstart / "final", threads=1, max_batch=3, batch_window_ms=5)
    assert torch.get_num_threads() == 1
    assert served[-1]["max_batch"] == 3 and served[-1]["window_s"] == pytest.approx(0.005)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "2"], "--concurrency is gone: .* use --max-batch .* and --threads"),
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--batch-window-ms", "-1"], "--batch-window-ms must be >= 0, got -1"),
    ],
)
def test_rlm_demo_refuses_settings_it_cannot_serve_before_loading(tmp_path, argv, message):
    from rlm.cli import build_parser
    from rlm.commands.demo import run

    parser, _ = build_parser("demo")
    # The checkpoint does not exist: the setting is refused before anything tries to load it.
    args = parser.parse_args(["--checkpoint", str(tmp_path / "nowhere"), *argv])
    with pytest.raises(UserError, match=message):
        run(args)
