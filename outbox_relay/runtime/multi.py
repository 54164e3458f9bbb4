"""One relay process for many outboxes: one publisher, one worker pool, one metrics server.

``MultiRelay`` serves the sources of ``[sources.<name>]`` and ``[discovery]``
(``sources.py``). Each source has its own small connection pool, lease keeper and
gauges (``SourceRuntime``), run by threads the sources share (one for every source's
lease extensions, one for their gauges, eight for probes); the worker threads are
shared and pick sources through the ``SourceScheduler`` (round-robin over sources with
due rows, probes with back-off for idle and failing ones: scheduler.py states the
fairness bound). The workers pipeline
as a single-source relay's do (claim of the next batch while the previous one is
acknowledged; one ``Submitter`` thread builds and submits every full batch), and one
more thread, the lane, claims sources the moment they become due.

Idle sources are found by polling, not LISTEN: a LISTEN needs a session per database
held open and read by someone, a probe is one indexed ``EXISTS`` per
``relay.poll_interval_seconds`` on the pool's one kept connection (measured side by
side in bench/many_sources.py).

Readiness (``/readyz``): ready when the publisher is healthy, the broker circuit
breaker closed, and at least one source answers (or no source exists yet); the body
names every source that is not ready and why. A source whose database is down is
not ready on its own: it backs off and the process keeps serving the others.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psycopg
import structlog
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from psycopg import sql

from ..config import Settings
from ..core.breaker import CircuitBreaker
from ..core.budget import InFlightBudget
from ..core.service import PeriodicService
from ..core.startup import startup_gave_up
from ..db.store import STATUSES, OutboxStore
from ..errors import ConfigError, DatabaseError, DatabaseRefused
from ..observability.metrics import MetricsServer, RelayMetrics, StatsRefresher
from ..observability.tracing import Tracing
from ..observability.tracing_factory import make_tracing
from ..publishers.base import Publisher, load_publisher, not_ready_because
from .heartbeat import LeaseKeeper
from .relay import make_store, tune_garbage_collector
from .scheduler import SourceScheduler, SourceState
from .sources import discovered_source, list_databases, settings_for, static_sources
from .submitter import Submitter
from .worker import Worker, WorkerConfig, _Batch, _Submitted

log = structlog.get_logger("outbox_relay.sources")

# Metric families that describe one outbox: exposed once per source, labelled source=NAME.
PER_SOURCE_FAMILIES = frozenset(
    {
        "outbox_relay_oldest_pending_age_seconds",
        "outbox_relay_expired_leases",
        "outbox_relay_queue_depth",
        "outbox_relay_attempts",
        "outbox_relay_blocked_aggregates",
        "outbox_relay_lost_leases",
        "outbox_relay_published",
        "outbox_relay_reaped",
        "outbox_relay_released",
        "outbox_relay_stats_refresh_errors",
        "outbox_relay_claim_batch_size",
        "outbox_relay_publish_latency_seconds",
        # MVCC pressure of each source's table (what holds its vacuum back, how vacuum keeps up)
        "outbox_relay_xmin_horizon_age_seconds",
        "outbox_relay_dead_tuples",
        "outbox_relay_table_size_bytes",
        "outbox_relay_last_vacuum_age_seconds",
    }
)


def has_due_rows(store: OutboxStore) -> bool:
    """Is a row claimable now (a due pending row or an expired lease)? One statement, two
    index probes: the front of the pending index and the front of the processing index
    (bounded by the connection's statement_timeout, database.statement_timeout_ms)."""
    query = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending' AND available_at <= now()) "
        "OR EXISTS (SELECT 1 FROM {t} WHERE status = 'processing' AND lease_until < now())"
    ).format(t=store.sql.ident)
    with store.connection() as conn:
        row = conn.execute(query).fetchone()
    return bool(row and row[0])


@dataclass
class SourceRuntime:
    """One source: its settings, connection pool, lease keeper, gauges and workers."""

    name: str
    settings: Settings
    store: OutboxStore
    metrics: RelayMetrics
    discovered: bool = False
    cfg: WorkerConfig | None = None
    keeper: LeaseKeeper | None = None
    refresher: StatsRefresher | None = None
    opened: bool = False
    workers: dict[int, Worker] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Held by the probe and the gauge refresh: an idle source's two readers take turns
    #: on the pool's one connection instead of opening a second one.
    reading: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, index: int, relay: MultiRelay) -> Worker:
        with self.lock:
            worker = self.workers.get(index)
            if worker is None:
                assert self.cfg is not None
                worker = Worker(
                    index,
                    self.store,
                    relay.publisher,
                    self.cfg,
                    self.metrics,
                    breaker=relay.breaker,
                    stop_event=relay.stop_event,
                    keeper=self.keeper,
                    budget=relay.budget,
                    tracing=relay.tracing,
                )
                worker.log = worker.log.bind(source=self.name)
                self.workers[index] = worker
                relay.keep_long_lived()
            return worker


@dataclass
class _InFlight:
    """A batch of one source between its claim and its finalize."""

    runtime: SourceRuntime
    worker: Worker
    batch: _Batch | _Submitted
    short: bool  # fewer rows than a batch: the source had no more due rows


class SourcesMetrics(RelayMetrics):
    """The process's metrics; per-outbox families come from each source's own registry,
    with a ``source`` label, so every source's series are counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, RelayMetrics] = {}
        #: Per source, the collectors of its per-outbox families (with the family's name).
        self._collectors: dict[str, list[tuple[str, MetricWrapperBase]]] = {}
        self._sources_lock = threading.Lock()
        self.source_up = Gauge(
            "outbox_relay_source_up",
            "1 while the source's database answers and its table is usable.",
            ["source"],
            registry=self.registry,
        )
        self.sources_due = Gauge(
            "outbox_relay_sources_due", "Sources with claimable rows waiting for a worker.", registry=self.registry
        )

    def add_source(self, name: str, metrics: RelayMetrics) -> None:
        # Only the per-outbox families are read from a source's registry: the rest of
        # it (process-wide families, registered by every RelayMetrics) is never shown,
        # and collecting it for every source made a scrape of 50 sources cost ~80 ms.
        collectors = [
            (family.name, collector)
            for collector in vars(metrics).values()
            if isinstance(collector, MetricWrapperBase)
            for family in collector.describe()
            if family.name in PER_SOURCE_FAMILIES
        ]
        with self._sources_lock:
            self.sources[name] = metrics
            self._collectors[name] = collectors
        self.source_up.labels(source=name).set(0)

    def remove_source(self, name: str) -> None:
        with self._sources_lock:
            self.sources.pop(name, None)
            self._collectors.pop(name, None)
        try:
            self.source_up.remove(name)
        except KeyError:
            pass

    def collect_all(self, names: Collection[str] | None = None) -> list[Metric]:
        """The process's families and every source's per-outbox ones (labelled
        source=NAME); with ``names`` only the samples of those names."""
        families: dict[str, Metric] = {}
        out: list[Metric] = []
        own = self.registry if names is None else self.registry.restricted_registry(names)
        for family in own.collect():
            if family.name not in PER_SOURCE_FAMILIES:
                out.append(family)
        wanted = None if names is None else set(names)
        with self._sources_lock:
            sources = sorted(self._collectors.items())
        for name, collectors in sources:
            for family_name, collector in collectors:
                if wanted is not None and not any(n.startswith(family_name) for n in wanted):
                    continue
                for family in collector.collect():
                    merged = families.get(family.name)
                    if merged is None:
                        merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                        merged.unit = family.unit
                    for sample in family.samples:
                        if wanted is None or sample.name in wanted:
                            merged.add_sample(
                                sample.name,
                                dict(sample.labels, source=name),
                                sample.value,
                                sample.timestamp,
                                sample.exemplar,
                            )
        out.extend(family for family in families.values() if family.samples or wanted is None)
        return out

    def render(self, names: Collection[str] | None = None) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected(partial(self.collect_all, names)))
        return generate_latest(registry)


class _Collected:
    def __init__(self, collect: Any) -> None:
        self.collect = collect


class MultiRelay:
    """Serves every configured and discovered source from one process."""

    def __init__(
        self, settings: Settings, *, publisher: Publisher | None = None, tracing: Tracing | None = None
    ) -> None:
        self.settings = settings
        self.metrics = SourcesMetrics()
        self._given_publisher = publisher
        self.publisher: Publisher = publisher  # type: ignore[assignment]  # set in start()
        self._given_tracing = tracing
        self.tracing: Tracing = tracing or Tracing()
        self.scheduler = SourceScheduler(probe_max_seconds=settings.relay.poll_interval_seconds)
        self.runtimes: dict[str, SourceRuntime] = {}
        self._runtimes_lock = threading.Lock()
        self.stop_event = threading.Event()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.breaker: CircuitBreaker | None = None
        self.budget = InFlightBudget(settings.relay.max_in_flight_bytes, self.metrics.in_flight_bytes)
        self._threads: list[threading.Thread] = []
        self._probe_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="source-probe")
        # Pipelining publishers: one thread builds and submits every worker's batches,
        # whatever their source, so workers go straight on to their next statement.
        self._submitter: Submitter | None = None
        self._server: MetricsServer | None = None
        self._started = False
        self._waiting_for: str | None = None
        self._gauges: _GaugeRefresher | None = None
        self._leases: _LeaseRounds | None = None
        self._discovery: _Discovery | None = None
        self._signals = 0
        #: run_forever froze what start() made (tune_garbage_collector): what each
        #: source makes later is frozen in turn (keep_long_lived).
        self._gc_frozen = False
        #: Monotonic time of the next full collection of frozen objects (recollect_if_due).
        self._recollect_at: float | None = None
        self._recollect_lock = threading.Lock()

    # --- sources ---------------------------------------------------------------------
    def add_source(self, name: str, settings: Settings, *, discovered: bool = False) -> None:
        """Serve one more source (probed at once; claimed once its probe finds rows)."""
        with self._runtimes_lock:
            if name in self.runtimes or self.stop_event.is_set():
                return
            pool_size = min(self.settings.pool_size, self.settings.relay.workers + 2)
            store = make_store(settings, pool_size=pool_size)
            runtime = SourceRuntime(
                name=name, settings=settings, store=store, metrics=RelayMetrics(), discovered=discovered
            )
            self.runtimes[name] = runtime
        self.metrics.add_source(name, runtime.metrics)
        self.scheduler.add(name)
        log.info("source added", source=name, table=settings.database.table, discovered=discovered)

    def remove_source(self, name: str) -> None:
        """Stop serving a source: no new claims; its batches in flight are finished
        (or, past relay.shutdown_timeout_seconds, left to their lease), then its pool closes."""
        state = self.scheduler.retire(name)
        with self._runtimes_lock:
            runtime = self.runtimes.get(name)
        if runtime is None:
            return
        if state is not None and not self.scheduler.wait_inactive(
            name, state, timeout=self.settings.relay.shutdown_timeout_seconds
        ):
            log.warning("source removed with batches still in flight: their leases expire", source=name)
        with self._runtimes_lock:
            self.runtimes.pop(name, None)
            self.metrics.remove_source(name)
        self._close_runtime(runtime)
        del runtime
        # What only the cyclic collector frees (the reference cycles of its pool's
        # threads, say) was frozen with the source: collect now, and once more a lease
        # later for what a thread still held just now.
        self._recollect()
        self._schedule_recollect()
        log.info("source removed", source=name)

    def _set_up(self, name: str, up: bool) -> None:
        """outbox_relay_source_up of a source still served (a late probe of a removed
        source must not bring its series back)."""
        with self._runtimes_lock:
            if name in self.runtimes:
                self.metrics.source_up.labels(source=name).set(1 if up else 0)

    def _close_runtime(self, runtime: SourceRuntime) -> None:
        if runtime.keeper is not None:
            runtime.keeper.stop()
        runtime.store.close()

    def _open(self, runtime: SourceRuntime) -> str | None:
        """Open the source's pool once its database and table answer; None when usable,
        else why not (the source stays unready and is probed again after a back-off)."""
        s = runtime.settings
        try:
            problem = runtime.store.check_ready()
        except DatabaseRefused as exc:
            return str(exc)
        if problem is not None:
            return problem
        try:
            runtime.store.open(wait=True)
            mismatch = runtime.store.run_problem(ordering=bool(s.relay.ordered_event_types), on_done=s.relay.on_done)
        except DatabaseError as exc:
            return str(exc)
        if mismatch is not None:
            return mismatch[0]
        runtime.cfg = WorkerConfig.from_settings(s, self.publisher)
        runtime.keeper = LeaseKeeper(
            runtime.store,
            lease_seconds=s.relay.lease_seconds,
            extend_after_fraction=s.relay.heartbeat_after_fraction,
            strict=s.relay.strict_lease,
        )
        # Not started: the process's one lease thread (_LeaseRounds) runs its steps.
        m = self.settings.metrics
        runtime.refresher = StatsRefresher(
            runtime.store,
            runtime.metrics,
            interval_seconds=m.refresh_interval_seconds,
            timeout_ms=m.query_timeout_ms,
            ordered_types=list(s.relay.ordered_event_types),
            count_cap=m.exact_count_limit,
            exact_count_interval_seconds=m.exact_count_interval_seconds,
            exact_count_timeout_ms=m.exact_count_timeout_ms,
            xmin_horizon_warn_seconds=m.xmin_horizon_warn_seconds,
        )
        runtime.opened = True
        self.keep_long_lived()
        log.info("source ready", source=runtime.name, table=s.database.table)
        return None

    def freeze_long_lived(self) -> None:
        """What exists now leaves the cyclic collector's reach (``tune_garbage_collector``)
        and so, from now on, does what each source makes as it opens (``run_forever``)."""
        tune_garbage_collector()
        self._gc_frozen = True

    def keep_long_lived(self) -> None:
        """Move what exists now (a source's pool, metrics, lease keeper and workers,
        made after start-up as sources open) out of the cyclic collector's reach, as
        ``tune_garbage_collector`` does for what start-up made. Each full collection
        walks every object it tracks: with 50 sources open and not frozen, the
        relay's collections took twice as long as a single-source relay's (about 5 ms
        of CPU per 1 000 rows delivered, in bench/many_sources.py). Freezing is a list
        splice; frozen objects are still freed by reference counting, and what only
        the cyclic collector frees (a cycle among the objects of a batch in flight at
        that moment) is collected a lease later (``recollect_if_due``)."""
        if self._gc_frozen:
            gc.freeze()
            self._schedule_recollect()

    def _schedule_recollect(self) -> None:
        """One full collection of frozen objects a lease from now (later freezes and
        removals push it back: one collection after a burst of sources opening)."""
        if self._gc_frozen:
            self._recollect_at = time.monotonic() + self.settings.relay.lease_seconds

    def recollect_if_due(self) -> None:
        due = self._recollect_at
        if due is not None and time.monotonic() >= due:
            self._recollect_at = None
            self._recollect()

    def _recollect(self) -> None:
        """Unfreeze, collect everything once, freeze again: cyclic garbage that was
        frozen (a source let go, a batch that was in flight at a freeze) is freed, and
        what is still alive is frozen again. A full collection: tens of milliseconds
        with hundreds of sources, once per burst of freezes."""
        if self._gc_frozen:
            with self._recollect_lock:
                gc.unfreeze()
                gc.collect()
                gc.freeze()

    def _probe(self, name: str) -> None:
        with self._runtimes_lock:
            runtime = self.runtimes.get(name)
        if runtime is None:
            return
        with structlog.contextvars.bound_contextvars(source=name):
            state = self.scheduler.state(name)
            was_ready = state is not None and state.ready and runtime.opened
            try:
                if not runtime.opened:
                    problem = self._open(runtime)
                    if problem is not None:
                        self._probe_failed(name, runtime, problem, state)
                        return
                with runtime.reading:
                    has_work = has_due_rows(runtime.store)
            except DatabaseError as exc:
                self._probe_failed(name, runtime, str(exc), state)
                return
            except Exception as exc:  # a probe must never end the prober
                self._probe_failed(name, runtime, f"probe failed: {type(exc).__name__}: {exc}", state)
                return
            if not was_ready and state is not None and state.failures:
                log.info("source answers again", source=name)
            self.scheduler.probed(name, has_work=has_work)
            self._set_up(name, True)

    def _probe_failed(self, name: str, runtime: SourceRuntime, problem: str, state: SourceState | None) -> None:
        problem = runtime.store.redact(problem)
        with self._runtimes_lock:
            if self.runtimes.get(name) is not runtime:
                return  # removed while the probe ran
        if state is None or state.last_error != problem:
            log.warning("source not ready; backing off", source=name, problem=problem)
        self.scheduler.probed(name, has_work=False, error=problem)
        self._set_up(name, False)

    def _prober(self) -> None:
        """Hands due probes to a small thread pool (a database that hangs holds one of
        its threads for at most connect_timeout_seconds, never the workers)."""
        while not self.stop_event.is_set():
            for name in self.scheduler.probes_due():
                self._probe_pool.submit(self._probe, name)
            self.metrics.sources_due.set(self.scheduler.due_count())
            self.recollect_if_due()
            self.stop_event.wait(min(0.05 + self.scheduler.next_probe_in(), 0.25))

    # --- start -----------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if self._given_publisher is None:
            self.publisher = load_publisher(s)
        if self._given_tracing is None:
            self.tracing = make_tracing(s, self.publisher)
        try:
            self.publisher.start()
        except Exception as exc:
            self.tracing.close()
            raise ConfigError(f"cannot create the publisher: {exc}") from None
        self.publisher.observer = self.metrics
        self._waiting_for = "starting"
        if s.metrics.enabled:
            try:
                self._server = MetricsServer(
                    self.metrics, host=s.metrics.host, port=s.metrics.port, healthy=self.health, ready=self.readiness
                )
            except OSError as exc:
                self.publisher.close()
                raise ConfigError(
                    f"metrics.port {s.metrics.port}: cannot listen on "
                    f"{s.metrics.host}:{s.metrics.port}: {exc.strerror or exc}"
                ) from None
            self._server.start()
        if self.publisher.can_probe:
            publisher = self.publisher
            self.breaker = CircuitBreaker(
                lambda: publisher.probe(timeout_seconds=2.0), self.metrics.circuit_breaker_open
            )
        for name, source_settings in static_sources(s).items():
            self.add_source(name, source_settings)
        self._start_threads()
        if s.discovery.enabled:
            self._discovery = _Discovery(self)
            self._discovery.start()
        self._started = True
        self._waiting_for = None
        if s.relay.startup_timeout_seconds > 0:
            self._await_first_ready(s.relay.startup_timeout_seconds)
        log.info(
            "relay started",
            sources=len(self.runtimes),
            discovery=s.discovery.enabled,
            workers=s.relay.workers,
            owner=s.relay.owner,
            publisher=s.relay.publisher,
            metrics_port=self.metrics_port,
        )

    def _await_first_ready(self, timeout: float) -> None:
        """``relay.startup_timeout_seconds`` with sources: give up (stop, raise: exit 1)
        unless within ``timeout`` the process becomes ready, i.e. the broker answers and
        at least one source is ready (with discovery: once the databases were listed,
        and a cluster without a matching database yet counts as ready). Sources that
        stay unready after that do not matter: each one backs off on its own, and
        ``/readyz`` names them."""
        deadline = time.monotonic() + timeout
        while not self.stop_event.is_set():
            listed = self._discovery is None or self._discovery.listed.is_set()
            ready, why = self.readiness()
            if ready and listed:
                return
            if time.monotonic() >= deadline:
                break
            self.stop_event.wait(0.1)
        else:
            return  # stop() was called meanwhile
        problems: dict[str, str] = {}
        if (self.breaker is not None and self.breaker.is_open) or not self.publisher.healthy():
            why_down = self.publisher.trouble() or "no broker answered"
            problems["target"] = f"cannot reach {self.publisher.describe_target()}: {why_down}"
        sources = self.source_readiness()
        unready = sorted((name, reason) for name, reason in sources.items() if reason is not None)
        if not listed:
            problems["database"] = "discovery could not list the databases"
        elif unready and len(unready) == len(sources):
            more = f"; +{len(unready) - 50} more" if len(unready) > 50 else ""
            problems["database"] = f"no source became ready ({'; '.join(f'{n}: {r}' for n, r in unready[:50])}{more})"
        elif not problems:
            problems["database"] = why.removeprefix("not ready: ")
        self.stop(timeout_seconds=0)
        raise startup_gave_up(problems, timeout)  # every dependency still down, one line

    def _start_threads(self) -> None:
        s = self.settings
        targets: list[tuple[str, Any]] = [("source-prober", self._prober), ("fresh-lane", self._fresh_lane)]
        targets += [(f"worker-{i}", self._worker_loop) for i in range(s.relay.workers)]
        for name, target in targets:
            args = (int(name.split("-")[1]),) if name.startswith("worker-") else ()
            thread = threading.Thread(target=self._guard, args=(target, *args), name=name, daemon=True)
            self._threads.append(thread)
        if s.metrics.enabled:
            self._gauges = _GaugeRefresher(self, s.metrics.refresh_interval_seconds)
            self._gauges.start()
        self._leases = _LeaseRounds(self)
        self._leases.start()
        if self.publisher.pipelines:
            self._submitter = Submitter()
        for thread in self._threads:
            thread.start()
        self.metrics.worker_threads_alive.set(s.relay.workers)

    def _guard(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except Exception:
            log.exception("relay thread crashed", thread=threading.current_thread().name)
        finally:
            if threading.current_thread().name.startswith("worker-"):
                self.metrics.worker_threads_alive.dec()

    @property
    def metrics_port(self) -> int | None:
        return self._server.port if self._server else None

    # --- the shared worker loop ------------------------------------------------------
    def _worker_loop(self, index: int) -> None:
        """Take the next due source, claim one batch of it, hand it to the submitter;
        finish the previous batch (of whichever source) while this one is being built,
        produced and acknowledged: the same pipeline as a single-source worker (the
        claim of batch N+1 overlaps the publish and finalize of batch N)."""
        in_flight: _InFlight | None = None
        max_batch_bytes = self.settings.relay.max_batch_bytes
        while not self.stop_event.is_set():
            if self.breaker is not None and self.breaker.is_open:
                self._finish(in_flight)
                in_flight = None
                self.breaker.wait_closed(timeout=0.5)
                continue
            pick = self.scheduler.next_due(timeout=0.0 if in_flight is not None else 0.25)
            if pick is None:
                self._finish(in_flight)
                in_flight = None
                continue
            name, epoch = pick
            runtime = self._claimable(name)
            if runtime is None:
                continue
            if not self.budget.try_reserve(max_batch_bytes):
                # Never wait on our own batch: finish it, then wait for the others'.
                self._finish(in_flight)
                in_flight = None
                if not self.budget.try_reserve(max_batch_bytes):
                    self.metrics.in_flight_budget_waits_total.inc()
                    if not self.budget.reserve(max_batch_bytes, self.stop_event):
                        self.scheduler.done(name)
                        break
            started = self._claim_and_start(runtime, runtime.worker(index, self), epoch, max_batch_bytes)
            # Between batches a worker holds nothing of a source but its batch in flight:
            # a source let go must not stay alive in the locals of a worker waiting for work.
            del runtime
            if started is None:
                continue
            if started.short or not self.publisher.pipelines:
                # A short batch (a quiet source's few rows) is finished at once, before
                # the previous batch: its latency is its own acknowledgements and a small
                # finalize, never another source's 1000-row finalize or next claim.
                self._finish(started)
                self._finish(in_flight)
                in_flight = None
            else:
                self._finish(in_flight)
                in_flight = started
            del started
        self._finish(in_flight)

    def _fresh_lane(self) -> None:
        """One more thread beside the worker pool, for sources that have just become
        due: it claims such a source as soon as its probe has seen a row, and finishes
        the batch at once (never pipelined). The pool's workers spend most of a busy
        drain waiting for their previous batch's acknowledgements; without the lane a
        quiet source's row would wait for one of them to come back for work. A source
        the lane finds busy (a full batch) stays due and is served by the pool."""
        index = self.settings.relay.workers  # its batches' owner is <owner>:w<workers>
        max_batch_bytes = self.settings.relay.max_batch_bytes
        while not self.stop_event.is_set():
            if self.breaker is not None and self.breaker.is_open:
                self.breaker.wait_closed(timeout=0.5)
                continue
            pick = self.scheduler.next_fresh(timeout=0.25)
            if pick is None:
                continue
            name, epoch = pick
            runtime = self._claimable(name)
            if runtime is None:
                continue
            if not self.budget.try_reserve(max_batch_bytes):
                self.scheduler.done(name)  # the budget is full: the pool serves it when it can
                continue
            started = self._claim_and_start(runtime, runtime.worker(index, self), epoch, max_batch_bytes)
            del runtime
            self._finish(started)
            del started

    def _claimable(self, name: str) -> SourceRuntime | None:
        """The runtime of a source just taken from the scheduler, if it can be claimed
        (still served, its pool open); otherwise the take is given back (``done``)."""
        with self._runtimes_lock:
            runtime = self.runtimes.get(name)
        if runtime is None or not runtime.opened or runtime.cfg is None:
            self.scheduler.done(name)
            return None
        return runtime

    def _claim_and_start(
        self, runtime: SourceRuntime, worker: Worker, epoch: int, reserved_bytes: int
    ) -> _InFlight | None:
        """Claim one batch of the source and hand it to the submitter (built and
        submitted on the worker itself without one). None when nothing was claimed
        (the source is then marked idle or failing by the scheduler).

        A short batch (a quiet source's few rows) is built here, not queued behind the
        busy sources' 1000-message batches on the submitter: the worker waits for it
        at once anyway (it is finished before anything else), so handing it over would
        only add the queue's wait to its latency. Building a few messages is cheap."""
        name = runtime.name
        assert runtime.cfg is not None
        batch_size = runtime.cfg.batch_size
        with structlog.contextvars.bound_contextvars(source=name):
            try:
                rows, trace = worker._claim()
            except DatabaseError as exc:
                self.budget.resize(reserved_bytes, 0)
                problem = runtime.store.redact(str(exc))
                delay = self.scheduler.failed(name, problem)
                self._set_up(name, False)
                worker.log.warning(
                    "source's database unavailable; backing off", error=problem, retry_in_seconds=round(delay, 2)
                )
                self.scheduler.done(name)
                return None
            held = sum(r.size_bytes for r in rows)
            self.budget.resize(reserved_bytes, held)
            self.scheduler.claimed(name, epoch, rows=len(rows), batch_size=batch_size)
            if not rows:
                self.scheduler.done(name)
                return None
            short = len(rows) < batch_size
            batch: _Batch | _Submitted
            if self._submitter is not None and not short:
                batch = _Submitted(self._submitter.submit(partial(worker._start, rows, trace)))
            else:
                try:
                    batch = worker._start(rows, trace)
                except BaseException:
                    self.budget.release(held)
                    self.scheduler.done(name)
                    raise
            batch.held_bytes = held
        return _InFlight(runtime, worker, batch, short=short)

    def _finish(self, in_flight: _InFlight | None) -> None:
        if in_flight is None:
            return
        runtime, worker = in_flight.runtime, in_flight.worker
        with structlog.contextvars.bound_contextvars(source=runtime.name):
            try:
                worker._complete(in_flight.batch)
            except Exception as exc:  # rows whose finalize failed are recovered by their lease
                worker.log.warning("batch not finalized; its leases expire", error=runtime.store.redact(str(exc)))
            finally:
                self.scheduler.done(runtime.name)

    # --- health ----------------------------------------------------------------------
    def source_readiness(self) -> dict[str, str | None]:
        """Every source and why it is not ready (None = ready)."""
        out: dict[str, str | None] = {}
        for state in self.scheduler.states():
            with self._runtimes_lock:
                runtime = self.runtimes.get(state.name)
            if runtime is None:
                continue
            if state.last_error is not None:
                out[state.name] = state.last_error
            elif not runtime.opened:
                out[state.name] = "not checked yet"
            else:
                out[state.name] = None
        return out

    def health(self) -> tuple[bool, str]:
        if not self._started:
            return True, f"ok: starting ({self._waiting_for or 'starting'})"
        problem = self.publisher.check_alive()
        if problem is not None:
            return False, f"unhealthy: {problem}"
        workers = [t for t in self._threads if t.name.startswith("worker-")]
        alive = sum(1 for t in workers if t.is_alive())
        if alive == len(workers) and alive > 0:
            return True, f"ok: {alive} workers alive, {len(self.runtimes)} sources"
        return False, f"unhealthy: {alive}/{len(workers)} workers alive"

    def readiness(self) -> tuple[bool, str]:
        if not self._started:
            return False, f"not ready: {self._waiting_for or 'starting'}"
        if self.breaker is not None and self.breaker.is_open:
            return False, not_ready_because("broker circuit breaker open", self.publisher.trouble())
        if not self.publisher.healthy():
            return False, not_ready_because("broker unreachable", self.publisher.trouble())
        sources = self.source_readiness()
        unready = {name: why for name, why in sources.items() if why is not None}
        ready_count = len(sources) - len(unready)
        detail = "; ".join(f"{name}: {why}" for name, why in sorted(unready.items())[:50])
        more = f" (+{len(unready) - 50} more)" if len(unready) > 50 else ""
        if sources and ready_count == 0:
            return False, f"not ready: no source is ready ({detail}{more})"
        text = f"ready: {ready_count}/{len(sources)} sources ready"
        if unready:
            text += f"; not ready: {detail}{more}"
        return True, text

    # --- stop ------------------------------------------------------------------------
    def stop(self, timeout_seconds: float | None = None) -> None:
        with self._stop_lock:
            if self._stopped.is_set():
                return
            timeout = self.settings.relay.shutdown_timeout_seconds if timeout_seconds is None else timeout_seconds
            log.info("stopping: no new claims; waiting for in-flight batches", timeout_seconds=timeout)
            self.stop_event.set()
            self.scheduler.close()
            if self._discovery is not None:
                self._discovery.stop()
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._threads) and self.publisher is not None:
                log.warning("shutdown deadline reached: releasing unacknowledged rows")
                self.publisher.abort()
                for thread in self._threads:
                    thread.join(timeout=10)
            if self._submitter is not None:
                self._submitter.close()
            self._probe_pool.shutdown(wait=False, cancel_futures=True)
            if self._gauges is not None:
                self._gauges.stop()
            if self._leases is not None:
                self._leases.stop()
            if self.publisher is not None:
                self.publisher.close()
            self.tracing.close()
            if self._server is not None:
                self._server.stop()
            with self._runtimes_lock:
                runtimes = list(self.runtimes.values())
            for runtime in runtimes:
                self._close_runtime(runtime)
            self._stopped.set()
            log.info("relay stopped")

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def install_signal_handlers(self) -> None:
        import os
        import signal

        def handler(signum: int, _frame: Any) -> None:
            self._signals += 1
            if self._signals > 1:
                os._exit(128 + signum)
            log.info("signal received: graceful shutdown", signal=signal.Signals(signum).name)
            threading.Thread(target=self.stop, name="shutdown", daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run_forever(self) -> None:
        self.install_signal_handlers()
        self.start()
        self.freeze_long_lived()
        while not self._stopped.wait(0.5):
            pass


#: The share of the gauge refresher's time spent querying: after each source's
#: gauges it rests nine times as long as their queries took. A single-source relay
#: reads one table's gauges per interval; a process with many busy sources would
#: otherwise read theirs back to back, a statement always running on some source's
#: database, taken from the claims and finalizes of the very backlogs it reports on.
#: Fast gauge queries (an unloaded database) keep every source at
#: metrics.refresh_interval_seconds; slow ones spread the rounds out instead.
GAUGE_QUERY_SHARE = 0.1


class _GaugeRefresher(PeriodicService):
    """One thread refreshes every ready source's gauges in turn, a round every
    ``interval_seconds`` (longer when the queries are slow: ``GAUGE_QUERY_SHARE``);
    a source that is not ready shows NaN rather than a stale value (and is not queried)."""

    thread_name = "metrics-refresh"

    def __init__(self, relay: MultiRelay, interval_seconds: float) -> None:
        super().__init__(interval_seconds, run_first=True)
        self._relay = relay

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._safe_step()
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def step(self) -> None:
        relay = self._relay
        with relay._runtimes_lock:
            runtimes = list(relay.runtimes.values())
        for runtime in runtimes:
            if relay.stop_event.is_set():
                return
            spent = self._refresh(runtime)
            if spent > 0 and self._stop.wait(spent * (1 - GAUGE_QUERY_SHARE) / GAUGE_QUERY_SHARE):
                return

    def _refresh(self, runtime: SourceRuntime) -> float:
        """Refresh one source's gauges; the seconds its queries took (0: none ran)."""
        state = self._relay.scheduler.state(runtime.name)
        if runtime.refresher is not None and runtime.opened and state is not None and state.ready:
            if not runtime.reading.acquire(blocking=False):
                return 0.0  # its probe is running: this source's gauges wait for the next round
            started = time.monotonic()
            try:
                with structlog.contextvars.bound_contextvars(source=runtime.name):
                    runtime.refresher.refresh_once()
            finally:
                runtime.reading.release()
            return time.monotonic() - started
        m = runtime.metrics
        for gauge in (
            m.oldest_pending_age_seconds,
            m.expired_leases,
            m.xmin_horizon_age_seconds,
            m.dead_tuples,
            m.last_vacuum_age_seconds,
        ):
            gauge.set(math.nan)
        for status in STATUSES:
            m.queue_depth.labels(status=status).set(math.nan)
        for part in ("heap", "indexes"):
            m.table_size_bytes.labels(part=part).set(math.nan)
        return 0.0


class _LeaseRounds(PeriodicService):
    """One thread for every source's lease keeper. A keeper of its own per source was
    a thread per source waking every second (200 sources: 200 wake-ups a second, each
    taking the GIL from the workers, whether or not a batch was in flight). Each round
    asks every source's keeper whether a batch of it needs its lease extended
    (``LeaseKeeper.has_due``: a lock and a look at its few batches) and hands those that
    do to the probe threads, one step per source at a time: a database that does not
    answer holds one of those threads, never the other sources' extensions. The round
    comes every tenth of the shortest lease (0.05-1 s), as a single keeper's does."""

    thread_name = "lease-keeper"

    def __init__(self, relay: MultiRelay) -> None:
        super().__init__(self._interval_for(relay))
        self._relay = relay
        self._running: set[str] = set()
        self._running_lock = threading.Lock()

    @staticmethod
    def _interval_for(relay: MultiRelay) -> float:
        leases = [relay.settings.relay.lease_seconds]
        leases += [s.lease_seconds for s in relay.settings.sources.values() if s.lease_seconds is not None]
        return max(0.05, min(1.0, min(leases) / 10))

    def step(self) -> None:
        relay = self._relay
        with relay._runtimes_lock:
            runtimes = list(relay.runtimes.values())
        now = time.monotonic()
        for runtime in runtimes:
            keeper = runtime.keeper
            if keeper is None or not keeper.has_due(now):
                continue
            with self._running_lock:
                if runtime.name in self._running:
                    continue  # its previous step is still running (a slow database)
                self._running.add(runtime.name)
            try:
                relay._probe_pool.submit(self._extend, runtime.name, keeper)
            except RuntimeError:  # the pool is shut down: the relay is stopping
                with self._running_lock:
                    self._running.discard(runtime.name)
                return

    def _extend(self, name: str, keeper: LeaseKeeper) -> None:
        try:
            with structlog.contextvars.bound_contextvars(source=name):
                keeper.step()
        except Exception as exc:  # a closed pool (the source let go meanwhile), a bug
            log.warning("lease extension failed", source=name, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._running_lock:
                self._running.discard(name)


class _Discovery(PeriodicService):
    """Reads the cluster's database list every ``discovery.refresh_interval_seconds``:
    new matching databases become sources, vanished ones are let go. A failed listing
    changes nothing (sources are never dropped because the list could not be read)."""

    thread_name = "source-discovery"

    def __init__(self, relay: MultiRelay) -> None:
        super().__init__(relay.settings.discovery.refresh_interval_seconds, run_first=True)
        self._relay = relay
        self._known: set[str] = set()
        self._failing = False
        #: Set once the databases were listed (the process knows its sources).
        self.listed = threading.Event()

    def step(self) -> None:
        relay = self._relay
        s = relay.settings
        try:
            names = set(list_databases(s))
        except DatabaseError as exc:
            if not self._failing:
                log.warning("discovery failed; keeping the current sources", error=str(exc))
            self._failing = True
            return
        except psycopg.Error as exc:  # pragma: no cover - list_databases maps these
            log.warning("discovery failed; keeping the current sources", error=type(exc).__name__)
            return
        self._failing = False
        static = set(s.sources)
        try:
            self._add_and_remove(names, static)
        finally:
            self.listed.set()

    def _add_and_remove(self, names: set[str], static: set[str]) -> None:
        relay = self._relay
        s = relay.settings
        for name in sorted(names - self._known - static):
            relay.add_source(name, settings_for(s, discovered_source(s, name)), discovered=True)
            self._known.add(name)
        for name in sorted(self._known - names):
            log.info("database gone; letting its source go", source=name)
            self._known.discard(name)
            threading.Thread(target=relay.remove_source, args=(name,), name=f"remove-{name}", daemon=True).start()
