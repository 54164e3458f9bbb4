"""Wake-ups: idle workers sleep on ``Wakeup``; ``NotificationListener`` wakes them.

``migrate`` installs a statement-level ``AFTER INSERT`` trigger that NOTIFYs only
while the relays have marked themselves idle in the table's one-row state table
(NOTIFY serialises committing transactions, so writers should pay it only when it
buys latency). A worker whose claim finds nothing marks the relays idle; the
listener clears the flag when a notification arrives and wakes one worker.
Polling (``relay.poll_interval_seconds``) stays the fallback.
"""

from __future__ import annotations

import random
import threading

import structlog

from ..db.store import Listener, OutboxStore

log = structlog.get_logger("outbox_relay.wakeup")


class Wakeup:
    """Idle workers sleep here. A notification wakes *one* worker (a busy worker that
    claims a full batch wakes the next), a stop wakes all. ``relays_marked_idle``
    mirrors the table's shared idle flag, so only the first worker to go idle pays
    the UPDATE that re-enables notifications."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self._tokens = 0
        self.relays_marked_idle = False
        # Held while the idle flag is changed in the table *and* mirrored here, so the
        # last writer leaves both in the same state (otherwise a worker marking idle
        # and the listener marking busy could interleave into "busy in the table,
        # idle here": no notifications and nobody re-arming them).
        self.flag_lock = threading.Lock()

    def wait(self, timeout: float) -> None:
        with self._cond:
            seen = self._generation
            self._cond.wait_for(lambda: self._generation != seen or self._tokens > 0, timeout=timeout)
            if self._generation == seen and self._tokens > 0:
                self._tokens -= 1

    def wake_one(self) -> None:
        with self._cond:
            # At most one token banked: a wake-up while every worker is busy makes
            # the next worker that would go to sleep look once more instead.
            self._tokens = 1
            self._cond.notify(1)

    def wake_all(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def mark_relays_idle(self, store: OutboxStore) -> None:
        """Ask inserts to notify (raises DatabaseError if the database is away)."""
        with self.flag_lock:
            store.mark_idle()
            self.relays_marked_idle = True

    def mark_relays_busy(self, listener: Listener) -> None:
        with self.flag_lock:
            listener.mark_busy()
            self.relays_marked_idle = False


class NotificationListener:
    """One thread per process holding the LISTEN connection; reconnects with backoff."""

    def __init__(self, store: OutboxStore, wakeup: Wakeup, stop_event: threading.Event) -> None:
        self._store = store
        self._wakeup = wakeup
        self._stop = stop_event
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="listen", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            listener: Listener | None = None
            try:
                listener = self._store.open_listener()
                failures = 0
                while not self._stop.is_set():
                    if listener.wait(timeout_seconds=1.0):
                        self._wakeup.wake_one()
                        # A worker is awake: inserts can stop notifying until a worker
                        # finds nothing to claim and marks the relays idle again. Not
                        # while vacuum is held back: each flip of the flag leaves a dead
                        # version of the state row that nothing can remove, and every
                        # insert's trigger reads them all (tens of thousands after a
                        # few minutes of a steady writer); writers notify meanwhile.
                        if not self._store.due_cursor.fast_claims_in_use():
                            self._wakeup.mark_relays_busy(listener)
            except Exception as exc:  # the listener must survive anything; polling covers the gap
                failures += 1
                if not self._stop.is_set():
                    log.warning("listen connection lost; polling until it is back", error=self._store.redact(str(exc)))
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0))
            finally:
                if listener is not None:
                    try:
                        listener.close()
                    except Exception:
                        pass
