"""Wake-ups: idle workers sleep on ``Wakeup``; ``NotificationListener`` wakes them.

``migrate`` installs a statement-level ``AFTER INSERT`` trigger that NOTIFYs only
while the relays have marked themselves idle in the table's one-row state table
(NOTIFY serialises committing transactions, so writers should pay it only when it
buys latency). What a relay spends on PostgreSQL at everyday rates comes from how
often it wakes, so the rules are:

- **One waker among the replicas.** Every listening replica's listen connection
  first waits for a session advisory lock of the table (a blocked lock wait costs
  no transaction); the one holding it LISTENs and wakes its workers. The others
  wake only on their idle poll and join when a claim comes back full. The lock goes
  with its connection: a waker that dies or loses its connection hands over to the
  next at once.
- **A short linger at a few hundred events per second.** A worker woken by a
  notification waits ``relay.claim_linger_ms`` before it claims while notifications
  come at least twice per linger, so one claim takes several rows; at lower rates a
  row is alone anyway and is claimed at once.
- **One worker per notification, and none while one is active.** A worker that is
  claiming or publishing will look again when it is done if a notification came in
  meanwhile (``Wakeup.notices``), so rows inserted meanwhile are taken by it in one
  claim instead of by a second worker in a second claim. Only when the active
  workers have been busy for longer than ``COALESCE_SECONDS`` (a slow publish) does
  a notification wake another.
- **One claimer while batches are small.** A worker whose claim was not full and
  that would claim again at once (the relays are busy, or nobody listens) steps
  aside when another worker is active, and the one left waits ``relay.claim_linger_ms``
  from its last claim's start before the next: at a few hundred events per second
  one worker claims a few rows each time instead of several workers one row each.
  A full batch wakes another worker.
- **The idle flag flips on real transitions only.** A worker marks the relays busy
  (inserts stop notifying) when the relay keeps finding rows: a full batch, or
  ``BUSY_AFTER_CYCLES`` non-empty claims without a pause in between. It marks them
  idle when a claim finds nothing. At a few hundred events per second the flag
  stays idle and the workers sleep between notifications; under a backlog it stays
  busy and they claim back to back.
- **One idle poll per process.** Polling is the safety net (a notification lost, a
  row inserted while the flag turned, an expired lease of a crashed peer, a row due
  later): while the listen connection is up, one sleeping worker polls every
  ``relay.idle_poll_interval_seconds`` and whenever a row this process rescheduled
  becomes due (every such time is kept, not only the earliest: rows deferred by a
  rate limit come due one after another), and the others sleep until woken. Without LISTEN, every worker polls
  every ``relay.poll_interval_seconds`` as before.
"""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
from collections.abc import Iterable

import structlog

from ..db.store import Listener, OutboxStore

log = structlog.get_logger("outbox_relay.wakeup")

# How long the active workers may take over a cycle before a notification wakes
# another worker: bounds the latency coalescing may add to a row behind a slow publish.
COALESCE_SECONDS = 0.05
# Non-empty claims in a row, without a pause, after which the relays count as busy.
BUSY_AFTER_CYCLES = 16
# Due times of rescheduled rows are rounded up to this grid, so rows due a few
# milliseconds apart (a rate limit defers them one token apart) are claimed together.
DUE_GRANULARITY_SECONDS = 0.05
# At most this many distinct due times are kept; later ones are left to the idle poll.
MAX_DUE_TIMES = 4096


class Wakeup:
    """Where idle workers sleep, and what the process knows of its wake-ups.

    A notification wakes *one* sleeping worker, and only when no worker is active (or
    the active ones have been at it for longer than ``COALESCE_SECONDS``); a stop wakes
    all. ``relays_marked_idle`` mirrors the table's shared idle flag, so only the first
    worker to go idle pays the UPDATE that re-enables notifications."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0  # bumped by wake_all (stop)
        self._tokens = 0
        self._notices = 0  # notifications received so far
        self._last_notice_at: float | None = None
        self._notice_gap_seconds = float("inf")  # moving average of the time between notifications
        self._active: dict[int, float] = {}  # worker key -> when its current cycle began (monotonic)
        self._sentry: int | None = None  # the sleeping worker that polls for the process
        # Sleeping workers that hold a finalize for their next claim (Worker._idle_wait):
        # a notification's wake-up goes to one of them, so the finalize rides in its claim.
        self._holders: set[int] = set()
        # Monotonic times (on the DUE_GRANULARITY_SECONDS grid) when rows this process
        # rescheduled become due: a heap, and the same times as a set against duplicates.
        self._due_times: list[float] = []
        self._due_set: set[float] = set()
        self.relays_marked_idle = False
        self._listening = False
        # Held while the idle flag is changed in the table *and* mirrored here, so the
        # last writer leaves both in the same state (otherwise a worker marking idle
        # and one marking busy could interleave into "busy in the table, idle here").
        self.flag_lock = threading.Lock()

    @property
    def listening(self) -> bool:
        """True while the listen connection is up: it holds the waker lock and listens,
        or waits for the lock behind the replica that does. Then one idle poll per
        process is enough; otherwise every worker polls."""
        return self._listening

    @listening.setter
    def listening(self, value: bool) -> None:
        with self._cond:
            changed = self._listening != value
            self._listening = value
            if changed:
                self._cond.notify_all()  # sleepers compute their poll again

    # --- what workers report ---------------------------------------------------------
    @property
    def notices(self) -> int:
        with self._cond:
            return self._notices

    def begin_cycle(self, key: int) -> int:
        """A worker starts a claim: it is active until ``end_cycle``. Returns the
        notifications seen so far, to compare with at the end of the cycle."""
        with self._cond:
            self._active[key] = time.monotonic()
            return self._notices

    def end_cycle(self, key: int, notices_before: int) -> bool:
        """A worker finished a cycle whose claim was not full: may it go to sleep? No
        (False) if a notification arrived since ``notices_before``: rows committed
        meanwhile are its to claim. Otherwise it is no longer active (True), in one
        step with the listener's check, so no notification falls between the two."""
        with self._cond:
            if self._notices != notices_before:
                self._active[key] = time.monotonic()
                return False
            self._active.pop(key, None)
            return True

    def step_aside(self, key: int) -> bool:
        """A worker whose claim was not full would claim again: is another worker
        active (claiming, or woken to, within ``COALESCE_SECONDS``)? Then this one stops being active and should
        sleep (True): while batches are small one claimer takes everything that is
        due, and a full batch wakes another (``wake_one``). Decided under the lock, so
        of two workers asking at once one goes on."""
        with self._cond:
            # As in notified(): one busy for longer than COALESCE_SECONDS (a slow
            # publish) does not count, or rows would wait for it or for the idle poll.
            recent = time.monotonic() - COALESCE_SECONDS
            if any(other != key and began > recent for other, began in self._active.items()):
                self._active.pop(key, None)
                return True
            return False

    def others_active(self, key: int) -> bool:
        """Is another worker of the process in a cycle (claiming or publishing)?"""
        with self._cond:
            return any(other != key for other in self._active)

    def leave(self, key: int) -> None:
        """A worker stops being active without a cycle's check (a failure, a stop)."""
        with self._cond:
            self._active.pop(key, None)

    def rescheduled(self, delays_seconds: Iterable[float]) -> None:
        """Rows this process rescheduled become due after these delays: the idle poll
        comes at each of those times (rounded up to ``DUE_GRANULARITY_SECONDS``), not
        only at the earliest, so rows deferred one after another are each claimed when
        due rather than at the next idle poll."""
        now = time.monotonic()
        with self._cond:
            earliest = self._due_times[0] if self._due_times else math.inf
            for delay in delays_seconds:
                due = math.ceil((now + max(0.0, delay)) / DUE_GRANULARITY_SECONDS) * DUE_GRANULARITY_SECONDS
                if due in self._due_set or len(self._due_times) >= MAX_DUE_TIMES:
                    continue
                self._due_set.add(due)
                heapq.heappush(self._due_times, due)
            if self._due_times and self._due_times[0] < earliest:
                self._cond.notify_all()  # the sentry's deadline comes sooner

    def _forget_due_times(self, now: float) -> None:
        """Drop the due times that have passed: the claim about to run takes their rows."""
        while self._due_times and self._due_times[0] <= now:
            self._due_set.discard(heapq.heappop(self._due_times))

    def linger_seconds(self, max_seconds: float) -> float:
        """How long a worker woken by a notification waits before it claims: while
        notifications come at least twice per ``max_seconds`` (a few hundred events per
        second), waiting that long lets one claim take the rows of several; slower, the
        row is alone anyway and is claimed at once."""
        with self._cond:
            gap = self._notice_gap_seconds
            if self._last_notice_at is not None and time.monotonic() - self._last_notice_at > 10 * max_seconds:
                return 0.0  # the rate the average describes is over
        return max_seconds if gap <= max_seconds / 2 else 0.0

    # --- sleeping ----------------------------------------------------------------------
    def idle_wait(
        self, key: int, *, poll_seconds: float, listening_poll_seconds: float, until: float | None = None
    ) -> bool:
        """Sleep until woken or until this worker's poll is due. While the process
        listens, one sleeping worker (the sentry) polls every ``listening_poll_seconds``
        (or when a rescheduled row is due) and the others sleep until woken; otherwise
        every worker polls every ``poll_seconds`` (both jittered). True when woken by a
        notification or a full batch (not a stop, not the poll). ``until`` (monotonic):
        return by then at the latest (False), still counted as sleeping until then."""
        woken = reached_until = False
        with self._cond:
            self._active.pop(key, None)
            if until is not None:
                self._holders.add(key)
            seen = self._generation
            started = time.monotonic()
            poll_jitter, sentry_jitter = random.uniform(0.5, 1.0), random.uniform(0.75, 1.0)
            sentry_since: float | None = None
            while True:
                if self._generation != seen:
                    break
                # A worker holding a finalize takes the wake-up first: its claim carries it.
                if self._tokens > 0 and (key in self._holders or not self._holders):
                    self._tokens -= 1
                    woken = True
                    break
                now = time.monotonic()
                if until is not None and now >= until:
                    reached_until = True
                    break
                if not self.listening:
                    if self._sentry == key:
                        self._sentry = None
                    deadline = started + poll_seconds * poll_jitter
                elif self._sentry is None or self._sentry == key:
                    if self._sentry is None:
                        self._sentry, sentry_since = key, now
                    deadline = (sentry_since or started) + listening_poll_seconds * sentry_jitter
                    if self._due_times:
                        deadline = min(deadline, self._due_times[0] + 0.01)
                else:
                    # Not the sentry: woken by a notification, a full batch or a stop;
                    # when the sentry leaves to claim, one of these takes its place.
                    self._cond.wait(
                        listening_poll_seconds if until is None else min(listening_poll_seconds, until - now)
                    )
                    continue
                if deadline <= now:
                    break
                if until is not None:
                    deadline = min(deadline, until)
                # Woken early by rescheduled(): the deadline is computed again.
                self._cond.wait(deadline - now)
            if self._sentry == key:
                self._sentry = None  # it claims now: another sleeper becomes the sentry
                self._cond.notify(1)
            if key in self._holders:
                self._holders.discard(key)
                if self._tokens > 0:
                    self._cond.notify_all()  # a wake-up it did not take is another's now
            if reached_until:
                # Not claiming: it stays a sleeper, so a notification meanwhile leaves a
                # token (taken when it waits again) rather than counting on it to look.
                return False
            self._forget_due_times(time.monotonic())
            self._active[key] = time.monotonic()
        return woken

    def wait(self, timeout: float) -> None:
        """Sleep until woken or for ``timeout`` seconds (loops without a sentry)."""
        with self._cond:
            seen = self._generation
            self._cond.wait_for(lambda: self._generation != seen or self._tokens > 0, timeout=timeout)
            if self._generation == seen and self._tokens > 0:
                self._tokens -= 1

    # --- waking ------------------------------------------------------------------------
    def notified(self) -> None:
        """A notification arrived: wake a worker unless an active one will look anyway."""
        with self._cond:
            self._notices += 1
            now = time.monotonic()
            if self._last_notice_at is not None:
                gap = now - self._last_notice_at
                if self._notice_gap_seconds == float("inf"):
                    self._notice_gap_seconds = gap
                else:
                    self._notice_gap_seconds += 0.2 * (gap - self._notice_gap_seconds)
            self._last_notice_at = now
            if self._active and min(self._active.values()) > now - COALESCE_SECONDS:
                return
            self._tokens = 1
            if self._holders:
                self._cond.notify_all()  # the holder of a finalize takes it (idle_wait)
            else:
                self._cond.notify(1)

    def wake_one(self) -> None:
        with self._cond:
            # At most one token banked: a wake-up while every worker is busy makes
            # the next worker that would go to sleep look once more instead.
            self._tokens = 1
            if self._holders:
                self._cond.notify_all()  # as in notified(): a holder of a finalize takes it
            else:
                self._cond.notify(1)

    def wake_all(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    # --- the shared idle flag ----------------------------------------------------------
    def mark_relays_idle(self, store: OutboxStore) -> None:
        """Ask inserts to notify (raises DatabaseError if the database is away)."""
        with self.flag_lock:
            store.mark_idle()
            self.relays_marked_idle = True

    def mark_relays_busy(self, store: OutboxStore) -> None:
        """Inserts need not notify: the relays claim back to back."""
        with self.flag_lock:
            if not self.relays_marked_idle:
                return
            store.mark_busy()
            self.relays_marked_idle = False


class NotificationListener:
    """One thread per process holding the listen connection; reconnects with backoff.

    The connection first waits for the table's waker lock (``Listener.become_waker``),
    then LISTENs: of several replicas only the lock holder listens and wakes workers."""

    def __init__(self, store: OutboxStore, wakeup: Wakeup, stop_event: threading.Event) -> None:
        self._store = store
        self._wakeup = wakeup
        self._stop = stop_event
        self._thread: threading.Thread | None = None
        self._listener: Listener | None = None
        self._lock = threading.Lock()
        self._waking = False  # this process holds the waker lock and listens

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="listen", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_waker(self) -> bool:
        """Does this process hold the waker lock and listen (rather than wait for it)?"""
        return self._waking

    def join(self, timeout: float) -> None:
        with self._lock:
            listener = self._listener
        if listener is not None:
            listener.cancel()  # a wait for the waker lock ends now, not at the server's leisure
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            listener: Listener | None = None
            try:
                listener = self._store.open_listener()
                with self._lock:
                    self._listener = listener
                if self._stop.is_set():
                    break
                # Waiting for the lock means another replica listens: one idle poll is enough.
                self._wakeup.listening = True
                listener.become_waker()  # blocks while another replica is the waker
                listener.listen()
                self._waking = True
                failures = 0
                log.info("listening for inserts: this process wakes the relays")
                # Whatever happened while nobody listened: look once.
                self._wakeup.notified()
                while not self._stop.is_set():
                    if listener.wait(timeout_seconds=1.0):
                        self._wakeup.notified()
            except Exception as exc:  # the listener must survive anything; polling covers the gap
                self._wakeup.listening = False
                failures += 1
                if not self._stop.is_set():
                    log.warning("listen connection lost; polling until it is back", error=self._store.redact(str(exc)))
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0))
            finally:
                self._waking = False
                self._wakeup.listening = False
                with self._lock:
                    self._listener = None
                if listener is not None:
                    try:
                        listener.close()
                    except Exception:
                        pass
