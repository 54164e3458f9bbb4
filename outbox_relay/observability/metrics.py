"""Prometheus metrics, the gauge refresher, and the /metrics /healthz /readyz server.

Counters are counted in process. Gauges describing the table are read from the
database every ``metrics.refresh_interval_seconds`` with the cheap, index-backed
queries of ``db/sql/monitoring.sql`` under a statement timeout (a queue depth above
``metrics.exact_count_limit`` comes from an exact count made at most every
``metrics.exact_count_interval_seconds``, see _SlowExactCount); if a refresh fails the
gauges are reset rather than left frozen at a stale value, and
``outbox_relay_stats_refresh_errors_total`` counts the failure.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.decision import Kind
from ..core.service import PeriodicService
from ..db.partitions import MaintenanceResult
from ..db.statement_counts import STATEMENT_KINDS, StatementCounts
from ..db.store import INDEXED_STATUSES, STATUSES, ClaimResult, OutboxStore, PauseGauges, Stats
from ..db.vacuum_health import HorizonClock, HorizonWarning, VacuumFigures, XminHorizon
from ..model import PublisherObserver

if TYPE_CHECKING:
    from ..config import Settings
    from ..core.batch_result import BatchResult

log = structlog.get_logger("outbox_relay.metrics")

OUTCOMES = ("done", "retry", "defer", "dead")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every value, with one update per bucket touched
    instead of a locked update (and a walk of the buckets) per value: the latency of
    every acknowledged message is observed, ~1 us each on the path that collects
    delivery reports. Same exposition as observing one by one (tests/unit/observability/test_metrics.py);
    falls back to that if prometheus_client's internals ever differ."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if not values:
        return
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        if value != value:  # NaN: in no bucket, as observe() does
            histogram.observe(value)
            continue
        # the first bound >= value: observe()'s "value <= bound" (+Inf is the last bound)
        counts[bisect.bisect_left(bounds, value)] += 1
    total.inc(sum(v for v in values if v == v))
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)


class RelayMetrics(PublisherObserver):
    """Every metric of one relay process, on its own registry.

    The relay loop does not touch individual metrics: it hands what happened to
    ``record_claim`` and ``record_batch``, and the publisher reports through the
    ``PublisherObserver`` hooks, so a new metric is a change to this module only.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.oldest_pending_age_seconds = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest pending or processing row (0 when none).",
            registry=r,
        )
        self.expired_leases = Gauge(
            "outbox_relay_expired_leases", "Processing rows whose lease has expired.", registry=r
        )
        self.queue_depth = Gauge("outbox_relay_queue_depth", "Rows per status.", ["status"], registry=r)
        self.attempts = Gauge(
            "outbox_relay_attempts", "Pending or processing rows by attempts used.", ["attempts"], registry=r
        )
        self.blocked_aggregates = Gauge(
            "outbox_relay_blocked_aggregates", "Ordered aggregates blocked behind a dead head.", registry=r
        )
        # Operator pauses (operator/pauses.py), stored in the outbox's pauses table; the
        # circuit breaker's automatic pause is outbox_relay_circuit_breaker_open.
        self.operator_pauses = Gauge(
            "outbox_relay_operator_pauses",
            "Active operator pauses of the outbox (`outbox-relay pause`; not the circuit breaker).",
            registry=r,
        )
        self.paused_rows = Gauge(
            "outbox_relay_paused_rows",
            "Pending rows parked by an operator pause, counted up to metrics.exact_count_limit.",
            registry=r,
        )
        self.lost_leases_total = Counter(
            "outbox_relay_lost_leases", "Finalizes rejected because the lease was taken over.", registry=r
        )
        self.published_total = Counter("outbox_relay_published", "Rows finalized by outcome.", ["outcome"], registry=r)
        self.reaped_total = Counter(
            "outbox_relay_reaped", "Rows sent to dead by the reaper (attempts used up without outcome).", registry=r
        )
        self.released_total = Counter(
            "outbox_relay_released", "Rows handed back to pending unpublished, attempt refunded.", registry=r
        )
        self.producer_replacements_total = Counter(
            "outbox_relay_producer_replacements", "Kafka producers replaced after a fatal state.", registry=r
        )
        self.isolated_total = Counter(
            "outbox_relay_isolated", "Rows re-produced alone because the broker refused their record batch.", registry=r
        )
        self.topic_authorization_failures_total = Counter(
            "outbox_relay_topic_authorization_failures",
            "Messages the broker refused because this principal may not write to the topic "
            "(TOPIC_AUTHORIZATION_FAILED); their rows wait, attempts refunded.",
            ["topic"],
            registry=r,
        )
        self.missing_topic_deferrals_total = Counter(
            "outbox_relay_missing_topic_deferrals",
            "Batches whose messages for the topic timed out because the cluster has no such topic and does "
            "not create it; "
            "their rows wait, attempts refunded.",
            ["topic"],
            registry=r,
        )
        self.producer_errors_total = Counter(
            "outbox_relay_producer_errors",
            "Errors the broker client reported, by librdkafka error name (NOT_ENOUGH_REPLICAS, _MSG_TIMED_OUT, "
            "_TRANSPORT, _ALL_BROKERS_DOWN, ...) and reported_by: delivery (one per failed message, from its delivery "
            "report) or client (the client's error callback: a broker connection failed, all brokers down).",
            ["reported_by", "code"],
            registry=r,
        )
        self.unwritable_partitions_gauge = Gauge(
            "outbox_relay_unwritable_partitions",
            "Partitions whose last messages failed and that took none since, by cause: no_leader, "
            "leader_unreachable, not_enough_replicas (fewer in-sync replicas than the topic's "
            "min.insync.replicas, or a NOT_ENOUGH_REPLICAS refusal), not_acknowledged (the leader answers but "
            "acknowledged nothing before the delivery timeout), refused (another error code). Kafka only; "
            "refreshed with librdkafka's statistics.",
            ["cause"],
            registry=r,
        )
        self.stats_refresh_errors_total = Counter(
            "outbox_relay_stats_refresh_errors", "Failed gauge refreshes.", registry=r
        )
        self.claim_batch_size = Histogram(
            "outbox_relay_claim_batch_size",
            "Rows per non-empty claim.",
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
            registry=r,
        )
        self.publish_latency_seconds = Histogram(
            "outbox_relay_publish_latency_seconds",
            "Claim to finalize of one batch.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end_latency_seconds = Histogram(
            "outbox_relay_end_to_end_latency_seconds",
            "Row created_at to broker acknowledgement.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.circuit_breaker_open = Gauge(
            "outbox_relay_circuit_breaker_open", "1 while the broker circuit breaker is open.", registry=r
        )
        self.in_flight_bytes = Gauge(
            "outbox_relay_in_flight_bytes",
            "Payload + headers bytes claimed and not yet finalized (bounded by relay.max_in_flight_bytes).",
            registry=r,
        )
        self.rate_limit_wait_seconds_total = Counter(
            "outbox_relay_rate_limit_wait_seconds",
            "Seconds messages were held for a [[limits]] token before being sent, summed over messages, by "
            "destination (topic:<name> or host:<name>); rows that could not get one within their batch are "
            'deferred (published_total{outcome="defer"}), attempt refunded.',
            ["destination"],
            registry=r,
        )
        self.in_flight_budget_waits_total = Counter(
            "outbox_relay_in_flight_budget_waits",
            "Claims that waited because the in-flight byte budget was full.",
            registry=r,
        )
        self.worker_threads_alive = Gauge("outbox_relay_worker_threads_alive", "Worker threads running.", registry=r)
        # MVCC pressure (vacuum_health.py): what holds vacuum back, and how vacuum keeps up.
        self.xmin_horizon_age_seconds = Gauge(
            "outbox_relay_xmin_horizon_age_seconds",
            "Age of the oldest xmin horizon holding back vacuum of the outbox (backend, prepared transaction or "
            "replication slot; 0 when none, NaN when the holder cannot be seen: grant pg_read_all_stats).",
            registry=r,
        )
        self.dead_tuples = Gauge(
            "outbox_relay_dead_tuples", "Dead row versions in the outbox (pg_stat_user_tables.n_dead_tup).", registry=r
        )
        self.table_size_bytes = Gauge(
            "outbox_relay_table_size_bytes", "Size of the outbox: heap, or all its indexes.", ["part"], registry=r
        )
        self.last_vacuum_age_seconds = Gauge(
            "outbox_relay_last_vacuum_age_seconds",
            "Seconds since the outbox was last vacuumed (autovacuum or manual; NaN if never).",
            registry=r,
        )
        self.statements_total = Counter(
            "outbox_relay_statements",
            "Statements the relay sent to its database, by kind (claim: took or reaped rows; claim_empty: found "
            "nothing; finalize: in a transaction of its own; finalize_in_claim: in the next claim's transaction; "
            "extend_lease; mark_idle, mark_busy: the wake-up flag; gauge_bounds: where the claims start, published "
            "while vacuum is held back); per source in a process serving several.",
            ["statement"],
            registry=r,
        )
        self._statements = {kind: self.statements_total.labels(statement=kind) for kind in STATEMENT_KINDS}
        # A partitioned outbox ([partitioning]): what the last maintenance round found and did.
        self.partitions = Gauge(
            "outbox_relay_table_partitions",
            "Partitions of a partitioned outbox (the default partition included), after the last maintenance.",
            registry=r,
        )
        self.partition_default_rows = Gauge(
            "outbox_relay_table_partition_default_rows",
            "Rows in the default partition of a partitioned outbox (no partition covers their created_at; "
            "normally 0), at the last maintenance.",
            registry=r,
        )
        self.partitions_kept_past_retention = Gauge(
            "outbox_relay_table_partitions_kept_past_retention",
            "Partitions older than partitioning.retention kept because they hold pending, processing or dead rows.",
            registry=r,
        )
        self.partition_maintenance_ok = Gauge(
            "outbox_relay_table_partition_maintenance_ok",
            "1 when the last maintenance round ran every partition change it meant to, 0 when one failed.",
            registry=r,
        )
        self.partition_maintenance_timestamp_seconds = Gauge(
            "outbox_relay_table_partition_maintenance_timestamp_seconds",
            "Unix time of the last maintenance round that ran (skipped rounds excluded).",
            registry=r,
        )
        self.partition_maintenance_total = Counter(
            "outbox_relay_table_partition_maintenance",
            "Maintenance rounds by result: ok, failed (a partition change did not run), skipped (another "
            "maintainer held the table), error (the round raised).",
            ["result"],
            registry=r,
        )
        # NaN until a maintenance round ran in this process: a relay of a plain table (or
        # one leaving maintenance to a CronJob) reports no partition figures at all.
        for gauge in (
            self.partitions,
            self.partition_default_rows,
            self.partitions_kept_past_retention,
            self.partition_maintenance_ok,
            self.partition_maintenance_timestamp_seconds,
        ):
            gauge.set(math.nan)
        for status in STATUSES:
            self.queue_depth.labels(status=status).set(0)
        for outcome in OUTCOMES:
            self.published_total.labels(outcome=outcome)
        self._published = {o: self.published_total.labels(outcome=o) for o in OUTCOMES}

    def published(self, outcome: str, count: int = 1) -> None:
        if count:
            self._published[outcome].inc(count)

    def count_statements_of(self, counts: StatementCounts) -> None:
        """Count the store's statements (see db/statement_counts.py) from now on, with
        those it has already sent; idempotent."""
        so_far = counts.observe(self.statement_sent)
        for kind, n in (so_far or {}).items():
            if n:
                self._statements[kind].inc(n)

    def statement_sent(self, kind: str) -> None:
        self._statements[kind].inc()

    def record_partition_maintenance(self, result: MaintenanceResult | None) -> None:
        """One maintenance round's result (None: the round raised)."""
        if result is None:
            self.partition_maintenance_total.labels(result="error").inc()
            self.partition_maintenance_ok.set(0)
            return
        if result.skipped:
            self.partition_maintenance_total.labels(result="skipped").inc()
            return
        self.partition_maintenance_total.labels(result="ok" if result.ok else "failed").inc()
        self.partition_maintenance_ok.set(1 if result.ok else 0)
        self.partitions.set(result.partitions)
        self.partition_default_rows.set(result.default_rows)
        self.partitions_kept_past_retention.set(len(result.kept))
        self.partition_maintenance_timestamp_seconds.set(time.time())

    # --- lifecycle hooks ----------------------------------------------------------------
    def record_claim(self, result: ClaimResult) -> None:
        if result.rows:
            self.claim_batch_size.observe(len(result.rows))
        if result.reaped:
            self.reaped_total.inc(len(result.reaped))
            self.published("dead", len(result.reaped))

    def record_batch(self, result: BatchResult) -> None:
        for kind in (Kind.DONE, Kind.RETRY, Kind.DEFER, Kind.DEAD):
            self.published(kind.value, result.count(kind))
        released = result.count(Kind.RELEASE)
        if released:
            self.released_total.inc(released)
        if result.lost:
            self.lost_leases_total.inc(len(result.lost))
        if result.elapsed_seconds is not None:
            self.publish_latency_seconds.observe(result.elapsed_seconds)

    # --- PublisherObserver ----------------------------------------------------------------
    def message_acknowledged(self, seconds_since_created: float) -> None:
        self.end_to_end_latency_seconds.observe(seconds_since_created)

    def messages_acknowledged(self, seconds_since_created: Sequence[float]) -> None:
        observe_many(self.end_to_end_latency_seconds, seconds_since_created)

    def client_replaced(self, reason: str) -> None:
        self.producer_replacements_total.inc()

    def messages_isolated(self, count: int) -> None:
        self.isolated_total.inc(count)

    def topic_authorization_failed(self, topic: str) -> None:
        self.topic_authorization_failures_total.labels(topic=topic).inc()

    def rate_limit_waited(self, destination: str, seconds: float) -> None:
        self.rate_limit_wait_seconds_total.labels(destination=destination).inc(max(0.0, seconds))

    def topic_missing(self, topic: str) -> None:
        self.missing_topic_deferrals_total.labels(topic=topic).inc()

    def producer_errors(self, reported_by: str, code: str, count: int = 1) -> None:
        self.producer_errors_total.labels(reported_by=reported_by, code=code).inc(count)

    def unwritable_partitions(self, by_cause: Mapping[str, int]) -> None:
        for cause, count in by_cause.items():
            self.unwritable_partitions_gauge.labels(cause=cause).set(count)

    def render(self, names: Collection[str] | None = None) -> bytes:
        """The exposition text; with ``names`` only the samples of those names (the
        ``name[]`` parameters of a scrape, as prometheus_client's own handler takes them)."""
        return generate_latest(self.registry if names is None else self.registry.restricted_registry(names))


class _SlowExactCount:
    """Exact counts of the statuses above ``metrics.exact_count_limit``, so an operator never acts on an estimate.

    The per-refresh count stops at the cap; above it the planner's estimate is stale
    exactly when an operator looks (right after a bulk failure). So a status above the
    cap is counted exactly — at most once per ``interval_seconds``, within its own
    time budget, in a thread of its own so the fast gauges never wait for it — and the
    gauge shows that count until the next one.
    """

    def __init__(self, store: OutboxStore, *, interval_seconds: float, budget_ms: int, first_upto: int) -> None:
        self._store = store
        self._interval = interval_seconds
        self._budget_ms = budget_ms
        self._first_upto = first_upto
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}
        self._started_at = float("-inf")
        self._thread: threading.Thread | None = None
        self._closed = False

    def close(self) -> None:
        """No more counts; one still running ends within its budget (a daemon thread)."""
        with self._lock:
            self._closed = True

    def reopen(self) -> None:
        with self._lock:
            self._closed = False

    def request(self, statuses: list[str]) -> None:
        """Start a count of ``statuses`` unless one is running or the last began < interval ago."""
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            if self._closed or running or time.monotonic() - self._started_at < self._interval:
                return
            self._started_at = time.monotonic()
            self._thread = threading.Thread(
                target=self._count, args=(list(statuses),), name="metrics-exact-count", daemon=True
            )
            self._thread.start()

    def _count(self, statuses: list[str]) -> None:
        try:
            counts = self._store.exact_depth(budget_ms=self._budget_ms, statuses=statuses, first_upto=self._first_upto)
        except Exception as exc:  # a failed count keeps the previous one; the next request retries
            if not self._closed:  # after close() the store is going away: an expected failure
                log.warning("exact queue depth count failed", error=str(exc))
            return
        with self._lock:
            self._latest.update({status: count.n for status, count in counts.items()})

    def latest(self, status: str) -> int | None:
        with self._lock:
            return self._latest.get(status)

    def forget(self, status: str) -> None:
        """The status is below the cap again (counted exactly every refresh)."""
        with self._lock:
            self._latest.pop(status, None)


class StatsRefresher(PeriodicService):
    """Background thread: reads the table's gauges every interval. start/stop are idempotent."""

    thread_name = "metrics-refresh"

    def __init__(
        self,
        store: OutboxStore,
        metrics: RelayMetrics,
        *,
        interval_seconds: float,
        timeout_ms: int,
        ordered_types: list[str],
        count_cap: int = 100_000,
        exact_count_interval_seconds: float = 60.0,
        exact_count_timeout_ms: int = 10_000,
        xmin_horizon_warn_seconds: float = 300.0,
        idle_interval_seconds: float = 0.0,
    ) -> None:
        super().__init__(interval_seconds, run_first=True)
        self._store = store
        self._idle_interval = max(interval_seconds, idle_interval_seconds)
        self._was_idle = False  # the last read found nothing pending or processing
        self._last_activity: tuple[int, int] | None = None
        self._last_refresh_at = float("-inf")
        metrics.count_statements_of(store.statement_counts)
        self._horizon_clock = HorizonClock()
        self._horizon_warning = HorizonWarning(xmin_horizon_warn_seconds, log)
        self._metrics = metrics
        self._timeout_ms = timeout_ms
        self._ordered = ordered_types
        self._count_cap = count_cap
        self._pauses_seen: set[int] | None = None  # the active pauses at the last refresh
        self._exact = _SlowExactCount(
            store, interval_seconds=exact_count_interval_seconds, budget_ms=exact_count_timeout_ms, first_upto=count_cap
        )

    @classmethod
    def from_settings(cls, store: OutboxStore, metrics: RelayMetrics, settings: Settings) -> StatsRefresher:
        """The refresher of one source's table, as ``metrics.*`` and its
        ``relay.ordered_event_types`` configure it."""
        m = settings.metrics
        return cls(
            store,
            metrics,
            interval_seconds=m.refresh_interval_seconds,
            timeout_ms=m.query_timeout_ms,
            ordered_types=list(settings.relay.ordered_event_types),
            count_cap=m.exact_count_limit,
            exact_count_interval_seconds=m.exact_count_interval_seconds,
            exact_count_timeout_ms=m.exact_count_timeout_ms,
            xmin_horizon_warn_seconds=m.xmin_horizon_warn_seconds,
            idle_interval_seconds=m.idle_refresh_interval_seconds,
        )

    def refresh_once(self) -> bool:
        """Read every gauge of the table in one transaction (``monitoring_reads``); a
        part that fails leaves its gauges unknown (NaN) and the others fresh."""
        try:
            horizon, figures, stats, pauses = self._store.monitoring_reads(
                ordered_types=self._ordered, timeout_ms=self._timeout_ms, count_cap=self._count_cap
            )
        except Exception as exc:  # the database is away: every gauge unknown
            horizon = figures = stats = pauses = exc
        vacuum_ok = self._apply_vacuum(horizon, figures)
        pauses_ok = self._apply_pauses(pauses)
        return self._apply_table(stats) and vacuum_ok and pauses_ok

    def _apply_vacuum(self, horizon: XminHorizon | Exception, figures: VacuumFigures | Exception) -> bool:
        """The xmin horizon and vacuum gauges: statistics views only, a failure of their
        own (it leaves the queue gauges alone)."""
        m = self._metrics
        if isinstance(horizon, Exception) or isinstance(figures, Exception):  # not stale values: unknown
            m.stats_refresh_errors_total.inc()
            for gauge in (m.xmin_horizon_age_seconds, m.dead_tuples, m.last_vacuum_age_seconds):
                gauge.set(float("nan"))
            for part in ("heap", "indexes"):
                m.table_size_bytes.labels(part=part).set(float("nan"))
            failure = horizon if isinstance(horizon, Exception) else figures
            log.warning("vacuum gauges refresh failed", error=str(failure))
            return False
        self._horizon_clock.apply(horizon.holders)
        m.xmin_horizon_age_seconds.set(horizon.age_seconds)
        self._horizon_warning.observe(horizon, table=self._store.table)
        m.dead_tuples.set(figures.dead_tuples)
        m.table_size_bytes.labels(part="heap").set(figures.heap_bytes)
        m.table_size_bytes.labels(part="indexes").set(figures.index_bytes)
        m.last_vacuum_age_seconds.set(
            float("nan") if figures.since_vacuum_seconds is None else figures.since_vacuum_seconds
        )
        return True

    def _apply_table(self, stats: Stats | Exception) -> bool:
        m = self._metrics
        if isinstance(stats, Exception):  # any failure: do not leave stale values behind
            exc = stats
            self._was_idle = False
            m.stats_refresh_errors_total.inc()
            m.oldest_pending_age_seconds.set(float("nan"))
            m.expired_leases.set(float("nan"))
            for status in STATUSES:
                m.queue_depth.labels(status=status).set(float("nan"))
            m.attempts.clear()
            m.blocked_aggregates.set(float("nan"))
            log.warning("metrics refresh failed", error=str(exc))
            return False
        self._was_idle = stats.queue_depth.get("pending", 0) == 0 and stats.queue_depth.get("processing", 0) == 0
        m.oldest_pending_age_seconds.set(stats.oldest_pending_age_seconds)
        m.expired_leases.set(stats.expired_leases)
        # Done rows have no index: an exact count would read the whole table every
        # interval, so above the cap the done gauge stays the planner's estimate.
        countable = [status for status in stats.estimated_statuses if status in INDEXED_STATUSES]
        if countable:
            self._exact.request(countable)
        for status, n in stats.queue_depth.items():
            if status in countable:
                exact = self._exact.latest(status)  # None until the first slow count is done
                if exact is not None:
                    n = max(self._count_cap, exact)
            else:
                self._exact.forget(status)
            m.queue_depth.labels(status=status).set(n)
        m.attempts.clear()
        for attempts, n in stats.attempts.items():
            m.attempts.labels(attempts=str(attempts)).set(n)
        m.blocked_aggregates.set(len(stats.blocked_aggregates))
        return True

    def _apply_pauses(self, pauses: PauseGauges | Exception) -> bool:
        """The operator pause gauges, and a log line when the set of active pauses
        changes (pause="operator"; the breaker's lines say pause="circuit_breaker"). The
        pauses themselves are read only then (one more statement, once per change)."""
        m = self._metrics
        if isinstance(pauses, Exception):
            m.stats_refresh_errors_total.inc()
            m.operator_pauses.set(float("nan"))
            m.paused_rows.set(float("nan"))
            log.warning("pause gauges refresh failed", error=str(pauses))
            return False
        m.operator_pauses.set(len(pauses.active_ids))
        m.paused_rows.set(pauses.parked_rows)
        seen = set(pauses.active_ids)
        previous, self._pauses_seen = self._pauses_seen, seen
        if previous is None:  # the first refresh: what is paused already, in one line
            if seen:
                log.warning(
                    "operator pauses active: rows they match are not claimed",
                    pause="operator",
                    pause_ids=sorted(seen),
                    table=self._store.table,
                )
            return True
        for pause_id in sorted(previous - seen):
            log.info("operator pause ended", pause="operator", pause_id=pause_id, table=self._store.table)
        started = sorted(seen - previous)
        if not started:
            return True
        try:
            details = {p.id: p for p in self._store.pauses()}
        except Exception as exc:  # the gauges are set; say what is known
            log.warning(
                "operator pause active: rows it matches are not claimed",
                pause="operator",
                pause_ids=started,
                table=self._store.table,
                error=str(exc),
            )
            return True
        for pause_id in started:
            p = details.get(pause_id)
            if p is None:  # ended between the two reads: the next refresh says so
                continue
            log.warning(
                "operator pause active: rows it matches are not claimed",
                pause="operator",
                pause_id=p.id,
                selector=p.selector,
                value=p.value,
                paused_by=p.paused_by,
                reason=p.reason,
                table=self._store.table,
            )
        return True

    def step(self) -> None:
        # While idle (nothing claimed or finalized since the last read, which found
        # nothing pending or processing) the gauges cannot have moved but for new rows,
        # which a claim would show: read them every idle interval only. An idle relay's
        # cost on the database is mostly its transactions.
        activity = self._activity()
        now = time.monotonic()
        if self._was_idle and activity == self._last_activity and now - self._last_refresh_at < self._idle_interval:
            return
        self._last_activity = activity
        self._last_refresh_at = now
        self.refresh_once()

    def _activity(self) -> tuple[int, int]:
        counts = self._store.statement_counts.snapshot()
        return counts["claim"], counts["finalize"]

    def start(self) -> None:
        self._exact.reopen()
        super().start()

    def stop(self) -> None:
        super().stop()
        self._exact.close()


class MetricsServer:
    """HTTP sidecar: /metrics, /healthz (workers alive), /readyz (DB + broker + breaker)."""

    def __init__(
        self,
        metrics: RelayMetrics,
        *,
        host: str,
        port: int,
        healthy: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        self._metrics = metrics
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == "/metrics":
                    # /metrics?name[]=outbox_relay_published_total: only those samples (a
                    # frequent reader of one counter need not pay for every series).
                    names = parse_qs(query).get("name[]")
                    self._send(200, outer._metrics.render(names), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok, why = healthy()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                elif path == "/readyz":
                    ok, why = ready()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=5)
