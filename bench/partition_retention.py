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

    .venv/bin/python bench/partition_retention.py --events 2000
    .venv/bin/python bench/partition_retention.py --events 20000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay.db.delivery import CLAIM_SETTINGS
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
                for name, value in CLAIM_SETTINGS.items():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2000, help="rows per mode (default: %(default)s)")
    parser.add_argument("--payload-bytes", type=int, default=200, help="payload size (default: %(default)s)")
    parser.add_argument("--partitions-list", default="30,300", help="partition counts of part 2 (default: %(default)s)")
    parser.add_argument("--claim-backlog", type=int, default=5000, help="pending rows of part 2 (default: %(default)s)")
    c.add_server_args(parser)
    args = parser.parse_args()
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
