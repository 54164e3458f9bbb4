"""One relay process for many outboxes: one publisher, one worker pool, one metrics server.

``MultiRelay`` serves the sources of ``[sources.<name>]`` and ``[discovery]``
(``sources.py``). Each source has its own small connection pool, lease keeper and
gauges (``SourceRuntime``), run by threads the sources share (source_services.py: one for
every source's lease extensions, one for their gauges, eight for probes); the worker threads are
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from ..config import Settings
from ..core.startup import startup_gave_up
from ..db.store import make_store
from ..errors import DatabaseError, DatabaseRefused
from ..observability.metrics import RelayMetrics, StatsRefresher
from ..observability.sources_metrics import SourcesMetrics
from ..observability.tracing import Tracing
from ..publishers.base import Publisher
from ..sources import static_sources
from .lease_keeper import LeaseKeeper
from .scheduler import SourceScheduler, SourceState
from .shell import RelayShell, tune_garbage_collector
from .source_services import Discovery, GaugeRounds, LeaseRounds, PartitionRounds, SourceRuntime
from .worker import ClaimedBatch, Worker, WorkerConfig

log = structlog.get_logger("outbox_relay.sources")


class MultiRelay(RelayShell):
    """The process shell serving every configured and discovered source."""

    metrics: SourcesMetrics

    def __init__(
        self, settings: Settings, *, publisher: Publisher | None = None, tracing: Tracing | None = None
    ) -> None:
        super().__init__(settings, SourcesMetrics(), publisher=publisher, tracing=tracing)
        self.scheduler = SourceScheduler(probe_max_seconds=settings.relay.poll_interval_seconds)
        self.runtimes: dict[str, SourceRuntime] = {}
        self._runtimes_lock = threading.Lock()
        self._probe_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="source-probe")
        self._gauges: GaugeRounds | None = None
        self._leases: LeaseRounds | None = None
        self._partition_rounds: PartitionRounds | None = None
        self._discovery: Discovery | None = None
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

    def _runtimes_now(self) -> list[SourceRuntime]:
        with self._runtimes_lock:
            return list(self.runtimes.values())

    def _worker_for(self, runtime: SourceRuntime, index: int) -> Worker:
        """The worker ``index`` of the pool for this source (made on first use)."""
        with runtime.lock:
            worker = runtime.workers.get(index)
            if worker is None:
                assert runtime.cfg is not None
                worker = Worker(
                    index,
                    runtime.store,
                    self.publisher,
                    runtime.cfg,
                    runtime.metrics,
                    breaker=self.breaker,
                    stop_event=self.stop_event,
                    keeper=runtime.keeper,
                    budget=self.budget,
                    tracing=self.tracing,
                    source=runtime.name,
                )
                runtime.workers[index] = worker
                self.keep_long_lived()
            return worker

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
        # Not started: the process's one lease thread (_LeaseRounds) runs its steps.
        runtime.keeper = LeaseKeeper.from_settings(runtime.store, s)
        runtime.refresher = StatsRefresher.from_settings(runtime.store, runtime.metrics, s)
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
                    has_work = runtime.store.has_due_rows()
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
    def _serve(self) -> None:
        s = self.settings
        self._start_breaker()
        for name, source_settings in static_sources(s).items():
            self.add_source(name, source_settings)
        self._start_threads()
        if s.discovery.enabled:
            self._discovery = Discovery(
                s,
                add=lambda name, settings: self.add_source(name, settings, discovered=True),
                remove=self.remove_source,
            )
            self._discovery.start()
        self._started = True
        self._waiting_for = None

    def _after_start(self) -> None:
        s = self.settings
        if not self._started:
            return
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
            ready, why = self.readiness_of_dependencies(held_back=False)  # a held-back topic is not a dependency down
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
        elif not problems:  # listing and sources ruled out: what remains comes from the target
            problems["target"] = why.removeprefix("not ready: ")
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
            self._gauges = GaugeRounds(
                s.metrics.refresh_interval_seconds,
                runtimes=self._runtimes_now,
                scheduler=self.scheduler,
                stopping=self.stop_event,
            )
            self._gauges.start()
        self._leases = LeaseRounds(s, runtimes=self._runtimes_now, pool=self._probe_pool)
        self._leases.start()
        if s.partitioning.enabled and s.partitioning.maintain_in_relay:
            self._partition_rounds = PartitionRounds(
                s.partitioning.maintain_interval_seconds, runtimes=self._runtimes_now, stopping=self.stop_event
            )
            self._partition_rounds.start()
        self._start_submitter()
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

    # --- the shared worker loop ------------------------------------------------------
    def _worker_loop(self, index: int) -> None:
        """Take the next due source, claim one batch of it, hand it to the submitter;
        finish the previous batch (of whichever source) while this one is being built,
        produced and acknowledged: the same pipeline as a single-source worker (the
        claim of batch N+1 overlaps the publish and finalize of batch N)."""
        in_flight: tuple[Worker, ClaimedBatch] | None = None
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
            started = self._claim_and_start(runtime, self._worker_for(runtime, index), epoch, max_batch_bytes)
            # Between batches a worker holds nothing of a source but its batch in flight:
            # a source let go must not stay alive in the locals of a worker waiting for work.
            del runtime
            if started is None:
                continue
            worker, batch = started
            if len(batch.rows) < worker.cfg.batch_size or not self.publisher.pipelines:
                # A short batch (a quiet source's few rows) is finished at once, before
                # the previous batch: its latency is its own acknowledgements and a small
                # finalize, never another source's 1000-row finalize or next claim.
                self._finish(started)
                self._finish(in_flight)
                in_flight = None
            else:
                self._finish(in_flight)
                in_flight = started
            del started, worker, batch
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
            started = self._claim_and_start(runtime, self._worker_for(runtime, index), epoch, max_batch_bytes)
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
    ) -> tuple[Worker, ClaimedBatch] | None:
        """Claim one batch of the source and start it: on the submitter if the batch is
        full, on the worker itself if it is short (or without a submitter). None when
        nothing was claimed (the source is then marked idle or failing by the scheduler).

        A short batch (a quiet source's few rows) is built here, not queued behind the
        busy sources' 1000-message batches on the submitter: the worker waits for it
        at once anyway (it is finished before anything else), so handing it over would
        only add the queue's wait to its latency. Building a few messages is cheap."""
        name = runtime.name
        assert runtime.cfg is not None
        batch_size = runtime.cfg.batch_size
        with structlog.contextvars.bound_contextvars(source=name):
            try:
                batch = worker.claim_batch(reserved_bytes)
            except DatabaseError as exc:
                problem = runtime.store.redact(str(exc))
                delay = self.scheduler.failed(name, problem)
                self._set_up(name, False)
                worker.log.warning(
                    "source's database unavailable; backing off", error=problem, retry_in_seconds=round(delay, 2)
                )
                self.scheduler.done(name)
                return None
            claimed = 0 if batch is None else len(batch.rows)
            self.scheduler.claimed(name, epoch, rows=claimed, batch_size=batch_size)
            if batch is None:
                self.scheduler.done(name)
                return None
            try:
                worker.start_batch(batch, self._submitter if claimed >= batch_size else None)
            except BaseException:
                self.scheduler.done(name)
                raise
        return worker, batch

    def _finish(self, in_flight: tuple[Worker, ClaimedBatch] | None) -> None:
        if in_flight is None:
            return
        worker, batch = in_flight
        name = worker.source or ""
        with structlog.contextvars.bound_contextvars(source=name):
            try:
                worker.finish_batch(batch)
            except Exception as exc:  # rows whose finalize failed are recovered by their lease
                worker.log.warning("batch not finalized; its leases expire", error=worker.store.redact(str(exc)))
            finally:
                self.scheduler.done(name)

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

    # --- the shell's hooks ----------------------------------------------------------
    def _health_detail(self) -> str:
        return f", {len(self.runtimes)} sources"

    def _source_readiness(self) -> tuple[bool, str]:
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

    def _wake_workers(self) -> None:
        self.scheduler.close()
        if self._discovery is not None:
            self._discovery.stop()

    def _stop_services(self) -> None:
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        if self._gauges is not None:
            self._gauges.stop()
        if self._leases is not None:
            self._leases.stop()
        if self._partition_rounds is not None:
            self._partition_rounds.stop()

    def _close_sources(self) -> None:
        for runtime in self._runtimes_now():
            self._close_runtime(runtime)
