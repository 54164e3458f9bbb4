"""One thread that builds and submits every worker's claimed batches.

With a pipelining publisher (Kafka) a worker's cycle is: claim the next batch, build
and submit it, finalize the batch before. Building and producing 1 000 messages is
~4 ms of Python work per batch, and while a worker spends it (and waits for the GIL
behind the other workers) it has no statement running: with the database on cores of
its own, PostgreSQL was idle ~20 % of a drain for that reason alone. Handing the build
and submit to this thread lets the worker go straight on to its next statement (the
finalize of the batch before, then the next claim), so the database always has work
(docs/benchmarks/tansu-2core.md: the relay's throughput with PostgreSQL on its own core rose ~14 %).

One thread, first in first out: the GIL runs one Python thread at a time anyway, and
a single queue keeps the produce calls in the order the batches were handed over.
Nothing is lost if the thread's work fails: the exception is handed back to the worker
with the batch (``Future.result()``), exactly as if the worker had run it itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class Submitter:
    def __init__(self, name: str = "submit") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Run ``work`` on the submitter thread; its result (or exception) comes back
        through the future."""
        future: Future[T] = Future()
        self._queue.put((future, work))
        return future

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Finish what was handed over, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout_seconds)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, work = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:  # handed back to the worker, which re-raises it
                future.set_exception(exc)
