"""Questions from many threads answered in batches: one worker thread takes what is waiting (up to `max_batch`),
runs it as one call, and hands each caller its own result through a `concurrent.futures.Future`.

Why one worker: on a CPU a reader's forward pass already uses every core through torch's intra-op threads, so
two passes side by side only split the cores between them; one pass over a batch of questions shares the work
that does not grow with the batch (the decoder's weights read once per generated token for all of them, the
Python overhead) and takes the cores alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class QueueClosed(RuntimeError):
    """A question was submitted to a `BatchingQueue` after `close()`."""


@dataclass
class _Waiting(Generic[Item, Result]):
    item: Item
    arrived: float  # time.monotonic() at submit
    future: Future = field(default_factory=Future)


class BatchingQueue(Generic[Item, Result]):
    """Items submitted from any thread, answered in batches of at most `max_batch` by `answer_batch`.

    `answer_batch(items)` returns one result per item, in order; a result that is an `Exception` instance fails
    that item's future alone. Should the call raise, each item of the batch is answered again on its own, so an
    item that breaks it fails only its own future (a batch of one fails with the exception it raised).

    When the worker is free, the first waiting item starts a batch, which waits at most `window_s` seconds after
    that item arrived for more to join it; items that arrived while the previous batch ran are past their
    window already and go at once. `close()` answers what is waiting, stops the worker and refuses new items.
    The worker is a daemon thread: it never keeps a process from exiting.
    """

    def __init__(
        self,
        answer_batch: Callable[[list[Item]], Sequence[Result | Exception]],
        max_batch: int = 8,
        window_s: float = 0.0,
        name: str = "batching-queue",
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.answer_batch, self.max_batch, self.window_s = answer_batch, max_batch, window_s
        self._waiting: deque[_Waiting] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=name, daemon=True)
        self._worker.start()

    def submit(self, item: Item) -> Future:
        """Queue `item`; the future holds its result (or the exception that failed it)."""
        waiting = _Waiting(item, time.monotonic())
        with self._changed:
            if self._closed:
                raise QueueClosed("the batching queue is closed; no new questions are taken")
            self._waiting.append(waiting)
            self._changed.notify_all()
        return waiting.future

    def __call__(self, item: Item) -> Result:
        """`item`'s result, waiting for it (its exception raised here)."""
        return self.submit(item).result()

    @property
    def waiting(self) -> int:
        """Items submitted and not yet taken into a batch."""
        with self._changed:
            return len(self._waiting)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called: no new items are taken."""
        with self._changed:
            return self._closed

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive (False once `close()` has returned)."""
        return self._worker.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new items, answer the waiting ones, and wait (up to `timeout` seconds) for the worker to stop.
        Closing twice is harmless."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)

    def __enter__(self) -> BatchingQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _next_batch(self) -> list[_Waiting] | None:
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if not self._waiting:
                return None  # closed, and nothing left to answer
            deadline = self._waiting[0].arrived + self.window_s
            while len(self._waiting) < self.max_batch and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            live = [
                w for w in batch if w.future.set_running_or_notify_cancel()
            ]  # a caller may have cancelled
            if live:
                self._answer(live)

    def _answer(self, batch: list[_Waiting]) -> None:
        try:
            results = list(self.answer_batch([w.item for w in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"answer_batch returned {len(results)} results for {len(batch)} items")
        except Exception as err:
            if len(batch) > 1:
                for waiting in batch:  # one at a time: only the item that breaks the call fails
                    self._answer([waiting])
            else:
                batch[0].future.set_exception(err)
            return
        for waiting, result in zip(batch, results):
            if isinstance(result, Exception):
                waiting.future.set_exception(result)
            else:
                waiting.future.set_result(result)
