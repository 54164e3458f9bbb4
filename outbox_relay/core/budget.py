"""The byte budget: how much event data one relay process holds at once.

Every byte a worker has claimed and not yet finalized lives in the process twice
(the row's text, and the producer's copy until the broker acknowledges it), so the
relay's memory is bounded by bytes, not rows: the sum of claimed-but-unfinalized
payload + headers bytes across all workers and their pipelined batches stays under
``relay.max_in_flight_bytes``. A worker reserves ``relay.max_batch_bytes`` (the most
a claim can return, bar a single larger row) before it claims, trims the
reservation to what it got, and gives it back after the finalize. A worker that
cannot reserve waits — pipelining pauses, nothing fails.

One exception keeps the relay live: when nothing is in flight, any reservation is
granted, so a single row larger than the whole budget is still claimed (alone) and
delivered.
"""

from __future__ import annotations

import threading
from typing import Protocol


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class ByteBudget:
    def __init__(self, limit_bytes: int, gauge: _Gauge | None = None) -> None:
        self.limit_bytes = limit_bytes
        self._used = 0
        self._cond = threading.Condition()
        self._gauge = gauge
        self.waits = 0  # reservations that had to wait (tests, metrics)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _fits(self, n: int) -> bool:
        return self._used == 0 or self._used + n <= self.limit_bytes

    def try_reserve(self, n: int) -> bool:
        with self._cond:
            if not self._fits(n):
                return False
            self._take(n)
            return True

    def reserve(self, n: int, stop: threading.Event) -> bool:
        """Block until ``n`` bytes fit (or ``stop`` is set: then False)."""
        with self._cond:
            if not self._fits(n):
                self.waits += 1
            while not self._fits(n):
                if stop.is_set():
                    return False
                self._cond.wait(timeout=0.2)
            self._take(n)
            return True

    def resize(self, reserved: int, actual: int) -> None:
        """Replace a reservation by what the claim really returned (may exceed it for
        a single large row: that is allowed, the next reservations wait)."""
        with self._cond:
            self._used += actual - reserved
            self._publish()
            if actual < reserved:
                self._cond.notify_all()

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._publish()
            self._cond.notify_all()

    def _take(self, n: int) -> None:
        self._used += n
        self._publish()

    def _publish(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self._used)
