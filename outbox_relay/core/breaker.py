"""The circuit breaker: pause claiming while the target is unreachable as a whole.

A batch in which nothing was delivered and every failure was a transport failure
(``decision.is_outage``) trips it: the batch's rows are released with their attempt
refunded (instead of burning attempts toward ``dead`` during a broker restart),
workers stop claiming, and a probe thread asks the publisher (``Publisher.probe``)
with exponential backoff until the target answers; then claiming resumes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger("outbox_relay.breaker")


class BreakerGauge(Protocol):
    def set(self, value: float) -> None: ...


class CircuitBreaker:
    def __init__(
        self,
        probe: Callable[[], bool],
        gauge: BreakerGauge | None = None,
        *,
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
    ) -> None:
        self._probe = probe
        self._gauge = gauge
        self._lock = threading.Lock()
        self._open = False
        self._closed_event = threading.Event()
        self._closed_event.set()
        self._initial = initial_backoff
        self._max = max_backoff
        self.opened_count = 0
        # Trips since the last batch that delivered anything. A target whose probe
        # answers but which refuses every message (say, an ACL that allows metadata but
        # not writes) would otherwise make the breaker close and trip again at once,
        # forever: each trip in a row waits twice as long before its first probe.
        self._streak = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, reason: str) -> None:
        with self._lock:
            if self._open:
                return
            self._open = True
            self.opened_count += 1
            self._streak += 1
            self._closed_event.clear()
        if self._gauge is not None:
            self._gauge.set(1)
        log.warning("broker unreachable: circuit breaker open, claiming paused", reason=reason, pause="circuit_breaker")
        threading.Thread(target=self._probe_loop, name="breaker-probe", daemon=True).start()

    def record_delivery(self) -> None:
        """A batch delivered something: the target works, the next outage starts afresh."""
        self._streak = 0

    def first_probe_delay(self) -> float:
        return min(self._max, self._initial * float(2 ** min(max(self._streak - 1, 0), 16)))

    def _probe_loop(self) -> None:
        delay = self.first_probe_delay()
        while self._open:
            time.sleep(delay * random.uniform(0.5, 1.0))
            try:
                ok = self._probe()
            except Exception:  # a probe that crashes just means "not yet"
                ok = False
            if ok:
                with self._lock:
                    self._open = False
                    self._closed_event.set()
                if self._gauge is not None:
                    self._gauge.set(0)
                log.info("broker answers again: circuit breaker closed", pause="circuit_breaker")
                return
            delay = min(self._max, delay * 2)

    def wait_closed(self, timeout: float) -> bool:
        return self._closed_event.wait(timeout)
