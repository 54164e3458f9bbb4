"""Where the plain claim starts reading the due index, so its cost stays flat while
vacuum is held back.

The claim reads the partial index of pending rows in (available_at, id) order and
stops after LIMIT rows. Every delivered row leaves a dead entry at the front of that
index (its pending version), which only vacuum removes; while something holds the
xmin horizon back (a long transaction, a prepared transaction, a standby's slot)
nothing is removed and not even marked dead in the index, so a claim from the front
walks every row delivered since the horizon was taken (one heap visit each): its cost
grows with time, and the relay falls further behind.

So most claims ("fast") start at a key instead of the front: the lowest key claimed
by any claim of this process in the last ``lag_seconds``, or, when there was none,
the lowest key claimed by the newest claim before that. A fast claim walks only the
dead entries of rows claimed since then (rate x lag, flat), and also skips the
expired-lease and poison-row parts (they read the processing index, whose front fills
with dead entries the same way).

A row that becomes due below that key is never skipped: a "full" claim, the original
statement from the front of both indexes, runs at least every ``rescan_max_seconds``,
more often when it is cheap (its last duration / ``full_cost_share``, at least
``rescan_min_seconds``). Such rows are those of a writer transaction that committed
more than ``lag_seconds`` after it began (a row's available_at defaults to its
transaction's start, its id to the insert), of an explicit available_at in the past,
or a row whose claim rolled back. The key of what a full claim finds enters the
window like any other, so the fast claims that follow start from it and drain all
such rows at once. An expired lease is reclaimed, and a poison row reaped, by the
next full claim.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[dt.datetime, int]  # (available_at, id): the order of the due index


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    full: bool
    start: Key | None  # None: from the front of the index (a full claim)


class DueCursor:
    """Shared by the workers of one process (thread-safe)."""

    def __init__(self, *, lag_seconds: float = 2.0, rescan_min_seconds: float = 1.0,
                 rescan_max_seconds: float = 30.0, full_cost_share: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lag = lag_seconds
        self._rescan_min = rescan_min_seconds
        self._rescan_max = rescan_max_seconds
        self._cost_share = full_cost_share
        self._clock = clock
        self._lock = threading.Lock()
        self._window: deque[tuple[float, Key]] = deque()  # (when, lowest key claimed), oldest first
        self._anchor: Key | None = None  # lowest key of the newest claim older than the window
        self._last_full_at = float("-inf")
        self._last_full_seconds = 0.0
        self._full_running = False
        self.full_claims = 0
        self.fast_claims = 0

    def begin(self) -> ClaimPlan:
        """The next claim: full if one is due (and no other worker runs one), else fast."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            start = self._start()
            interval = min(self._rescan_max, max(self._rescan_min, self._last_full_seconds / self._cost_share))
            if not self._full_running and (start is None or now - self._last_full_at >= interval):
                self._full_running = True
                self._last_full_at = now
                self.full_claims += 1
                return ClaimPlan(full=True, start=None)
            if start is None:  # another worker's full claim is running: so is this one, from the front
                return ClaimPlan(full=True, start=None)
            self.fast_claims += 1
            return ClaimPlan(full=False, start=start)

    def end(self, plan: ClaimPlan, lowest: Key | None, elapsed_seconds: float) -> None:
        """Record what a claim found (its lowest due key) and, for a full one, its cost."""
        now = self._clock()
        with self._lock:
            if plan.full and self._full_running:
                self._full_running = False
                self._last_full_seconds = elapsed_seconds
            if lowest is not None:
                self._window.append((now, lowest))
            self._expire(now)

    def failed(self, plan: ClaimPlan) -> None:
        """A claim that raised: a full one is tried again by the next claim."""
        with self._lock:
            if plan.full and self._full_running:
                self._full_running = False
                self._last_full_at = float("-inf")

    def start_key(self) -> Key | None:
        """Where a fast claim would start now (None: from the front)."""
        with self._lock:
            self._expire(self._clock())
            return self._start()

    def _expire(self, now: float) -> None:
        while self._window and now - self._window[0][0] > self._lag:
            self._anchor = self._window.popleft()[1]

    def _start(self) -> Key | None:
        keys = [key for _, key in self._window]
        if self._anchor is not None:
            keys.append(self._anchor)
        return min(keys) if keys else None
