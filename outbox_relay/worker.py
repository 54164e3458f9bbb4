"""The worker loop: claim -> publish (no transaction, no connection held) -> fenced finalize.

At-least-once: a row is finalized only after its publish outcome is known, and a
finalize that finds the lease taken over (a *lost lease*) is logged and counted,
never forced. A message may therefore be published more than once; consumers
deduplicate on the ``message_id`` header.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from .errors import CommitOutcomeUnknown, DatabaseError, SchemaMissing
from .heartbeat import InFlight, LeaseKeeper
from .metrics import RelayMetrics
from .publisher import (
    Defer,
    Message,
    NotDelivered,
    Outcome,
    PermanentError,
    Publisher,
    RetryableError,
    build_message,
)
from .store import Claimed, OutboxStore, Reschedule

log = structlog.get_logger("outbox_relay.worker")


def full_jitter_backoff(attempt: int, *, base: float, cap: float) -> float:
    """AWS "full jitter": uniform(0, min(cap, base * 2**attempt)) seconds."""
    return random.uniform(0.0, min(cap, base * (2 ** min(attempt, 62))))


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class WorkerConfig:
    owner: str
    batch_size: int
    lease_seconds: float
    max_attempts: int
    ordered_types: list[str]
    run_length: int
    strict_lease: bool
    topic_template: str
    poll_interval_seconds: float
    backoff_base_seconds: float
    backoff_cap_seconds: float
    publish_timeout_seconds: float
    max_error_chars: int = 1000
    listen_notify: bool = False


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


class CircuitBreaker:
    """Opens when a whole batch fails on transport (broker unreachable), so rows are
    released with their attempt refunded instead of burning attempts toward dead.
    While open, workers do not claim; ``probe`` (with exponential backoff) closes it."""

    def __init__(self, probe, metrics: RelayMetrics | None = None, *,
                 initial_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        self._probe = probe
        self._metrics = metrics
        self._lock = threading.Lock()
        self._open = False
        self._closed_event = threading.Event()
        self._closed_event.set()
        self._initial = initial_backoff
        self._max = max_backoff
        self.opened_count = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, reason: str) -> None:
        with self._lock:
            if self._open:
                return
            self._open = True
            self.opened_count += 1
            self._closed_event.clear()
        if self._metrics is not None:
            self._metrics.circuit_breaker_open.set(1)
        log.warning("broker unreachable: circuit breaker open, claiming paused", reason=reason)
        threading.Thread(target=self._probe_loop, name="breaker-probe", daemon=True).start()

    def _probe_loop(self) -> None:
        delay = self._initial
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
                if self._metrics is not None:
                    self._metrics.circuit_breaker_open.set(0)
                log.info("broker answers again: circuit breaker closed")
                return
            delay = min(self._max, delay * 2)

    def wait_closed(self, timeout: float) -> bool:
        return self._closed_event.wait(timeout)


@dataclass
class _Batch:
    """A claimed batch between claim and finalize."""

    rows: Sequence[Claimed]
    started: float
    outcomes: list[Outcome]
    messages: list[Message] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    ticket: InFlight | None = None
    handle: Any = None  # the publisher's in-flight batch (submit), if any


@dataclass
class BatchResult:
    claimed: int = 0
    done: int = 0
    retried: int = 0
    deferred: int = 0
    dead: int = 0
    released: int = 0
    lost: list[int] = field(default_factory=list)
    unfinalized: list[int] = field(default_factory=list)  # database down: lease expiry recovers them


class Worker:
    """One worker thread's loop. ``stop()`` makes it finish its batch and return."""

    def __init__(self, index: int, store: OutboxStore, publisher: Publisher, config: WorkerConfig,
                 metrics: RelayMetrics, *, wakeup: Wakeup | None = None,
                 breaker: CircuitBreaker | None = None, stop_event: threading.Event | None = None,
                 keeper: LeaseKeeper | None = None) -> None:
        self.index = index
        self.owner = f"{config.owner}:w{index}"
        self.store = store
        self.publisher = publisher
        self.cfg = config
        self.metrics = metrics
        self.wakeup = wakeup or Wakeup()
        self.breaker = breaker
        self.stop_event = stop_event or threading.Event()
        self.keeper = keeper
        # Publishers that accept cancel= stop waiting when the keeper finds the batch's lease lost.
        self._publisher_cancellable = bool(getattr(publisher, "supports_cancel", False))
        # Publishers with submit() (produce now, wait later) allow pipelining.
        self._publisher_submits = callable(getattr(publisher, "submit", None))
        self._db_failures = 0
        self._ordered_after = ""  # aggregate_id where the last ordered claim ended
        self.log = log.bind(worker=self.owner)

    # --- loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Loop until stopped. With a publisher that can ``submit`` (Kafka), the next
        batch is claimed and produced while the previous one is still being
        delivered: batch N+1's claim overlaps batch N's wait for acknowledgements.
        (Ordered rows are unaffected: a row behind an unfinished head is never claimable.)"""
        self.log.info("worker started")
        pipelined = self._publisher_submits
        pending: _Batch | None = None
        while not self.stop_event.is_set():
            if self.breaker is not None and self.breaker.is_open:
                if pending is not None:
                    self._complete(pending)
                    pending = None
                self.breaker.wait_closed(timeout=0.5)
                continue
            try:
                rows = self.claim()
            except DatabaseError as exc:
                if pending is not None:
                    self._complete(pending)
                    pending = None
                self._log_db_error(exc)
                self._sleep_db_backoff()
                continue
            self._db_failures = 0
            if len(rows) >= self.cfg.batch_size:
                self.wakeup.wake_one()  # a backlog: get another worker going
            if rows:
                batch = self._start(rows)
                if pipelined:
                    if pending is not None:
                        self._complete(pending)
                    pending = batch
                else:
                    self._complete(batch)
                continue
            if pending is not None:
                self._complete(pending)
                pending = None
                continue
            if self.cfg.listen_notify and not self.wakeup.relays_marked_idle:
                # Going idle: ask inserts to notify, then look once more, so a row
                # inserted just before the flag was set is not left to the poll.
                try:
                    with self.wakeup.flag_lock:
                        self.store.mark_idle()
                        self.wakeup.relays_marked_idle = True
                except DatabaseError as exc:
                    self._log_db_error(exc)
                    self._sleep_db_backoff()
                continue
            self.wakeup.wait(self.cfg.poll_interval_seconds * random.uniform(0.5, 1.0))
        if pending is not None:
            self._complete(pending)
        self.log.info("worker stopped")

    def _log_db_error(self, exc: DatabaseError) -> None:
        if isinstance(exc, SchemaMissing):
            self.log.error("outbox table missing", error=str(exc))
        elif isinstance(exc, CommitOutcomeUnknown):
            # Never publish after an unknown commit outcome: if the claim committed,
            # its lease expires and a later claim recovers the rows.
            self.log.warning("claim commit outcome unknown; not publishing", error=str(exc))
        else:
            self.log.warning("database unavailable; backing off", error=str(exc))

    def _sleep_db_backoff(self) -> None:
        self._db_failures += 1
        delay = full_jitter_backoff(self._db_failures, base=0.1, cap=5.0) + 0.05
        self.stop_event.wait(delay)

    def stop(self) -> None:
        self.stop_event.set()
        self.wakeup.wake_all()

    # --- one batch -------------------------------------------------------------------
    def claim(self) -> list[Claimed]:
        cfg = self.cfg
        result = self.store.claim(owner=self.owner, batch=cfg.batch_size, lease_seconds=cfg.lease_seconds,
                                  max_attempts=cfg.max_attempts, ordered_types=cfg.ordered_types,
                                  run_length=cfg.run_length, ordered_after=self._ordered_after)
        self._ordered_after = result.ordered_after
        for row_id, version, owner in result.reaped:
            self.log.warning("reaped: attempts used up without an outcome; row is dead",
                             outbox_id=row_id, lease_version=version, lease_owner=owner)
        if result.reaped:
            self.metrics.reaped_total.inc(len(result.reaped))
            self.metrics.published("dead", len(result.reaped))
        return result.rows

    def run_once(self) -> BatchResult:
        rows = self.claim()
        if not rows:
            return BatchResult()
        return self.process(rows)

    def process(self, rows: Sequence[Claimed]) -> BatchResult:
        """Publish and finalize one claimed batch (blocking)."""
        return self._complete(self._start(rows))

    def _start(self, rows: Sequence[Claimed]) -> _Batch:
        """Build the messages and, if the publisher can, produce them now."""
        cfg = self.cfg
        batch = _Batch(rows=rows, started=time.monotonic(), outcomes=[None] * len(rows))
        self.metrics.claim_batch_size.observe(len(rows))
        failed_aggregates: set[str] = set()  # ordered aggregates whose run stopped here
        for i, row in enumerate(rows):
            ordered = bool(cfg.ordered_types) and self._is_ordered(row)
            if ordered and row.aggregate_id in failed_aggregates:
                # Never produce a row after a failed row of its ordered run.
                batch.outcomes[i] = NotDelivered("released: an earlier row of this aggregate did not succeed")
                continue
            try:
                message = build_message(row, cfg.topic_template)
            except PermanentError as exc:
                batch.outcomes[i] = exc
            except ValueError as exc:  # headers column that is not valid JSON
                batch.outcomes[i] = PermanentError(f"bad headers: {exc}")
            else:
                if ordered:
                    message.extra["order_group"] = row.aggregate_id
                batch.messages.append(message)
                batch.positions.append(i)
                continue
            if ordered:
                failed_aggregates.add(row.aggregate_id)
        if batch.messages:
            # Heartbeat for at most the publish timeout plus one lease.
            batch.ticket = (self.keeper.track(rows, self.owner,
                                              max_seconds=cfg.publish_timeout_seconds + cfg.lease_seconds)
                            if self.keeper is not None else None)
            if self._publisher_submits:
                batch.handle = self.publisher.submit(  # type: ignore[attr-defined]
                    batch.messages, timeout_seconds=cfg.publish_timeout_seconds)
        return batch

    def _complete(self, batch: _Batch) -> BatchResult:
        """Wait for (or perform) the publish, then finalize with fencing."""
        cfg = self.cfg
        if batch.messages:
            cancel = batch.ticket.cancel if batch.ticket is not None else None
            try:
                if batch.handle is not None:
                    published = batch.handle.wait(cancel=cancel)
                elif cancel is not None and self._publisher_cancellable:
                    published = self.publisher.publish_batch(  # type: ignore[call-arg]
                        batch.messages, timeout_seconds=cfg.publish_timeout_seconds, cancel=cancel)
                else:
                    published = self.publisher.publish_batch(batch.messages,
                                                             timeout_seconds=cfg.publish_timeout_seconds)
            finally:
                if batch.ticket is not None and self.keeper is not None:
                    self.keeper.untrack(batch.ticket)
            if len(published) != len(batch.messages):
                raise RuntimeError(f"publisher returned {len(published)} outcomes for {len(batch.messages)} messages")
            for pos, outcome in zip(batch.positions, published):
                batch.outcomes[pos] = outcome
        if cfg.ordered_types:
            self._stop_runs_at_failure(batch.rows, batch.outcomes)
        result = self.finalize(batch.rows, batch.outcomes)
        self.metrics.publish_latency_seconds.observe(time.monotonic() - batch.started)
        return result

    def _is_ordered(self, row: Claimed) -> bool:
        types = self.cfg.ordered_types
        return "*" in types or row.event_type in types

    def _stop_runs_at_failure(self, rows: Sequence[Claimed], outcomes: list[Outcome]) -> None:
        """Within an aggregate's run, nothing after a failed row may be finalized as
        done: release those rows (attempt refunded) so they follow the failed head."""
        failed_aggregates: set[str] = set()
        for i, row in enumerate(rows):  # rows are in id order
            if not self._is_ordered(row):
                continue
            if row.aggregate_id in failed_aggregates:
                outcomes[i] = NotDelivered("released: an earlier row of this aggregate did not succeed")
            elif outcomes[i] is not None:
                failed_aggregates.add(row.aggregate_id)

    # --- fenced finalize -------------------------------------------------------------
    def finalize(self, rows: Sequence[Claimed], outcomes: Sequence[Outcome]) -> BatchResult:
        cfg = self.cfg
        done: list[tuple[int, int]] = []
        reschedule: list[Reschedule] = []
        dead: list[tuple[int, int, str]] = []
        kinds: dict[int, str] = {}
        # A batch in which nothing was delivered and every failure was a transport
        # failure means the broker is unreachable as a whole: release those rows with
        # the attempt refunded (even on their last attempt) and open the breaker,
        # instead of burning attempts toward dead.
        failures = [o for o in outcomes if o is not None and not isinstance(o, NotDelivered)]
        outage = (self.breaker is not None and bool(failures) and all(o is not None for o in outcomes)
                  and all(isinstance(o, RetryableError) and o.transport for o in failures))
        for row, outcome in zip(rows, outcomes):
            if outcome is None:
                done.append((row.id, row.lease_version))
                kinds[row.id] = "done"
            elif isinstance(outcome, NotDelivered) or (outage and isinstance(outcome, RetryableError)):
                error = None if isinstance(outcome, NotDelivered) else truncate(outcome.reason, cfg.max_error_chars)
                reschedule.append(Reschedule(row.id, row.lease_version, 0.0, error, True))
                kinds[row.id] = "release"
            elif isinstance(outcome, Defer):
                reschedule.append(Reschedule(row.id, row.lease_version, outcome.delay,
                                             truncate(f"deferred: {outcome.reason}", cfg.max_error_chars), True))
                kinds[row.id] = "defer"
            elif isinstance(outcome, RetryableError):
                if row.attempts >= cfg.max_attempts:
                    dead.append((row.id, row.lease_version,
                                 truncate(f"retries exhausted after {row.attempts} attempts: {outcome.reason}",
                                          cfg.max_error_chars)))
                    kinds[row.id] = "dead"
                else:
                    delay = full_jitter_backoff(row.attempts, base=cfg.backoff_base_seconds,
                                                cap=cfg.backoff_cap_seconds)
                    if outcome.retry_after_seconds is not None:
                        delay = max(delay, outcome.retry_after_seconds)
                    reschedule.append(Reschedule(row.id, row.lease_version, delay,
                                                 truncate(outcome.reason, cfg.max_error_chars), False))
                    kinds[row.id] = "retry"
            elif isinstance(outcome, PermanentError):
                dead.append((row.id, row.lease_version, truncate(f"permanent: {outcome.reason}", cfg.max_error_chars)))
                kinds[row.id] = "dead"
            else:
                raise TypeError(f"publisher returned {outcome!r}, not an outcome")

        if outage and self.breaker is not None:
            self.breaker.trip(f"{len(failures)} transport failures and no delivery in one batch")

        accepted: set[int] = set()
        unfinalized: set[int] = set()
        versions = {row.id: row.lease_version for row in rows}
        for ids, target, operation in (
            ([i for i, _ in done], "done", lambda: self.store.mark_done(done, strict=cfg.strict_lease)),
            ([r.id for r in reschedule], "pending",
             lambda: self.store.reschedule(reschedule, strict=cfg.strict_lease)),
            ([i for i, _, _ in dead], "dead", lambda: self.store.mark_dead(dead, strict=cfg.strict_lease)),
        ):
            if not ids:
                continue
            finalized, retried = self._with_db_retry(operation)
            if finalized is None:
                unfinalized.update(ids)
                continue
            accepted |= finalized
            missing = [i for i in ids if i not in finalized]
            if retried and missing:
                # An earlier try may have committed before its connection broke: rows
                # that carry our outcome and our (unchanged) version were ours.
                try:
                    for row_id, (status, version) in self.store.states(missing).items():
                        if status == target and version == versions[row_id]:
                            accepted.add(row_id)
                except DatabaseError:
                    pass

        dead_reasons = {row_id: reason for row_id, _, reason in dead}
        result = BatchResult(claimed=len(rows))
        counted = {"done": 0, "retry": 0, "defer": 0, "dead": 0, "release": 0}
        for row in rows:
            kind = kinds[row.id]
            if row.id in unfinalized:
                result.unfinalized.append(row.id)
            elif row.id in accepted:
                counted[kind] += 1
                if kind == "dead":
                    self.log.warning("row is dead", outbox_id=row.id, lease_version=row.lease_version,
                                     lease_owner=self.owner, reason=dead_reasons[row.id])
            else:
                result.lost.append(row.id)
                self.log.warning("lost lease: finalize rejected, row belongs to a newer claim",
                                 outbox_id=row.id, lease_version=row.lease_version, lease_owner=self.owner,
                                 outcome=kind)
        for outcome_name in ("done", "retry", "defer", "dead"):
            self.metrics.published(outcome_name, counted[outcome_name])
        if counted["release"]:
            self.metrics.released_total.inc(counted["release"])
        if result.lost:
            self.metrics.lost_leases_total.inc(len(result.lost))
        result.done, result.retried, result.deferred = counted["done"], counted["retry"], counted["defer"]
        result.dead, result.released = counted["dead"], counted["release"]
        return result

    def _with_db_retry(self, operation) -> tuple[set[int] | None, bool]:
        """A finalize that fails on the database is retried briefly (it is fenced, so
        repeating it is safe); past the lease there is no point: the rows are reclaimed.
        Returns (finalized ids or None if it never succeeded, whether it was retried)."""
        deadline = time.monotonic() + self.cfg.lease_seconds * 0.5
        attempt = 0
        while True:
            try:
                return operation(), attempt > 0
            except DatabaseError as exc:
                attempt += 1
                if time.monotonic() > deadline:
                    self.log.error("finalize failed; rows will be reclaimed after their lease", error=str(exc))
                    return None, True
                self.log.warning("finalize failed; retrying", error=str(exc), attempt=attempt)
                time.sleep(full_jitter_backoff(attempt, base=0.05, cap=2.0) + 0.02)
