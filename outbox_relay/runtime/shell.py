"""RelayShell: what a relay process does the same whether it serves one source or many.

A process serves its sources (one ``[database]``: ``relay.py``; ``[sources]`` and
``[discovery]``: ``multi.py``) with one publisher, one tracing, one metrics server
(/metrics, /healthz, /readyz), one broker circuit breaker and one byte budget. The
shell starts and stops those, answers health and readiness, and handles the signals;
what a source needs (its pool, lease keeper, gauges, workers) the subclass brings
through the hooks below. Every worker drives its batches through the same steps
(``Worker.claim_batch``, ``start_batch``, ``finish_batch``).

Start: load and start the publisher (and tracing), serve /healthz and /readyz, then
``_serve`` (the subclass: wait for the database, open it, start the workers). If any of
it fails, everything started is closed again, the publisher and tracing included.

Stop (SIGTERM/SIGINT, or ``stop()``): no new claims, wait up to
``relay.shutdown_timeout_seconds`` for the batches in flight, then make the publisher
give up (what has no delivery report is released: fenced, back to pending, due now,
attempt refunded) so another replica takes it at once; then the services, the
publisher, tracing, the metrics server and the pools close. A second stop waits for
the first; a second signal exits at once.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import structlog

from ..config import Settings
from ..core.breaker import CircuitBreaker
from ..core.budget import ByteBudget
from ..errors import ConfigError
from ..observability.metrics import MetricsServer, RelayMetrics
from ..observability.tracing import Tracing
from ..observability.tracing_factory import make_tracing
from ..publishers.base import Publisher, load_publisher, not_ready_because
from .submitter import Submitter

log = structlog.get_logger("outbox_relay.relay")


class RelayShell(ABC):
    """The process around the workers; subclasses serve one source or many. ``_serve``
    is theirs to write; the other hooks below do nothing unless a subclass needs them."""

    def __init__(
        self,
        settings: Settings,
        metrics: RelayMetrics,
        *,
        publisher: Publisher | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._given_publisher = publisher
        self.publisher: Publisher = publisher if publisher is not None else _NotLoaded()
        self._given_tracing = tracing
        self.tracing: Tracing = tracing or Tracing()
        self.breaker: CircuitBreaker | None = None
        #: The bytes of claimed rows the process holds at most (relay.max_in_flight_bytes).
        self.budget = ByteBudget(settings.relay.max_in_flight_bytes, metrics.in_flight_bytes)
        #: Pipelining publishers: one thread builds and submits every worker's batches,
        #: so workers go straight on to their next statement (submitter.py).
        self._submitter: Submitter | None = None
        #: Set by stop(): no new claims; a start() still waiting returns.
        self.stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: MetricsServer | None = None
        self._started = False
        # What start() is waiting for; None once the workers run (or before start()).
        self._waiting_for: str | None = None
        self._start_lock = threading.Lock()  # stop() waits for a start() in progress
        self._stop_lock = threading.Lock()
        self._stopped = threading.Event()
        self._signals = 0

    # --- what a subclass brings ---------------------------------------------------------
    @abstractmethod
    def _serve(self) -> None:
        """Start serving (called by start() once the publisher and the metrics server
        run); sets ``_started``. Returning early (stop() was called) is allowed."""

    # Optional hooks: a subclass overrides those it needs; they do nothing here.
    def _after_start(self) -> None:  # noqa: B027 (optional hook)
        """Called by start() once ``_serve`` returned, outside the start lock."""

    def _wake_workers(self) -> None:  # noqa: B027 (optional hook)
        """stop(): wake workers and services waiting for work, so they see the stop."""

    def _stop_services(self) -> None:  # noqa: B027 (optional hook)
        """Stop the subclass's own threads and services (after the workers ended)."""

    def _close_sources(self) -> None:  # noqa: B027 (optional hook)
        """Close every source's connection pool (last)."""

    def _starting_text(self) -> str:
        return f"ok: starting ({self._waiting_for or 'starting'})"

    def _health_detail(self) -> str:
        return ""

    def _database_problem(self) -> str | None:
        """Why the process is not ready on account of its database, if it is not."""
        return None

    def _source_readiness(self) -> tuple[bool, str]:
        return True, "ready"

    def freeze_long_lived(self) -> None:
        """run_forever(), once started: cheaper garbage collection from now on."""
        tune_garbage_collector()

    # --- start ----------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self.stop_event.is_set():
                return
            self._start_publisher()
            self._waiting_for = "starting"  # /healthz 200, /readyz 503 from the first request
            try:
                self._start_metrics_server()
                self._serve()
            except BaseException:
                self._clean_up_failed_start()
                raise
        self._after_start()

    def _start_publisher(self) -> None:
        s = self.settings
        if self._given_publisher is None:
            self.publisher = load_publisher(s)
        if self._given_tracing is None:
            self.tracing = make_tracing(s, self.publisher)  # ConfigError if enabled but not installed
        try:
            self.publisher.start()
        except Exception as exc:  # e.g. KafkaException: unknown property, bad SASL mechanism
            self.tracing.close()
            raise ConfigError(f"cannot create the publisher: {exc}") from None
        self.publisher.observer = self.metrics

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

    def _start_breaker(self) -> None:
        """The broker circuit breaker, for publishers that can be probed."""
        publisher = self.publisher
        if publisher.can_probe:
            self.breaker = CircuitBreaker(
                lambda: publisher.probe(timeout_seconds=2.0), self.metrics.circuit_breaker_open
            )

    def _clean_up_failed_start(self) -> None:
        """A start that failed after the publisher started: close everything it opened."""
        self.stop_event.set()
        self._wake_workers()
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join(timeout=5)
        self._close_submitter()
        self._stop_services()
        self.publisher.close()
        self.tracing.close()
        if self._server is not None:
            self._server.stop()
        self._close_sources()

    def _start_submitter(self) -> None:
        if self.publisher.pipelines:
            self._submitter = Submitter()

    def _close_submitter(self) -> None:
        if self._submitter is not None:
            self._submitter.close()

    @property
    def metrics_port(self) -> int | None:
        return self._server.port if self._server else None

    # --- health -----------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if not self._started and self._waiting_for is not None:
            return True, self._starting_text()
        workers = [t for t in self._threads if t.name.startswith("worker-")]
        alive = sum(1 for t in workers if t.is_alive())
        problem = self.publisher.check_alive() if self._started else None
        if problem is not None:
            return False, f"unhealthy: {problem}"
        if self._started and alive == len(workers) and alive > 0:
            return True, f"ok: {alive} workers alive{self._health_detail()}"
        return False, f"unhealthy: {alive}/{len(workers)} workers alive"

    def readiness(self) -> tuple[bool, str]:
        return self.readiness_of_dependencies(held_back=True)

    def readiness_of_dependencies(self, *, held_back: bool) -> tuple[bool, str]:
        """Readiness; ``held_back=False`` leaves out the topics the target holds back
        (an ACL, a missing topic): the broker answers, so start-up need not wait for them."""
        if not self._started:
            return False, f"not ready: {self._waiting_for or 'starting'}"
        database_problem = self._database_problem()
        if database_problem is not None:
            return False, f"not ready: {database_problem}"
        if self.breaker is not None and self.breaker.is_open:
            return False, not_ready_because("broker circuit breaker open", self.publisher.trouble())
        if not self.publisher.healthy():
            return False, not_ready_because("broker unreachable", self.publisher.trouble())
        held = self.publisher.held_back() if held_back else None
        if held is not None:
            return False, f"not ready: {held}"
        return self._source_readiness()

    # --- stop -------------------------------------------------------------------------
    def stop(self, timeout_seconds: float | None = None) -> None:
        """Graceful hand-off; safe to call twice (a second caller waits for the first)."""
        with self._stop_lock:
            if not self._stopped.is_set():
                self._stop(timeout_seconds)

    def _stop(self, timeout_seconds: float | None) -> None:
        s = self.settings
        timeout = s.relay.shutdown_timeout_seconds if timeout_seconds is None else timeout_seconds
        log.info("stopping: no new claims; waiting for in-flight batches", timeout_seconds=timeout)
        self.stop_event.set()
        self._wake_workers()
        # A start() still waiting for its dependencies sees the flag and returns.
        if not self._start_lock.acquire(timeout=s.database.connect_timeout_seconds + 15):
            log.warning("start-up did not return in time; stopping anyway")
        else:
            self._start_lock.release()
        deadline = time.monotonic() + timeout
        started = [t for t in self._threads if t.ident is not None]
        for thread in started:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in started):
            log.warning("shutdown deadline reached: releasing unacknowledged rows")
            self.publisher.abort()
            for thread in started:
                thread.join(timeout=10)
        self._close_submitter()
        self._stop_services()
        self.publisher.close()
        self.tracing.close()  # flushes the last spans
        if self._server is not None:
            self._server.stop()
        self._close_sources()
        self._stopped.set()
        log.info("relay stopped")

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # --- signals ----------------------------------------------------------------------
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
        self.freeze_long_lived()
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
        raise RuntimeError("start() was not called")
