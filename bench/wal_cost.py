#!/usr/bin/env python3
"""What the relay costs the primary: WAL bytes per event, by who wrote them.

Per configuration (``--configs``) and payload size (``--payload-bytes``), on a fresh
table migrated by ``outbox-relay migrate`` with that configuration:

  run        a real ``outbox-relay run --workers N`` subprocess, started warm, drains
             while the application writes ``--events`` rows in 100-row transactions
             (one INSERT per row, the six application columns, random-hex payloads so
             nothing compresses), paced at ``--rate`` events/s: steady state, so a
             row's first touch after the CHECKPOINT that opens the phase is its insert.
  retention  ``outbox-relay purge --older-than 0s`` (a subprocess) once all rows are done.
  vacuum     VACUUM of the table afterwards (autovacuum is off on the bench table so
             that the dead tuples left behind are counted, not cleaned at random times).

Attribution: pg_walinspect reads every WAL record of a phase back. The application
records its transaction ids (pg_current_xact_id() in each of its transactions), so a
record with one of those xids (heap/btree inserts, commit records) is the application's;
every other record of the run phase is the relay's: its claims, finalizes and commits,
and the records without an xid that only exist because the relay runs (pruning of the
row versions its updates left behind, hint-bit full-page images of pages it read).
Bytes are WAL space (start of a record to the start of the next: alignment and page
headers included), so the parts add up to the phase's LSN difference, the same figure
as reading pg_current_wal_lsn() before and after. pg_stat_wal (records, full-page
images, bytes; cluster-wide, flushed when the relay's backends exit) is printed per
phase as a cross-check, and ``--app-alone`` adds the same writer into a table no relay
reads (the insert's price without the relay, by LSN difference).

Configurations (``--configs``, comma-separated; default keep,delete):
  keep            the defaults: done rows stay until ``purge``; no ordered types.
  keep-ordered    relay.ordered_event_types = ["*"].
  delete          relay.on_done = "delete": the finalize deletes delivered rows.
  delete-ordered  both.

    .venv/bin/python bench/wal_cost.py                           # keep, delete; ~200 B and ~1 KB
    .venv/bin/python bench/wal_cost.py --configs keep,keep-ordered,delete,delete-ordered --app-alone
    .venv/bin/python bench/wal_cost.py --json > wal.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import _common as c
import psycopg
from psycopg import sql


@dataclass(frozen=True)
class Config:
    """One way of running the relay: settings for `migrate`, `run` and `purge`."""

    name: str
    description: str
    env: dict[str, str] = field(default_factory=dict)  # OUTBOX_RELAY_* settings
    ordered: bool = False


CONFIGS: dict[str, Config] = {
    "keep": Config("keep", "defaults: done rows kept until purge, no ordered types"),
    "keep-ordered": Config(
        "keep-ordered",
        'relay.ordered_event_types = ["*"]',
        {"OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES": '["*"]'},
        ordered=True,
    ),
    "delete": Config(
        "delete",
        'relay.on_done = "delete": the finalize deletes delivered rows',
        {"OUTBOX_RELAY_RELAY__ON_DONE": "delete"},
    ),
    "delete-ordered": Config(
        "delete-ordered",
        'relay.on_done = "delete", relay.ordered_event_types = ["*"]',
        {"OUTBOX_RELAY_RELAY__ON_DONE": "delete", "OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES": '["*"]'},
        ordered=True,
    ),
}

# --- WAL positions and records ------------------------------------------------------------
WAL_STATS_SQL = "SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal"

RECORDS_SQL = """
WITH r AS (
    SELECT start_lsn, xid::text::bigint AS xid, resource_manager, record_type, record_length, fpi_length,
           coalesce(lead(start_lsn) OVER (ORDER BY start_lsn), %(end)s::pg_lsn) - start_lsn AS space,
           (regexp_match(block_ref, 'rel \\d+/\\d+/(\\d+)'))[1]::oid AS relfilenode
    FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)
)
SELECT CASE WHEN xid = ANY(%(app_xids)s::bigint[]) THEN 'app' WHEN xid = 0 THEN 'no-xid' ELSE 'other-xid' END,
       resource_manager, record_type, coalesce(c.relname, ''), count(*), sum(record_length),
       count(*) FILTER (WHERE fpi_length > 0), sum(fpi_length), sum(space)
FROM r LEFT JOIN pg_class AS c ON c.relfilenode = r.relfilenode AND c.relfilenode <> 0
GROUP BY 1, 2, 3, 4
"""


def current_lsn(conn: psycopg.Connection[Any]) -> str:
    """The insert position, once flushed (pg_walinspect reads only flushed WAL)."""
    lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[0]:
            break
        time.sleep(0.05)
    return str(lsn)


def lsn_diff(conn: psycopg.Connection[Any], start: str, end: str) -> int:
    return int(conn.execute("SELECT %s::pg_lsn - %s::pg_lsn", (end, start)).fetchone()[0])


def wal_stats(conn: psycopg.Connection[Any]) -> dict[str, int]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    records, fpi, nbytes = conn.execute(WAL_STATS_SQL).fetchone()
    return {"records": int(records), "fpi": int(fpi), "bytes": int(nbytes)}


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def records(conn: psycopg.Connection[Any], start: str, end: str, app_xids: list[int]) -> list[dict[str, Any]]:
    if lsn_diff(conn, start, end) <= 0:
        return []  # the phase wrote nothing (e.g. purge in delete mode)
    try:
        rows = conn.execute(RECORDS_SQL, {"start": start, "end": end, "app_xids": app_xids}).fetchall()
    except psycopg.errors.InternalError_ as exc:
        # pg_walinspect: "could not find a valid record after <start>": no record
        # begins in the range (it holds at most a page header), i.e. nothing was written.
        if "could not find a valid record" not in str(exc):
            raise
        return []
    return [
        {
            "who": who,
            "rmgr": rmgr,
            "type": rtype,
            "relation": rel,
            "records": int(n),
            "record_bytes": int(rec or 0),
            "fpi_records": int(nfpi),
            "fpi_bytes": int(fpi or 0),
            "space": int(space or 0),
        }
        for who, rmgr, rtype, rel, n, rec, nfpi, fpi, space in rows
    ]


def summarise(recs: list[dict[str, Any]], events: int, who: set[str]) -> dict[str, Any]:
    """Per-event figures of the records written by ``who`` (a set of categories)."""
    mine = [r for r in recs if r["who"] in who]
    space = sum(r["space"] for r in mine)
    by_type: dict[str, int] = {}
    counts: dict[str, int] = {}
    by_relation: dict[str, int] = {}  # the table, each index ("outbox_pending_idx"), or "" (commits, ...)
    for r in mine:
        by_relation[r["relation"] or "-"] = by_relation.get(r["relation"] or "-", 0) + r["space"]
        key = f"{r['rmgr']}/{r['type']}" + ("" if r["who"] != "no-xid" else " (no xid)")
        by_type[key] = by_type.get(key, 0) + r["space"]
        counts[key] = counts.get(key, 0) + r["records"]
    return {
        "bytes": space,
        "bytes_per_event": round(space / events, 1),
        "records_per_event": round(sum(r["records"] for r in mine) / events, 2),
        "fpi_records": sum(r["fpi_records"] for r in mine),
        "fpi_bytes_per_event": round(sum(r["fpi_bytes"] for r in mine) / events, 1),
        "records_per_event_by_record": {
            k: round(v / events, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if v / events >= 0.01
        },
        "bytes_per_event_by_relation": {
            k: round(v / events, 1) for k, v in sorted(by_relation.items(), key=lambda kv: -kv[1]) if v / events >= 0.5
        },
        "bytes_per_event_by_record": {
            k: round(v / events, 1) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]) if v / events >= 0.5
        },
    }


# --- the application ------------------------------------------------------------------------
def random_payload(seq: int, size: int) -> str:
    """JSON text of about ``size`` bytes whose content is random hex (incompressible for pglz)."""
    head = json.dumps({"seq": seq, "data": ""}, separators=(",", ":"))
    return json.dumps({"seq": seq, "data": os.urandom(max(1, (size - len(head)) // 2)).hex()}, separators=(",", ":"))


def write_events(
    dsn: str, table: str, *, events: int, payload_bytes: int, aggregates: int, rate: float, tx_rows: int
) -> tuple[list[int], float]:
    """The application: ``tx_rows`` single-row INSERTs per transaction, paced at ``rate``
    events/s. Returns the transactions' xids (32-bit, as pg_walinspect shows them) and seconds."""
    stmt = sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
        "VALUES ('order', %s, 'OrderPlaced', %s::jsonb)"
    ).format(c.ident(table))
    xids: list[int] = []
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        for first in range(0, events, tx_rows):
            batch = [
                (f"agg-{i % aggregates}", random_payload(i, payload_bytes))
                for i in range(first, min(events, first + tx_rows))
            ]
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(stmt, batch)
                xid = int(cur.execute("SELECT pg_current_xact_id()::text").fetchone()[0])
                xids.append(xid % 2**32)
            due = started + (first + len(batch)) / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    return xids, time.monotonic() - started


# --- one measurement --------------------------------------------------------------------------
def table_counters(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_live_tup, n_dead_tup,"
        " pg_table_size(relid), pg_indexes_size(relid) FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (table,),
    ).fetchone()
    keys = ("inserted", "updated", "hot_updated", "deleted", "live_tuples", "dead_tuples", "table_bytes", "index_bytes")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def index_list(conn: psycopg.Connection[Any], table: str) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1", (table,)
        )
    ]


def settle_stats(seconds: float = 1.2) -> None:
    """Backends flush their WAL and table statistics at most once a second."""
    time.sleep(seconds)


def measure(dsn: str, bootstrap: str, config: Config, payload_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    label = f"wal{config.name.replace('-', '')}{payload_bytes}"
    table = c.new_table(label)
    topic = f"bench.{c.RUN_ID}.{label}"
    env = c.relay_env(dsn, table, bootstrap, topic, **config.env)
    c.run_cli(["migrate"], env)
    c.create_topic(bootstrap, topic)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(c.ident(table)))
        for statement in args.after_migrate:  # layout experiments: {table} is the outbox table
            conn.execute(sql.SQL(statement).format(table=c.ident(table)))
        indexes = index_list(conn, table)
    result: dict[str, Any] = {
        "config": config.name,
        "payload_bytes": payload_bytes,
        "events": args.events,
        "table": table,
        "indexes": indexes,
    }
    relay = c.RelayProcess(["--workers", str(args.workers)], env)
    try:
        relay.wait_started()
        time.sleep(args.warm_seconds)
        with psycopg.connect(dsn, autocommit=True) as conn:
            c.checkpoint(dsn)
            settle_stats()
            stats0 = wal_stats(conn)
            start = current_lsn(conn)
            c.say(
                f"  {config.name} ~{payload_bytes} B: writing {args.events} events at {args.rate:g}/s "
                "while the relay drains ..."
            )
            xids, write_seconds = write_events(
                dsn,
                table,
                events=args.events,
                payload_bytes=payload_bytes,
                aggregates=args.aggregates,
                rate=args.rate,
                tx_rows=args.tx_rows,
            )
            c.wait_drained(conn, table, timeout=args.timeout)
    finally:
        code = relay.stop()
    problems = [] if code == 0 else [f"relay exited {code}"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        end = current_lsn(conn)
        settle_stats()
        stats1 = wal_stats(conn)
        after_run = table_counters(conn, table)
        recs = records(conn, start, end, xids)
        run_space = lsn_diff(conn, start, end)
        depth = c.count_by_status(dsn, table)
        expected = {} if config.env.get("OUTBOX_RELAY_RELAY__ON_DONE") == "delete" else {"done": args.events}
        if depth != expected:
            problems.append(f"rows after the run: {depth}, expected {expected}")
        unique, total = c.unique_message_ids(bootstrap, topic, args.events)
        if unique != args.events:
            problems.append(f"{unique} unique message ids on the topic ({total} messages), expected {args.events}")

        c.say(f"  {config.name} ~{payload_bytes} B: purge --older-than 0s ...")
        settle_stats()
        stats2 = wal_stats(conn)
        p_start = current_lsn(conn)
        purged = c.run_cli(["purge", "--older-than", "0s"], env).stdout.strip()
        p_end = current_lsn(conn)
        settle_stats()
        stats3 = wal_stats(conn)
        after_purge = table_counters(conn, table)
        purge_recs = records(conn, p_start, p_end, [])

        v_start = current_lsn(conn)
        conn.execute(sql.SQL("VACUUM {}").format(c.ident(table)))
        v_end = current_lsn(conn)
        vacuum_space = lsn_diff(conn, v_start, v_end)
    unattributed = run_space - sum(r["space"] for r in recs)
    result.update(
        {
            "write_seconds": round(write_seconds, 2),
            "app_transactions": len(xids),
            "app": summarise(recs, args.events, {"app"}),
            "relay": summarise(recs, args.events, {"other-xid", "no-xid"}),
            "relay_no_xid": summarise(recs, args.events, {"no-xid"}),
            "run_lsn_bytes": run_space,
            "run_unattributed_bytes": unattributed,
            "retention": summarise(purge_recs, args.events, {"app", "other-xid", "no-xid"}),
            "retention_output": purged,
            "vacuum_bytes_per_event": round(vacuum_space / args.events, 1),
            "pg_stat_wal_run": stats_delta(stats0, stats1),
            "pg_stat_wal_purge": stats_delta(stats2, stats3),
            "table_after_run": after_run,
            "table_after_purge": after_purge,
            "relay_exit_code": code,
            "relay_warnings": relay.warnings(),
            "ok": not problems,
            "problems": problems,
        }
    )
    app, rel, ret = result["app"], result["relay"], result["retention"]
    result["relay_plus_retention_per_event"] = round(rel["bytes_per_event"] + ret["bytes_per_event"], 1)
    result["relay_plus_retention_over_app"] = round(
        result["relay_plus_retention_per_event"] / app["bytes_per_event"], 2
    )
    relay.cleanup()
    if not args.keep:
        c.drop_schema(dsn, table)
    c.say(
        f"    app {app['bytes_per_event']} B/event, relay {rel['bytes_per_event']}, "
        f"purge {ret['bytes_per_event']}" + ("" if not problems else f"  PROBLEMS: {problems}")
    )
    return result


def measure_app_alone(dsn: str, payload_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same writer into a migrated table that no relay reads: the insert's own price."""
    table = c.new_table(f"walapp{payload_bytes}")
    c.migrate(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(c.ident(table)))
        c.checkpoint(dsn)
        start = current_lsn(conn)
        c.say(f"  app alone ~{payload_bytes} B: writing {args.events} events ...")
        xids, _ = write_events(
            dsn,
            table,
            events=args.events,
            payload_bytes=payload_bytes,
            aggregates=args.aggregates,
            rate=args.rate,
            tx_rows=args.tx_rows,
        )
        end = current_lsn(conn)
        space = lsn_diff(conn, start, end)
        app = summarise(records(conn, start, end, xids), args.events, {"app"})
    if not args.keep:
        c.drop_schema(dsn, table)
    return {"payload_bytes": payload_bytes, "lsn_bytes_per_event": round(space / args.events, 1), "app": app}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    c.add_server_args(parser)
    parser.add_argument(
        "--configs", default="keep,delete", help=f"comma-separated subset of {','.join(CONFIGS)} (default keep,delete)"
    )
    parser.add_argument("--payload-bytes", default="200,1000", help="payload sizes (default 200,1000)")
    parser.add_argument("--events", type=int, default=20_000, help="events per measurement (default 20000)")
    parser.add_argument("--tx-rows", type=int, default=100, help="rows per application transaction (default 100)")
    parser.add_argument("--rate", type=float, default=2000.0, help="application write rate, events/s (default 2000)")
    parser.add_argument("--aggregates", type=int, default=1000, help="distinct aggregate ids (default 1000)")
    parser.add_argument("--workers", type=int, default=4, help="relay workers (default 4)")
    parser.add_argument("--warm-seconds", type=float, default=2.0, help="relay idle time before writing (default 2)")
    parser.add_argument(
        "--app-alone",
        action="store_true",
        help="also measure the writer into a table no relay reads (cross-check of the attribution)",
    )
    parser.add_argument(
        "--after-migrate",
        action="append",
        default=[],
        metavar="SQL",
        help="layout experiment: run this statement after migrate ({table} = the outbox table), "
        "e.g. 'DROP INDEX ...' or 'ALTER TABLE {table} SET (fillfactor = 70)'; repeatable",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    sizes = [int(s) for s in args.payload_bytes.split(",") if s.strip()]

    results: list[dict[str, Any]] = []
    alone: list[dict[str, Any]] = []
    with c.servers(args) as (dsn, bootstrap):
        assert bootstrap is not None
        version = c.server_version(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            server = {
                s: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(s))).fetchone()[0]
                for s in ("wal_level", "data_checksums", "full_page_writes", "wal_compression")
            }
        for name in names:
            for size in sizes:
                results.append(measure(dsn, bootstrap, CONFIGS[name], size, args))
        if args.app_alone:
            alone = [measure_app_alone(dsn, size, args) for size in sizes]
        with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP EXTENSION IF EXISTS pg_walinspect")

    report = {
        "benchmark": "wal_cost",
        "postgresql": version,
        "server": server,
        "broker": c.broker_label(args),
        "events": args.events,
        "after_migrate": args.after_migrate,
        "tx_rows": args.tx_rows,
        "rate": args.rate,
        "aggregates": args.aggregates,
        "workers": args.workers,
        "configs": {n: CONFIGS[n].description for n in names},
        "results": results,
        "app_alone": alone,
        "correct": all(r["ok"] for r in results),
    }
    lines = [
        f"wal_cost: PostgreSQL {version} ({', '.join(f'{k}={v}' for k, v in server.items())}); "
        f"{args.events} events per run, {args.tx_rows}-row transactions at {args.rate:g} events/s, "
        f"`outbox-relay run --workers {args.workers}` draining, broker {c.broker_label(args)}; WAL bytes per event",
        f"  {'config':<14}{'payload':>8}{'app':>8}{'relay':>8}{'purge':>8}{'relay+ret':>11}{'x app':>7}"
        f"{'vacuum':>8}   dead tuples after run / purge",
    ]
    for r in results:
        lines.append(
            f"  {r['config']:<14}{'~' + str(r['payload_bytes']) + ' B':>8}{r['app']['bytes_per_event']:>8.0f}"
            f"{r['relay']['bytes_per_event']:>8.0f}{r['retention']['bytes_per_event']:>8.0f}"
            f"{r['relay_plus_retention_per_event']:>11.0f}{r['relay_plus_retention_over_app']:>7.2f}"
            f"{r['vacuum_bytes_per_event']:>8.0f}   {r['table_after_run']['dead_tuples']} / "
            f"{r['table_after_purge']['dead_tuples']}" + ("" if r["ok"] else "   FAILED: " + "; ".join(r["problems"]))
        )
    lines.append(
        "  per event: records / full-page images (bytes) — app | relay (of which no-xid) | purge; "
        "pg_stat_wal run: records, fpi, bytes"
    )
    for r in results:
        a, rl, nx, rt, sw = r["app"], r["relay"], r["relay_no_xid"], r["retention"], r["pg_stat_wal_run"]
        lines.append(
            f"  {r['config']:<14}{'~' + str(r['payload_bytes']) + ' B':>8}  "
            f"{a['records_per_event']:.1f} / {a['fpi_bytes_per_event']:.0f} | "
            f"{rl['records_per_event']:.1f} / {rl['fpi_bytes_per_event']:.0f} ({nx['bytes_per_event']:.0f} B) | "
            f"{rt['records_per_event']:.1f} / {rt['fpi_bytes_per_event']:.0f};  "
            f"pg_stat_wal {sw['records'] / r['events']:.1f} rec, {sw['fpi']} fpi, {sw['bytes'] / r['events']:.0f} B"
        )
    for r in results:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(r["relay"]["bytes_per_event_by_record"].items())[:6])
        lines.append(f"  {r['config']:<14}{'~' + str(r['payload_bytes']) + ' B':>8}  relay by record: {top}")
    for r in results:
        for side in ("app", "relay"):
            rel = ", ".join(f"{k} {v:.0f}" for k, v in r[side]["bytes_per_event_by_relation"].items())
            lines.append(f"  {r['config']:<14}{'~' + str(r['payload_bytes']) + ' B':>8}  {side} by relation: {rel}")
    for a in alone:
        lines.append(
            f"  app alone ~{a['payload_bytes']} B: {a['lsn_bytes_per_event']:.0f} B/event by LSN difference "
            f"({a['app']['bytes_per_event']:.0f} by xid)"
        )
    if not report["correct"]:
        lines.append("  CORRECTNESS CHECK FAILED")
    c.emit(report, lines, args.json)
    return 0 if report["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
