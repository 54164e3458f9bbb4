#!/usr/bin/env python3
"""Retention of delivered rows: dropping partitions vs keep + purge vs delete mode, in
WAL bytes per event; and what the claim reads with 30 and 300 partitions.

Part 1, WAL per event (differences of the WAL insert position,
pg_current_wal_insert_lsn(): counts, independent of load and machine). Per mode, a
fresh table made by the relay's own `migrate`:

  drop    [partitioning] interval 1 hour: rows in an hour partition past the retention,
          delivered (done, kept), then `maintain` detaches and drops the partition.
  purge   a plain table in keep mode: rows delivered (done), then `purge --older-than 0s`
          (the relay's purge chunks, 5 000 rows looked at per transaction).
  delete  relay.on_done = delete: the finalize deletes each delivered row.

Phases, each measured by its own LSN difference (a CHECKPOINT first, so every phase
starts with the same full-page-image state): write (the application's inserts, 100
rows a transaction, --payload-bytes of random hex so nothing compresses), deliver (the
relay's claim and fenced finalize statements, batches of 100, through the relay's
store: the statements `run` sends, without a broker), vacuum (VACUUM of the table, as
autovacuum would in the days before retention: the versions delivery left), retention
(drop / purge / none) and vacuum after (what retention left for vacuum).

Every row is written with created_at in one hour two days back, so the same rows are
"old enough" for every mode (the drop mode's partition for that hour is attached first).

Part 2, the claim on a partitioned outbox with --partitions-list partitions (default
30,300) holding --claim-backlog pending rows in the current partition: shared buffers
the claim statement reads (planning and execution, EXPLAIN (ANALYZE, BUFFERS) of the
relay's full claim, rolled back) and the relation locks it takes. Counts, not times.

The timed run (--minutes N) instead: the three modes side by side for N minutes, each
in a process of its own with its own embedded PostgreSQL (default settings, autovacuum
on with the queue's parameters, log_lock_waits on with deadlock_timeout 20 ms). In each,
a writer inserts --rate events/s on a fixed schedule (what is due each tick, one
statement, every insert timed: a wait for a lock is in its time), --workers threads
deliver through the relay's claim and fenced finalize, and retention runs every
--retention-every seconds: drop mode `maintain` (partitions of --interval, --retention),
keep mode `purge --older-than --retention`, delete mode nothing. Every --sample-seconds:
table and index bytes, dead tuples and autovacuum runs (pg_stat_user_tables, summed over
the partitions), the WAL written. Reported per mode: the achieved write and delivery
rates (a rate the machine did not sustain is said so), all WAL per event written, claim
latency p50/p99 per minute, the longest insert during a retention round, and the lock
waits the server logged.

    .venv/bin/python bench/partition_retention.py --events 2000
    .venv/bin/python bench/partition_retention.py --events 20000 --json
    .venv/bin/python bench/partition_retention.py --minutes 3 --rate 500 --interval "1 minute" --retention 1m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay.config import parse_duration, parse_partition_interval
from outbox_relay.db.delivery import BUSY_PLAIN_CLAIM_SETTINGS
from outbox_relay.db.partitions import PartitionLayout, create_partition, partition_storage, range_start
from outbox_relay.db.store import FinalizeItem, OutboxStore

HOUR = 3600
MODES = ("drop", "purge", "delete")


def lsn(conn: psycopg.Connection[Any]) -> int:
    """The WAL insert position: pg_current_wal_lsn() is the write position, which does
    not move for WAL still in the WAL buffers (a VACUUM's records stay there until a
    later flush, and would be counted in the next phase or not at all)."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def layout(premake: int = 2) -> PartitionLayout:
    # autovacuum off on the bench's tables and partitions: vacuum runs in the phases
    # below only, so each phase's WAL is its own and not autovacuum's at a random moment.
    storage = {**partition_storage({}), "autovacuum_enabled": "off"}
    return PartitionLayout(interval_seconds=HOUR, premake=premake, retention_seconds=24 * HOUR, storage=storage)


def write_rows(dsn: str, table: str, events: int, payload_bytes: int, created_at: datetime) -> None:
    ident = c.ident(table)
    with psycopg.connect(dsn) as conn:
        for first in range(0, events, 100):
            with conn.transaction():
                with conn.cursor() as cur:
                    cur.executemany(
                        sql.SQL(
                            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, created_at) "
                            "VALUES ('order', %s, 'OrderCreated', %s::jsonb, %s)"
                        ).format(ident),
                        [
                            (
                                f"agg-{i % 50}",
                                json.dumps({"seq": i, "pad": os.urandom(payload_bytes // 2).hex()}),
                                created_at,
                            )
                            for i in range(first, min(events, first + 100))
                        ],
                    )


def deliver(store: OutboxStore, events: int) -> None:
    delivered = 0
    for _ in range(events):  # bounded: at least one row a round
        rows = store.claim(owner="bench", batch=100, lease_seconds=60, max_attempts=5).rows
        if not rows:
            break
        store.finalize([FinalizeItem(r.id, r.lease_version, "done") for r in rows])
        delivered += len(rows)
    if delivered != events:
        raise SystemExit(f"delivered {delivered} of {events} rows")


def wal_of_mode(dsn: str, mode: str, events: int, payload_bytes: int) -> dict[str, float]:
    table = c.new_table(f"ret_{mode}")
    store = OutboxStore(dsn, table, pool_size=2)
    old_hour = range_start(datetime.now(UTC) - timedelta(days=2), HOUR)
    figures: dict[str, float] = {}
    with store, psycopg.connect(dsn, autocommit=True) as conn:
        store.migrate(
            on_done="delete" if mode == "delete" else "keep",
            partitioning=layout() if mode == "drop" else None,
            notify_trigger=False,
        )
        if mode != "drop":
            conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(c.ident(table)))
        if mode == "drop":
            with conn.transaction():
                create_partition(
                    conn, store.sql, layout(), store.sql.partition_name("pold"), old_hour, old_hour + timedelta(hours=1)
                )
        created_at = old_hour + timedelta(minutes=30)

        def phase(name: str, action: Any) -> None:
            c.checkpoint(dsn)
            before = lsn(conn)
            action()
            figures[name] = (lsn(conn) - before) / events

        vacuum = sql.SQL("VACUUM {}").format(c.ident(table))
        phase("write", lambda: write_rows(dsn, table, events, payload_bytes, created_at))
        phase("deliver", lambda: deliver(store, events))
        # The days between delivery and retention: autovacuum cleans what delivery left.
        phase("vacuum_before", lambda: conn.execute(vacuum))
        if mode == "drop":
            phase("retention", lambda: _drop(store))
        elif mode == "purge":
            phase("retention", lambda: _purge(store))
        else:
            figures["retention"] = 0.0
        phase("vacuum_after", lambda: conn.execute(vacuum))
        [(left,)] = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(c.ident(table))).fetchall()
        if left:
            raise SystemExit(f"{mode}: {left} rows left after retention")
    c.drop_schema(dsn, table)
    figures["total"] = sum(figures[p] for p in ("write", "deliver", "vacuum_before", "retention", "vacuum_after"))
    return figures


def _drop(store: OutboxStore) -> None:
    result = store.maintain_partitions(layout())
    if len(result.dropped) != 1:
        raise SystemExit(f"maintain dropped {result.dropped}, kept {result.kept}, failed {result.failed}")


def _purge(store: OutboxStore) -> None:
    after: int | None = 0
    while after is not None:
        _n, after = store.purge_chunk(0.0, 5000, after)


def claim_reads(dsn: str, partitions: int, backlog: int) -> dict[str, float]:
    """Buffers and locks of one full claim on a table of ``partitions`` partitions."""
    table = c.new_table(f"claim{partitions}")
    store = OutboxStore(dsn, table, pool_size=2)
    with store, psycopg.connect(dsn, autocommit=True) as conn:
        # The default partition and partitions-1 hour partitions: the current one and those ahead (at least 3 in all).
        partitions = max(3, partitions)
        store.migrate(on_done="keep", partitioning=layout(premake=partitions - 2), notify_trigger=False)
        write_rows(dsn, table, backlog, 200, datetime.now(UTC))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(c.ident(table)))
        params = {
            "owner": "bench",
            "batch": 100,
            "lease_seconds": 60.0,
            "max_attempts": 5,
            "ordered_types": [],
            "all_ordered": False,
            "max_batch_bytes": 2**62,
            "candidates": 100,
            "max_message_bytes": None,
            "excluded_types": [],
        }
        statement = store._full_claim_statement  # the statement `run` sends for a full claim
        results = []
        for _ in range(3):  # the first run warms the relation cache; the figures are the last run's
            with conn.transaction(force_rollback=True):
                for name, value in BUSY_PLAIN_CLAIM_SETTINGS.items():  # what `run` sends while busy
                    conn.execute("SELECT set_config(%s, %s, true)", (name, value))
                [(plan,)] = conn.execute(
                    sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + statement, params
                ).fetchall()
                [(locks,)] = conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
                ).fetchall()
            top = plan[0]
            planning = top.get("Planning", {})
            results.append(
                {
                    "partitions": float(len(store.partitions())),
                    "execution_buffers": float(
                        top["Plan"].get("Shared Hit Blocks", 0) + top["Plan"].get("Shared Read Blocks", 0)
                    ),
                    "planning_buffers": float(
                        planning.get("Shared Hit Blocks", 0) + planning.get("Shared Read Blocks", 0)
                    ),
                    "relation_locks": float(locks),
                }
            )
    c.drop_schema(dsn, table)
    return results[-1]


# --- the timed run: three modes side by side, each on its own PostgreSQL -------------------
TIMED_MODES = ("drop", "purge", "delete")
INSERT_ROWS = (
    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT 'order', 'agg-' || (g %% 50), 'OrderCreated', "
    "jsonb_build_object('seq', g, 'pad', substr(repeat(md5(random()::text), 16), 1, %(pad)s)) "
    "FROM generate_series(1, %(rows)s) AS g"
)


@dataclass
class TimedLog:
    """What one mode's threads record, each list appended by one thread only."""

    t0: float
    inserts: list[tuple[float, float, int]] = field(default_factory=list)  # (start s, seconds, rows)
    claims: list[tuple[float, float, int]] = field(default_factory=list)  # (start s, seconds, rows)
    delivered: list[tuple[float, int]] = field(default_factory=list)  # (end s, rows finalized)
    retention: list[dict[str, Any]] = field(default_factory=list)  # one per maintain / purge round
    samples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0


def timed_layout(args: argparse.Namespace) -> PartitionLayout:
    interval = parse_partition_interval(args.interval)
    # Partitions ahead for at least two maintenance rounds (the settings' own rule), and 2 at least.
    premake = max(2, math.ceil(2 * args.retention_every / interval) + 1)
    return PartitionLayout(
        interval_seconds=interval,
        premake=premake,
        retention_seconds=parse_duration(args.retention),
        storage=partition_storage({}),
    )


def _writer(dsn: str, table: str, args: argparse.Namespace, log: TimedLog, stop: threading.Event) -> None:
    """Rows at a fixed rate: each tick inserts what the schedule says is due (one
    statement, autocommit), so a writer that falls behind catches up and the achieved
    rate says what the machine did. Every insert is timed: its wait for a lock is in it."""
    statement = sql.SQL(INSERT_ROWS).format(c.ident(table))
    max_rows = max(1, args.rate // 5)  # at most 200 ms of rows in one statement
    written = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            start = log.now()
            if start >= args.minutes * 60:
                break
            due = int(args.rate * start) - written
            if due <= 0:
                time.sleep(min(0.05, (written + 1) / args.rate - start))
                continue
            rows = min(due, max_rows)
            began = time.monotonic()
            conn.execute(statement, {"rows": rows, "pad": args.payload_bytes})
            log.inserts.append((start, time.monotonic() - began, rows))
            written += rows


def _relay_worker(store: OutboxStore, args: argparse.Namespace, log: TimedLog, stop: threading.Event, n: int) -> None:
    """The relay's claim and fenced finalize through its store (no broker): the statements `run` sends."""
    while not stop.is_set():
        start = log.now()
        began = time.monotonic()
        rows = store.claim(owner=f"bench-{n}", batch=args.batch, lease_seconds=60, max_attempts=5).rows
        log.claims.append((start, time.monotonic() - began, len(rows)))
        if not rows:
            stop.wait(0.05)
            continue
        store.finalize([FinalizeItem(r.id, r.lease_version, "done") for r in rows])
        log.delivered.append((log.now(), len(rows)))


def _retention(
    store: OutboxStore, dsn: str, mode: str, args: argparse.Namespace, log: TimedLog, stop: threading.Event
) -> None:
    """drop: `maintain` (partitions ahead, expired ones dropped); purge: `purge
    --older-than RETENTION` (the relay's purge chunks); delete: nothing to do."""
    if mode == "delete":
        return
    partition_layout = timed_layout(args)
    retention_seconds = parse_duration(args.retention)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(args.retention_every):
            start = log.now()
            wal_before = lsn(conn)
            began = time.monotonic()
            entry: dict[str, Any] = {"t": start}
            if mode == "drop":
                result = store.maintain_partitions(partition_layout)
                entry.update(
                    dropped=len(result.dropped),
                    created=len(result.created),
                    kept=len(result.kept),
                    failed=result.failed,
                    default_rows=result.default_rows,
                )
            else:
                deleted, after = 0, 0
                for _ in range(100_000):  # bounded: at least one chunk of 5 000 rows looked at each
                    n, following = store.purge_chunk(retention_seconds, 5000, after)
                    deleted += n
                    if following is None:
                        break
                    after = following
                entry["deleted"] = deleted
            entry["seconds"] = time.monotonic() - began
            # Includes the WAL every other session wrote in the meantime: an upper bound.
            entry["wal_bytes_span"] = lsn(conn) - wal_before
            log.retention.append(entry)


# The outbox's relations holding rows: its partitions, or the plain table itself
# (pg_partition_tree lists nothing for a table that is not partitioned).
_LEAVES = """
WITH leaves AS (
    SELECT relid FROM pg_partition_tree(%(table)s::regclass) WHERE isleaf
    UNION SELECT %(table)s::regclass WHERE (SELECT relkind FROM pg_class WHERE oid = %(table)s::regclass) = 'r'
)
"""
SAMPLE_SIZES = (
    _LEAVES + "SELECT coalesce(sum(pg_table_size(relid)), 0), coalesce(sum(pg_indexes_size(relid)), 0), count(*) "
    "FROM leaves"
)
SAMPLE_STATS = (
    _LEAVES + "SELECT s.relname, s.n_dead_tup, s.n_live_tup, s.autovacuum_count, s.vacuum_count "
    "FROM pg_stat_user_tables AS s JOIN leaves AS t ON t.relid = s.relid"
)


def _sampler(dsn: str, table: str, args: argparse.Namespace, log: TimedLog, stop: threading.Event, mode: str) -> None:
    """Every --sample-seconds: table and index bytes, dead tuples, autovacuum runs (summed
    over the partitions, a dropped partition's runs kept), the WAL position."""
    regclass = table
    autovacuums: dict[str, int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        wal_start = lsn(conn)
        while True:
            finished = stop.wait(args.sample_seconds)
            [(heap, index, leaves)] = conn.execute(SAMPLE_SIZES, {"table": regclass}).fetchall()
            dead = live = 0
            for relname, n_dead, n_live, av_count, _v in conn.execute(SAMPLE_STATS, {"table": regclass}).fetchall():
                dead += n_dead
                live += n_live
                autovacuums[relname] = max(autovacuums.get(relname, 0), int(av_count))
            written = sum(r for _s, _d, r in log.inserts)
            delivered = sum(r for _t, r in log.delivered)
            sample = {
                "t": log.now(),
                "table_bytes": int(heap),
                "index_bytes": int(index),
                "relations": int(leaves),
                "dead_tuples": int(dead),
                "live_tuples": int(live),
                "autovacuum_runs": sum(autovacuums.values()),
                "wal_bytes": lsn(conn) - wal_start,
                "written": written,
                "delivered": delivered,
            }
            log.samples.append(sample)
            c.say(
                f"[{mode}] {sample['t'] / 60:5.1f} min: written {written}, delivered {delivered}, "
                f"table {heap / 2**20:.1f} MiB + indexes {index / 2**20:.1f} MiB, dead {dead}, "
                f"autovacuum runs {sample['autovacuum_runs']}, WAL {sample['wal_bytes'] / max(1, written):.0f} B/event"
            )
            if finished:
                return


def _lock_waits(log_path: Path) -> list[dict[str, Any]]:
    """The server log's lock waits (log_lock_waits, logged after deadlock_timeout): who
    waited for which lock, how long."""
    found: list[dict[str, Any]] = []
    if not log_path.exists():
        return found
    pattern = re.compile(r"process \d+ (still waiting for|acquired) (\w+) on (.*?) after ([\d.]+) ms")
    lines = log_path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = pattern.search(line)
        if m:
            statement = next((x for x in lines[i + 1 : i + 4] if "STATEMENT:" in x), "")
            found.append(
                {
                    "state": m.group(1),
                    "lock": m.group(2),
                    "on": m.group(3),
                    "ms": float(m.group(4)),
                    "statement": statement.split("STATEMENT:", 1)[-1].strip()[:80],
                }
            )
    return found


def _server_trouble(log_path: Path) -> list[str]:
    """The server log's lines about a backend that died or a failed start (at most 40)."""
    if not log_path.exists():
        return []
    pattern = re.compile(r"terminated by signal|was terminated|Failed process was running|PANIC|not properly shut down")
    return [line for line in log_path.read_text(errors="replace").splitlines() if pattern.search(line)][:40]


def _guarded(target: Any, log: TimedLog, failed: threading.Event, *targs: Any) -> threading.Thread:
    """A thread whose exception ends the mode (every thread stops) and is reported, not lost."""

    def run() -> None:
        try:
            target(*targs)
        except Exception as exc:
            first = (str(exc).splitlines() or [""])[0]
            log.errors.append(f"{log.now() / 60:.1f} min, {target.__name__}: {type(exc).__name__}: {first}")
            failed.set()

    return threading.Thread(target=run, daemon=True)


def timed_worker(args: argparse.Namespace) -> None:
    """One mode of the timed run, on its own embedded PostgreSQL; its figures as JSON to --result."""
    from outbox_relay._embedded.embedded import EmbeddedPostgres

    mode = args.timed_worker
    base = Path(tempfile.mkdtemp(prefix=f"outbox-relay-long-{mode}-"))
    pg = EmbeddedPostgres(base_dir=base).start()
    try:
        dsn = pg.dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            # A lock wait longer than deadlock_timeout is logged (who, which lock, how long).
            conn.execute("ALTER SYSTEM SET log_lock_waits = on")
            conn.execute("ALTER SYSTEM SET deadlock_timeout = '20ms'")
            conn.execute("SELECT pg_reload_conf()")
        table = c.new_table(f"long_{mode}")
        store = OutboxStore(dsn, table, pool_size=args.workers + 4)
        with store:
            store.migrate(
                on_done="delete" if mode == "delete" else "keep",
                partitioning=timed_layout(args) if mode == "drop" else None,
                notify_trigger=False,
            )
            log = TimedLog(t0=time.monotonic())
            stop_writer, stop_rest, failed = threading.Event(), threading.Event(), threading.Event()
            threads = [_guarded(_writer, log, failed, dsn, table, args, log, stop_writer)]
            threads += [
                _guarded(_relay_worker, log, failed, store, args, log, stop_rest, n) for n in range(args.workers)
            ]
            threads.append(_guarded(_retention, log, failed, store, dsn, mode, args, log, stop_rest))
            sampler = _guarded(_sampler, log, failed, dsn, table, args, log, stop_rest, mode)
            for t in [*threads, sampler]:
                t.start()
            deadline = time.monotonic() + args.minutes * 60 + 120
            while threads[0].is_alive() and not failed.is_set() and time.monotonic() < deadline:
                threads[0].join(1.0)
            stop_writer.set()
            stop_rest.set()
            for t in threads:
                t.join(120)
            sampler.join(120)
        server_log = pg.pgdata / "log"
        report = summarize(mode, args, log, _lock_waits(server_log), _version_or_none(dsn))
        report["server_trouble"] = _server_trouble(server_log)
        if args.server_log_dir:
            Path(args.server_log_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(server_log, Path(args.server_log_dir) / f"{mode}.log")
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    Path(args.result).write_text(json.dumps(report, default=str))


def _version_or_none(dsn: str) -> str | None:
    try:
        return c.server_version(dsn)
    except psycopg.Error:
        return None


def summarize(
    mode: str, args: argparse.Namespace, log: TimedLog, lock_waits: list[dict[str, Any]], version: str | None
) -> dict[str, Any]:
    # A mode that failed early is measured over the time its writer ran.
    duration = float(args.minutes * 60)
    if log.errors and log.inserts:
        duration = max(1.0, min(duration, max(s + d for s, d, _r in log.inserts)))
    written = sum(r for _s, _d, r in log.inserts)
    delivered = sum(r for _t, r in log.delivered)
    per_minute = []
    for minute in range(math.ceil(duration / 60)):
        span = min(60.0, duration - minute * 60)  # the last minute may be a part of one
        claims = [d * 1000 for s, d, n in log.claims if minute * 60 <= s < (minute + 1) * 60 and n]
        inserts = [(d * 1000, r) for s, d, r in log.inserts if minute * 60 <= s < (minute + 1) * 60]
        per_minute.append(
            {
                "minute": minute + 1,
                "written_per_s": sum(r for _d, r in inserts) / span,
                "delivered_per_s": sum(r for t, r in log.delivered if minute * 60 <= t < (minute + 1) * 60) / span,
                "claim_p50_ms": c.pct(claims, 50) if claims else None,
                "claim_p99_ms": c.pct(claims, 99) if claims else None,
                "insert_max_ms": max((d for d, _r in inserts), default=None),
            }
        )
    # The longest insert that overlapped a retention round (a drop's DETACH takes ACCESS EXCLUSIVE).
    # drop: the rounds that dropped a partition; purge: every round.
    windows = [(e["t"], e["t"] + e["seconds"]) for e in log.retention if mode != "drop" or e.get("dropped")]
    during = [d for s, d, _r in log.inserts if any(s < end and s + d > begin for begin, end in windows)]
    final = log.samples[-1] if log.samples else {}
    return {
        "mode": mode,
        "server_version": version,
        "errors": log.errors,
        "seconds_measured": duration,
        "minutes": args.minutes,
        "target_rate": args.rate,
        "written": written,
        "delivered": delivered,
        "written_per_s": written / duration,
        "delivered_per_s": delivered / duration,
        "wal_bytes": final.get("wal_bytes", 0),
        "wal_bytes_per_event": final.get("wal_bytes", 0) / max(1, written),
        "autovacuum_runs": final.get("autovacuum_runs", 0),
        "claims": len(log.claims),
        "claim_p50_ms": c.pct([d * 1000 for _s, d, n in log.claims if n], 50),
        "claim_p99_ms": c.pct([d * 1000 for _s, d, n in log.claims if n], 99),
        "insert_p99_ms": c.pct([d * 1000 for _s, d, _r in log.inserts], 99),
        "insert_max_ms": max((d * 1000 for _s, d, _r in log.inserts), default=0.0),
        "insert_max_during_retention_ms": max(during, default=0.0) * 1000,
        "retention_rounds": log.retention,
        "lock_waits": lock_waits,
        "samples": log.samples,
        "per_minute": per_minute,
    }


def timed_main(args: argparse.Namespace) -> None:
    """The three modes at once, each a process of its own with its own PostgreSQL."""
    started = datetime.now(UTC)
    commit = subprocess.run(
        ["git", "-C", str(c.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results_dir = Path(tempfile.mkdtemp(prefix="outbox-relay-long-results-"))
    passed = [
        "--minutes", str(args.minutes), "--rate", str(args.rate), "--interval", args.interval,
        "--retention", args.retention, "--retention-every", str(args.retention_every),
        "--sample-seconds", str(args.sample_seconds), "--workers", str(args.workers), "--batch", str(args.batch),
        "--payload-bytes", str(args.payload_bytes),
        *(["--server-log-dir", args.server_log_dir] if args.server_log_dir else []),
    ]  # fmt: skip
    procs = {
        mode: subprocess.Popen(
            [sys.executable, __file__, *passed, "--timed-worker", mode, "--result", str(results_dir / f"{mode}.json")]
        )
        for mode in TIMED_MODES
    }
    loads: list[tuple[float, float, float]] = []
    deadline = time.monotonic() + args.minutes * 60 + 900
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        loads.append(os.getloadavg())
        time.sleep(10)
    for mode, p in procs.items():
        if p.poll() is None:
            p.kill()
            c.say(f"[{mode}] did not finish in time: killed")
    reports = {}
    for mode in TIMED_MODES:
        path = results_dir / f"{mode}.json"
        if path.exists():
            reports[mode] = json.loads(path.read_text())
    shutil.rmtree(results_dir, ignore_errors=True)
    one_minute = [x[0] for x in loads] or [float("nan")]
    report = {
        "started": started.isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join(["bench/partition_retention.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "load_average_1min": {"min": min(one_minute), "mean": statistics.fmean(one_minute), "max": max(one_minute)},
        "modes": reports,
    }
    c.emit(report, timed_lines(report, args), args.json)


def timed_lines(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    load = report["load_average_1min"]
    lines = [
        f"timed run {report['started']} (commit {report['commit']}): {args.minutes} min at {args.rate} events/s "
        f"per mode, three modes side by side, partitions of {args.interval}, retention {args.retention}, "
        f"retention every {args.retention_every:g} s",
        f"machine: {report['cpus']} CPUs; 1-minute load average during the run min {load['min']:.2f} "
        f"mean {load['mean']:.2f} max {load['max']:.2f}",
    ]
    modes = report["modes"]
    missing = [m for m in TIMED_MODES if m not in modes]
    if missing:
        lines.append(f"NO FIGURES for {', '.join(missing)} (the mode's process failed: see its lines above)")
    lines.append(
        "mode     written/s delivered/s  target met  WAL B/event  autovacuums  claim p50/p99 ms  "
        "insert p99/max ms  max insert in a retention round ms"
    )
    for mode, r in modes.items():
        met = "yes" if r["written_per_s"] >= 0.98 * r["target_rate"] else "NO"
        lines.append(
            f"{mode:<8} {r['written_per_s']:>9.0f} {r['delivered_per_s']:>11.0f}  {met:>10}  "
            f"{r['wal_bytes_per_event']:>11.0f}  {r['autovacuum_runs']:>11}  "
            f"{r['claim_p50_ms']:>7.1f}/{r['claim_p99_ms']:<8.1f}  "
            f"{r['insert_p99_ms']:>8.1f}/{r['insert_max_ms']:<8.1f}  {r['insert_max_during_retention_ms']:>10.1f}"
        )
    for mode, r in modes.items():
        for error in r.get("errors", []):
            lines.append(f"{mode}: FAILED at {error} (figures cover the {r['seconds_measured'] / 60:.1f} min before)")
        for line in r.get("server_trouble", []):
            lines.append(f"{mode}: server log: {line[:300]}")
    for mode, r in modes.items():
        if r["written_per_s"] < 0.98 * r["target_rate"]:
            lines.append(
                f"{mode}: the writer reached {r['written_per_s']:.0f} of {r['target_rate']} events/s: "
                "this machine did not sustain the rate side by side"
            )
    for mode, r in modes.items():
        rounds = r["retention_rounds"]
        if mode == "drop":
            dropped = sum(e.get("dropped", 0) for e in rounds)
            failed = [f for e in rounds for f in e.get("failed", [])]
            lines.append(
                f"{mode}: {len(rounds)} maintain rounds, {dropped} partitions dropped, "
                f"{sum(e.get('kept', 0) for e in rounds)} kept-lines, {len(failed)} failed DDL; "
                f"longest round {max((e['seconds'] for e in rounds), default=0) * 1000:.0f} ms"
            )
        elif mode == "purge":
            lines.append(
                f"{mode}: {len(rounds)} purge rounds, {sum(e.get('deleted', 0) for e in rounds)} rows deleted; "
                f"longest round {max((e['seconds'] for e in rounds), default=0) * 1000:.0f} ms"
            )
        waits = r["lock_waits"]
        if waits:
            longest = max(waits, key=lambda w: w["ms"])
            lines.append(
                f"{mode}: {len(waits)} lock waits over 20 ms logged; longest {longest['ms']:.0f} ms for "
                f"{longest['lock']} ({longest['statement']})"
            )
        else:
            lines.append(f"{mode}: no lock wait over 20 ms logged")
    lines.append("per sample: minute  table MiB  index MiB  dead tuples  autovacuum runs  WAL B/event so far")
    for mode, r in modes.items():
        for s in r["samples"]:
            lines.append(
                f"  {mode:<7} {s['t'] / 60:6.1f} {s['table_bytes'] / 2**20:10.1f} {s['index_bytes'] / 2**20:10.1f} "
                f"{s['dead_tuples']:>12} {s['autovacuum_runs']:>16} {s['wal_bytes'] / max(1, s['written']):>12.0f}"
            )
    lines.append("per minute: minute  written/s  delivered/s  claim p50 ms  claim p99 ms  insert max ms")
    for mode, r in modes.items():
        for m in r["per_minute"]:
            lines.append(
                f"  {mode:<7} {m['minute']:>4} {m['written_per_s']:>10.0f} {m['delivered_per_s']:>12.0f} "
                f"{_ms(m['claim_p50_ms']):>13} {_ms(m['claim_p99_ms']):>13} {_ms(m['insert_max_ms']):>14}"
            )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000, help="rows per mode (default: %(default)s)")
    parser.add_argument("--payload-bytes", type=int, default=200, help="payload size (default: %(default)s)")
    parser.add_argument("--partitions-list", default="30,300", help="partition counts of part 2 (default: %(default)s)")
    parser.add_argument("--claim-backlog", type=int, default=5000, help="pending rows of part 2 (default: %(default)s)")
    timed = parser.add_argument_group(
        "timed run", "--minutes N: the three modes side by side for N minutes instead of parts 1 and 2"
    )
    timed.add_argument("--minutes", type=float, help="length of the timed run in minutes")
    timed.add_argument("--rate", type=int, default=500, help="events/s written per mode (default: %(default)s)")
    timed.add_argument("--interval", default="1 minute", help="partition width, drop mode (default: %(default)s)")
    timed.add_argument("--retention", default="1m", help="rows kept at least this long (default: %(default)s)")
    timed.add_argument(
        "--retention-every", type=float, default=60.0, help="seconds between maintain / purge rounds (default: 60)"
    )
    timed.add_argument("--sample-seconds", type=float, default=60.0, help="seconds between samples (default: 60)")
    timed.add_argument("--workers", type=int, default=2, help="relay claim/finalize threads per mode (default: 2)")
    timed.add_argument("--batch", type=int, default=100, help="rows per claim (default: %(default)s)")
    timed.add_argument("--server-log-dir", help="copy each mode's PostgreSQL log here (<mode>.log)")
    timed.add_argument("--timed-worker", choices=TIMED_MODES, help=argparse.SUPPRESS)
    timed.add_argument("--result", help=argparse.SUPPRESS)
    c.add_server_args(parser)
    args = parser.parse_args()
    if args.timed_worker:
        timed_worker(args)
        return
    if args.minutes is not None:
        if args.minutes <= 0 or args.rate <= 0:
            parser.error("--minutes and --rate must be positive")
        try:
            parse_partition_interval(args.interval)
            parse_duration(args.retention)
        except ValueError as exc:
            parser.error(str(exc))
        timed_main(args)
        return
    report: dict[str, Any] = {"events": args.events, "payload_bytes": args.payload_bytes, "wal_per_event": {}}
    lines: list[str] = []
    with c.servers(args, need_broker=False) as (dsn, _bootstrap):
        report["server_version"] = c.server_version(dsn)
        lines.append(
            f"PostgreSQL {report['server_version']}; {args.events} events per mode, payload ~{args.payload_bytes} B"
        )
        lines.append("WAL bytes per event   write  deliver  vacuum  retention  vacuum after   total")
        for mode in MODES:
            c.say(f"mode {mode} ...")
            f = report["wal_per_event"][mode] = wal_of_mode(dsn, mode, args.events, args.payload_bytes)
            lines.append(
                f"  {mode:<18} {f['write']:>7.0f} {f['deliver']:>8.0f} {f['vacuum_before']:>7.0f} "
                f"{f['retention']:>10.0f} {f['vacuum_after']:>13.0f} {f['total']:>7.0f}"
            )
        report["claim"] = {}
        lines.append(f"claim with {args.claim_backlog} pending rows   planning buffers  execution buffers  locks")
        for count in (int(x) for x in args.partitions_list.split(",")):
            c.say(f"claim with {count} partitions ...")
            f = report["claim"][count] = claim_reads(dsn, count, args.claim_backlog)
            lines.append(
                f"  {int(f['partitions']):>4} partitions {'':>14} {f['planning_buffers']:>10.0f} "
                f"{f['execution_buffers']:>18.0f} {f['relation_locks']:>6.0f}"
            )
    c.emit(report, lines, args.json)


if __name__ == "__main__":
    sys.exit(main())
