"""Relay: one process's workers, producer, wake-up listener and metrics sidecar.

``Relay.start()`` checks the database and broker, then starts N worker threads.
``Relay.stop()`` (SIGTERM/SIGINT) stops claiming, waits up to
``relay.shutdown_timeout_seconds`` for in-flight batches, then makes them release
what has no delivery report (fenced, back to pending, due now, attempt refunded)
so another replica takes it at once. Every service tolerates a double stop.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

import structlog

from ..config import Settings
from ..core.breaker import CircuitBreaker
from ..core.budget import InFlightBudget
from ..core.startup import startup_gave_up
from ..db.store import OutboxStore
from ..errors import ConfigError
from ..observability.metrics import MetricsServer, RelayMetrics, StatsRefresher
from ..observability.tracing import Tracing
from ..observability.tracing_factory import make_tracing
from ..publishers.base import Publisher, load_publisher, not_ready_because
from .heartbeat import LeaseKeeper
from .submitter import Submitter
from .wakeup import NotificationListener, Wakeup
from .worker import Worker, WorkerConfig

log = structlog.get_logger("outbox_relay.relay")


def make_store(
    settings: Settings, *, pool_size: int | None = None, application_name: str = "outbox-relay"
) -> OutboxStore:
    return OutboxStore(
        settings.database.dsn.get_secret_value(),
        settings.database.table,
        pool_size=pool_size or settings.pool_size,
        connect_timeout_seconds=settings.database.connect_timeout_seconds,
        statement_timeout_ms=settings.database.statement_timeout_ms,
        application_name=application_name,
        transaction_pooler=settings.database.transaction_pooler,
        listen_dsn=settings.database.listen_dsn.get_secret_value() if settings.database.listen_dsn else None,
        tcp_params=settings.database.tcp_params(),
        pool_max_idle_seconds=settings.database.pool_max_idle_seconds,
    )


class Relay:
    def __init__(
        self,
        settings: Settings,
        *,
        publisher: Publisher | None = None,
        metrics: RelayMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or RelayMetrics()
        self.store = make_store(settings)
        self._given_publisher = publisher
        self.publisher: Publisher = publisher if publisher is not None else _NotLoaded()
        self._given_tracing = tracing
        self.tracing: Tracing = tracing or Tracing()
        self.wakeup = Wakeup()
        self.workers: list[Worker] = []
        self._threads: list[threading.Thread] = []
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()
        self._listener: NotificationListener | None = None
        self._submitter: Submitter | None = None
        self._server: MetricsServer | None = None
        self._refresher: StatsRefresher | None = None
        self.breaker: CircuitBreaker | None = None
        self.keeper: LeaseKeeper | None = None
        self._started = False
        self._start_lock = threading.Lock()  # stop() waits for a start() in progress
        self._stop_lock = threading.Lock()
        # What start() is waiting for; None once the workers run (or before start()).
        self._waiting_for: str | None = None
        self._signals = 0

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
        s = self.settings
        with self._start_lock:
            if self._stop_claiming.is_set():
                return
            if self._given_publisher is None:
                self.publisher = load_publisher(s)
            publisher = self.publisher
            if self._given_tracing is None:
                self.tracing = make_tracing(s, publisher)  # ConfigError if enabled but not installed
            try:
                publisher.start()
            except Exception as exc:  # e.g. KafkaException: unknown property, bad SASL mechanism
                self.tracing.close()
                raise ConfigError(f"cannot create the publisher: {exc}") from None
            publisher.observer = self.metrics
            self._waiting_for = "starting"  # /healthz 200, /readyz 503 from the first request
            try:
                self._start_metrics_server()
                if not self._wait_for_dependencies():
                    return  # stop() was called while waiting
                self.store.open()
                self._start_workers()
            except BaseException:
                self._stop_claiming.set()
                if self.keeper is not None:
                    self.keeper.stop()
                self._close_publisher()
                self.tracing.close()
                if self._server is not None:
                    self._server.stop()
                self.store.close()
                raise

    def _start_metrics_server(self) -> None:
        s = self.settings
        if not s.metrics.enabled:
            return
        try:
            self._server = MetricsServer(
                self.metrics, host=s.metrics.host, port=s.metrics.port, healthy=self.health, ready=self.readiness
            )
        except OSError as exc:
            raise ConfigError(
                f"metrics.port {s.metrics.port}: cannot listen on "
                f"{s.metrics.host}:{s.metrics.port}: {exc.strerror or exc}"
            ) from None
        self._server.start()

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
            if self._stop_claiming.is_set():
                return False
            log.warning(
                "waiting for dependencies before starting",
                waited_seconds=round(waited, 1),
                retry_in_seconds=round(delay, 1),
                **problems,
            )
            if self._stop_claiming.wait(delay):
                return False
            delay = min(5.0, delay * 2)

    def _start_workers(self) -> None:
        s = self.settings
        publisher = self.publisher
        if publisher.can_probe:
            self.breaker = CircuitBreaker(
                lambda: publisher.probe(timeout_seconds=2.0), self.metrics.circuit_breaker_open
            )
        cfg = WorkerConfig.from_settings(s, publisher)
        budget = InFlightBudget(s.relay.max_in_flight_bytes, self.metrics.in_flight_bytes)
        self.keeper = LeaseKeeper(
            self.store,
            lease_seconds=s.relay.lease_seconds,
            extend_after_fraction=s.relay.heartbeat_after_fraction,
            strict=s.relay.strict_lease,
        )
        self.keeper.start()
        # Pipelining publishers: one thread builds and submits every worker's batches,
        # so workers go straight on to their next statement (submitter.py).
        self._submitter = Submitter() if publisher.pipelines else None
        for index in range(s.relay.workers):
            worker = Worker(
                index,
                self.store,
                self.publisher,
                cfg,
                self.metrics,
                wakeup=self.wakeup,
                breaker=self.breaker,
                stop_event=self._stop_claiming,
                keeper=self.keeper,
                budget=budget,
                tracing=self.tracing,
                submitter=self._submitter,
            )
            self.workers.append(worker)
            thread = threading.Thread(target=self._run_worker, args=(worker,), name=f"worker-{index}", daemon=True)
            self._threads.append(thread)
        if s.listens_for_wakeups:
            self._listener = NotificationListener(self.store, self.wakeup, self._stop_claiming)
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
            self._refresher = StatsRefresher(
                self.store,
                self.metrics,
                interval_seconds=s.metrics.refresh_interval_seconds,
                timeout_ms=s.metrics.query_timeout_ms,
                ordered_types=list(s.relay.ordered_event_types),
                count_cap=s.metrics.exact_count_limit,
                exact_count_interval_seconds=s.metrics.exact_count_interval_seconds,
                exact_count_timeout_ms=s.metrics.exact_count_timeout_ms,
                xmin_horizon_warn_seconds=s.metrics.xmin_horizon_warn_seconds,
            )
            self._refresher.start()
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

    @property
    def metrics_port(self) -> int | None:
        return self._server.port if self._server else None

    def _run_worker(self, worker: Worker) -> None:
        try:
            worker.run()
        except Exception:
            # A bug, not an outcome: log it loudly. The thread's rows are recovered by
            # lease expiry; /healthz turns false so the orchestrator restarts us.
            log.exception("worker crashed", worker=worker.owner)
        finally:
            self.metrics.worker_threads_alive.dec()

    # --- health ----------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if not self._started and self._waiting_for is not None:
            return True, f"ok: starting, waiting for dependencies ({self._waiting_for})"
        alive = sum(1 for t in self._threads if t.is_alive())
        problem = self.publisher.check_alive() if self._started else None
        if problem is not None:
            return False, f"unhealthy: {problem}"
        if self._started and alive == len(self._threads) and alive > 0:
            return True, f"ok: {alive} workers alive"
        return False, f"unhealthy: {alive}/{len(self._threads)} workers alive"

    def readiness(self) -> tuple[bool, str]:
        if not self._started:
            return False, f"not ready: {self._waiting_for or 'starting'}"
        if not self.store.ping(timeout_seconds=2.0):
            return False, "not ready: database unreachable"
        if self.breaker is not None and self.breaker.is_open:
            return False, not_ready_because("broker circuit breaker open", self.publisher.trouble())
        if not self.publisher.healthy():
            return False, not_ready_because("broker unreachable", self.publisher.trouble())
        held_back = self.publisher.held_back()
        if held_back is not None:
            return False, f"not ready: {held_back}"
        return True, "ready"

    # --- stop ------------------------------------------------------------------------
    def stop(self, timeout_seconds: float | None = None) -> None:
        """Graceful hand-off; safe to call twice (a second caller waits for the first)."""
        with self._stop_lock:
            if not self._stopped.is_set():
                self._stop(timeout_seconds)

    def _stop(self, timeout_seconds: float | None) -> None:
        timeout = self.settings.relay.shutdown_timeout_seconds if timeout_seconds is None else timeout_seconds
        log.info("stopping: no new claims; waiting for in-flight batches", timeout_seconds=timeout)
        self._stop_claiming.set()
        self.wakeup.wake_all()
        # A start() still waiting for its dependencies sees the flag and returns.
        if not self._start_lock.acquire(timeout=self.settings.database.connect_timeout_seconds + 15):
            log.warning("start-up did not return in time; stopping anyway")
        else:
            self._start_lock.release()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("shutdown deadline reached: releasing unacknowledged rows")
            self.publisher.abort()
            for thread in self._threads:
                thread.join(timeout=10)
        if self._listener is not None:
            self._listener.join(timeout=3)
        if self._submitter is not None:
            self._submitter.close()
        if self.keeper is not None:
            self.keeper.stop()
        self._close_publisher()
        self.tracing.close()  # flushes the last spans
        if self._refresher is not None:
            self._refresher.stop()
        if self._server is not None:
            self._server.stop()
        self.store.close()
        self._stopped.set()
        log.info("relay stopped")

    def _close_publisher(self) -> None:
        self.publisher.close()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # --- signals ---------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self._signals += 1
            if self._signals > 1:
                log.warning("second signal: exiting at once", signal=signal.Signals(signum).name)
                os._exit(128 + signum)
            log.info("signal received: graceful shutdown", signal=signal.Signals(signum).name)
            threading.Thread(target=self.stop, name="shutdown", daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run_forever(self) -> None:
        """Start, then block until a signal has stopped the relay."""
        self.install_signal_handlers()
        self.start()
        tune_garbage_collector()
        while not self._stopped.wait(0.5):
            pass


def tune_garbage_collector() -> None:
    """Cheaper cyclic garbage collection for the long-running process (``run``).

    Each batch allocates a few container objects per message (claimed rows, messages,
    header lists, delivery callbacks) that reference counting frees; the cyclic
    collector still walks them on every 700 allocations, and on each full collection
    walks every object the process holds (the imported libraries, settings, metrics):
    ~20 % of the relay's CPU while draining, in a perf profile. Freezing moves what
    exists after start-up into a permanent generation that collections skip (relay CPU
    per event 19.9 -> 16.3 us in bench/throughput.py). Cycles are still collected.
    """
    gc.freeze()


class _NotLoaded(Publisher):
    """Stands in until ``start()`` loads the configured publisher."""

    def publish_batch(self, messages: Any, *, timeout_seconds: float, cancel: Any = None) -> Any:
        raise RuntimeError("Relay.start() was not called")
