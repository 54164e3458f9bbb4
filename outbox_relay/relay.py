"""Relay: one process's workers, producer, wake-up listener and metrics sidecar.

``Relay.start()`` checks the database and broker, then starts N worker threads.
``Relay.stop()`` (SIGTERM/SIGINT) stops claiming, waits up to
``relay.shutdown_timeout_seconds`` for in-flight batches, then makes them release
what has no delivery report (fenced, back to pending, due now, attempt refunded)
so another replica takes it at once. Every service tolerates a double stop.
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import threading
import time
from typing import Any

import structlog

from .config import Settings
from .errors import BrokerUnavailable, ConfigError, DatabaseError, PublisherLoadError
from .heartbeat import LeaseKeeper
from .metrics import MetricsServer, RelayMetrics, StatsRefresher
from .publisher import Publisher, SimplePublisher
from .store import OutboxStore
from .worker import CircuitBreaker, Wakeup, Worker, WorkerConfig

log = structlog.get_logger("outbox_relay.relay")


def make_store(settings: Settings, *, pool_size: int | None = None, application_name: str = "outbox-relay") -> OutboxStore:
    return OutboxStore(
        settings.database.dsn.get_secret_value(),
        settings.database.table,
        pool_size=pool_size or settings.pool_size,
        connect_timeout_seconds=settings.database.connect_timeout_seconds,
        statement_timeout_ms=settings.database.statement_timeout_ms,
        application_name=application_name,
    )


class _SequentialAdapter(SimplePublisher):
    """Wraps a plug-in object that only has ``publish(message)``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def publish(self, message):  # type: ignore[override]
        self._inner.publish(message)

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if callable(close):
            close()


def load_publisher(settings: Settings) -> Any:
    """``relay.publisher``: "kafka", "http", or "package.module:factory".

    A factory is called with the Settings and must return an object with
    ``publish_batch(messages, *, timeout_seconds)`` (see ``Publisher``) or a plain
    ``publish(message)``. Anything else is a start-up error (exit 2)."""
    reference = settings.relay.publisher
    if reference == "kafka":
        from .kafka_publisher import KafkaPublisher, producer_config

        return KafkaPublisher(producer_config(settings))
    if reference == "http":
        from .http_publisher import HttpPublisher

        return HttpPublisher.from_settings(settings)
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise PublisherLoadError(
            f"relay.publisher {reference!r} is not 'kafka', 'http' or 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, but also a SyntaxError or a crash at import
        raise PublisherLoadError(
            f"relay.publisher {reference!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise PublisherLoadError(f"relay.publisher {reference!r}: {module_name!r} has no attribute {attr!r}")
    try:
        obj = factory(settings) if callable(factory) and not hasattr(factory, "publish_batch") else factory
    except Exception as exc:
        raise PublisherLoadError(
            f"relay.publisher {reference!r}: the factory failed: {type(exc).__name__}: {exc}") from None
    if hasattr(obj, "publish_batch") and callable(obj.publish_batch):
        return obj
    if hasattr(obj, "publish") and callable(obj.publish):
        return _SequentialAdapter(obj)
    raise PublisherLoadError(
        f"relay.publisher {reference!r} returned {type(obj).__name__}, which has neither publish_batch() nor publish()")


class Relay:
    def __init__(self, settings: Settings, *, publisher: Publisher | None = None,
                 metrics: RelayMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or RelayMetrics()
        self.store = make_store(settings)
        self.publisher: Any = publisher
        self.wakeup = Wakeup()
        self.workers: list[Worker] = []
        self._threads: list[threading.Thread] = []
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()
        self._listener: threading.Thread | None = None
        self._server: MetricsServer | None = None
        self._refresher: StatsRefresher | None = None
        self.breaker: CircuitBreaker | None = None
        self.keeper: LeaseKeeper | None = None
        self._started = False
        self._signals = 0

    # --- start -----------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if self.publisher is None:
            self.publisher = load_publisher(s)
        self.store.open()
        self.store.require_table()
        start = getattr(self.publisher, "start", None)
        if callable(start):
            try:
                start()
            except Exception as exc:  # e.g. KafkaException: unknown property, bad SASL mechanism
                self.store.close()
                raise ConfigError(f"cannot create the publisher: {exc}") from None
        probe = getattr(self.publisher, "probe", None)
        # Kafka must answer at start-up (a clear error beats a relay that only retries);
        # other publishers' targets may come and go: their probe only drives the breaker.
        if s.relay.publisher == "kafka" and callable(probe) and not probe(
                timeout_seconds=s.database.connect_timeout_seconds + 5):
            self._close_publisher()
            self.store.close()
            servers = getattr(s.kafka, "bootstrap_servers", "?")
            raise BrokerUnavailable(f"cannot reach the Kafka cluster at {servers}: no broker answered")
        if hasattr(self.publisher, "on_replace"):
            self.publisher.on_replace.append(lambda _reason: self.metrics.producer_replacements_total.inc())
        if hasattr(self.publisher, "observe_end_to_end"):
            self.publisher.observe_end_to_end = self.metrics.end_to_end_latency_seconds.observe
        self.breaker = CircuitBreaker(self._probe_publisher, self.metrics) if callable(probe) else None

        cfg = WorkerConfig(
            owner=s.relay.owner,
            batch_size=s.relay.batch_size,
            lease_seconds=s.relay.lease_seconds,
            max_attempts=s.relay.max_attempts,
            ordered_types=list(s.relay.ordered_event_types),
            run_length=s.relay.max_run_length,
            strict_lease=s.relay.strict_lease,
            topic_template=s.kafka.topic_template,
            poll_interval_seconds=s.relay.poll_interval_seconds,
            backoff_base_seconds=s.relay.backoff_base_seconds,
            backoff_cap_seconds=s.relay.backoff_cap_seconds,
            publish_timeout_seconds=s.delivery_wait_seconds if s.relay.publisher == "kafka"
            else s.relay.lease_seconds * 0.8,
            max_error_chars=s.relay.max_error_chars,
            listen_notify=s.relay.listen_notify,
        )
        self.keeper = LeaseKeeper(self.store, lease_seconds=s.relay.lease_seconds,
                                  extend_after_fraction=s.relay.heartbeat_after_fraction,
                                  strict=s.relay.strict_lease)
        self.keeper.start()
        for index in range(s.relay.workers):
            worker = Worker(index, self.store, self.publisher, cfg, self.metrics, wakeup=self.wakeup,
                            breaker=self.breaker, stop_event=self._stop_claiming, keeper=self.keeper)
            self.workers.append(worker)
            thread = threading.Thread(target=self._run_worker, args=(worker,), name=f"worker-{index}", daemon=True)
            self._threads.append(thread)
        if s.relay.listen_notify:
            self._listener = threading.Thread(target=self._listen_loop, name="listen", daemon=True)
            self._listener.start()
        if s.metrics.enabled:
            self._refresher = StatsRefresher(self.store, self.metrics,
                                             interval_seconds=s.metrics.refresh_interval_seconds,
                                             timeout_ms=s.metrics.query_timeout_ms,
                                             ordered_types=list(s.relay.ordered_event_types),
                                             count_cap=s.metrics.exact_count_limit)
            self._refresher.start()
            try:
                self._server = MetricsServer(self.metrics, host=s.metrics.host, port=s.metrics.port,
                                             healthy=self.health, ready=self.readiness)
            except OSError as exc:
                self._stop_claiming.set()
                self._refresher.stop()
                if self.keeper is not None:
                    self.keeper.stop()
                self._close_publisher()
                self.store.close()
                raise ConfigError(f"metrics.port {s.metrics.port}: cannot listen on "
                                  f"{s.metrics.host}:{s.metrics.port}: {exc.strerror or exc}") from None
            self._server.start()
        for thread in self._threads:
            thread.start()
        self.metrics.worker_threads_alive.set(len(self._threads))
        self._started = True
        log.info("relay started", workers=s.relay.workers, table=s.database.table,
                 owner=s.relay.owner, publisher=s.relay.publisher, batch_size=s.relay.batch_size,
                 lease_seconds=s.relay.lease_seconds,
                 metrics_port=self._server.port if self._server else None)

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

    def _probe_publisher(self) -> bool:
        probe = getattr(self.publisher, "probe", None)
        return bool(probe(timeout_seconds=2.0)) if callable(probe) else True

    # --- wake-ups --------------------------------------------------------------------
    def _listen_loop(self) -> None:
        failures = 0
        while not self._stop_claiming.is_set():
            conn = None
            try:
                conn = self.store.listen_connection()
                failures = 0
                while not self._stop_claiming.is_set():
                    # Drain the generator before using the connection again: notifies()
                    # holds the connection's lock while it is suspended.
                    received = list(conn.notifies(timeout=1.0, stop_after=1))
                    if received:
                        self.wakeup.wake_one()
                        # A worker is awake: inserts can stop notifying until a worker
                        # finds nothing to claim and marks the relays idle again.
                        with self.wakeup.flag_lock:
                            conn.execute(self.store.sql.query("mark_busy"))
                            self.wakeup.relays_marked_idle = False
            except (DatabaseError, Exception) as exc:  # noqa: BLE001 - the listener must survive
                failures += 1
                if not self._stop_claiming.is_set():
                    log.warning("listen connection lost; polling until it is back", error=self.store.redact(str(exc)))
                self._stop_claiming.wait(min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0))
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass

    # --- health ----------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        alive = sum(1 for t in self._threads if t.is_alive())
        poll_alive = getattr(self.publisher, "poll_thread_alive", None)
        if callable(poll_alive) and self._started and not poll_alive():
            return False, "unhealthy: the Kafka poll thread died"
        if self._started and alive == len(self._threads) and alive > 0:
            return True, f"ok: {alive} workers alive"
        return False, f"unhealthy: {alive}/{len(self._threads)} workers alive"

    def readiness(self) -> tuple[bool, str]:
        if not self.store.ping(timeout_seconds=2.0):
            return False, "not ready: database unreachable"
        if self.breaker is not None and self.breaker.is_open:
            return False, "not ready: broker circuit breaker open"
        healthy = getattr(self.publisher, "healthy", None)
        if callable(healthy) and not healthy():
            return False, "not ready: broker unreachable"
        return True, "ready"

    # --- stop ------------------------------------------------------------------------
    def stop(self, timeout_seconds: float | None = None) -> None:
        """Graceful hand-off; safe to call twice."""
        if self._stopped.is_set():
            return
        timeout = self.settings.relay.shutdown_timeout_seconds if timeout_seconds is None else timeout_seconds
        log.info("stopping: no new claims; waiting for in-flight batches", timeout_seconds=timeout)
        self._stop_claiming.set()
        self.wakeup.wake_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            abort = getattr(self.publisher, "abort", None)
            if abort is not None:
                log.warning("shutdown deadline reached: releasing unacknowledged rows")
                abort.set()
            for thread in self._threads:
                thread.join(timeout=10)
        if self._listener is not None:
            self._listener.join(timeout=3)
        if self.keeper is not None:
            self.keeper.stop()
        self._close_publisher()
        if self._refresher is not None:
            self._refresher.stop()
        if self._server is not None:
            self._server.stop()
        self.store.close()
        self._stopped.set()
        log.info("relay stopped")

    def _close_publisher(self) -> None:
        close = getattr(self.publisher, "close", None)
        if callable(close):
            close()

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
        while not self._stopped.wait(0.5):
            pass


def check_config_consistency(settings: Settings) -> None:
    if settings.relay.publisher not in ("kafka", "http") and ":" not in settings.relay.publisher:
        raise ConfigError(f"relay.publisher {settings.relay.publisher!r} is not 'kafka', 'http' or 'module:factory'")
