"""Where the plain claim starts reading its indexes, so that its cost stays flat while
vacuum is held back.

The claim reads the partial index of pending rows in (available_at, id) order, and
the partial index of processing rows by lease expiry for expired leases, and stops
after LIMIT rows. Every delivered row leaves a dead entry at the front of both (its
pending version; its processing version, whose lease_until has passed), which only
vacuum removes. While something holds the xmin horizon back (a long transaction, a
prepared transaction, a standby's slot) nothing is removed, nor even marked dead in
the index, so a claim from the front walks every row delivered since the horizon was
taken (one heap visit each): its cost grows with time, and the relay falls behind.

"Fast" claims start past those entries:

- the due index at the lowest key any claim of this process claimed in the last
  ``lag_seconds`` (or, when none did, at the lowest key of the newest claim before):
  a fast claim walks only the dead entries of rows claimed since then (rate x lag);
  every WRITERS_CHECK_INTERVAL_SECONDS one also looks for open writer transactions on
  the outbox and reports the oldest one's start among those younger than
  ``writers_within_seconds``, kept in the window like a claimed key, so that
  transaction's rows (keyed by its start) are taken after its commit;
- a long writer (open for longer than ``writers_within_seconds``: an import, a
  nightly recompute writing thousands of rows in one transaction) does not hold the
  fast claims back: the same look reports each one (its backend pid and transaction
  start) and the cursor remembers it. Once a later look no longer sees a remembered
  writer (it committed or rolled back: its lock is released only after its commit is
  visible), the next claim is ONE "catch-up" claim, a fast claim that starts at that
  writer's start: it walks the dead entries from there up to where fast claims start
  (rate x the writer's age, once) and takes its rows, whose key then enters the window
  like any other, so the fast claims that follow drain the rest (the store sends it
  at once when the claim whose look saw the writer end found nothing). A look is applied
  only when it was taken after the last one applied (the database's clock at the
  look), so a slow claim's older look cannot make the cursor forget a writer still
  open. While full claims are cheap (every claim is one) a full claim takes the
  catch-up's place (it reads from the front); while they are slow, a full claim due at
  the same time leaves the catch-up to the next fast claim, which reaches the ended
  writer's rows at once instead of after the full claim's walk from the front.
  A catch-up claim that fails quickly is sent again; one that runs out of its
  statement timeout is not, and that writer's rows are left to the full claims;
- the processing index, once per ``lease_scan_interval_seconds`` (at once again while
  the last look was cut by its LIMIT), at the clock of the last claim whose
  expired-lease scan was not cut by its LIMIT, less ``lease_margin_seconds``: every
  lease that had expired by then was reclaimed. The other fast claims skip it.

A row that becomes due below the fast start is never skipped: a "full" claim comes
round for it. Such rows are those of a writer transaction the look for open writers
did not see (it wrote to the outbox only after the claims moved past its start and
ended before the next look, the relay may not read its start: a session of another
role without pg_read_all_stats, whatever its age, or it was prepared for a two-phase
commit: a prepared transaction's locks belong to no session, so the look takes it for
ended at PREPARE TRANSACTION, before its rows are committed), of an explicit
available_at in the past, or a row whose claim rolled back (or whose expired lease
lies below the processing index's fast start).

A full claim from the front of both indexes walks every dead entry there, and grows
with the age of the horizon towards its statement timeout. So while fast claims are
in use the full claim is a "sweep" in bounded steps (Sweep):

- a pass starts at the fast claims' starts (the due index's key, the processing
  index's lease_until) and goes down to the front of both indexes. Each step reads one
  range: the due index in [(low, 0), high) and the processing index in
  [low, min(high, its start)), where high is where the last step's range began, and
  low = high - width (the last step, once low would fall before 1970, reads on to the
  front). The width, in seconds of key, is scaled after each step by the ratio of the
  target time (``sweep_step_seconds``: 0.5 s, or 5 % of the statement timeout if that
  is less) to the step's time in the server, at most doubled (a cheap range may lie
  just above a dense one: such a step costs at most twice the target) and at most
  divided by 16: a step reads about that share of dead entries, whatever the rate and
  the age of the horizon. A step that runs out of time is tried again 16 times narrower;
- a step that claimed a row (or whose lease scan was cut by its LIMIT) reads the same
  range again at once, until it yields nothing: the rows it takes leave the range. Its
  keys do not enter the window (the fast claims would walk every dead entry above
  them); and a worker whose step found nothing claims again at once, from the fast start;
- steps come every (their time / ``full_cost_share``) seconds, at most
  ``rescan_max_seconds``; a pass completed counts as one full
  claim of its summed cost (for the switch back to full claims and the interval), and
  the next pass starts after the full-claim interval, doubled for each pass in a row
  that found nothing (up to ``rescan_quiet_max_seconds``).

Why no row is skipped: a step reads its whole range (claimed rows and rows locked by
another claim aside: the latter are being claimed), and the ranges of a pass are
contiguous, from the fast starts when the pass began down to the front. A row R due
at key k from time t on: take the first pass that begins after t. If k lies below its
start, some step of it reads k after t and takes R. If not, R lay at or above where
fast claims started when the pass began; the fast claims read upwards in key order,
so the start moves past k only through a claim that took R, or one whose snapshot
predates t (ended long before the next pass begins): then the next pass starts above
k and takes R. So R is delivered within two passes and the pause between them, which
grows with the horizon's age (a pass costs what a full claim would, spent at
``full_cost_share`` of one worker's time) but is bounded, and no statement reads more
than one step's range.

While full claims are cheap (see DueCursor._record_full_cost) every claim is a full
one: without MVCC pressure the claim is exactly what it always was, oldest due row
first.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# The due window: a fast claim starts at the lowest key claimed in the last
# LAG_SECONDS, and so walks the dead entries of the rows claimed in that time (the
# write rate times LAG_SECONDS). Rows of a writer transaction still open when a claim
# runs are covered beyond it where the relay may read other sessions (claim statement,
# "outbox_writers"), by the window or a catch-up claim; the rest of the late rows wait
# for a full claim.
LAG_SECONDS = 0.1
# An open writer transaction older than this no longer holds fast claims back (one
# left open for minutes would make every fast claim walk the dead entries since its
# start, and the index entries of the rows it has written so far): it is remembered
# instead, and its rows are taken by one catch-up claim from its start once a look no
# longer sees it. One second: an application's transaction rarely lasts longer, and a
# batch job writing 10 000 rows a second pins the fast claims behind its uncommitted
# entries for at most that long (a catch-up claim costs one walk from its start, once).
WRITERS_WITHIN_SECONDS = 1.0
# How often a fast claim looks for them (reading pg_locks and pg_stat_activity costs
# a fraction of a millisecond); what one saw stays in the window for LAG_SECONDS, so
# looks come at least twice per window.
WRITERS_CHECK_INTERVAL_SECONDS = 0.04
# A look reported this much before the last one applied is not a claim's stale look
# (a claim does not run that long after its look) but the server's clock set back: it
# is applied, so that catch-ups do not stop until the clock passes the last look again.
LOOK_CLOCK_STEP = dt.timedelta(seconds=60)
# Full claims count as slow (fast claims take over) from this many seconds per row
# claimed (+ 10): 0.5 ms against some 0.02-0.05 ms without MVCC pressure.
FAST_ABOVE_SECONDS_PER_ROW = 0.0005
# The longest interval between full claims while they find nothing below the fast start.
RESCAN_QUIET_MAX_SECONDS = 300.0
# How often a fast claim also looks for expired leases and poison rows.
LEASE_SCAN_INTERVAL_SECONDS = 1.0

# The sweep (see the module docstring): one step's target time in the server (a share
# of the statement timeout, at most this), its first width in seconds of key, how much
# one step's width may grow or shrink against the last (by the ratio of the target to
# the last step's time), and the key below which a step reads on to the front. Growth
# is slow (a cheap range may lie just above a dense one: a step is then at most twice
# its target), shrinking fast.
SWEEP_STEP_SECONDS = 0.5
SWEEP_STEP_TIMEOUT_SHARE = 0.05
# A step's own statement timeout, in targets: one whose range turned out far denser
# than the last (an idle stretch of keys above a busy one) is cancelled there, far
# below the claim's statement timeout, and tried again narrower.
SWEEP_STEP_TIMEOUT_TARGETS = 4.0
SWEEP_FIRST_WIDTH_SECONDS = 1.0
SWEEP_WIDTH_GROWTH = 2.0
SWEEP_WIDTH_SHRINK = 16.0
SWEEP_MIN_WIDTH_SECONDS = 0.001
SWEEP_MAX_WIDTH_SECONDS = 1e10
SWEEP_FRONT_AT = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

# While fast claims are in use, the gauge bounds are published (for `status` in another
# process) this often; entries older than BOUNDS_STALE_SECONDS are no longer read.
BOUNDS_PUBLISH_INTERVAL_SECONDS = 5.0
BOUNDS_STALE_SECONDS = 30.0

# A full claim that fails faster than this (or than fast_above_seconds) is tried again
# by the next claim; a slower one waits for its interval (DueCursor.failed). A catch-up
# claim that fails faster than this is sent again; a slower one is not.
QUICK_FAILURE_SECONDS = 1.0


def sweep_step_seconds(statement_timeout_ms: int) -> float:
    """A sweep step's target time: SWEEP_STEP_SECONDS, or less under a short statement
    timeout (0: none), so that a step stays far from it."""
    if statement_timeout_ms <= 0:
        return SWEEP_STEP_SECONDS
    return min(SWEEP_STEP_SECONDS, statement_timeout_ms / 1000.0 * SWEEP_STEP_TIMEOUT_SHARE)


Key = tuple[dt.datetime, int]  # (available_at, id): the order of the due index


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    full: bool
    start: Key | None  # None: from the front of the due index (a full claim)
    leases_from: dt.datetime | None = None  # None: from the front of the processing index
    measured: bool = True  # a full claim whose duration feeds the average (one at a time)
    lease_scan: bool = True  # look for expired leases and poison rows (always in a full claim)
    writers_check: bool = False  # a fast claim that looks for open writer transactions
    fast_start: Key | None = None  # a full claim: where a fast claim would have started
    # The start of the long writer transaction(s) seen ended that this claim covers: a
    # fast one (a catch-up claim) starts there instead of at the window's start; a full
    # one reads from the front anyway. None: none pending.
    catch_up_from: dt.datetime | None = None
    # Open writers younger than this hold the window at their start; older ones are
    # remembered for a catch-up claim (the look's threshold, a statement parameter).
    writers_within_seconds: float = WRITERS_WITHIN_SECONDS
    # A sweep step (fast claims in use): the due index from ``start`` (None: the front)
    # up to ``until`` (exclusive), the processing index from ``leases_from`` (None: the
    # front) up to ``leases_until`` (exclusive); nothing outside them.
    sweep: bool = False
    until: Key | None = None
    leases_until: dt.datetime | None = None
    statement_timeout_ms: int | None = None  # a sweep step's own (SWEEP_STEP_TIMEOUT_TARGETS)


LongWriter = tuple[int, dt.datetime]  # (backend pid, transaction start): one open writer transaction


@dataclass(frozen=True, slots=True)
class WritersLook:
    """What one look for open writer transactions saw."""

    looked_at: dt.datetime  # the database's clock right after it read pg_locks / pg_stat_activity
    long_writers: frozenset[LongWriter]  # those open for longer than writers_within_seconds


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """What one claim statement saw, for the next claims' start."""

    lowest: Key | None = None  # the lowest due key it claimed
    database_now: dt.datetime | None = None  # the statement's now()
    leases_exhausted: bool = False  # its expired-lease scan ran and did not stop at its LIMIT
    server_seconds: float | None = None  # how long the statement ran in the server
    writers_look: WritersLook | None = None  # the statement looked for open writers
    claimed: int = 0  # rows it claimed (due and expired leases)


@dataclass(frozen=True, slots=True)
class GaugeBounds:
    """Lower bounds of the queue gauges' index scans (the fast claims' starts)."""

    due_from: Key  # the pending index from this (available_at, id)
    leases_from: dt.datetime | None  # the processing index from this lease_until (None: the front)


@dataclass(frozen=True, slots=True)
class SweepStep:
    """One step of the sweep: the due index in [(low, 0), due_until) and the processing
    index in [low, leases_until) (None low: from the front; leases_until at or below low:
    no lease part)."""

    low: dt.datetime | None
    due_until: Key
    leases_until: dt.datetime | None


class Sweep:
    """The full claim in bounded steps while fast claims are in use (see the module
    docstring): a pass goes down from where the fast claims start to the front of both
    indexes, one key range per step, each sized so that it runs about
    ``step_seconds`` in the server. Not thread-safe: DueCursor holds its lock."""

    def __init__(self, *, step_seconds: float = SWEEP_STEP_SECONDS) -> None:
        self.step_seconds = step_seconds
        self._top_due: Key | None = None  # the pass's upper end in the due index (exclusive)
        self._top_leases: dt.datetime | None = None  # ... in the processing index (None: no lease part)
        self._high: Key | None = None  # the pass swept [high, top) already; None: no pass under way
        self._width = SWEEP_FIRST_WIDTH_SECONDS  # seconds of key of the next step
        self._first_width = SWEEP_FIRST_WIDTH_SECONDS  # of a pass's first step
        self._first_step = False
        self._step: SweepStep | None = None  # the step sent and not yet ended
        # The pass so far: client seconds, server seconds, rows claimed, steps.
        self.pass_seconds = 0.0
        self.pass_server_seconds = 0.0
        self.pass_rows = 0
        self.pass_steps = 0
        self.pass_row_cost = 0.0  # the highest of its steps' server seconds / (rows claimed + 10)
        self.passes = 0  # passes completed

    def under_way(self) -> bool:
        return self._high is not None

    def position(self) -> Key | None:
        """The upper end of the next step (None: no pass under way)."""
        return self._high

    def next_step(self, fast_start: Key, leases_from: dt.datetime | None) -> SweepStep:
        """The next step; a new pass starts at the fast claims' starts."""
        if self._high is None:
            self._top_due, self._top_leases = fast_start, leases_from
            self._high = max(fast_start, (leases_from, 0)) if leases_from is not None else fast_start
            self._width = self._first_width
            self._first_step = True
            self.pass_seconds = self.pass_server_seconds = self.pass_row_cost = 0.0
            self.pass_rows = self.pass_steps = 0
        assert self._top_due is not None
        high_at = self._high[0]
        low: dt.datetime | None
        try:
            low = high_at - dt.timedelta(seconds=self._width)
        except OverflowError:
            low = None
        if low is not None and low < SWEEP_FRONT_AT:
            low = None  # the rest, down to the front, in this step
        leases_until = None if self._top_leases is None else min(self._top_leases, high_at)
        self._step = SweepStep(low=low, due_until=min(self._high, self._top_due), leases_until=leases_until)
        return self._step

    def step_ended(self, *, seconds: float, server_seconds: float | None, rows: int, more: bool) -> bool:
        """Record a step: ``rows`` it claimed, ``more``: its lease scan was cut by its
        LIMIT. True when this step completed a pass."""
        step, self._step = self._step, None
        if step is None:
            return False
        cost = seconds if server_seconds is None else server_seconds
        self.pass_seconds += seconds
        self.pass_server_seconds += cost
        self.pass_rows += rows
        self.pass_steps += 1
        self.pass_row_cost = max(self.pass_row_cost, cost / (rows + 10))
        if rows or more:
            return False  # the same range again, until it yields nothing: rows claimed leave it
        factor = min(SWEEP_WIDTH_GROWTH, max(1.0 / SWEEP_WIDTH_SHRINK, self.step_seconds / max(cost, 1e-4)))
        width = min(SWEEP_MAX_WIDTH_SECONDS, max(SWEEP_MIN_WIDTH_SECONDS, self._width * factor))
        if self._first_step:  # the next pass starts where this one did: its first width from this one's
            self._first_width = width
            self._first_step = False
        self._width = width
        if step.low is None:
            self._high = None
            self.passes += 1
            return True
        self._high = (step.low, 0)
        return False

    def step_failed(self, *, seconds: float, timed_out: bool) -> None:
        """A step that raised: one that ran out of time is tried again narrower."""
        self._step = None
        self.pass_seconds += seconds
        self.pass_server_seconds += seconds
        if timed_out:
            self._width = max(SWEEP_MIN_WIDTH_SECONDS, self._width / SWEEP_WIDTH_SHRINK)
            if self._first_step:
                self._first_width = self._width


class DueCursor:
    """Shared by the workers of one process (thread-safe)."""

    def __init__(
        self,
        *,
        lag_seconds: float = LAG_SECONDS,
        rescan_min_seconds: float = 0.0,
        rescan_max_seconds: float = 30.0,
        rescan_quiet_max_seconds: float = RESCAN_QUIET_MAX_SECONDS,
        full_cost_share: float = 0.1,
        lease_margin_seconds: float = 1.0,
        lease_scan_interval_seconds: float = LEASE_SCAN_INTERVAL_SECONDS,
        fast_above_seconds: float = 0.1,
        fast_above_seconds_per_row: float = FAST_ABOVE_SECONDS_PER_ROW,
        writers_within_seconds: float = WRITERS_WITHIN_SECONDS,
        sweep_step_seconds: float = SWEEP_STEP_SECONDS,
        sweep: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # While fast claims are in use, the full claim is a sweep in bounded steps
        # (``sweep`` False: one whole statement every full-claim interval, as before).
        self._sweeps = sweep
        self.sweep = Sweep(step_seconds=sweep_step_seconds)
        self._sweep_next_at = float("-inf")  # when the next step is due (the clock's seconds)
        self.sweep_steps = 0
        self.sweep_timeouts = 0  # steps that ran out of their own statement timeout
        self._bounds_published_at: float | None = None  # None: none published (or withdrawn)
        self.writers_within_seconds = writers_within_seconds
        self._long_writers: frozenset[LongWriter] = frozenset()  # seen open by the last look applied
        self._last_look_at: dt.datetime | None = None  # the database's clock at that look
        self._catch_up_from: dt.datetime | None = None  # a remembered writer ended: claim from its start
        self._lease_scan_interval = lease_scan_interval_seconds
        self._writers_check_interval = min(WRITERS_CHECK_INTERVAL_SECONDS, lag_seconds * 0.4)
        self._last_writers_check_at = float("-inf")
        self._last_lease_scan_at = float("-inf")
        self._leases_left = False  # the last lease scan was cut by its LIMIT: more are waiting
        self._fast_above = fast_above_seconds
        self._fast_above_per_row = fast_above_seconds_per_row
        self._full_costs: deque[float] = deque(maxlen=3)  # the last full claims' durations
        self._full_cost = 0.0  # the least of them (0 until there are three)
        self._full_row_costs: deque[float] = deque(maxlen=3)  # their durations / (rows claimed + 10)
        self._slow = fast_above_seconds <= 0  # full claims are slow: fast claims in use
        self._lag = lag_seconds
        self._lease_margin = lease_margin_seconds
        self._rescan_min = rescan_min_seconds
        self._rescan_max = rescan_max_seconds
        self._rescan_quiet_max = max(rescan_quiet_max_seconds, rescan_max_seconds)
        self._quiet_full_claims = 0  # full claims in a row that found nothing below the fast start
        self._cost_share = full_cost_share
        self._clock = clock
        self._lock = threading.Lock()
        self._window: deque[tuple[float, Key]] = deque()  # (when, lowest key claimed), oldest first
        self._anchor: Key | None = None  # lowest key of the newest claim older than the window
        self._last_full_at = float("-inf")
        self._full_running = False
        self._leases_from: dt.datetime | None = None
        self.full_claims = 0
        self.fast_claims = 0
        self.catch_up_claims = 0  # fast claims sent from an ended long writer's start

    def begin(self) -> ClaimPlan:
        """The next claim: full while full claims are cheap, or when one is due (and no
        other worker runs one); else fast."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            start = self._start()
            cheap = not self._slow  # nothing to save: every claim is full
            sweep_due = self._sweeps and not self._full_running and now >= self._sweep_next_at
            if start is not None and not cheap and sweep_due:
                return self._sweep_step(now, start)
            interval = self._full_interval()
            full_due = not self._sweeps and not self._full_running and now - self._last_full_at >= interval
            if start is None or cheap or full_due:
                # A full claim reads from the front: while full claims are cheap (every
                # claim is one) it takes over a pending catch-up (what it finds below the
                # fast start enters the window). While they are slow it does not: it may
                # run for seconds, or out of its statement timeout, before it reaches
                # the ended writer's rows, so the catch-up stays for the next fast claim,
                # which starts at that writer's start at once.
                catch_up_from = None
                if cheap or start is None:
                    catch_up_from, self._catch_up_from = self._catch_up_from, None
                if not self._full_running:
                    self._full_running = True  # this one's duration feeds the average
                    self._last_full_at = now
                    self._last_lease_scan_at = now
                    self.full_claims += 1
                    return ClaimPlan(full=True, start=None, fast_start=start, catch_up_from=catch_up_from)
                return ClaimPlan(full=True, start=None, measured=False, catch_up_from=catch_up_from)
            self.fast_claims += 1
            # A remembered long writer has ended: this one claim starts at its start
            # (the rows it committed are keyed there, below the window), once; the
            # window then holds the key of what it finds, and the claims after it
            # drain the rest. A start already at or below it needs no catch-up.
            catch_up_from = self._catch_up_from
            self._catch_up_from = None
            if catch_up_from is not None and (catch_up_from, 0) < start:
                start = (catch_up_from, 0)
                self.catch_up_claims += 1
            else:
                catch_up_from = None
            # Expired leases are rare (a relay died or hung): a fast claim looks for
            # them once per interval, or at once while the last look found more than
            # its LIMIT, instead of walking the processing index's dead entries each time.
            lease_scan = self._leases_left or now - self._last_lease_scan_at >= self._lease_scan_interval
            if lease_scan:
                self._last_lease_scan_at = now
            # Open writers are looked for more often than the window is long, so what
            # one look saw is still in the window when the next look comes.
            writers_check = now - self._last_writers_check_at >= self._writers_check_interval
            if writers_check:
                self._last_writers_check_at = now
            return ClaimPlan(
                full=False,
                start=start,
                leases_from=self._leases_from,
                lease_scan=lease_scan,
                writers_check=writers_check,
                catch_up_from=catch_up_from,
                writers_within_seconds=self.writers_within_seconds,
            )

    def _sweep_step(self, now: float, start: Key) -> ClaimPlan:
        """The next step of the sweep (the lock held): one key range below the fast starts."""
        self._full_running = True
        self._last_full_at = now
        self.full_claims += 1
        self.sweep_steps += 1
        step = self.sweep.next_step(start, self._leases_from)
        return ClaimPlan(
            full=True,
            sweep=True,
            start=None if step.low is None else (step.low, 0),
            until=step.due_until,
            leases_from=step.low,
            leases_until=step.leases_until,
            fast_start=start,
            statement_timeout_ms=max(1, round(self.sweep.step_seconds * SWEEP_STEP_TIMEOUT_TARGETS * 1000)),
        )

    def _sweep_ended(self, now: float, outcomes: list[ClaimOutcome], elapsed_seconds: float) -> None:
        """A sweep step ended (the lock held): the same range again at once while it
        yields rows, else the next one after its share of time, or the next pass after
        the full-claim interval; a completed pass counts as one full claim's cost."""
        self._full_running = False
        server = [o.server_seconds for o in outcomes if o.server_seconds is not None]
        server_seconds = sum(server) if server else None
        rows = sum(o.claimed for o in outcomes)
        more = any(not o.leases_exhausted for o in outcomes)
        sweep = self.sweep
        if not sweep.step_ended(seconds=elapsed_seconds, server_seconds=server_seconds, rows=rows, more=more):
            cost = elapsed_seconds if server_seconds is None else server_seconds
            self._sweep_next_at = now if rows or more else now + self._step_interval(cost)
            return
        # Its summed time against fast_above_seconds (what one full claim from the front
        # would have taken), and per row its most expensive step, judged like a claim:
        # a pass of many cheap steps, once vacuum has caught up, reads as cheap; one with
        # a step that walked dead entries does not.
        self._record_full_cost(sweep.pass_seconds, 0, sweep.pass_server_seconds, row_cost=sweep.pass_row_cost)
        self._quiet_full_claims = 0 if sweep.pass_rows or not self._slow else self._quiet_full_claims + 1
        self._sweep_next_at = now + self._full_interval()

    def _step_interval(self, cost_seconds: float) -> float:
        """After a step, its share of time (up to rescan_max_seconds; rescan_min_seconds
        spaces the passes, not their steps: a cheap step is followed at once)."""
        return min(self._rescan_max, cost_seconds / self._cost_share)

    def end(
        self,
        plan: ClaimPlan,
        outcomes: list[ClaimOutcome],
        elapsed_seconds: float,
        claimed_rows: int = 0,
        *,
        found_below: bool | None = None,
    ) -> None:
        """Record what a claim's statements saw and, for a full claim, its cost.
        ``found_below``: whether a full claim found a row the fast claims would not have
        found (None: one keyed below where they start, as the plain claim reports it)."""
        now = self._clock()
        with self._lock:
            if plan.sweep:
                # A step reads only its range: its keys are not where fast claims start
                # (it takes the rows of its range itself), nor does its lease scan say
                # anything of the leases above it.
                if self._full_running:
                    self._sweep_ended(now, outcomes, elapsed_seconds)
                self._expire(now)
                return
            if plan.full and plan.measured and self._full_running:
                self._full_running = False
                server = [o.server_seconds for o in outcomes if o.server_seconds is not None]
                self._record_full_cost(elapsed_seconds, claimed_rows, sum(server) if server else None)
                if found_below is None:
                    claimed = [o.lowest for o in outcomes if o.lowest is not None]
                    found_below = plan.fast_start is not None and bool(claimed) and min(claimed) < plan.fast_start
                if found_below or not self._slow:
                    self._quiet_full_claims = 0
                else:
                    self._quiet_full_claims += 1
                self._sweep_next_at = now + self._full_interval()  # the sweep, if slow now, after a pause
            keys = [o.lowest for o in outcomes if o.lowest is not None]
            if keys:
                self._window.append((now, min(keys)))
            looks = sorted((o.writers_look for o in outcomes if o.writers_look is not None), key=lambda w: w.looked_at)
            for look in looks:
                self._apply_look(look)
            if plan.lease_scan:
                self._leases_left = any(not o.leases_exhausted for o in outcomes)
            for outcome in outcomes:
                # Every lease that expired before this statement's clock was reclaimed
                # (or is being changed by another transaction right now): later claims
                # may start the processing index there, less a margin for the
                # transactions still in flight.
                if outcome.leases_exhausted and outcome.database_now is not None:
                    floor = outcome.database_now - dt.timedelta(seconds=self._lease_margin)
                    if self._leases_from is None or floor > self._leases_from:
                        self._leases_from = floor
            self._expire(now)

    def failed(self, plan: ClaimPlan, elapsed_seconds: float = 0.0, *, timed_out: bool = False) -> None:
        """A claim that raised. A full one that failed quickly (a connection lost) is
        tried again by the next claim; one that ran for a while (its statement timeout:
        right after a long-held horizon ends, the first scan from the front prunes and
        marks dead every entry it passes) counts as a full claim that long, so the next
        one comes after its interval — not at once, which would keep one worker in
        failing full claims while the fast claims go on."""
        with self._lock:
            # A catch-up claim that failed quickly (a connection lost) is sent again by
            # the next claim; one that ran out of its statement timeout is not (it would
            # keep a worker in failing claims): those rows are left to the full claims.
            if plan.catch_up_from is not None and elapsed_seconds < QUICK_FAILURE_SECONDS:
                self._catch_up(plan.catch_up_from)
            if plan.sweep:
                if self._full_running:
                    self._full_running = False
                    # One that ran for a while (or out of its own statement timeout) is
                    # tried again narrower, after its share of time; a quick failure at once.
                    long = timed_out or elapsed_seconds >= max(self._fast_above, QUICK_FAILURE_SECONDS)
                    self.sweep_timeouts += timed_out
                    self.sweep.step_failed(seconds=elapsed_seconds, timed_out=long)
                    retry_after = self._step_interval(elapsed_seconds) if long else float("-inf")
                    self._sweep_next_at = self._clock() + retry_after
                return
            if plan.full and plan.measured and self._full_running:
                self._full_running = False
                if elapsed_seconds < max(self._fast_above, QUICK_FAILURE_SECONDS):
                    self._last_full_at = float("-inf")
                else:  # its interval counts from its end
                    self._last_full_at = self._clock()
                    self._record_full_cost(elapsed_seconds, 0, None)
                    self._sweep_next_at = self._last_full_at + self._full_interval()

    def catch_up_pending(self) -> bool:
        """A remembered long writer has ended and no claim has started from its start yet."""
        with self._lock:
            return self._catch_up_from is not None

    def fast_claims_in_use(self) -> bool:
        """Full claims are slow (see _record_full_cost): vacuum is being held back and
        dead entries pile up."""
        with self._lock:
            return self._slow

    def start_key(self) -> Key | None:
        """Where a fast claim would start now (None: from the front)."""
        with self._lock:
            self._expire(self._clock())
            return self._start()

    def gauge_bounds(self) -> GaugeBounds | None:
        """Where the queue gauges may start their index scans: where fast claims start,
        while they are in use (full claims slow: dead entries pile up at the front);
        None while full claims are cheap (the gauges read from the front, exactly)."""
        with self._lock:
            self._expire(self._clock())
            start = self._start()
            if start is None or not self._slow:
                return None
            return GaugeBounds(due_from=start, leases_from=self._leases_from)

    def bounds_to_publish(self) -> tuple[bool, GaugeBounds | None]:
        """(whether to publish now, what): the gauge bounds every
        BOUNDS_PUBLISH_INTERVAL_SECONDS while fast claims are in use; once they are not,
        None once (withdraw them). Nothing at all while full claims are cheap."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            start = self._start()
            if start is None or not self._slow:
                if self._bounds_published_at is None:
                    return False, None
                self._bounds_published_at = None
                return True, None
            last = self._bounds_published_at
            if last is not None and now - last < BOUNDS_PUBLISH_INTERVAL_SECONDS:
                return False, None
            self._bounds_published_at = now
            return True, GaugeBounds(due_from=start, leases_from=self._leases_from)

    def _record_full_cost(
        self, elapsed_seconds: float, claimed_rows: int, server_seconds: float | None, *, row_cost: float | None = None
    ) -> None:
        """Full claims are slow when the least of the last three took fast_above_seconds
        or more, or ran in the server fast_above_seconds_per_row or more per row
        claimed (+ 10, so an empty claim is judged too): a small batch that takes tens
        of milliseconds in the server is walking dead entries, a large one may just be
        large (the server's time, so that a busy client machine does not count). The
        least of three: a slow claim or two (or a new connection's first) do not
        switch the relay to fast claims, a horizon held back long enough to slow every
        full claim does."""
        self._full_costs.append(elapsed_seconds)
        server = elapsed_seconds if server_seconds is None else server_seconds
        self._full_row_costs.append(server / (claimed_rows + 10) if row_cost is None else row_cost)
        if len(self._full_costs) < 3:  # the deques keep three
            self._full_cost, self._slow = 0.0, self._fast_above <= 0
            return
        self._full_cost = min(self._full_costs)
        self._slow = self._full_cost >= self._fast_above or min(self._full_row_costs) >= self._fast_above_per_row

    def _full_interval(self) -> float:
        """Seconds between full claims while they are expensive: a share of the time
        (their cost / full_cost_share, within rescan_min..rescan_max), doubled for each
        full claim in a row that found nothing below where fast claims start (up to
        rescan_quiet_max): a full claim reads every dead entry since the horizon was
        taken, so while late rows do not come (the look for open writers covers the
        usual ones) it comes round less and less often; one that finds a late row
        brings the interval back at once."""
        base = min(self._rescan_max, max(self._rescan_min, self._full_cost / self._cost_share))
        return min(base * 2.0 ** min(self._quiet_full_claims, 16), max(base, self._rescan_quiet_max))

    def _apply_look(self, look: WritersLook) -> None:
        """Remember the long writers a look saw open; a remembered one it no longer sees
        has ended (committed or rolled back): claim once from its start. A look taken
        before the last one applied is ignored: it may predate a writer's first write,
        and would make the cursor forget a writer still open."""
        last = self._last_look_at
        if last is not None and last - LOOK_CLOCK_STEP < look.looked_at <= last:
            return  # (far older than the last: the server's clock was set back, not a stale look)
        self._last_look_at = look.looked_at
        ended = self._long_writers - look.long_writers
        if ended:
            self._catch_up(min(started for _, started in ended))
        self._long_writers = look.long_writers

    def _catch_up(self, started: dt.datetime) -> None:
        if self._catch_up_from is None or started < self._catch_up_from:
            self._catch_up_from = started

    def _expire(self, now: float) -> None:
        while self._window and now - self._window[0][0] > self._lag:
            self._anchor = self._window.popleft()[1]

    def _start(self) -> Key | None:
        keys = [key for _, key in self._window]
        if self._anchor is not None:
            keys.append(self._anchor)
        return min(keys) if keys else None
