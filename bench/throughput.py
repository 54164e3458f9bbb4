#!/usr/bin/env python3
"""Drain throughput, side by side in one run on the same PostgreSQL and broker.

Three variants, each draining the same backlog from a fresh table (its own schema):

  seed      the naive leased dispatcher, re-implemented faithfully: 4 threads, its
            claim SQL (batch 50), then per message a synchronous publish (produce +
            flush = wait for that message's delivery report) and a fenced UPDATE in
            its own transaction.
  db-bound  the database-only bound: OutboxStore.claim (relay default batch) +
            OutboxStore.mark_done per batch, no publish, 4 threads.
  relay     ``outbox-relay run --workers 4`` as a subprocess, started warm (running
            and idle) before the backlog is committed in one transaction; timed from
            that COMMIT until no row is pending/processing.
  otel      (opt-in, ``--variants otel``) the relay with OpenTelemetry tracing off,
            on, and on with the writers' traces sampled at 10 % (the default
            parent-based sampler follows them), OTLP/HTTP to a receiver in this
            process that decodes every span, alternating ``--otel-rounds`` times.
            Every row carries a stored traceparent. Reports each mode / off, and
            how many sampled message spans arrived (the SDK's batch processor
            drops spans when its queue, OTEL_BSP_MAX_QUEUE_SIZE, is full).

Optional (--variants): ``ordered`` (the relay with ordered_event_types=["*"] on few
hot and many cold aggregates) and ``ordered-dead`` (ordered drains of 20 000 events
over 2 000 live aggregates while 0 / 20 000 / 100 000 other aggregates hold only one
old dead row each: the ordered claim's cost must not grow with the operator's backlog).

Correctness: every variant must end with all rows done; seed and relay must put
every message id on their topic (read back with embedded.read_messages).

    .venv/bin/python bench/throughput.py                  # 40k events, embedded servers
    .venv/bin/python bench/throughput.py --events 5000    # quick
    .venv/bin/python bench/throughput.py --rss-events 100000 --json
    .venv/bin/python bench/throughput.py --variants ordered-dead
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import _common as c
import psycopg
from psycopg import sql
from psycopg.rows import class_row

from outbox_relay.config import load_settings
from outbox_relay.db.store import OutboxStore

DEFAULTS = load_settings(None)  # the product's defaults (no file; env is not read for bench knobs)


# =========================================================================================
# (a) the naive leased dispatcher (claim + reap, fenced UPDATE per message), against our table's columns
# =========================================================================================
class RetryableError(Exception):
    pass


class PermanentError(Exception):
    pass


class Defer(Exception):
    def __init__(self, delay: timedelta, reason: str) -> None:
        super().__init__(reason)
        self.delay = delay


@dataclass(frozen=True)
class SeedClaimed:
    id: int
    lease_version: int
    attempts: int
    aggregate_id: str
    event_type: str
    payload: dict[str, Any]


SEED_CLAIM_SQL = """
WITH picked AS (
    SELECT id
    FROM {table}
    WHERE (status = 'pending' AND available_at <= now())
       OR (status = 'processing' AND lease_until < now()
           AND attempts < %(max_attempts)s)
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + %(lease)s,
    lease_version = o.lease_version + 1,
    attempts = o.attempts + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_id, o.event_type, o.payload
"""

SEED_REAP_SQL = """
UPDATE {table}
SET status = 'dead', last_error = 'lease expired after max attempts (worker crash?)',
    lease_owner = NULL, lease_until = NULL
WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s
"""

SEED_FENCED_UPDATE = """
UPDATE {table}
SET {set_clause},
    lease_owner = NULL,
    lease_until = NULL
WHERE id = %(id)s
  AND status = 'processing'
  AND lease_version = %(version)s
"""


class SeedDispatcher:
    """The seed's functions, bound to one table (names composed with sql.Identifier)."""

    def __init__(self, table: str) -> None:
        t = c.ident(table)
        self.claim_sql = sql.SQL(SEED_CLAIM_SQL).format(table=t)
        self.reap_sql = sql.SQL(SEED_REAP_SQL).format(table=t)
        self._table = t

    def claim(
        self, conn: psycopg.Connection[Any], *, owner: str, batch: int, lease: timedelta, max_attempts: int = 12
    ) -> list[SeedClaimed]:
        params = {"batch": batch, "owner": owner, "lease": lease, "max_attempts": max_attempts}
        with conn.transaction(), conn.cursor(row_factory=class_row(SeedClaimed)) as cur:
            cur.execute(self.reap_sql, params)
            cur.execute(self.claim_sql, params)
            return sorted(cur.fetchall(), key=lambda m: m.id)

    def _fenced_update(
        self, conn: psycopg.Connection[Any], msg: SeedClaimed, set_clause: str, params: dict[str, Any]
    ) -> bool:
        stmt = sql.SQL(SEED_FENCED_UPDATE).format(table=self._table, set_clause=sql.SQL(set_clause))
        with conn.transaction():
            cur = conn.execute(stmt, {"id": msg.id, "version": msg.lease_version, **params})
            return cur.rowcount == 1

    def mark_done(self, conn: psycopg.Connection[Any], msg: SeedClaimed) -> bool:
        return self._fenced_update(conn, msg, "status = 'done', done_at = now(), last_error = NULL", {})

    def reschedule(
        self, conn: psycopg.Connection[Any], msg: SeedClaimed, *, delay: timedelta, error: str, refund_attempt: bool
    ) -> bool:
        return self._fenced_update(
            conn,
            msg,
            "status = 'pending', available_at = now() + %(delay)s, last_error = %(error)s,"
            " attempts = attempts - %(refund)s",
            {"delay": delay, "error": error[:500], "refund": 1 if refund_attempt else 0},
        )

    def mark_dead(self, conn: psycopg.Connection[Any], msg: SeedClaimed, *, error: str) -> bool:
        return self._fenced_update(conn, msg, "status = 'dead', last_error = %(error)s", {"error": error[:500]})

    def dispatch_once(
        self,
        conn: psycopg.Connection[Any],
        publisher: SeedKafkaPublisher,
        *,
        owner: str,
        batch: int = 50,
        lease: timedelta = timedelta(seconds=60),
        max_attempts: int = 12,
    ) -> int:
        """One claim, then per message a synchronous publish and a fenced UPDATE."""
        messages = self.claim(conn, owner=owner, batch=batch, lease=lease, max_attempts=max_attempts)
        for msg in messages:
            try:
                publisher.publish(
                    message_id=str(msg.id), key=msg.aggregate_id, event_type=msg.event_type, payload=msg.payload
                )
            except Defer as d:
                fenced = self.reschedule(conn, msg, delay=d.delay, error=f"deferred: {d}", refund_attempt=True)
            except RetryableError as exc:
                if msg.attempts >= max_attempts:
                    fenced = self.mark_dead(conn, msg, error=f"retries exhausted: {exc!r}")
                else:
                    fenced = self.reschedule(
                        conn, msg, delay=full_jitter_backoff(msg.attempts), error=repr(exc), refund_attempt=False
                    )
            except PermanentError as exc:
                fenced = self.mark_dead(conn, msg, error=repr(exc))
            else:
                fenced = self.mark_done(conn, msg)
            if not fenced:
                c.say(f"  seed: lost lease id={msg.id} version={msg.lease_version}")
        return len(messages)


def full_jitter_backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> timedelta:
    return timedelta(seconds=random.uniform(0, min(cap, base * 2**attempt)))


class SeedKafkaPublisher:
    """The seed's ``Publisher`` on Kafka: publish() returns once *this* message's
    delivery report arrived (produce, then flush). One producer per worker thread so
    a flush waits for its own message only. Same producer settings as the relay
    (idempotent, acks=all) except linger.ms=0, which only helps a one-message flush."""

    def __init__(self, conf: dict[str, Any], topic: str, timeout_seconds: float = 20.0) -> None:
        from confluent_kafka import Producer

        self._producer = Producer({**conf, "linger.ms": 0})
        self._topic = topic
        self._timeout = timeout_seconds

    def publish(self, *, message_id: str, key: str, event_type: str, payload: dict[str, Any]) -> None:
        from confluent_kafka import KafkaError, KafkaException

        report: list[Any] = []
        try:
            self._producer.produce(
                self._topic,
                key=key.encode(),
                value=json.dumps(payload).encode(),
                headers=[("message_id", message_id), ("event_type", event_type)],
                on_delivery=lambda err, _msg: report.append(err),
            )
        except KafkaException as exc:
            raise RetryableError(str(exc)) from exc
        except BufferError as exc:
            raise RetryableError("local queue full") from exc
        self._producer.flush(self._timeout)
        if not report:
            raise RetryableError("no delivery report")
        err = report[0]
        if err is not None:
            if err.code() in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD):
                raise PermanentError(err.str())
            raise RetryableError(err.str())

    def close(self) -> None:
        self._producer.flush(10)


def _unfinished(conn: psycopg.Connection[Any], table: str) -> bool:
    stmt = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending') "
        "OR EXISTS (SELECT 1 FROM {t} WHERE status = 'processing')"
    ).format(t=c.ident(table))
    return bool(conn.execute(stmt).fetchone()[0])


def _run_threads(target: Any, count: int) -> float:
    """Start ``count`` threads of ``target(i)`` together; seconds until all finished."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


def run_seed(dsn: str, bootstrap: str, args: argparse.Namespace) -> dict[str, Any]:
    table = c.new_table("seed")
    topic = f"bench.{c.RUN_ID}.seed"
    c.migrate(dsn, table)
    c.create_topic(bootstrap, topic)
    with psycopg.connect(dsn) as conn, conn.transaction():
        c.copy_backlog(conn, table, args.events, aggregates=args.aggregates, payload_bytes=args.payload_bytes)
    dispatcher = SeedDispatcher(table)
    from outbox_relay.publishers.kafka import producer_config

    conf = producer_config(load_settings(None, kafka={"bootstrap_servers": bootstrap}))
    conns = [psycopg.connect(dsn) for _ in range(args.workers)]
    publishers = [SeedKafkaPublisher(conf, topic) for _ in range(args.workers)]
    for p in publishers:  # connect + fetch metadata before the clock starts
        p._producer.list_topics(topic, timeout=10)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            while True:
                n = dispatcher.dispatch_once(conns[i], publishers[i], owner=f"seed:w{i}", batch=args.seed_batch)
                if n == 0:
                    if not _unfinished(conns[i], table):
                        return
                    time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    c.checkpoint(dsn)
    c.say(f"(a) seed dispatcher: draining {args.events} events ...")
    elapsed = _run_threads(worker, args.workers)
    for p in publishers:
        p.close()
    for cn in conns:
        cn.close()
    if errors:
        raise errors[0]
    return _finish("seed", dsn, bootstrap, table, topic, args, elapsed, read_back=True)


# =========================================================================================
# (b) database-only bound: the product's batched claim + batched fenced finalize
# =========================================================================================
def _warm_pool(store: OutboxStore, size: int) -> None:
    """Open every pooled connection before the clock starts (the pool grows lazily)."""
    barrier = threading.Barrier(size)

    def hold() -> None:
        with store.connection() as conn:
            conn.execute("SELECT 1")
            barrier.wait(timeout=30)

    threads = [threading.Thread(target=hold) for _ in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_db_bound(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    table = c.new_table("dbbound")
    c.migrate(dsn, table, on_done=args.on_done)
    with psycopg.connect(dsn) as conn, conn.transaction():
        c.copy_backlog(conn, table, args.events, aggregates=args.aggregates, payload_bytes=args.payload_bytes)
    store = OutboxStore(dsn, table, pool_size=args.workers + 2)
    store.open()
    _warm_pool(store, args.workers + 2)
    errors: list[BaseException] = []
    relay = DEFAULTS.relay

    probes = [psycopg.connect(dsn, autocommit=True) for _ in range(args.workers)]

    def worker(i: int) -> None:
        try:
            while True:
                rows = store.claim(
                    owner=f"db:w{i}",
                    batch=args.batch_size,
                    lease_seconds=relay.lease_seconds,
                    max_attempts=relay.max_attempts,
                ).rows
                if not rows:
                    if not _unfinished(probes[i], table):
                        return
                    time.sleep(0.05)
                    continue
                store.mark_done([(r.id, r.lease_version) for r in rows])
        except BaseException as exc:
            errors.append(exc)

    c.checkpoint(dsn)
    c.say(f"(b) database-only bound: draining {args.events} events (batch {args.batch_size}) ...")
    elapsed = _run_threads(worker, args.workers)
    store.close()
    for probe in probes:
        probe.close()
    if errors:
        raise errors[0]
    return _finish("db-bound", dsn, None, table, None, args, elapsed, read_back=False)


# =========================================================================================
# (c) the real relay: `outbox-relay run --workers N` as a warm subprocess
# =========================================================================================
def run_relay(
    dsn: str,
    bootstrap: str,
    args: argparse.Namespace,
    events: int,
    label: str,
    *,
    aggregates: int | None = None,
    ordered: bool = False,
    dead_aggregates: int = 0,
    extra_env: dict[str, str] | None = None,
    sampled_every: int = 0,
) -> dict[str, Any]:
    table = c.new_table(label.replace("-", ""))
    topic = f"bench.{c.RUN_ID}.{label}"
    # with the NOTIFY trigger, as `outbox-relay migrate` does by default
    c.migrate(dsn, table, ordering=ordered, on_done=args.on_done)
    c.add_dead_aggregates(dsn, table, dead_aggregates, payload_bytes=args.payload_bytes, analyze=False)
    c.create_topic(bootstrap, topic)
    env = c.relay_env(dsn, table, bootstrap, topic)
    if args.batch_size != DEFAULTS.relay.batch_size:
        env["OUTBOX_RELAY_RELAY__BATCH_SIZE"] = str(args.batch_size)
    if ordered:
        env["OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES"] = '["*"]'
    env["OUTBOX_RELAY_RELAY__ON_DONE"] = args.on_done
    env.update(extra_env or {})
    aggregates = aggregates or args.aggregates
    relay = c.RelayProcess(["--workers", str(args.workers)], env)
    try:
        relay.wait_started()
        time.sleep(args.warm_seconds)  # every worker has made its first (empty) claim and sleeps
        rss_idle_kb = relay.status_kb("VmRSS")
        cpu_before = relay.cpu_seconds()
        with psycopg.connect(dsn) as conn:
            with conn.transaction():
                c.copy_backlog(conn, table, events, aggregates=aggregates, payload_bytes=args.payload_bytes)
                if sampled_every:  # every row written inside a writer span, as enqueue() stores it;
                    # one in `sampled_every` of those traces sampled (trace flags 01), the rest not (00)
                    conn.execute(
                        sql.SQL(
                            "UPDATE {} SET headers = jsonb_build_object('traceparent', '00-' || md5(id::text) || '-' "
                            "|| left(md5('s' || id::text), 16) || CASE WHEN id %% %s = 0 THEN '-01' ELSE '-00' END)"
                        ).format(sql.Identifier(*table.split("."))),
                        (sampled_every,),
                    )
                c.checkpoint(dsn)
                c.say(f"(c) relay subprocess ({label}): committing {events} events, relay idle and warm ...")
                started = time.monotonic()  # the COMMIT below makes the whole backlog visible at once
            with psycopg.connect(dsn, autocommit=True) as poll:
                finished = c.wait_drained(poll, table, timeout=args.timeout)
        elapsed = finished - started
        cpu_after = relay.cpu_seconds()
        hwm_kb = relay.status_kb("VmHWM")
        rss_end_kb = relay.status_kb("VmRSS")
    finally:
        code = relay.stop()
    result = _finish(
        label, dsn, bootstrap, table, topic, args, elapsed, read_back=True, events=events, dead=dead_aggregates
    )
    result.update(
        {
            "aggregates": aggregates,
            "ordered": ordered,
            "dead_aggregates": dead_aggregates,
            "peak_rss_mb": round(hwm_kb / 1024, 1) if hwm_kb else None,
            "idle_rss_mb": round(rss_idle_kb / 1024, 1) if rss_idle_kb else None,
            "end_rss_mb": round(rss_end_kb / 1024, 1) if rss_end_kb else None,
            "exit_code": code,
            "log_warnings": relay.warnings(),
            # CPU the relay process spent draining (all its threads): steadier than events/s
            # on a shared machine. Spans still queued for export at the end are not in it.
            "relay_cpu_us_per_event": (
                round((cpu_after - cpu_before) / events * 1e6, 1)
                if cpu_before is not None and cpu_after is not None
                else None
            ),
        }
    )
    if code != 0:
        result["ok"] = False
        result["problems"].append(f"relay exited {code} on SIGTERM")
    relay.cleanup()
    return result


def run_otel(dsn: str, bootstrap: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The relay with tracing off and on, alternating, on identical traced backlogs."""
    from tests.helpers.otlp_receiver import OtlpReceiver

    results: dict[str, dict[str, Any]] = {}
    with OtlpReceiver() as receiver:
        on_env = {
            "OUTBOX_RELAY_OTEL__ENABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "outbox-relay-bench",
        }
        for round_ in range(1, args.otel_rounds + 1):
            for mode, sampled_every in (("off", 1), ("on", 1), ("on10", 10)):
                label = f"otel-{mode}-{round_}"
                before = len(receiver.snapshot())
                result = run_relay(
                    dsn,
                    bootstrap,
                    args,
                    args.events,
                    label,
                    sampled_every=sampled_every,
                    extra_env={"OUTBOX_RELAY_OTEL__ENABLED": "false"} if mode == "off" else on_env,
                )
                if mode != "off":  # SIGTERM flushed the exporter: what did not arrive was dropped
                    spans = receiver.snapshot()[before:]
                    sends = sum(1 for s in spans if s.kind == "PRODUCER")
                    expected = args.events // sampled_every
                    result["message_spans_expected"] = expected
                    result["message_spans_received"] = sends
                    result["spans_received"] = len(spans)
                    if not sends or sends > expected:
                        result["problems"].append(f"{sends} message spans received, expected up to {expected}")
                        result["ok"] = False
                results[label] = result
    return results


# =========================================================================================
def _finish(
    label: str,
    dsn: str,
    bootstrap: str | None,
    table: str,
    topic: str | None,
    args: argparse.Namespace,
    elapsed: float,
    *,
    read_back: bool,
    events: int | None = None,
    dead: int = 0,
) -> dict[str, Any]:
    """``dead``: rows that were dead before the drain and must still be (an operator's dead backlog)."""
    n = events if events is not None else args.events
    depth = c.count_by_status(dsn, table)
    problems = []
    # In delete mode (relay.on_done=delete; the seed keeps its rows) delivered rows are gone.
    deleted = args.on_done == "delete" and label != "seed"
    expected_done = 0 if deleted else n
    if (
        depth.get("done", 0) != expected_done
        or depth.get("dead", 0) != dead
        or sum(depth.values()) != expected_done + dead
    ):
        problems.append(f"rows not all {'delivered' if deleted else 'done'}: {depth}")
    result: dict[str, Any] = {
        "variant": label,
        "events": n,
        "seconds": round(elapsed, 3),
        "events_per_second": round(n / elapsed, 1) if elapsed > 0 else None,
        "rows": depth,
        "table": table,
    }
    if read_back and bootstrap and topic:
        c.say(f"    reading {topic} back ...")
        unique, total = c.unique_message_ids(bootstrap, topic, n)
        result.update({"topic": topic, "unique_message_ids": unique, "messages_on_topic": total})
        if unique != n:
            problems.append(f"{unique} unique message ids on the topic, expected {n}")
    result["ok"] = not problems
    result["problems"] = problems
    if not args.keep:
        c.drop_schema(dsn, table)
    c.say(
        f"    {label}: {result['events_per_second']} events/s in {elapsed:.2f}s"
        + ("" if result["ok"] else f"  PROBLEMS: {problems}")
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    c.add_server_args(parser)
    parser.add_argument("--events", type=int, default=40_000, help="backlog size (default 40000)")
    parser.add_argument("--aggregates", type=int, default=100, help="distinct aggregate ids (default 100)")
    parser.add_argument("--payload-bytes", type=int, default=200, help="approximate JSON payload size (default 200)")
    parser.add_argument("--workers", type=int, default=4, help="threads of every variant (default 4)")
    parser.add_argument("--seed-batch", type=int, default=50, help="seed dispatcher's claim batch (default 50)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS.relay.batch_size,
        help=f"db-bound and relay claim batch (default: relay default, {DEFAULTS.relay.batch_size})",
    )
    parser.add_argument(
        "--warm-seconds",
        type=float,
        default=2.0,
        help="idle time of the started relay before the backlog commits (default 2)",
    )
    parser.add_argument(
        "--rss-events",
        type=int,
        default=0,
        help="also drain this many events with the relay and report its peak RSS (e.g. 100000)",
    )
    parser.add_argument(
        "--on-done",
        choices=("keep", "delete"),
        default="keep",
        help="relay.on_done of the db-bound and relay variants (and their tables)",
    )
    parser.add_argument(
        "--variants",
        default="seed,db-bound,relay",
        help="comma-separated subset of seed,db-bound,relay,ordered,ordered-dead,otel (default "
        "seed,db-bound,relay; 'ordered' adds the relay with ordered_event_types=[\"*\"] on few "
        "hot and many cold aggregates; 'ordered-dead' adds ordered drains of --dead-events over "
        "--dead-live-aggregates with each --dead-aggregates count of dead-only aggregates; "
        "'otel' the relay with tracing off vs on)",
    )
    parser.add_argument("--hot-aggregates", type=int, default=4, help="ordered variant: few hot aggregates (4)")
    parser.add_argument(
        "--cold-aggregates", type=int, default=20_000, help="ordered variant: many cold aggregates (20000)"
    )
    parser.add_argument(
        "--dead-aggregates",
        default="0,20000,100000",
        help="ordered-dead variant: counts of aggregates holding only one old dead row (default 0,20000,100000)",
    )
    parser.add_argument("--dead-events", type=int, default=20_000, help="ordered-dead variant: backlog (20000)")
    parser.add_argument(
        "--dead-live-aggregates",
        type=int,
        default=2_000,
        help="ordered-dead variant: live aggregates of the backlog (2000)",
    )
    parser.add_argument(
        "--dead-repeats",
        type=int,
        default=1,
        help="ordered-dead variant: runs of each count, interleaved; ratios of medians (default 1)",
    )
    parser.add_argument("--target-dead-ratio", type=float, default=0.8)
    parser.add_argument(
        "--otel-rounds", type=int, default=2, help="otel variant: off/on pairs, alternating (default 2)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up a drain after this many seconds")
    parser.add_argument("--target-vs-seed", type=float, default=10.0)
    parser.add_argument("--target-vs-db", type=float, default=0.6)
    parser.add_argument("--target-rss-mb", type=float, default=150.0)
    args = parser.parse_args()
    variants = {v.strip() for v in args.variants.split(",") if v.strip()}

    results: dict[str, dict[str, Any]] = {}
    with c.servers(args) as (dsn, bootstrap):
        assert bootstrap is not None
        version = c.server_version(dsn)
        if "seed" in variants:
            results["seed"] = run_seed(dsn, bootstrap, args)
        if "db-bound" in variants:
            results["db-bound"] = run_db_bound(dsn, args)
        if "relay" in variants:
            results["relay"] = run_relay(dsn, bootstrap, args, args.events, "relay")
        if "ordered" in variants:
            results["ordered-hot"] = run_relay(
                dsn, bootstrap, args, args.events, "ordered-hot", aggregates=args.hot_aggregates, ordered=True
            )
            results["ordered-cold"] = run_relay(
                dsn, bootstrap, args, args.events, "ordered-cold", aggregates=args.cold_aggregates, ordered=True
            )
        if "ordered-dead" in variants:
            for rep in range(1, args.dead_repeats + 1):  # interleaved, so drift hits every count alike
                for n in (int(x) for x in args.dead_aggregates.split(",") if x.strip()):
                    label = f"ordered-dead-{n}" + (f"-run{rep}" if args.dead_repeats > 1 else "")
                    results[label] = run_relay(
                        dsn,
                        bootstrap,
                        args,
                        args.dead_events,
                        label,
                        aggregates=args.dead_live_aggregates,
                        ordered=True,
                        dead_aggregates=n,
                    )
        if "otel" in variants:
            results.update(run_otel(dsn, bootstrap, args))
        if args.rss_events:
            results["relay-rss"] = run_relay(dsn, bootstrap, args, args.rss_events, "relay-rss")

    def eps(name: str) -> float | None:
        return results.get(name, {}).get("events_per_second")

    ratios: dict[str, float | None] = {}
    if eps("relay") and eps("seed"):
        ratios["relay_vs_seed"] = round(eps("relay") / eps("seed"), 2)
    if eps("relay") and eps("db-bound"):
        ratios["relay_vs_db_bound"] = round(eps("relay") / eps("db-bound"), 2)
    targets: dict[str, dict[str, Any]] = {}
    if "relay_vs_seed" in ratios:
        targets["relay_vs_seed"] = {
            "target": f">= {args.target_vs_seed}x",
            "value": ratios["relay_vs_seed"],
            "met": ratios["relay_vs_seed"] >= args.target_vs_seed,
        }
    for name in ("ordered-hot", "ordered-cold"):
        if eps(name) and eps("relay"):
            ratios[f"{name}_vs_unordered"] = round(eps(name) / eps("relay"), 2)
    per_dead: dict[int, list[float]] = {}  # dead-only aggregates -> events/s of each run
    for name, r in results.items():
        if name.startswith("ordered-dead-") and r.get("events_per_second"):
            per_dead.setdefault(r["dead_aggregates"], []).append(r["events_per_second"])
    if 0 in per_dead and len(per_dead) > 1:
        none = c.median(per_dead[0])
        for n in sorted(per_dead)[1:]:
            ratios[f"ordered-dead-{n}_vs_none"] = round(c.median(per_dead[n]) / none, 2)
        worst = f"ordered-dead-{max(per_dead)}_vs_none"
        targets[worst] = {
            "target": f">= {args.target_dead_ratio:g}x",
            "value": ratios[worst],
            "met": ratios[worst] >= args.target_dead_ratio,
        }

    def median_of(prefix: str, key: str) -> float | None:
        values = [r[key] for n, r in results.items() if n.startswith(prefix) and r.get(key)]
        return statistics.median(values) if values else None

    otel_off, otel_off_cpu = (
        median_of("otel-off-", "events_per_second"),
        median_of("otel-off-", "relay_cpu_us_per_event"),
    )
    for mode in ("on", "on10"):
        value, cpu = (
            median_of(f"otel-{mode}-", "events_per_second"),
            median_of(f"otel-{mode}-", "relay_cpu_us_per_event"),
        )
        if value and otel_off:
            ratios[f"otel_{mode}_vs_off"] = round(value / otel_off, 2)
        if cpu and otel_off_cpu:
            ratios[f"otel_{mode}_cpu_vs_off"] = round(cpu / otel_off_cpu, 2)
    if "relay_vs_db_bound" in ratios:
        targets["relay_vs_db_bound"] = {
            "target": f">= {args.target_vs_db}x",
            "value": ratios["relay_vs_db_bound"],
            "met": ratios["relay_vs_db_bound"] >= args.target_vs_db,
        }
    for name in ("relay", "relay-rss"):
        mb = results.get(name, {}).get("peak_rss_mb")
        if mb is not None:
            targets[f"{name}_peak_rss"] = {
                "target": f"<= {args.target_rss_mb:g} MB",
                "value": mb,
                "met": mb <= args.target_rss_mb,
            }
    all_ok = all(r["ok"] for r in results.values())
    report = {
        "benchmark": "throughput",
        "postgresql": version,
        "broker": c.broker_label(args),
        "events": args.events,
        "aggregates": args.aggregates,
        "payload_bytes": args.payload_bytes,
        "workers": args.workers,
        "seed_batch": args.seed_batch,
        "batch_size": args.batch_size,
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "correct": all_ok,
    }
    lines = [
        f"throughput: {args.events} events (~{args.payload_bytes} B payload, {args.aggregates} aggregates), "
        f"{args.workers} workers, PostgreSQL {version}, broker {c.broker_label(args)}",
        f"  {'variant':<20}{'events/s':>11}{'seconds':>10}  check",
    ]
    for name, r in results.items():
        check = "all done"
        if "unique_message_ids" in r:
            check += f", {r['unique_message_ids']} unique ids on topic ({r['messages_on_topic']} messages)"
        if not r["ok"]:
            check = "FAILED: " + "; ".join(r["problems"])
        extra = f" (events {r['events']})" if name == "relay-rss" else ""
        if name.startswith("ordered-dead-"):
            extra = f" ({r['events']} events over {r['aggregates']} aggregates + {r['dead_aggregates']} dead-only)"
        if r.get("relay_cpu_us_per_event") and name.startswith("otel"):
            extra += f", relay CPU {r['relay_cpu_us_per_event']} us/event, peak RSS {r.get('peak_rss_mb')} MB"
        if "message_spans_received" in r:
            extra += (
                f", {r['message_spans_received']} of {r['message_spans_expected']} sampled message spans "
                f"received ({r['spans_received']} spans)"
            )
        lines.append(f"  {name:<20}{r['events_per_second']:>11,.0f}{r['seconds']:>10.2f}  {check}{extra}")
    for name in ("relay", "relay-rss"):
        r = results.get(name)
        if r and r.get("peak_rss_mb") is not None:
            lines.append(
                f"  {name} subprocess peak RSS (VmHWM): {r['peak_rss_mb']:.1f} MB "
                f"(idle {r['idle_rss_mb']} MB, end {r['end_rss_mb']} MB)"
            )
    for mode, what in (("on", "every trace sampled"), ("on10", "10 % of traces sampled")):
        if f"otel_{mode}_vs_off" in ratios:
            lines.append(
                f"  tracing on, {what} / off: events/s x{ratios[f'otel_{mode}_vs_off']}, "
                f"relay CPU per event x{ratios.get(f'otel_{mode}_cpu_vs_off')}"
            )
    for key, t in targets.items():
        lines.append(f"  {key:<32} {t['value']!s:>8}   target {t['target']:<10} {'met' if t['met'] else 'NOT MET'}")
    if not all_ok:
        lines.append("  CORRECTNESS CHECK FAILED")
    c.emit(report, lines, args.json)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
