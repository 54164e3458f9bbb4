"""The worker loop: claim -> publish (no transaction, no connection held) -> fenced finalize.

At-least-once: a row is finalized only after its publish outcome is known, and a
finalize that finds the lease taken over (a *lost lease*) is logged and counted,
never forced. A message may therefore be published more than once; consumers
deduplicate on the ``message_id`` header.

Who does what: the store claims (``OutboxStore.claim``); the worker builds the
messages and hands them to the publisher; ``decision.decide`` turns each outcome
into a decision (pure); the ``Finalizer`` writes them in one fenced statement; the
metrics and log lines are made from the ``BatchResult`` in ``_record``. Tracing
follows the same batch through a ``BatchTrace`` (``tracing.py``; a no-op unless
``otel.enabled``). Messages are built in the configured format (``formats.py``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from ..core.backoff import full_jitter_backoff
from ..core.batch_result import BatchResult
from ..core.breaker import CircuitBreaker
from ..core.budget import ByteBudget
from ..core.decision import DONE, Decision, RetryPolicy, decide, is_outage
from ..core.formats import WireFormat
from ..core.ordering import RELEASED_AFTER_FAILURE, OrderingRule, RunGuard, release_after_failures
from ..db.store import GENERIC_FINALIZE_MAX_ROWS, ClaimResult, OutboxStore
from ..errors import CommitOutcomeUnknown, DatabaseError, SchemaMissing
from ..model import Claimed, Message, NotDelivered, Outcome, PermanentError
from ..observability.metrics import RelayMetrics
from ..observability.tracing import NO_TRACE, BatchTrace, Tracing
from ..publishers.base import PendingBatch, Publisher, build_message
from .finalizer import Finalizer, log_batch
from .lease_keeper import LeasedBatch, LeaseKeeper
from .submitter import Submitter
from .wakeup import BUSY_AFTER_CYCLES, Wakeup

if TYPE_CHECKING:
    from ..config import Settings

log = structlog.get_logger("outbox_relay.worker")

# A busy worker whose last claim took at most this many rows claims with the generic
# plan, as an idle one does: at a few hundred events per second a lingering claimer
# takes a few rows each time, and planning such a claim costs several times running
# it. Bigger claims (a backlog, thousands of events per second) are planned each time:
# there the generic plan's full claims were slow (db/delivery.py, PLAIN_CLAIM_SETTINGS).
GENERIC_CLAIM_MAX_ROWS = 16


@dataclass
class WorkerConfig:
    """Everything a worker needs from the settings; built by ``from_settings`` for
    the relay and the tests alike."""

    owner: str
    batch_size: int
    lease_seconds: float
    max_attempts: int
    ordered_types: Sequence[str]
    run_length: int
    strict_lease: bool
    topic_template: str
    poll_interval_seconds: float
    backoff_base_seconds: float
    backoff_cap_seconds: float
    publish_timeout_seconds: float
    max_error_chars: int = 1000
    listen_notify: bool = False
    idle_poll_interval_seconds: float = 5.0  # while listening: the process's one idle poll (runtime/wakeup.py)
    durable_finalize: bool = True  # relay.finalize_synchronous_commit = "on"
    claim_linger_ms: float = 0.0  # relay.claim_linger_ms (runtime/wakeup.py)
    finalize_hold_ms: float = 0.0  # relay.finalize_hold_ms (Worker._hold_or_finish)
    max_batch_bytes: int = 2**62  # relay.max_batch_bytes
    max_message_bytes: int | None = None  # the publisher's limit: bigger rows go dead unfetched
    #: The message format (``kafka.message_format``); None = the contract with ``topic_template``.
    wire_format: WireFormat | None = None
    ordering: OrderingRule = field(init=False)
    retry_policy: RetryPolicy = field(init=False)

    def __post_init__(self) -> None:
        if self.wire_format is None:
            self.wire_format = WireFormat(topic_template=self.topic_template)
        self.ordering = OrderingRule.of(self.ordered_types)
        self.retry_policy = RetryPolicy(
            self.max_attempts, self.backoff_base_seconds, self.backoff_cap_seconds, self.max_error_chars
        )

    @classmethod
    def from_settings(cls, settings: Settings, publisher: Publisher | None = None, **overrides: Any) -> WorkerConfig:
        """The configuration ``Relay`` gives its workers. ``publisher`` decides the
        publish timeout (``Publisher.publish_timeout_seconds``); ``overrides`` replace
        single fields (tests)."""
        s = settings
        lease = float(overrides.get("lease_seconds", s.relay.lease_seconds))
        timeout = publisher.publish_timeout_seconds(lease) if publisher is not None else lease * 0.8
        wire = WireFormat.from_settings(s)
        if "topic_template" in overrides:
            wire = replace(wire, topic_template=overrides["topic_template"])
        config = cls(
            owner=s.relay.owner,
            batch_size=s.relay.batch_size,
            lease_seconds=lease,
            max_attempts=s.relay.max_attempts,
            ordered_types=list(s.relay.ordered_event_types),
            run_length=s.relay.max_run_length,
            strict_lease=s.relay.strict_lease,
            topic_template=wire.topic_template,
            poll_interval_seconds=s.relay.poll_interval_seconds,
            idle_poll_interval_seconds=s.relay.idle_poll_interval_seconds,
            durable_finalize=s.relay.finalize_synchronous_commit == "on",
            claim_linger_ms=s.relay.claim_linger_ms,
            finalize_hold_ms=s.relay.finalize_hold_ms,
            backoff_base_seconds=s.relay.backoff_base_seconds,
            backoff_cap_seconds=s.relay.backoff_cap_seconds,
            publish_timeout_seconds=timeout,
            max_error_chars=s.relay.max_error_chars,
            listen_notify=s.listens_for_wakeups,
            max_batch_bytes=s.relay.max_batch_bytes,
            max_message_bytes=publisher.max_message_bytes() if publisher is not None else None,
            wire_format=wire,
        )
        return replace(config, **overrides) if overrides else config


@dataclass(slots=True)
class HeldFinalize:
    """A delivered batch whose finalize waits for the worker's next claim, to ride in
    its transaction (``relay.finalize_hold_ms``); written on its own at ``until``."""

    rows: Sequence[Claimed]
    decisions: list[Decision]
    trace: BatchTrace
    elapsed_seconds: float
    until: float  # monotonic


@dataclass(eq=False)
class ClaimedBatch:
    """A batch a worker claimed and is delivering, from its claim to its finalize.

    Its state, in order: *claimed* (``claim_batch``: rows leased, ``held_bytes`` taken
    from the process's byte budget), *started* (``start_batch``: messages built and
    submitted; ``future`` is set while the ``Submitter``'s thread does it), *finished*
    (``finish_batch``: outcomes waited for, decisions written with fencing, bytes given
    back). Rows the worker could not build are decided already when it is started
    (``outcomes``)."""

    rows: Sequence[Claimed]
    trace: BatchTrace
    outcomes: list[Outcome]
    held_bytes: int = 0  # taken from the byte budget until the finalize
    started: float = 0.0  # monotonic time its messages began to be built
    messages: list[Message] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index in rows of each message
    lease: LeasedBatch | None = None  # the lease keeper's record while it is published
    pending: PendingBatch | None = None
    future: Future[ClaimedBatch] | None = None  # started on the Submitter's thread, not collected yet


class Worker:
    """One worker thread's loop. ``stop()`` makes it finish its batch and return."""

    def __init__(
        self,
        index: int,
        store: OutboxStore,
        publisher: Publisher,
        config: WorkerConfig,
        metrics: RelayMetrics,
        *,
        wakeup: Wakeup | None = None,
        breaker: CircuitBreaker | None = None,
        stop_event: threading.Event | None = None,
        keeper: LeaseKeeper | None = None,
        budget: ByteBudget | None = None,
        tracing: Tracing | None = None,
        submitter: Submitter | None = None,
        source: str | None = None,
    ) -> None:
        self.index = index
        self.source = source  # the source's name when the process serves many (logs, tests)
        self.owner = f"{config.owner}:w{index}"
        self.store = store
        self.publisher = publisher
        self.cfg = config
        self.metrics = metrics
        self.wakeup = wakeup or Wakeup()
        self.breaker = breaker
        self.stop_event = stop_event or threading.Event()
        self.keeper = keeper
        self.budget = budget
        # Builds and submits this worker's batches on its own thread (pipelining
        # publishers; submitter.py says why). None: the worker does it itself.
        self.submitter = submitter
        self._in_flight: ClaimedBatch | None = None  # the pipelined batch, for cleanup if the loop dies
        self._avg_row_bytes = 0.0  # of the last non-empty claim: sizes the next claim's candidates
        self._last_candidates = config.batch_size  # the rows the last claim could size at most
        # The relay keeps finding rows (runtime/wakeup.py): claims then use custom plans,
        # unless they keep taking a few rows, all that was due (GENERIC_CLAIM_MAX_ROWS).
        self._busy = False
        self._last_claim_small = True
        self._last_claim_lost_rows = False  # the last claim picked rows another claim took first
        # Set by the loop before each claim: no other worker of the process is claiming
        # (the many-source loop leaves it False: its workers share each busy source).
        self.claims_alone = False
        self._held: HeldFinalize | None = None  # a finalize waiting for the next claim
        self.tracing = tracing or Tracing()
        self.finalizer = Finalizer(
            store,
            strict_lease=config.strict_lease,
            retry_for_seconds=config.lease_seconds * 0.5,
            durable=config.durable_finalize,
        )
        self._db_failures = 0
        self._ordered_after: str | None = None  # aggregate_id where the last ordered claim ended
        self.log = log.bind(worker=self.owner) if source is None else log.bind(worker=self.owner, source=source)

    # --- loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Loop until stopped. With a pipelining publisher (Kafka), the next batch is
        claimed and submitted while the previous one is still being acknowledged:
        batch N+1's claim overlaps batch N's wait. (Ordered rows are unaffected: a row
        behind an unfinished head is never claimable.)"""
        self.log.info("worker started")
        try:
            self._loop()
        except BaseException:
            # A bug escaped (the thread ends, /healthz turns 503): give the batch's bytes
            # back to the process budget, so the other workers are not starved by it.
            if self._in_flight is not None:
                self._release_bytes(self._in_flight)
            raise
        self.log.info("worker stopped")

    def _loop(self) -> None:
        pipelined = self.publisher.pipelines
        submitter = self.submitter if pipelined else None
        in_flight: ClaimedBatch | None = None
        busy_cycles = 0  # non-empty claims in a row without a pause (runtime/wakeup.py)
        wakeup, key = self.wakeup, self.index
        try:
            while not self.stop_event.is_set():
                self._in_flight = in_flight
                if self.breaker is not None and self.breaker.is_open:
                    if in_flight is not None:
                        self.finish_batch(in_flight)
                        in_flight = None
                    self._write_held()
                    self.breaker.wait_closed(timeout=0.5)
                    continue
                reserved, in_flight = self._reserve_bytes(in_flight)
                if reserved is None:
                    break  # stopped while waiting for the budget
                notices = wakeup.begin_cycle(key)  # notifications after this: rows this claim may miss
                self.claims_alone = not wakeup.others_active(key)
                cycle_started = time.monotonic()
                try:
                    batch = self.claim_batch(reserved)
                except DatabaseError as exc:
                    if in_flight is not None:
                        self.finish_batch(in_flight)
                        in_flight = None
                    self._log_db_error(exc)
                    self._sleep_db_backoff()
                    continue
                self._db_failures = 0
                if batch is not None:
                    busy_cycles += 1
                    # Full: the batch size, or cut by the byte budget or the rows sized.
                    full = len(batch.rows) >= self.cfg.batch_size or self._was_cut(batch.rows)
                    if full:
                        wakeup.wake_one()  # a backlog: get another worker going
                    busy = self._busy = full or busy_cycles >= BUSY_AFTER_CYCLES
                    if busy:
                        self._mark_busy()
                    self.start_batch(batch, submitter)  # with a submitter: built and submitted on its thread
                    # Busy (also while vacuum is held back, when the flag stays idle):
                    # the next claim overlaps this batch's wait.
                    if pipelined and (busy or not self._sleeps_between_batches()):
                        # A crash while finishing the previous batch (which returns its
                        # own bytes) must still return this one's: run() releases _in_flight.
                        self._in_flight = batch
                        if in_flight is not None:
                            self.finish_batch(in_flight)
                        in_flight = batch
                        if not full and not self._may_have_left_rows(batch):
                            if wakeup.step_aside(key):
                                self.finish_batch(batch)
                                in_flight = self._in_flight = None
                                busy_cycles = 0
                                self._idle_wait()
                                continue
                            self._linger_after(cycle_started, announced=False)
                        continue
                    self._in_flight = batch
                    if in_flight is not None:
                        self.finish_batch(in_flight)
                        in_flight = None
                    if self._sleeps_between_batches():
                        self.finish_batch_or_hold(batch)  # its finalize may ride in the next claim
                    else:
                        self.finish_batch(batch)
                    self._in_flight = None
                    # The claim took what was due. Rows committed since were announced
                    # by a notification: none came, nothing to claim until one does.
                    if self._may_have_left_rows(batch):
                        continue
                    if not self._sleeps_between_batches():
                        if wakeup.step_aside(key):
                            busy_cycles = 0
                            self._idle_wait()
                        else:
                            self._linger_after(cycle_started, announced=False)
                        continue
                    if not wakeup.end_cycle(key, notices):
                        self._linger_after(cycle_started, announced=True)
                        continue
                    busy_cycles = 0
                    self._idle_wait()
                    continue
                busy_cycles = 0
                self._busy = False
                if in_flight is not None:
                    self.finish_batch(in_flight)
                    in_flight = None
                    continue
                if self._last_claim_lost_rows:
                    # Another claim took the rows this one picked; rows after them may
                    # be due and were not looked at.
                    self._linger_after(cycle_started, announced=False)
                    continue
                if self.cfg.listen_notify and not wakeup.relays_marked_idle:
                    # Going idle: ask inserts to notify, then look once more, so a row
                    # inserted just before the flag was set is not left to the poll.
                    try:
                        wakeup.mark_relays_idle(self.store)
                    except DatabaseError as exc:
                        self._log_db_error(exc)
                        self._sleep_db_backoff()
                    continue
                # A notification that came while this claim ran announced a row it may
                # have missed (committed after its snapshot); no sleeper was woken for
                # it, since this worker was active: claim again instead of sleeping.
                if not wakeup.end_cycle(key, notices):
                    self._linger_after(cycle_started, announced=True)
                    continue
                self._idle_wait()
        finally:
            wakeup.leave(key)
            self._write_held()  # also when a failure ends the loop
        self._in_flight = in_flight
        if in_flight is not None:
            self.finish_batch(in_flight)

    def _sleeps_between_batches(self) -> bool:
        """May this worker sleep after a batch that was not full, trusting a
        notification to announce the next rows? Only while inserts notify (the idle
        flag is set) and a listen connection of this process is up."""
        return self.cfg.listen_notify and self.wakeup.relays_marked_idle and self.wakeup.listening

    def _may_have_left_rows(self, batch: ClaimedBatch) -> bool:
        """Could rows have been due that this claim, not full, did not take? Then the
        worker claims again rather than wait for a notification that will not come:
        - ordered rows: finalizing a head makes the next row of its aggregate claimable;
        - a claim cut by its byte budget or by the rows it sized (``_candidates``);
        - a claim some of whose picked rows another claim took first (a claim without
          the row lock: the rows after them were not looked at);
        - fast claims in use (vacuum held back): the claim cursor may owe a claim from
          below where this one started (a catch-up, a full claim)."""
        rows = batch.rows
        ordering = self.cfg.ordering
        if ordering.enabled and any(ordering.is_ordered(r.event_type) for r in rows):
            return True
        if self._was_cut(rows) or self._last_claim_lost_rows:
            return True
        return self._fast_claims_in_use()

    def _was_cut(self, rows: Sequence[Claimed]) -> bool:
        """Did the claim stop before what was due: at the rows it sized
        (``_candidates``) or at the byte budget? Such a claim counts as full."""
        if not rows:
            return False
        if len(rows) >= self._last_candidates:
            return True
        biggest = max(r.size_bytes for r in rows)
        return sum(r.size_bytes for r in rows) + biggest > self.cfg.max_batch_bytes

    def _fast_claims_in_use(self) -> bool:
        """Vacuum is held back: the plain claims, or the ordered ones, have turned to
        fast claims (their full claims are slow)."""
        return self.store.due_cursor.fast_claims_in_use() or (
            self.cfg.ordering.enabled and self.store.ordered_cursor.fast_claims_in_use()
        )

    def _idle_wait(self) -> None:
        if self.cfg.listen_notify:
            while True:
                held = self._held
                woken = self.wakeup.idle_wait(
                    self.index,
                    poll_seconds=self.cfg.poll_interval_seconds,
                    listening_poll_seconds=self.cfg.idle_poll_interval_seconds,
                    until=held.until if held is not None else None,
                )
                if held is None or woken or time.monotonic() < held.until or self.stop_event.is_set():
                    break
                # No claim came within the hold: the finalize goes on its own, and the
                # worker sleeps on (a notification meanwhile left it a token).
                self._write_held()
            linger = self.wakeup.linger_seconds(self.cfg.claim_linger_ms / 1000) if woken else 0.0
            if linger > 0:
                self.stop_event.wait(linger)
        else:
            self.wakeup.leave(self.index)
            self.wakeup.wait(self.cfg.poll_interval_seconds * random.uniform(0.5, 1.0))

    def _linger_after(self, cycle_started: float, *, announced: bool) -> None:
        """The worker claims again after a claim that was not full: no sooner than
        ``claim_linger_ms`` after that claim began, so at a few hundred events per
        second each claim takes the rows of several inserts (a claim and a finalize per
        lone row is what makes such rates expensive). ``announced``: the next claim is
        for rows notifications announced, and lingers only while they come fast
        (``Wakeup.linger_seconds``); otherwise (the relays are busy, or nobody listens)
        it always lingers: a claim that was not full took everything that was due."""
        max_seconds = self.cfg.claim_linger_ms / 1000
        linger = self.wakeup.linger_seconds(max_seconds) if announced else max_seconds
        remaining = cycle_started + linger - time.monotonic()
        if remaining > 0:
            self.stop_event.wait(remaining)

    def _mark_busy(self) -> None:
        """The relay keeps finding rows: inserts may stop notifying. Not while vacuum is
        held back: each flip of the flag leaves a dead version of the state row that
        nothing can remove, and every insert's trigger reads them all (tens of
        thousands after a few minutes of a steady writer); writers notify meanwhile."""
        if not self.cfg.listen_notify or not self.wakeup.relays_marked_idle:
            return
        if self._fast_claims_in_use():
            return
        try:
            self.wakeup.mark_relays_busy(self.store)
        except DatabaseError as exc:
            self._log_db_error(exc)

    def _reserve_bytes(self, in_flight: ClaimedBatch | None) -> tuple[int | None, ClaimedBatch | None]:
        """Reserve room for the next claim in the process's byte budget. If it is
        full, finish our own pipelined batch first (never wait on ourselves), then wait.
        Returns (bytes reserved or None if stopped while waiting, the batch in flight)."""
        if self.budget is None:
            return 0, in_flight
        wanted = self.cfg.max_batch_bytes
        if self.budget.try_reserve(wanted):
            return wanted, in_flight
        if in_flight is not None:
            self.finish_batch(in_flight)
            in_flight = None
            if self.budget.try_reserve(wanted):
                return wanted, None
        self._write_held()  # a held finalize does not wait for the budget (no lease keeper tracks it)
        self.metrics.in_flight_budget_waits_total.inc()
        if not self.budget.reserve(wanted, self.stop_event):
            return None, None
        return wanted, None

    def _return_bytes(self, reserved: int, kept: int) -> None:
        if self.budget is not None:
            self.budget.resize(reserved, kept)

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
        self.stop_event.wait(full_jitter_backoff(self._db_failures, base=0.1, cap=5.0) + 0.05)

    def stop(self) -> None:
        self.stop_event.set()
        self.wakeup.wake_all()

    # --- one batch: the steps every loop drives (this one and the many-source one) ----
    def claim_batch(self, reserved_bytes: int = 0) -> ClaimedBatch | None:
        """Claim the next batch. ``reserved_bytes`` (taken from the byte budget before
        the claim) shrink to what the rows hold, which the batch keeps until its
        finalize; None when nothing was due (everything reserved is given back). A
        failed claim (``DatabaseError``) gives the reserved bytes back and raises."""
        trace = self.tracing.batch(self.owner)
        try:
            rows = self._claim(trace)
        except BaseException:
            self._return_bytes(reserved_bytes, 0)
            raise
        held = sum(r.size_bytes for r in rows)
        self._return_bytes(reserved_bytes, held)
        if not rows:
            return None
        return ClaimedBatch(rows, trace, [None] * len(rows), held_bytes=held if self.budget is not None else 0)

    def start_batch(self, batch: ClaimedBatch, submitter: Submitter | None = None) -> None:
        """Build the batch's messages and submit them (a pipelining publisher starts
        producing now); with ``submitter``, on its thread (``finish_batch`` collects it).
        If building fails here, the batch's bytes go back to the budget."""
        if submitter is not None:
            batch.future = submitter.submit(partial(self._build_and_submit, batch))
            return
        try:
            self._build_and_submit(batch)
        except BaseException:
            self._release_bytes(batch)
            raise

    def finish_batch(self, batch: ClaimedBatch) -> BatchResult:
        """Wait for the publish outcomes, then finalize with fencing. The batch's bytes
        go back to the byte budget whatever happens."""
        try:
            future = batch.future
            if future is not None:
                batch.future = None
                future.result()  # re-raises what building or submitting raised
            return self._wait_and_finalize(batch)
        finally:
            self._release_bytes(batch)

    def claim(self) -> list[Claimed]:
        return self._claim(self.tracing.batch(self.owner))

    def _claim(self, trace: BatchTrace) -> list[Claimed]:
        cfg = self.cfg
        candidates = self._last_candidates = self._candidates()
        held, self._held = self._held, None
        if held is not None and cfg.ordering.enabled:  # never held then; written on its own
            self._write_held(held)
            held = None
        if held is not None:
            held.trace.finalizing()
        try:
            result = self._claim_with(held, candidates)
        except BaseException:
            if held is not None:
                # The claim's transaction rolled back, or its commit outcome is unknown,
                # or it committed and a catch-up claim after it failed: the finalize goes
                # on its own, fenced, and rows it finds already finalized with this
                # worker's lease_version count as this worker's (as after a lost reply).
                self._write_held(held, after_unknown=True, traced=True)
            raise
        if held is not None:
            if result.finalized is None:  # the claim went without it (a sweep step)
                self._write_held(held, traced=True)
            else:
                result_of_held = Finalizer.accepted_result(held.rows, held.decisions, result.finalized)
                self._finalized(result_of_held, held.decisions, held.elapsed_seconds, held.trace)
        return self._claimed(result, trace)

    def _claim_with(self, held: HeldFinalize | None, candidates: int) -> ClaimResult:
        cfg = self.cfg
        return self.store.claim(
            owner=self.owner,
            batch=cfg.batch_size,
            lease_seconds=cfg.lease_seconds,
            max_attempts=cfg.max_attempts,
            ordered_types=cfg.ordered_types,
            run_length=cfg.run_length,
            ordered_after=self._ordered_after,
            max_batch_bytes=cfg.max_batch_bytes,
            candidates=candidates,
            max_message_bytes=cfg.max_message_bytes,
            generic_plan=not self._busy or self._last_claim_small,
            # Without the row lock only while this worker claims alone and its last
            # claim was small and took all it picked (delivery.py LOCKLESS_CLAIM_SETTINGS).
            lock_rows=not (self.claims_alone and self._last_claim_small),
            finalize_first=Finalizer.items(held.rows, held.decisions) if held is not None else (),
            finalize_strict=cfg.strict_lease,
        )

    def _claimed(self, result: ClaimResult, trace: BatchTrace) -> list[Claimed]:
        self._ordered_after = result.ordered_after
        self._last_claim_lost_rows = result.taken_by_others > 0
        # Small: a few rows and everything that was due (not cut by the rows sized or
        # the byte budget, which a backlog of large rows always is).
        self._last_claim_small = (
            len(result.rows) <= GENERIC_CLAIM_MAX_ROWS
            and not self._was_cut(result.rows)
            and not self._last_claim_lost_rows
        )
        if result.rows:
            self._avg_row_bytes = sum(r.size_bytes for r in result.rows) / len(result.rows)
        for row_id, version, owner in result.reaped:
            self.log.warning(
                "reaped: attempts used up without an outcome; row is dead",
                outbox_id=row_id,
                lease_version=version,
                lease_owner=owner,
            )
        self.metrics.record_claim(result)
        trace.claimed(result)
        return result.rows

    def _candidates(self) -> int:
        """How many rows the claim should size: sizing detoasts a payload, so with
        large rows look at about twice as many as the byte budget can take."""
        if self._avg_row_bytes <= 0:
            return self.cfg.batch_size
        return max(1, min(self.cfg.batch_size, int(2 * self.cfg.max_batch_bytes / self._avg_row_bytes) + 1))

    def run_once(self) -> BatchResult:
        batch = self.claim_batch()
        if batch is None:
            return BatchResult()
        self.start_batch(batch)
        return self.finish_batch(batch)

    def process(self, rows: Sequence[Claimed]) -> BatchResult:
        """Publish and finalize one claimed batch (blocking)."""
        batch = ClaimedBatch(rows, self.tracing.batch(self.owner), [None] * len(rows))
        self.start_batch(batch)
        return self.finish_batch(batch)

    def _build_and_submit(self, batch: ClaimedBatch) -> ClaimedBatch:
        """Build the messages and submit them (a pipelining publisher starts producing now)."""
        cfg = self.cfg
        wire = cfg.wire_format
        rows = batch.rows
        batch.started = time.monotonic()
        runs = RunGuard()  # a row that cannot be built stops its ordered run here already
        for i, row in enumerate(rows):
            key = cfg.ordering.order_key(row.event_type, row.aggregate_id)
            if runs.stopped(key):
                batch.outcomes[i] = NotDelivered(RELEASED_AFTER_FAILURE)
                continue
            if row.payload is None:  # claimed without its payload: above the target's limit
                batch.outcomes[i] = PermanentError(
                    f"message too large (MSG_SIZE_TOO_LARGE): payload and headers are {row.size_bytes} bytes, "
                    f"above the publisher's limit of {cfg.max_message_bytes} bytes (Kafka: kafka.message_max_bytes)"
                )
                runs.record(key, failed=True)
                continue
            try:
                message = build_message(row, wire or cfg.topic_template, cfg.ordering)
            except PermanentError as exc:
                batch.outcomes[i] = exc
                runs.record(key, failed=True)
                continue
            batch.messages.append(message)
            batch.positions.append(i)
        if batch.messages:
            # The lease keeper extends its leases for at most the publish timeout plus one lease.
            if self.keeper is not None:
                batch.lease = self.keeper.track(
                    rows, self.owner, max_seconds=cfg.publish_timeout_seconds + cfg.lease_seconds
                )
            try:
                batch.trace.publishing(batch.messages)
                batch.pending = self.publisher.submit(batch.messages, timeout_seconds=cfg.publish_timeout_seconds)
            except BaseException:
                # Nothing will wait for this batch: its leases must run out, not be extended.
                if batch.lease is not None and self.keeper is not None:
                    self.keeper.untrack(batch.lease)
                raise
        return batch

    def _release_bytes(self, batch: ClaimedBatch) -> None:
        if self.budget is not None and batch.held_bytes:
            self.budget.release(batch.held_bytes)
            batch.held_bytes = 0

    def finish_batch_or_hold(self, batch: ClaimedBatch) -> None:
        """``finish_batch`` for a worker about to sleep after a small batch: when every
        row was delivered, the finalize waits up to ``relay.finalize_hold_ms`` for the
        worker's next claim and rides in its transaction (one transaction per event
        where there were two); ``_idle_wait`` writes it on its own when no claim comes."""
        hold = min(self.cfg.finalize_hold_ms / 1000, self.cfg.lease_seconds / 10)
        if hold <= 0 or self.cfg.ordering.enabled or len(batch.rows) > GENERIC_FINALIZE_MAX_ROWS:
            self.finish_batch(batch)
            return
        try:
            future = batch.future
            if future is not None:
                batch.future = None
                future.result()
            self._wait_and_finalize(batch, hold_seconds=hold)
        finally:
            self._release_bytes(batch)

    def _write_held(
        self, held: HeldFinalize | None = None, *, after_unknown: bool = False, traced: bool = False
    ) -> None:
        """Write a held finalize on its own (``held``, or the worker's, which it clears).
        ``traced``: its trace already says it is finalizing."""
        if held is None:
            held, self._held = self._held, None
            if held is None:
                return
        if not traced:
            held.trace.finalizing()
        result = self.finalizer.write(held.rows, held.decisions, owner=self.owner, after_unknown=after_unknown)
        self._finalized(result, held.decisions, held.elapsed_seconds, held.trace)

    def _wait_and_finalize(self, batch: ClaimedBatch, *, hold_seconds: float = 0.0) -> BatchResult:
        if batch.pending is not None:
            cancel = batch.lease.cancel if batch.lease is not None else None
            try:
                published = batch.pending.wait(cancel=cancel)
            finally:
                if batch.lease is not None and self.keeper is not None:
                    self.keeper.untrack(batch.lease)
            if len(published) != len(batch.messages):
                raise RuntimeError(f"publisher returned {len(published)} outcomes for {len(batch.messages)} messages")
            batch.trace.published(published)
            for position, outcome in zip(batch.positions, published, strict=True):
                batch.outcomes[position] = outcome
        # Judged on what the target said, before stopped runs turn delivered rows into
        # releases (those would otherwise look like a batch with no delivery at all).
        outage = self.breaker is not None and is_outage(batch.outcomes)
        if self.cfg.ordering.enabled:
            ordering = self.cfg.ordering
            release_after_failures(
                [ordering.order_key(r.event_type, r.aggregate_id) for r in batch.rows], batch.outcomes
            )
        elapsed = time.monotonic() - batch.started
        if hold_seconds > 0 and not outage and all(o is None for o in batch.outcomes):
            decisions = [DONE] * len(batch.rows)
            if self.breaker is not None:
                self.breaker.record_delivery()
            self._held = HeldFinalize(batch.rows, decisions, batch.trace, elapsed, time.monotonic() + hold_seconds)
            return BatchResult(rows=batch.rows, decisions=decisions)
        return self._finalize(batch.rows, batch.outcomes, elapsed_seconds=elapsed, trace=batch.trace, outage=outage)

    # --- decide, write, record -----------------------------------------------------------
    def finalize(self, rows: Sequence[Claimed], outcomes: Sequence[Outcome]) -> BatchResult:
        """Decide every row's next state from its outcome and write them with fencing."""
        return self._finalize(rows, outcomes, elapsed_seconds=None)

    def _finalize(
        self,
        rows: Sequence[Claimed],
        outcomes: Sequence[Outcome],
        *,
        elapsed_seconds: float | None,
        trace: BatchTrace = NO_TRACE,
        outage: bool | None = None,
    ) -> BatchResult:
        # A batch that failed only on transport means the target is unreachable as a
        # whole: release it (attempts refunded) and open the breaker.
        if outage is None:
            outage = self.breaker is not None and is_outage(outcomes)
        policy = self.cfg.retry_policy
        # A delivered row is DONE whatever else is true (decide's first rule), spelled
        # out here because it is nearly every row of nearly every batch.
        decisions = [
            DONE if outcome is None else decide(row.attempts, outcome, outage=outage, policy=policy)
            for row, outcome in zip(rows, outcomes, strict=True)
        ]
        if self.breaker is not None:
            if outage:
                failures = sum(1 for o in outcomes if o is not None and not isinstance(o, NotDelivered))
                why = self.publisher.trouble()  # what the target's client knows of the outage
                self.breaker.trip(
                    f"{failures} transport failures and no delivery in one batch" + (f": {why}" if why else "")
                )
            elif any(o is None for o in outcomes):
                self.breaker.record_delivery()
        trace.finalizing()
        result = self.finalizer.write(rows, decisions, owner=self.owner)
        return self._finalized(result, decisions, elapsed_seconds, trace)

    def _finalized(
        self, result: BatchResult, decisions: Sequence[Decision], elapsed_seconds: float | None, trace: BatchTrace
    ) -> BatchResult:
        """What follows a written finalize: due times, the trace, metrics and logs."""
        delays = [d.delay_seconds for d in decisions if d.status == "pending"]
        if delays:
            self.wakeup.rescheduled(delays)  # the idle poll comes when each is due
        result.elapsed_seconds = elapsed_seconds
        trace.finalized(result)
        self._record(result)
        return result

    def _record(self, result: BatchResult) -> None:
        """Counting and logging of a finalized batch, in one place."""
        self.metrics.record_batch(result)
        log_batch(self.log, result, owner=self.owner)
