"""Relay: a process serving one outbox (``[database]``): its workers, lease keeper,
wake-up listener and gauges, in the process shell every relay shares (``shell.py``).

``Relay.start()`` waits for the database and broker, then starts N worker threads.
``Relay.stop()`` (SIGTERM/SIGINT) stops claiming, waits up to
``relay.shutdown_timeout_seconds`` for in-flight batches, then makes them release
what has no delivery report (fenced, back to pending, due now, attempt refunded)
so another replica takes it at once. Every service tolerates a double stop.
"""

from __future__ import annotations

import threading
import time

import structlog

from ..config import Settings
from ..core.startup import startup_gave_up
from ..db.partitions import PartitionLayout
from ..db.store import make_store
from ..errors import ConfigError
from ..observability.metrics import RelayMetrics, StatsRefresher
from ..observability.tracing import Tracing
from ..publishers.base import Publisher
from .lease_keeper import LeaseKeeper
from .partition_maintenance import PartitionMaintenance
from .shell import RelayShell
from .wakeup import NotificationListener, Wakeup
from .worker import Worker, WorkerConfig

__all__ = ["Relay"]

log = structlog.get_logger("outbox_relay.relay")


class Relay(RelayShell):
    """The process shell serving one source, ``[database]``, with workers of its own."""

    def __init__(
        self,
        settings: Settings,
        *,
        publisher: Publisher | None = None,
        metrics: RelayMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(settings, metrics or RelayMetrics(), publisher=publisher, tracing=tracing)
        self.store = make_store(settings)
        self.wakeup = Wakeup()
        self.workers: list[Worker] = []
        self._listener: NotificationListener | None = None
        self._refresher: StatsRefresher | None = None
        self.keeper: LeaseKeeper | None = None
        self._maintenance: PartitionMaintenance | None = None

    # --- start -----------------------------------------------------------------------
    def start(self) -> None:
        """Load and start the publisher, serve /healthz and /readyz, wait for the
        database, the table and (for publishers with ``must_answer_at_start``) the
        target to answer, then start the workers.

        Waiting is what an orchestrator wants: a relay started before its database or
        broker (or before the migrate Job finished) stays up, not ready, and starts
        delivering by itself, instead of crash-looping into a long back-off. What
        waiting cannot fix fails at once: bad configuration (``ConfigError``, exit 2),
        a refused login or certificate (``DependencyRefused``, exit 1). With
        ``relay.startup_timeout_seconds`` > 0 the wait gives up after that long
        (exit 1). ``stop()`` during the wait returns from ``start()`` early."""
        super().start()

    def _serve(self) -> None:
        if not self._wait_for_dependencies():
            return  # stop() was called while waiting
        self.store.open()
        self._start_workers()

    def _wait_for_dependencies(self) -> bool:
        """Poll until the database, the table and the target answer (True), or stop()
        is called (False). One structured log line per attempt, backing off to 5 s."""
        s = self.settings
        timeout = s.relay.startup_timeout_seconds
        started = time.monotonic()
        delay = 0.5
        probe_seconds = min(5.0, s.database.connect_timeout_seconds + 2.0)
        waited_before = False
        while True:
            problems: dict[str, str] = {}
            database_problem = self.store.check_ready()  # raises DatabaseRefused
            if database_problem is not None:
                problems["database"] = database_problem
            else:
                # A table set up for another on_done mode is a configuration error; one
                # from an older version, or still without the ordering indexes this
                # relay needs (a migrate may be building them), is waited for.
                mismatch = self.store.run_problem(ordering=bool(s.relay.ordered_event_types), on_done=s.relay.on_done)
                if mismatch is not None:
                    message, waitable = mismatch
                    if not waitable:
                        raise ConfigError(message)
                    problems["database"] = message
            if self.publisher.must_answer_at_start and not self.publisher.probe(timeout_seconds=probe_seconds):
                why = self.publisher.probe_problem() or "no broker answered"
                problems["target"] = f"cannot reach {self.publisher.describe_target()}: {why}"
            if not problems:
                if waited_before:
                    log.info("dependencies answer: starting", waited_seconds=round(time.monotonic() - started, 1))
                self._waiting_for = "starting the workers"  # healthy, not ready, until _start_workers ends
                return True
            self._waiting_for = "; ".join(problems.values())
            waited_before = True
            waited = time.monotonic() - started
            if timeout > 0 and waited >= timeout:
                raise startup_gave_up(problems, timeout)  # every dependency still down, one line
            if self.stop_event.is_set():
                return False
            log.warning(
                "waiting for dependencies before starting",
                waited_seconds=round(waited, 1),
                retry_in_seconds=round(delay, 1),
                **problems,
            )
            if self.stop_event.wait(delay):
                return False
            delay = min(5.0, delay * 2)

    def _start_workers(self) -> None:
        s = self.settings
        publisher = self.publisher
        self._start_breaker()
        cfg = WorkerConfig.from_settings(s, publisher)
        self.keeper = LeaseKeeper.from_settings(self.store, s)
        self.keeper.start()
        self._start_submitter()
        for index in range(s.relay.workers):
            worker = Worker(
                index,
                self.store,
                self.publisher,
                cfg,
                self.metrics,
                wakeup=self.wakeup,
                breaker=self.breaker,
                stop_event=self.stop_event,
                keeper=self.keeper,
                budget=self.budget,
                tracing=self.tracing,
                submitter=self._submitter,
            )
            self.workers.append(worker)
            thread = threading.Thread(target=self._run_worker, args=(worker,), name=f"worker-{index}", daemon=True)
            self._threads.append(thread)
        if s.listens_for_wakeups:
            self._listener = NotificationListener(self.store, self.wakeup, self.stop_event)
            self._listener.start()
        elif s.relay.listen_notify:
            # Said once: LISTEN through a transaction pooler would never hear anything.
            log.info(
                "transaction pooler without database.listen_dsn: no LISTEN, idle workers poll",
                poll_interval_seconds=s.relay.poll_interval_seconds,
                hint="set database.listen_dsn to a direct DSN for wake-ups; without any listening relay, "
                "`migrate --no-notify-trigger` spares writers the NOTIFY",
            )
        if s.metrics.enabled:
            self._refresher = StatsRefresher.from_settings(self.store, self.metrics, s)
            self._refresher.start()
        layout = PartitionLayout.from_settings(s)
        if layout is not None and s.partitioning.maintain_in_relay:
            self._maintenance = PartitionMaintenance(
                self.store, layout, self.metrics, interval_seconds=s.partitioning.maintain_interval_seconds
            )
            self._maintenance.start()
        for thread in self._threads:
            thread.start()
        self.metrics.worker_threads_alive.set(len(self._threads))
        self._started = True
        self._waiting_for = None
        log.info(
            "relay started",
            workers=s.relay.workers,
            table=s.database.table,
            owner=s.relay.owner,
            publisher=s.relay.publisher,
            batch_size=s.relay.batch_size,
            message_format=s.kafka.message_format,
            tracing=self.tracing.enabled,
            lease_seconds=s.relay.lease_seconds,
            metrics_port=self._server.port if self._server else None,
        )

    def _run_worker(self, worker: Worker) -> None:
        try:
            worker.run()
        except Exception:
            # A bug, not an outcome: log it loudly. The thread's rows are recovered by
            # lease expiry; /healthz turns false so the orchestrator restarts us.
            log.exception("worker crashed", worker=worker.owner)
        finally:
            self.metrics.worker_threads_alive.dec()

    # --- the shell's hooks ----------------------------------------------------------
    def _starting_text(self) -> str:
        return f"ok: starting, waiting for dependencies ({self._waiting_for})"

    def _database_problem(self) -> str | None:
        return None if self.store.ping(timeout_seconds=2.0) else "database unreachable"

    def _wake_workers(self) -> None:
        self.wakeup.wake_all()

    def _stop_services(self) -> None:
        if self._listener is not None:
            self._listener.join(timeout=3)
        if self.keeper is not None:
            self.keeper.stop()
        if self._refresher is not None:
            self._refresher.stop()
        if self._maintenance is not None:
            self._maintenance.stop()

    def _close_sources(self) -> None:
        self.store.close()
