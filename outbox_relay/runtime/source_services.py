"""What runs beside the workers of a process serving many sources: each source's
runtime (``SourceRuntime``) and the periodic services every source shares, one thread
each: the gauge rounds (``GaugeRounds``), the lease rounds (``LeaseRounds``), the partition
maintenance of partitioned sources (``PartitionRounds``) and the discovery of
databases (``Discovery``)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psycopg
import structlog

from ..config import Settings
from ..core.service import PeriodicService
from ..db.partitions import PartitionLayout
from ..db.store import STATUSES, OutboxStore
from ..errors import DatabaseError
from ..observability.metrics import RelayMetrics, StatsRefresher
from ..sources import discovered_source, list_databases, settings_for
from .lease_keeper import LeaseKeeper
from .scheduler import SourceScheduler
from .worker import Worker, WorkerConfig

log = structlog.get_logger("outbox_relay.sources")


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


#: The share of the gauge refresher's time spent querying: after each source's
#: gauges it rests nine times as long as their queries took. A single-source relay
#: reads one table's gauges per interval; a process with many busy sources would
#: otherwise read theirs back to back, a statement always running on some source's
#: database, taken from the claims and finalizes of the very backlogs it reports on.
#: Fast gauge queries (an unloaded database) keep every source at
#: metrics.refresh_interval_seconds; slow ones spread the rounds out instead.
GAUGE_QUERY_SHARE = 0.1


class PartitionRounds(PeriodicService):
    """[partitioning] in a process serving many sources: one thread maintains each open
    source whose table is partitioned in turn (db/partitions.py), a round every
    ``partitioning.maintain_interval_seconds``; a source whose table is plain is skipped
    (said once). Each source's figures go to its own metrics."""

    thread_name = "partition-maintenance"

    def __init__(
        self, interval_seconds: float, *, runtimes: Callable[[], list[SourceRuntime]], stopping: threading.Event
    ) -> None:
        super().__init__(interval_seconds, run_first=True)
        self._runtimes = runtimes
        self._stopping = stopping
        self._plain: set[str] = set()

    def step(self) -> None:
        for runtime in self._runtimes():
            if self._stopping.is_set() or self._stop.is_set():
                return
            layout = PartitionLayout.from_settings(runtime.settings)
            if layout is None or not runtime.opened or runtime.name in self._plain:
                continue
            with structlog.contextvars.bound_contextvars(source=runtime.name):
                try:
                    if not runtime.store.is_partitioned():
                        self._plain.add(runtime.name)
                        log.info("partition maintenance: the source's table is not partitioned; skipped")
                        continue
                    result = runtime.store.maintain_partitions(layout, sleep=self._stop.wait)
                except Exception:
                    runtime.metrics.record_partition_maintenance(None)
                    log.exception("partition maintenance failed; the next round retries")
                    continue
                runtime.metrics.record_partition_maintenance(result)
                if result.failed:
                    log.warning("partition maintenance: some changes failed", failed=result.failed)


class GaugeRounds(PeriodicService):
    """One thread refreshes every ready source's gauges in turn, a round every
    ``interval_seconds`` (longer when the queries are slow: ``GAUGE_QUERY_SHARE``);
    a source that is not ready shows NaN rather than a stale value (and is not queried)."""

    thread_name = "metrics-refresh"

    def __init__(
        self,
        interval_seconds: float,
        *,
        runtimes: Callable[[], list[SourceRuntime]],
        scheduler: SourceScheduler,
        stopping: threading.Event,
    ) -> None:
        super().__init__(interval_seconds, run_first=True)
        self._runtimes = runtimes
        self._scheduler = scheduler
        self._stopping = stopping

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._safe_step()
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def step(self) -> None:
        for runtime in self._runtimes():
            if self._stopping.is_set():
                return
            spent = self._refresh(runtime)
            if spent > 0 and self._stop.wait(spent * (1 - GAUGE_QUERY_SHARE) / GAUGE_QUERY_SHARE):
                return

    def _refresh(self, runtime: SourceRuntime) -> float:
        """Refresh one source's gauges; the seconds its queries took (0: none ran)."""
        state = self._scheduler.state(runtime.name)
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


class LeaseRounds(PeriodicService):
    """One thread for every source's lease keeper. A keeper of its own per source was
    a thread per source waking every second (200 sources: 200 wake-ups a second, each
    taking the GIL from the workers, whether or not a batch was in flight). Each round
    asks every source's keeper whether a batch of it needs its lease extended
    (``LeaseKeeper.has_due``: a lock and a look at its few batches) and hands those that
    do to the probe threads, one step per source at a time: a database that does not
    answer holds one of those threads, never the other sources' extensions. The round
    comes every tenth of the shortest lease (0.05-1 s), as a single keeper's does."""

    thread_name = "lease-keeper"

    def __init__(
        self, settings: Settings, *, runtimes: Callable[[], list[SourceRuntime]], pool: ThreadPoolExecutor
    ) -> None:
        super().__init__(self._interval_for(settings))
        self._runtimes = runtimes
        self._pool = pool
        self._running: set[str] = set()
        self._running_lock = threading.Lock()

    @staticmethod
    def _interval_for(settings: Settings) -> float:
        leases = [settings.relay.lease_seconds]
        leases += [s.lease_seconds for s in settings.sources.values() if s.lease_seconds is not None]
        return max(0.05, min(1.0, min(leases) / 10))

    def step(self) -> None:
        now = time.monotonic()
        for runtime in self._runtimes():
            keeper = runtime.keeper
            if keeper is None or not keeper.has_due(now):
                continue
            with self._running_lock:
                if runtime.name in self._running:
                    continue  # its previous step is still running (a slow database)
                self._running.add(runtime.name)
            try:
                self._pool.submit(self._extend, runtime.name, keeper)
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


class Discovery(PeriodicService):
    """Reads the cluster's database list every ``discovery.refresh_interval_seconds``:
    new matching databases become sources, vanished ones are let go. A failed listing
    changes nothing (sources are never dropped because the list could not be read)."""

    thread_name = "source-discovery"

    def __init__(
        self,
        settings: Settings,
        *,
        add: Callable[[str, Settings], None],
        remove: Callable[[str], None],
    ) -> None:
        super().__init__(settings.discovery.refresh_interval_seconds, run_first=True)
        self._settings = settings
        self._add = add
        self._remove = remove
        self._known: set[str] = set()
        self._failing = False
        #: Set once the databases were listed (the process knows its sources).
        self.listed = threading.Event()

    def step(self) -> None:
        s = self._settings
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
        s = self._settings
        for name in sorted(names - self._known - static):
            self._add(name, settings_for(s, discovered_source(s, name)))
            self._known.add(name)
        for name in sorted(self._known - names):
            log.info("database gone; letting its source go", source=name)
            self._known.discard(name)
            threading.Thread(target=self._remove, args=(name,), name=f"remove-{name}", daemon=True).start()
