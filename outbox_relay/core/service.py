"""PeriodicService: a daemon thread that calls ``step()`` every interval.

``start()`` and ``stop()`` are idempotent (a double stop is harmless), and an
exception in a step is logged and the loop goes on: a background service of the
relay must never die silently.
"""

from __future__ import annotations

import abc
import threading

import structlog

log = structlog.get_logger("outbox_relay.service")


class PeriodicService(abc.ABC):
    thread_name = "service"

    def __init__(self, interval_seconds: float, *, run_first: bool = False) -> None:
        self._interval = interval_seconds
        self._run_first = run_first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def step(self) -> None:
        """One round of the service's work."""

    def _loop(self) -> None:
        if self._run_first:
            self._safe_step()
        while not self._stop.wait(self._interval):
            self._safe_step()

    def _safe_step(self) -> None:
        try:
            self.step()
        except Exception:
            log.exception("background service step failed; continuing", service=self.thread_name)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
