#!/usr/bin/env python3
"""What the relay adds on PostgreSQL at everyday rates, beside the application's insert.

A writer commits one row per transaction (~``--payload-bytes`` JSON, ``--aggregates``
aggregate ids) at fixed rates (``--rates``; 0 = no writer: the idle relay). Per WAL
level x mode (``keep``: done rows stay; ``delete``: relay.on_done = "delete") x rate,
two windows of ``--window-seconds`` each, after ``--warmup-seconds`` at that rate:

  baseline  the writer alone, into a table migrated the same way that no relay reads
            (the insert's own price; at rate 0: the server's background);
  relay     ``--replicas`` x ``outbox-relay run --workers N`` on the mode's outbox
            (defaults otherwise), the same writer into that outbox.

Every relay window is followed by a drain (writer stopped); at the end of a mode every
row written into its outbox must be done (keep) or gone (delete), and every one must be
in Kafka (unique ``message_id`` headers read back): exit status 1 otherwise.

How each figure is attributed (the relay's share = relay window - baseline window, per
event, since the two windows run the same writer at the same rate):

  transactions, all   ``xact_commit + xact_rollback`` of pg_stat_database for the bench's
                      own database (created per run; the bench's monitoring connects to
                      another database, so its queries are not in it). Backends flush
                      these counters about once a second: each window edge is off by
                      up to a second of traffic, the same at both edges in a steady state.
  transactions, writing  COMMIT records in the window's WAL (``Transaction/COMMIT`` of
                      pg_walinspect's pg_get_wal_stats): only a transaction that wrote
                      something writes one; exact.
  WAL bytes           ``pg_current_wal_insert_lsn()`` at both edges (every byte, page
                      headers included), and by record type from pg_get_wal_stats over
                      the same range (record + full-page-image bytes). The bench's
                      cluster has checkpoint_timeout = 1 h and a CHECKPOINT before each
                      warm-up, so no checkpoint falls inside a window (``checkpoints``
                      says so per window; a non-zero one brings full-page images).
  PostgreSQL CPU      utime + stime from /proc of the relay's backends (application_name
                      ``outbox-relay*`` in the bench database), listed from pg_stat_activity
                      every 0.25 s while the window runs, so that a backend a pool opens
                      mid-window is counted from its start and one that closes loses at
                      most 0.25 s; the writer's backends the same way. Not measurable on a
                      server on another host (reported missing).
  statements          pg_stat_statements (reset at each window's start; track = all,
                      track_planning = on) of the bench database: the writer connects
                      as a role of its own, so its insert and what the outbox's
                      triggers run inside it (nested statements are tracked) are told
                      from the relay's; per statement calls per event, mean planning
                      and execution ms, WAL bytes per event.
  insert -> done      keep: ``done_at - created_at`` of the rows the window's writer
                      committed (created_at is now() of the writer's one-statement
                      transaction, done_at now() of the finalize's); delete: the row is
                      gone when done, so there is nothing to read back (insert -> Kafka
                      is bench/latency.py's measure).

The server: without ``--dsn``, a throwaway cluster (initdb in a temp directory, a free
loopback port) from ``--pg-bin`` (default: Debian's PostgreSQL 15), with
pg_stat_statements preloaded and the WAL level restarted per ``--wal-levels``. With
``--dsn``: that server (superuser; pg_stat_statements preloaded; its one WAL level);
a database and a writer role of the run's own are created and dropped there. Before a
mode's windows the bench database is vacuumed (the catalogs the previous mode's DROP
changed) and the script waits for autovacuum to be done; a note says when autovacuum
still ran inside a window.

    .venv/bin/python bench/primary_cost.py --rates 0,20,200,2000 --modes keep,delete
    .venv/bin/python bench/primary_cost.py --rates 0,20 --modes keep --window-seconds 15 --warmup-seconds 3
    .venv/bin/python bench/primary_cost.py --wal-levels replica,logical --json > cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as c
import _local_pg as lp
import psycopg
from psycopg import sql

WRITER_APP = "costbench-writer"
RELAY_APP = "outbox-relay"
MODES = ("keep", "delete")


# --- the writer ---------------------------------------------------------------------------------
class Writer:
    """``--writer-connections`` threads, each on its own connection, committing one row
    per transaction on a monotonic schedule (rate / connections each): the k-th row of a
    thread is due at start + k / its rate, never earlier; a thread that falls a second
    behind skips ahead instead of bursting (``late`` counts the rows it skipped)."""

    def __init__(self, dsn: str, table: str, args: argparse.Namespace) -> None:
        self.dsn = dsn
        self.insert = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s)"
        ).format(c.ident(table))
        self.args = args
        self.committed = 0
        self.skipped = 0
        self.pids: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def start(self, rate: float) -> None:
        if rate <= 0:
            return
        self._stop.clear()
        connections = max(1, min(self.args.writer_connections, int(rate)))
        ready = threading.Barrier(connections + 1)
        for k in range(connections):
            thread = threading.Thread(
                target=self._run, args=(k, connections, rate / connections, ready), name=f"writer-{k}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        try:
            ready.wait(timeout=60)
        except threading.BrokenBarrierError:
            self.stop()
            raise RuntimeError(f"writer did not start: {self.errors[:1]}") from None

    def _run(self, k: int, connections: int, rate: float, ready: threading.Barrier) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True, application_name=WRITER_APP) as conn:
                conn.execute(
                    "SELECT set_config('synchronous_commit', %s, false)", (self.args.writer_synchronous_commit,)
                )
                with self._lock:
                    self.pids.append(int(conn.info.backend_pid))
                ready.wait(timeout=60)
                interval = 1.0 / rate
                seq = k
                next_at = time.monotonic() + k * interval / connections  # threads interleaved
                while not self._stop.is_set():
                    delay = next_at - time.monotonic()
                    if delay > 0 and self._stop.wait(delay):
                        break
                    conn.execute(
                        self.insert,
                        (
                            "order",
                            f"agg-{seq % self.args.aggregates}",
                            "OrderCreated",
                            c.payload_json(seq, self.args.payload_bytes),
                        ),
                    )
                    seq += connections
                    with self._lock:
                        self.committed += 1
                    next_at += interval
                    behind = time.monotonic() - next_at
                    if behind > 1.0:
                        skipped = int(behind / interval)
                        next_at += skipped * interval
                        with self._lock:
                            self.skipped += skipped
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.abort()

    def count(self) -> int:
        with self._lock:
            return self.committed

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads.clear()
        with self._lock:
            self.pids.clear()
        if self.errors:
            raise RuntimeError(f"writer failed: {self.errors[0]}")


# --- figures of one window -----------------------------------------------------------------------
@dataclass
class Edge:
    """The counters read at one edge of a window."""

    at: float
    lsn: str
    xacts: int
    checkpoints: int
    db_time: Any
    written: int


@dataclass
class Bench:
    """The run's servers and connections."""

    admin: psycopg.Connection[Any]  # on the --dsn database: never in the bench database's counters
    admin_dsn: str
    bench_dsn: str
    database: str
    bootstrap: str
    walinspect: bool
    writer_dsn: str
    writer_role: str
    statement_names: list[tuple[list[str], str]] = field(default_factory=list)


def read_edge(bench: Bench, writer: Writer | None) -> Edge:
    row = bench.admin.execute(
        "SELECT pg_current_wal_insert_lsn()::text, "
        "(SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s), clock_timestamp()",
        (bench.database,),
    ).fetchone()
    assert row is not None
    return Edge(
        time.monotonic(),
        row[0],
        int(row[1]),
        checkpoints(bench.admin),
        row[2],
        writer.count() if writer is not None else 0,
    )


def checkpoints(conn: psycopg.Connection[Any]) -> int:
    try:
        row = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()  # 17+
    except psycopg.errors.UndefinedTable:
        row = conn.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").fetchone()
    return int(row[0])  # type: ignore[index]


def wal_by_record(bench: Bench, start: str, end: str) -> dict[str, dict[str, int]] | None:
    """{"Heap/UPDATE": {"count", "bytes"}, ...} over [start, end), once the WAL up to
    ``end`` is flushed (asynchronous commits reach disk within wal_writer_delay)."""
    if not bench.walinspect:
        return None
    # WAL that no commit waits for (e.g. the background writer's running-transactions
    # records) may stay unflushed: a transaction of the monitoring connection (another
    # database, after ``end``: outside the window) flushes everything before its commit.
    bench.admin.execute("SELECT pg_logical_emit_message(true, 'primary_cost', 'flush')")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        (flushed,) = bench.admin.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (end,)).fetchone()  # type: ignore[misc]
        if flushed:
            break
        time.sleep(0.05)
    rows = bench.admin.execute(
        'SELECT "resource_manager/record_type", count, combined_size FROM pg_get_wal_stats(%s, %s, true) '
        "WHERE count > 0",
        (start, end),
    ).fetchall()
    return {str(name): {"count": int(n), "bytes": int(size)} for name, n, size in rows}


def reset_statements(bench: Bench) -> None:
    bench.admin.execute("SELECT pg_stat_statements_reset()")


def statements(bench: Bench, *, writer: bool) -> list[dict[str, Any]]:
    """The bench database's statements of the writer's role (its insert and what the
    outbox's triggers run inside it: nested statements are tracked) or of every other
    role (the relay's, and autovacuum's none)."""
    rows = bench.admin.execute(
        "SELECT s.query, sum(s.calls), sum(s.plans), sum(s.total_plan_time), sum(s.total_exec_time), "
        "sum(s.wal_bytes), sum(s.rows) FROM pg_stat_statements AS s JOIN pg_database AS d ON d.oid = s.dbid "
        "JOIN pg_roles AS r ON r.oid = s.userid WHERE d.datname = %s AND (r.rolname = %s) = %s GROUP BY s.query",
        (bench.database, bench.writer_role, writer),
    ).fetchall()
    out = []
    for query, calls, plans, plan_ms, exec_ms, wal, nrows in rows:
        out.append(
            {
                "statement": statement_name(bench, str(query)),
                "calls": int(calls),
                "plans": int(plans),
                "plan_ms_total": float(plan_ms),
                "exec_ms_total": float(exec_ms),
                "wal_bytes": int(wal),
                "rows": int(nrows),
            }
        )
    return out


def _words(text: str) -> list[str]:
    """The words of a statement: comments, quoted identifiers (the tables), parameters
    ($1 or %(name)s), placeholders ({table}) and the literals a placeholder may be
    filled with (null, true, false) left out."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    body = re.sub(r'"[^"]*"|\$\d+|\{[^}]*\}|%\([^)]*\)s', " ", body.lower())
    return [w for w in re.findall(r"[a-z_]+", body) if w not in {"null", "true", "false"}]


def load_statement_names() -> list[tuple[list[str], str]]:
    """(words, name) of the store's SQL sections (outbox_relay/db/sql/*.sql)."""
    from outbox_relay.db.schema import _load_sections

    return [(_words(text), name) for name, text in _load_sections().items()]


def statement_name(bench: Bench, query: str) -> str:
    """The section whose words are most like the statement's (several begin alike: the
    claim starts with the reap's CTE, mark_idle and mark_busy differ by one word), when
    they are alike enough; else the statement's first 70 characters."""
    words = _words(query)
    best, best_name = 0.0, ""
    for key, name in bench.statement_names:
        if not key or not words:
            continue
        ratio = difflib.SequenceMatcher(None, words, key, autojunk=False).ratio()
        if ratio > best:
            best, best_name = ratio, name
    if best >= 0.8:
        return best_name
    return " ".join(query.split())[:70]


class Window:
    """One window: edges, CPU of the relay's and the writer's backends, statements."""

    def __init__(self, bench: Bench, writer: Writer | None, relays: list[c.RelayProcess]) -> None:
        self.bench, self.writer, self.relays = bench, writer, relays
        # the samplers connect to the admin database: their queries stay out of the bench database's counters
        self.relay_cpu = lp.BackendCpu(bench.admin_dsn, lp.pids_by_application(bench.database, RELAY_APP))
        self.writer_cpu = lp.BackendCpu(bench.admin_dsn, lambda _conn: list(writer.pids) if writer else [])
        self.autovacuum_cpu = lp.BackendCpu(bench.admin_dsn, autovacuum_workers(bench.database))

    def run(self, seconds: float) -> dict[str, Any]:
        reset_statements(self.bench)
        process0 = [r.cpu_seconds() for r in self.relays]
        self.relay_cpu.start()
        self.writer_cpu.start()
        self.autovacuum_cpu.start()
        start = read_edge(self.bench, self.writer)
        lp.sleep_until(start.at + seconds)
        end = read_edge(self.bench, self.writer)
        relay_cpu = self.relay_cpu.stop()
        writer_cpu = self.writer_cpu.stop()
        autovacuum_cpu = self.autovacuum_cpu.stop()
        process1 = [r.cpu_seconds() for r in self.relays]
        stmts = statements(self.bench, writer=False)
        writer_stmts = statements(self.bench, writer=True)
        (wal_total,) = self.bench.admin.execute(
            "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (end.lsn, start.lsn)
        ).fetchone()  # type: ignore[misc]
        by_record = (
            wal_by_record(self.bench, start.lsn, end.lsn) if wal_total else ({} if self.bench.walinspect else None)
        )
        process = (
            sum(b - a for a, b in zip(process0, process1, strict=True))  # type: ignore[operator]
            if self.relays and None not in process0 and None not in process1
            else None
        )
        return {
            "seconds": round(end.at - start.at, 3),
            "events": end.written - start.written,
            "created_from": start.db_time,
            "created_until": end.db_time,
            "xacts": end.xacts - start.xacts,
            "commit_records": None if by_record is None else by_record.get("Transaction/COMMIT", {}).get("count", 0),
            "wal_bytes": int(wal_total),
            "wal_by_record": by_record,
            "checkpoints": end.checkpoints - start.checkpoints,
            "relay_backend_cpu_s": relay_cpu,
            "relay_backends": self.relay_cpu.backends,
            "relay_backends_exited": self.relay_cpu.lost_backends,
            "writer_backend_cpu_s": writer_cpu,
            "relay_process_cpu_s": process,
            # autovacuum in the bench database during the window (its WAL is in the figures)
            "autovacuum_workers": self.autovacuum_cpu.backends,
            "autovacuum_cpu_s": autovacuum_cpu,
            "statements": stmts,
            "writer_statements": writer_stmts,
        }


def autovacuum_workers(_database: str) -> Callable[[psycopg.Connection[Any]], list[int]]:
    """Autovacuum workers in any database: the WAL figures are the whole cluster's."""

    def run(conn: psycopg.Connection[Any]) -> list[int]:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'").fetchall()
        return [int(r[0]) for r in rows]

    return run


def settle(bench: Bench, timeout: float = 60.0) -> None:
    """Before a mode's windows: VACUUM (ANALYZE) the bench database (the catalogs the
    previous mode's DROP and this mode's migrate changed, the fresh tables), then wait
    until no autovacuum worker is left in it, so that the windows do not pay for
    earlier work."""
    with psycopg.connect(bench.bench_dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
    deadline = time.monotonic() + timeout
    busy = autovacuum_workers(bench.database)
    while busy(bench.admin) and time.monotonic() < deadline:
        time.sleep(0.5)


# --- one mode at one WAL level ---------------------------------------------------------------------
def table_name(level: str, mode: str, role: str) -> str:
    return f"cost_{level}_{mode}_{role}.outbox"


def warm(bench: Bench, writer: Writer, rate: float, seconds: float) -> None:
    c.checkpoint(bench.bench_dsn)  # no checkpoint inside the window: it starts after this one
    writer.start(rate)
    time.sleep(seconds)


def measure_mode(bench: Bench, level: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    base_table = table_name(level, mode, "base")
    relay_table = table_name(level, mode, "relay")
    for table in (base_table, relay_table):
        c.migrate(bench.bench_dsn, table, on_done=mode)
        schema = sql.Identifier(table.split(".")[0])
        role = sql.Identifier(bench.writer_role)
        with psycopg.connect(bench.bench_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, role))
            conn.execute(sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA {} TO {}").format(schema, role))
            conn.execute(sql.SQL("GRANT ALL ON ALL SEQUENCES IN SCHEMA {} TO {}").format(schema, role))
    settle(bench)
    topic = f"costbench-{c.RUN_ID}-{level}-{mode}"
    c.create_topic(bench.bootstrap, topic, args.partitions)
    windows: dict[str, Any] = {}

    # writer alone, every rate, before any relay runs on this server
    base_writer = Writer(bench.writer_dsn, base_table, args)
    for rate in args.rates:
        c.say(f"[{level} {mode} {rate:g}/s] baseline: writer alone ...")
        warm(bench, base_writer, rate, args.warmup_seconds)
        try:
            windows[f"{rate:g}"] = {"baseline": Window(bench, base_writer, []).run(args.window_seconds)}
        finally:
            base_writer.stop()

    env = c.relay_env(bench.bench_dsn, relay_table, bench.bootstrap, topic, OUTBOX_RELAY_RELAY__ON_DONE=mode)
    for setting in args.relay_setting:  # e.g. RELAY__CLAIM_LINGER_MS=20
        name, _, value = setting.partition("=")
        env["OUTBOX_RELAY_" + name.upper()] = value
    relays = [c.RelayProcess(["--workers", str(args.workers)], env) for _ in range(args.replicas)]
    writer = Writer(bench.writer_dsn, relay_table, args)
    check: dict[str, Any] = {}
    try:
        for relay in relays:
            relay.wait_started()
        for rate in args.rates:
            c.say(f"[{level} {mode} {rate:g}/s] relay: {args.replicas} x run --workers {args.workers} ...")
            warm(bench, writer, rate, args.warmup_seconds)
            try:
                window = Window(bench, writer, relays).run(args.window_seconds)
            finally:
                writer.stop()
            with psycopg.connect(bench.bench_dsn, autocommit=True) as conn:
                c.wait_drained(conn, relay_table, timeout=args.drain_timeout, interval=0.2)
            window["latency_ms"] = done_latency(bench, relay_table, window, mode)
            windows[f"{rate:g}"]["relay"] = window
        for relay in relays:
            if relay.proc.poll() is not None:
                raise RuntimeError(f"a relay exited {relay.proc.returncode}: {relay.log_text()[-2000:]}")
        check = check_delivered(bench, relay_table, topic, writer.committed, mode)
    finally:
        codes = [r.stop() for r in relays]
        warnings = [w for r in relays for w in r.warnings(3)]
        for relay in relays:
            relay.cleanup()
        if not args.keep:
            for table in (base_table, relay_table):
                c.drop_schema(bench.bench_dsn, table)
    check["exit_codes"] = codes
    check["relay_warnings"] = warnings
    check["writer_skipped_rows"] = base_writer.skipped + writer.skipped
    return {
        "wal_level": level,
        "mode": mode,
        "rates": {k: derive(v, float(k)) for k, v in windows.items()},
        "windows": windows,
        "check": check,
    }


def done_latency(bench: Bench, table: str, window: dict[str, Any], mode: str) -> dict[str, Any] | None:
    if mode != "keep" or window["events"] == 0:
        return None
    with psycopg.connect(bench.bench_dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*), percentile_disc(0.5) WITHIN GROUP (ORDER BY d), "
                "percentile_disc(0.99) WITHIN GROUP (ORDER BY d), max(d) FROM "
                "(SELECT extract(epoch FROM done_at - created_at) * 1000 AS d FROM {} "
                " WHERE created_at >= %s AND created_at < %s AND status = 'done') AS x"
            ).format(c.ident(table)),
            (window["created_from"], window["created_until"]),
        ).fetchone()
    assert row is not None
    n, p50, p99, high = row
    return {
        "rows": int(n),
        "p50": _round(p50, 1),
        "p99": _round(p99, 1),
        "max": _round(high, 1),
    }


def check_delivered(bench: Bench, table: str, topic: str, written: int, mode: str) -> dict[str, Any]:
    by_status = c.count_by_status(bench.bench_dsn, table)
    unique, messages = c.unique_message_ids(bench.bootstrap, topic, written, timeout=300) if written else (0, 0)
    in_table_ok = by_status.get("done", 0) == written if mode == "keep" else sum(by_status.values()) == 0
    return {
        "written": written,
        "rows_by_status": by_status,
        "in_kafka_unique": unique,
        "messages": messages,
        "ok": in_table_ok and unique == written,
    }


# --- per event ------------------------------------------------------------------------------------
def _round(value: Any, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def _per(value: float | None, n: float) -> float | None:
    return None if value is None or n <= 0 else value / n


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def derive(pair: dict[str, Any], rate: float) -> dict[str, Any]:
    """The relay's share per event (per second at rate 0) and the writer's own insert."""
    base, relay = pair["baseline"], pair.get("relay")
    idle = rate <= 0
    unit = "second" if idle else "event"

    def per(window: dict[str, Any], value: float | None) -> float | None:
        return _per(value, window["seconds"] if idle else window["events"])

    out: dict[str, Any] = {"per": unit}
    out["writer"] = (
        None
        if idle
        else {
            "events": base["events"],
            "events_per_s": round(base["events"] / base["seconds"], 1),
            "xacts": _round(per(base, base["xacts"]), 3),
            "commit_records": _round(per(base, base["commit_records"]), 3),
            "backend_cpu_ms": _round(_scale(per(base, base["writer_backend_cpu_s"]), 1000), 3),
            "wal_bytes": _round(per(base, base["wal_bytes"]), 1),
        }
    )
    if relay is None:
        return out

    def share(key: str, scale: float = 1.0) -> float | None:
        return _scale(_minus(per(relay, relay[key]), per(base, base[key])), scale)

    records: dict[str, float] = {}
    if relay["wal_by_record"] is not None and base["wal_by_record"] is not None:
        for name in set(relay["wal_by_record"]) | set(base["wal_by_record"]):
            r = relay["wal_by_record"].get(name, {}).get("bytes", 0)
            b = base["wal_by_record"].get(name, {}).get("bytes", 0)
            value = _minus(per(relay, r), per(base, b))
            if value is not None:
                records[name] = round(value, 1)
    # every writer transaction is one row: the writer's count is known exactly, so only
    # the rest (the relay's, and in both windows the server's background) comes from the
    # lazily flushed counters
    others = _minus(per(relay, relay["xacts"] - relay["events"]), per(base, base["xacts"] - base["events"]))
    out["relay"] = {
        "events": relay["events"],
        "xacts": _round(others, 3),
        "writing_xacts": _round(share("commit_records"), 3),
        # the relay's backends are not running in the baseline: their CPU is all the relay's
        "backend_cpu_ms": _round(_scale(per(relay, relay["relay_backend_cpu_s"]), 1000), 3),
        "process_cpu_ms": _round(_scale(per(relay, relay["relay_process_cpu_s"]), 1000), 3),
        "wal_bytes": _round(share("wal_bytes"), 1),
        "wal_by_record": dict(sorted(records.items(), key=lambda kv: -abs(kv[1]))),
        "latency_ms": relay.get("latency_ms"),
        "checkpoints_in_windows": relay["checkpoints"] + base["checkpoints"],
        "autovacuum_workers_in_windows": {"baseline": base["autovacuum_workers"], "relay": relay["autovacuum_workers"]},
        "statements": [
            {
                "statement": s["statement"],
                "calls": _round(per(relay, s["calls"]), 4),
                "plans": _round(per(relay, s["plans"]), 4),
                "plan_ms": _round(s["plan_ms_total"] / s["plans"], 4) if s["plans"] else None,
                "exec_ms": _round(s["exec_ms_total"] / s["calls"], 4) if s["calls"] else None,
                "wal_bytes": _round(per(relay, s["wal_bytes"]), 1),
            }
            for s in sorted(relay["statements"], key=lambda s: -(s["plan_ms_total"] + s["exec_ms_total"]))
        ],
    }
    return out


def _scale(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


# --- the server ---------------------------------------------------------------------------------
@contextlib.contextmanager
def server(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, lp.LocalPostgres | None]]:
    if args.dsn:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            level = str(conn.execute("SHOW wal_level").fetchone()[0])  # type: ignore[index]
            preload = str(conn.execute("SHOW shared_preload_libraries").fetchone()[0])  # type: ignore[index]
        if "pg_stat_statements" not in preload:
            raise SystemExit("--dsn: the server must preload pg_stat_statements (shared_preload_libraries)")
        if args.wal_levels != [level]:
            raise SystemExit(f"--dsn: the server's wal_level is {level}; pass --wal-levels {level}")
        yield args.dsn, None
        return
    c.say(f"starting PostgreSQL from {args.pg_bin} (a throwaway cluster on a loopback port) ...")
    pg = lp.LocalPostgres(
        tmp,
        Path(args.pg_bin),
        {
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "all",
            "pg_stat_statements.track_planning": "on",
            "pg_stat_statements.max": "10000",
            "wal_level": args.wal_levels[0],
            "max_connections": "200",
            "checkpoint_timeout": "1h",
            "max_wal_size": "8GB",
        },
    ).start()
    try:
        yield pg.dsn, pg
    finally:
        pg.stop()


def prepare(admin: psycopg.Connection[Any], database: str) -> bool:
    """Extensions on the admin database and the bench database; True when
    pg_walinspect is there (the WAL breakdown by record type)."""
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        return True
    except psycopg.Error as exc:
        c.say(f"  note: no pg_walinspect ({exc}); WAL by record type not measured")
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument(
        "--pg-bin", default=str(lp.DEBIAN_PG15_BIN), help="PostgreSQL bin directory (default %(default)s)"
    )
    parser.add_argument("--rates", default="0,20,200,2000", help="writer events/s, comma-separated; 0 = idle")
    parser.add_argument("--modes", default="keep,delete", help="keep and/or delete (relay.on_done)")
    parser.add_argument("--wal-levels", default="replica", help="replica and/or logical (each a server restart)")
    parser.add_argument("--replicas", type=int, default=1, help="relay processes on the same outbox")
    parser.add_argument("--workers", type=int, default=4, help="outbox-relay run --workers")
    parser.add_argument("--window-seconds", type=float, default=60.0)
    parser.add_argument("--warmup-seconds", type=float, default=10.0)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--aggregates", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument(
        "--writer-connections", type=int, default=1, help="writer connections sharing the rate (default %(default)s)"
    )
    parser.add_argument(
        "--writer-synchronous-commit",
        default="off",
        choices=("on", "off", "local", "remote_write", "remote_apply"),
        help="the writer's synchronous_commit (default off: 2 000 commits/s from one connection "
        "without waiting for each flush; the same WAL records); the relay keeps the server's",
    )
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--top", type=int, default=8, help="statements shown per window in the text output")
    parser.add_argument(
        "--relay-setting",
        action="append",
        default=[],
        metavar="SECTION__NAME=VALUE",
        help="a setting of the relay under test, as its OUTBOX_RELAY_ variable without the prefix (repeatable)",
    )
    args = parser.parse_args()

    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error("--rates: comma-separated numbers, e.g. 0,20,200")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.wal_levels = [w.strip() for w in args.wal_levels.split(",") if w.strip()]
    if not args.rates or any(r < 0 for r in args.rates):
        parser.error("--rates: one or more numbers >= 0")
    if not args.modes or set(args.modes) - set(MODES):
        parser.error("--modes: keep and/or delete")
    if not args.wal_levels or set(args.wal_levels) - {"replica", "logical"}:
        parser.error("--wal-levels: replica and/or logical")
    if args.replicas < 1 or args.workers < 1 or args.window_seconds <= 0 or args.warmup_seconds < 0:
        parser.error("--replicas and --workers >= 1, --window-seconds > 0, --warmup-seconds >= 0")

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-cost-"))
    database = f"costbench_{c.RUN_ID}"
    results: list[dict[str, Any]] = []
    try:
        with server(args, tmp) as (dsn, pg):
            bench_dsn = psycopg.conninfo.make_conninfo(dsn, dbname=database)
            writer_role = f"costbench_writer_{c.RUN_ID}"
            writer_password = secrets.token_hex(16)
            writer_dsn = psycopg.conninfo.make_conninfo(bench_dsn, user=writer_role, password=writer_password)
            admin = psycopg.connect(dsn, autocommit=True, application_name="costbench-monitor")
            try:
                walinspect = prepare(admin, database)
                admin.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                        sql.Identifier(writer_role), sql.Literal(writer_password)
                    )
                )
                version = c.server_version(dsn)
                namespace = argparse.Namespace(**{**vars(args), "dsn": bench_dsn})
                with c.servers(namespace) as (_, bootstrap):
                    assert bootstrap is not None
                    bench = Bench(
                        admin,
                        dsn,
                        bench_dsn,
                        database,
                        bootstrap,
                        walinspect,
                        writer_dsn,
                        writer_role,
                        load_statement_names(),
                    )
                    for level in args.wal_levels:
                        if pg is not None and pg.settings.get("wal_level") != level:
                            c.say(f"restarting PostgreSQL with wal_level={level} ...")
                            admin.close()
                            pg.restart(wal_level=level)
                            admin = bench.admin = psycopg.connect(
                                dsn, autocommit=True, application_name="costbench-monitor"
                            )
                        for mode in args.modes:
                            results.append(measure_mode(bench, level, mode, args))
            finally:
                with contextlib.suppress(psycopg.Error):
                    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
                with contextlib.suppress(psycopg.Error):
                    admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(writer_role)))
                admin.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    report = {
        "benchmark": "primary_cost",
        "postgresql": version,
        "broker": c.broker_label(args),
        "settings": {
            k: getattr(args, k)
            for k in (
                "rates",
                "modes",
                "wal_levels",
                "replicas",
                "workers",
                "window_seconds",
                "warmup_seconds",
                "payload_bytes",
                "aggregates",
                "writer_connections",
                "writer_synchronous_commit",
            )
        },
        "results": results,
    }
    c.emit(report, text_report(report, args.top), args.json)
    return 0 if all(r["check"].get("ok") for r in results) else 1


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}".replace(",", " ")
    return str(value)


def text_report(report: dict[str, Any], top: int) -> list[str]:
    s = report["settings"]
    lines = [
        f"primary_cost: PostgreSQL {report['postgresql']}, broker {report['broker']}, "
        f"{s['replicas']} x run --workers {s['workers']}, {s['payload_bytes']}-byte payloads, "
        f"{s['aggregates']} aggregates, one row per transaction (writer synchronous_commit="
        f"{s['writer_synchronous_commit']}), {s['window_seconds']:g} s windows after {s['warmup_seconds']:g} s",
        "",
        "Relay's share (relay window - writer-only window), per event; idle rows per second",
        "| WAL | mode | rate | relay xacts all / writing | relay backends' CPU ms | relay WAL B "
        "| insert->done p50/p99 ms | relay process CPU ms | writer: xacts, CPU ms, WAL B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in report["results"]:
        for rate, fig in res["rates"].items():
            relay, writer = fig.get("relay"), fig.get("writer")
            if relay is None:
                continue
            lat = relay["latency_ms"]
            latency = f"{_fmt(lat['p50'], 1)} / {_fmt(lat['p99'], 1)}" if lat else "-"
            per = "/s" if fig["per"] == "second" else ""
            w = (
                f"{_fmt(writer['xacts'])}, {_fmt(writer['backend_cpu_ms'], 3)}, {_fmt(writer['wal_bytes'], 0)}"
                if writer
                else "-"
            )
            lines.append(
                f"| {res['wal_level']} | {res['mode']} | {rate}{' (idle)' if per else ''} "
                f"| {_fmt(relay['xacts'])} / {_fmt(relay['writing_xacts'])}{per} "
                f"| {_fmt(relay['backend_cpu_ms'], 3)}{per} | {_fmt(relay['wal_bytes'], 0)}{per} | {latency} "
                f"| {_fmt(relay['process_cpu_ms'], 3)}{per} | {w} |"
            )
    for res in report["results"]:
        for rate, fig in res["rates"].items():
            relay = fig.get("relay")
            if relay is None:
                continue
            unit = "s" if fig["per"] == "second" else "event"
            lines += [
                "",
                f"{res['wal_level']} {res['mode']} {rate}/s: statements (per {unit}), "
                f"WAL by record (relay's share, B per {unit})",
                "| statement | calls | plans | ms per plan | exec ms per call | WAL B |",
                "|---|---|---|---|---|---|",
            ]
            for st in relay["statements"][:top]:
                lines.append(
                    f"| {st['statement']} | {_fmt(st['calls'], 3)} | {_fmt(st.get('plans'), 3)} "
                    f"| {_fmt(st['plan_ms'], 3)} | {_fmt(st['exec_ms'], 3)} | {_fmt(st['wal_bytes'], 0)} |"
                )
            records = [f"{k} {v:g}" for k, v in list(relay["wal_by_record"].items())[:8] if abs(v) >= 0.5]
            if records:
                lines.append("WAL: " + ", ".join(records))
            if relay["checkpoints_in_windows"]:
                lines.append(f"note: {relay['checkpoints_in_windows']} checkpoint(s) inside the windows")
            vacuums = relay["autovacuum_workers_in_windows"]
            if vacuums["baseline"] or vacuums["relay"]:
                lines.append(
                    f"note: autovacuum ran during the windows (workers: baseline {vacuums['baseline']}, "
                    f"relay {vacuums['relay']}); its WAL and transactions are in the figures"
                )
    for res in report["results"]:
        ch = res["check"]
        lines.append(
            f"check {res['wal_level']} {res['mode']}: written {ch.get('written')}, in Kafka "
            f"{ch.get('in_kafka_unique')} unique of {ch.get('messages')} messages, rows {ch.get('rows_by_status')}, "
            f"writer skipped {ch.get('writer_skipped_rows')}, exit codes {ch.get('exit_codes')}: "
            f"{'ok' if ch.get('ok') else 'FAILED'}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
