"""Fair scheduling of one worker pool over many outbox sources.

Every source is in one of three states:

* **due** — it is believed to have claimable rows. Due sources wait in one ring; a
  worker takes the source at the head and puts it straight back at the tail, so the
  next worker takes the *next* source (round-robin), and a busy source keeps every
  worker that has nothing else to do. A source that has just *become* due (its probe
  found a row) is taken before the sources of the ring, by the next worker that looks
  for work: it has had no turn yet, and the ring's sources each just had one.
* **idle** — its last claim was short (fewer rows than a batch). It is not claimed
  again until a probe (a cheap ``EXISTS`` over the claim's indexes) finds a due row.
  Probes of an idle source back off from ``probe_min_seconds`` to
  ``probe_max_seconds`` (``relay.poll_interval_seconds``), so an idle source costs at
  most one query per ``probe_max_seconds``.
* **failing** — its database did not answer (or its table is missing). It is left
  alone for a full-jitter back-off (up to ``error_cap_seconds``) and then probed
  again; other sources are never made to wait for it.

The bound this gives a quiet source: once its probe has seen a due row, the relay's
lane for just-due sources (``next_fresh``) claims it at once if it is free, else the
next worker that ends its current batch (ahead of the sources already in the ring;
only other sources that became due before it go first). Each worker looks for
work after every batch, so with ``workers`` workers that is at most one batch of the
busy sources per worker, and usually a fraction of one. The probe adds up to
``probe_max_seconds`` of detection delay while the source was idle (less for a source
that had rows a moment ago: its probes restart at ``probe_min_seconds`` and double).
The backlog of the other sources does not enter the bound: however many rows they
have, a worker ends its batch and looks again.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..core.backoff import full_jitter_backoff


@dataclass
class SourceState:
    """The scheduler's view of one source."""

    name: str
    due: bool = False
    #: Bumped every time the source is (re)marked due: a short claim that began before
    #: a newer "due" signal does not mark the source idle.
    due_epoch: int = 0
    probe_at: float = 0.0  # monotonic time of the next probe while idle or failing
    probe_delay: float = 0.0  # current idle back-off
    failures: int = 0  # consecutive database failures
    last_error: str | None = None
    probing: bool = False  # a probe is running right now
    active: int = 0  # workers claiming or finishing a batch of this source
    retired: bool = False  # removed: never scheduled again
    claims: int = 0  # claims taken (tests and the status of the scheduler)
    active_until: float = 0.0  # monotonic time until which an idle source counts as recently active
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.failures == 0 and self.last_error is None


class SourceScheduler:
    """Round-robin over due sources; idle and failing sources are probed on a timer."""

    def __init__(
        self,
        *,
        probe_min_seconds: float = 0.05,
        probe_max_seconds: float = 1.0,
        error_cap_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cond = threading.Condition()
        self._states: dict[str, SourceState] = {}
        self._ring: collections.deque[str] = collections.deque()
        # Sources that became due and have not been claimed since: served first, in the
        # order they became due (each is also in the ring).
        self._fresh: collections.deque[str] = collections.deque()
        # Retired sources whose batches are still in flight (done() counts them down).
        self._retiring: dict[str, SourceState] = {}
        self._probe_min = probe_min_seconds
        self._probe_max = max(probe_min_seconds, probe_max_seconds)
        # A source whose claim found rows a moment ago is probed at least every quarter
        # of probe_max for ten probe_max: its next row is likely soon, and these probes
        # cost only the sources that actually have traffic (an idle one backs off fully).
        self._active_probe_max = max(self._probe_min, self._probe_max / 4)
        self._active_seconds = 10 * self._probe_max
        self._error_cap = error_cap_seconds
        self._clock = clock
        self._closed = False

    # --- membership ------------------------------------------------------------------
    def add(self, name: str) -> SourceState:
        """A new source starts idle with a probe due now (it is not claimed blind)."""
        with self._cond:
            state = self._states.get(name)
            if state is None or state.retired:
                state = self._states[name] = SourceState(name=name, probe_at=self._clock())
            self._cond.notify_all()
            return state

    def retire(self, name: str) -> SourceState | None:
        """Never schedule the source again; its batches in flight finish normally."""
        with self._cond:
            state = self._states.pop(name, None)
            if state is not None:
                self._retiring[name] = state
                state.retired = True
                state.due = False
                self._drop_from_ring(name)
            return state

    def wait_inactive(self, name: str, state: SourceState, timeout: float) -> bool:
        """Wait until no worker holds a batch of a retired source (True) or timeout."""
        deadline = self._clock() + timeout
        with self._cond:
            while state.active > 0:
                left = deadline - self._clock()
                if left <= 0:
                    self._retiring.pop(name, None)  # given up: the leases of what is left expire
                    return False
                self._cond.wait(min(left, 0.5))
            if self._retiring.get(name) is state:
                del self._retiring[name]
            return True

    def names(self) -> list[str]:
        with self._cond:
            return list(self._states)

    def state(self, name: str) -> SourceState | None:
        with self._cond:
            return self._states.get(name)

    def states(self) -> list[SourceState]:
        with self._cond:
            return list(self._states.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- workers ---------------------------------------------------------------------
    def next_due(self, timeout: float) -> tuple[str, int] | None:
        """The next due source in round-robin order (and its epoch), waiting up to
        ``timeout`` for one; it stays in the ring (at the tail) so other workers may
        take it too once every other due source had its turn."""
        return self._take(timeout, fresh_only=False)

    def claimed(self, name: str, epoch: int, *, rows: int, batch_size: int) -> None:
        """A claim of ``name`` (taken at ``epoch``) returned ``rows`` rows."""
        with self._cond:
            state = self._states.get(name)
            if state is None:
                return
            state.failures = 0
            state.last_error = None
            if rows:
                state.active_until = self._clock() + self._active_seconds
            if rows < batch_size and state.due_epoch == epoch and state.due:
                # Nothing more to take right now: back to probing, starting soon (rows
                # may have been held by other workers' claims a moment ago).
                state.due = False
                self._drop_from_ring(name)
                state.probe_delay = self._probe_min
                state.probe_at = self._clock() + self._probe_min

    def failed(self, name: str, error: str) -> float:
        """The source's database did not answer: out of the ring for a back-off."""
        with self._cond:
            state = self._states.get(name)
            if state is None:
                return 0.0
            state.failures += 1
            state.last_error = error
            state.due = False
            self._drop_from_ring(name)
            delay = full_jitter_backoff(state.failures, base=0.5, cap=self._error_cap) + 0.1
            state.probe_at = self._clock() + delay
            return delay

    def done(self, name: str, state: SourceState | None = None) -> None:
        """A worker finished (finalized or gave up) a batch of ``name``."""
        with self._cond:
            target = state or self._states.get(name) or self._retiring.get(name)
            if target is not None and target.active > 0:
                target.active -= 1
            self._cond.notify_all()

    def next_fresh(self, timeout: float) -> tuple[str, int] | None:
        """A source that has just become due and has not been claimed since (and its
        epoch), waiting up to ``timeout``; like ``next_due`` it stays in the ring."""
        return self._take(timeout, fresh_only=True)

    def _take(self, timeout: float, *, fresh_only: bool) -> tuple[str, int] | None:
        """Take a source for one claim: a just-due one first, else (unless
        ``fresh_only``) the head of the ring; it goes (back) to the ring's tail and
        counts as active until ``done``. Waits up to ``timeout`` for one."""
        deadline = self._clock() + timeout
        with self._cond:
            while not self._closed:
                name: str | None = None
                if self._fresh:
                    name = self._fresh.popleft()
                    self._ring.remove(name)
                elif self._ring and not fresh_only:
                    name = self._ring.popleft()
                if name is not None:
                    self._ring.append(name)
                    state = self._states[name]
                    state.active += 1
                    state.claims += 1
                    return name, state.due_epoch
                left = deadline - self._clock()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return None

    def active_of(self, name: str) -> SourceState | None:
        with self._cond:
            return self._states.get(name)

    # --- probes ----------------------------------------------------------------------
    def probes_due(self) -> list[str]:
        """Idle or failing sources whose probe time has come (marked as probing)."""
        now = self._clock()
        with self._cond:
            out = []
            for state in self._states.values():
                if not state.due and not state.probing and state.probe_at <= now:
                    state.probing = True
                    out.append(state.name)
            return out

    def next_probe_in(self) -> float:
        now = self._clock()
        with self._cond:
            times = [s.probe_at for s in self._states.values() if not s.due and not s.probing]
        return max(0.0, min(times) - now) if times else self._probe_max

    def probed(self, name: str, *, has_work: bool, error: str | None = None) -> None:
        with self._cond:
            state = self._states.get(name)
            if state is None:
                return
            state.probing = False
            if error is not None:
                state.failures += 1
                state.last_error = error
                delay = full_jitter_backoff(state.failures, base=0.5, cap=self._error_cap) + 0.1
                state.probe_at = self._clock() + delay
                return
            state.failures = 0
            state.last_error = None
            if has_work:
                self._mark_due(state)
            else:
                # Idle: back off (doubling, jittered) up to probe_max (a quarter of it
                # while the source was recently active).
                now = self._clock()
                cap = self._active_probe_max if now < state.active_until else self._probe_max
                state.probe_delay = min(cap, max(self._probe_min, state.probe_delay * 2))
                state.probe_at = now + state.probe_delay * random.uniform(0.75, 1.0)

    def mark_due(self, names: Iterable[str]) -> None:
        """Something says these sources have work (a full claim, a notification)."""
        with self._cond:
            for name in names:
                state = self._states.get(name)
                if state is not None and state.failures == 0:
                    self._mark_due(state)

    def _mark_due(self, state: SourceState) -> None:
        state.due_epoch += 1
        if not state.due:
            state.due = True
            state.probe_delay = self._probe_min
            self._ring.append(state.name)
            self._fresh.append(state.name)
            self._cond.notify_all()

    def _drop_from_ring(self, name: str) -> None:
        for queue in (self._ring, self._fresh):
            try:
                queue.remove(name)
            except ValueError:
                pass

    def due_count(self) -> int:
        with self._cond:
            return len(self._ring)
