"""One bad row in a batch on a broker that validates records: what happens to its neighbours?

Starts an embedded PostgreSQL 18 and the embedded tansu broker **with a schema
directory** (``tansu broker --schema-registry file://./schema``, a JSON schema
``<topic>.json`` requiring an integer ``amount``), writes ``--rows`` outbox rows of
which ``--bad`` violate the schema (spread evenly through the backlog), runs
``outbox-relay run`` as a subprocess until no row is pending or processing (or
``--timeout``), and prints how the rows ended: status counts, the reasons of the dead
rows, the attempts the good rows used, how many messages the topic holds, and the
relay's ``outbox_relay_isolated_total``.

A broker validates a produce request's record batch as a whole: without isolation
every row that shared a batch with a bad one goes dead with the bad one's error.

    .venv/bin/python bench/isolation.py                 # 200 rows, 1 bad
    .venv/bin/python bench/isolation.py --rows 2000 --bad 5 --ordered
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psycopg
from _common import (
    RUN_ID,
    RelayProcess,
    add_server_args,
    count_by_status,
    create_topic,
    drop_schema,
    emit,
    ident,
    migrate,
    new_table,
    relay_env,
    say,
    servers,
    unique_message_ids,
)
from psycopg import sql

from outbox_relay._embedded.embedded import EmbeddedBroker, free_port

# The topic's schema: the value must be an object with an integer "amount".
VALUE_SCHEMA = {
    "type": "object",
    "properties": {
        "value": {
            "type": "object",
            "properties": {"amount": {"type": "integer"}},
            "required": ["amount"],
        },
    },
}


def bad_positions(rows: int, bad: int) -> set[int]:
    """``bad`` row positions spread evenly through the backlog (none at the very start),
    shifted by one per bad row so that they fall on different aggregates."""
    if bad <= 0:
        return set()
    step = rows / bad
    return {min(rows - 1, int(step * k + step / 2) + k) for k in range(bad)}


def scrape_metric(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    parser.add_argument("--rows", type=int, default=200, help="outbox rows to write (default 200)")
    parser.add_argument("--bad", type=int, default=1, help="rows whose payload violates the schema (default 1)")
    parser.add_argument("--aggregates", type=int, default=20, help="distinct aggregate ids (default 20)")
    parser.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="partitions of the topic (default 1: the whole batch is one record batch)",
    )
    parser.add_argument("--workers", type=int, default=2, help="relay worker threads (default 2)")
    parser.add_argument("--batch-size", type=int, default=1000, help="relay.batch_size (default 1000)")
    parser.add_argument("--ordered", action="store_true", help="claim the event type in per-aggregate order")
    parser.add_argument("--relay-log", help="copy the relay's log (JSON lines) to this file")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the backlog to settle")
    args = parser.parse_args()
    if args.bootstrap:
        parser.error("--bootstrap is not supported: this script needs the embedded broker with a schema directory")

    topic = f"isolation_{RUN_ID}"
    table = new_table("isolation")
    bad = bad_positions(args.rows, args.bad)
    with (
        tempfile.TemporaryDirectory(prefix="outbox-relay-isolation-") as tmp,
        servers(args, need_broker=False) as (dsn, _),
    ):
        schema_dir = Path(tmp) / "schema"
        schema_dir.mkdir()
        (schema_dir / f"{topic}.json").write_text(json.dumps(VALUE_SCHEMA))
        say(f"starting the embedded tansu broker with --schema-registry ({schema_dir}/{topic}.json) ...")
        with EmbeddedBroker(log_file=Path(tmp) / "broker.log", schema_dir=schema_dir) as broker:
            create_topic(broker.bootstrap_servers, topic, partitions=args.partitions)
            migrate(dsn, table)
            with psycopg.connect(dsn) as conn, conn.cursor() as cur:
                insert = sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
                    "VALUES ('order', %s, 'OrderPlaced', %s)"
                ).format(ident(table))
                cur.executemany(
                    insert,
                    [
                        (
                            f"agg-{i % args.aggregates}",
                            json.dumps({"amount": "not-a-number" if i in bad else i, "seq": i}),
                        )
                        for i in range(args.rows)
                    ],
                )
            metrics_port = free_port()
            env = relay_env(
                dsn,
                table,
                broker.bootstrap_servers,
                topic,
                OUTBOX_RELAY_METRICS__PORT=str(metrics_port),
                OUTBOX_RELAY_METRICS__HOST="127.0.0.1",
                OUTBOX_RELAY_RELAY__BATCH_SIZE=str(args.batch_size),
                OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES=json.dumps(["OrderPlaced"] if args.ordered else []),
            )
            say(f"running outbox-relay run --workers {args.workers} on {args.rows} rows ({len(bad)} bad) ...")
            relay = RelayProcess(["--workers", str(args.workers)], env)
            started = time.monotonic()
            settled = False
            try:
                relay.wait_started()
                # Settled: nothing processing, and every pending row waits behind a dead
                # earlier row of its aggregate (an ordered aggregate's dead head blocks it).
                probe = sql.SQL(
                    "SELECT EXISTS (SELECT 1 FROM {t} o WHERE o.status = 'processing' OR (o.status = 'pending' "
                    "AND NOT (%s AND EXISTS (SELECT 1 FROM {t} d WHERE d.aggregate_id = o.aggregate_id "
                    "AND d.status = 'dead' AND d.id < o.id))))"
                ).format(t=ident(table))
                with psycopg.connect(dsn, autocommit=True) as conn:
                    while time.monotonic() - started < args.timeout:
                        if not conn.execute(probe, (args.ordered,)).fetchone()[0]:  # type: ignore[index]
                            settled = True
                            break
                        time.sleep(0.05)
                elapsed = time.monotonic() - started
                isolated = scrape_metric(metrics_port, "outbox_relay_isolated_total")
            finally:
                relay.stop()
                if args.relay_log:
                    Path(args.relay_log).write_text(relay.log_text())
                relay.cleanup()

            statuses = count_by_status(dsn, table)
            with psycopg.connect(dsn, autocommit=True) as conn:
                rows = conn.execute(
                    sql.SQL("SELECT id, status, attempts, last_error FROM {} ORDER BY id").format(ident(table))
                ).fetchall()
            first_id = rows[0][0]
            bad_ids = {first_id + i for i in bad}
            dead_reasons: dict[str, int] = {}
            good_attempts: dict[int, int] = {}
            burned_reasons: dict[str, int] = {}  # last_error of good rows that used more than one attempt
            for row_id, status, attempts, last_error in rows:
                if status == "dead":
                    dead_reasons[str(last_error)] = dead_reasons.get(str(last_error), 0) + 1
                if row_id not in bad_ids:
                    good_attempts[attempts] = good_attempts.get(attempts, 0) + 1
                    if attempts > 1:
                        burned_reasons[str(last_error)] = burned_reasons.get(str(last_error), 0) + 1
            bad_dead = sum(1 for row_id, status, _, _ in rows if row_id in bad_ids and status == "dead")
            good_dead = sum(1 for row_id, status, _, _ in rows if row_id not in bad_ids and status == "dead")
            delivered = statuses.get("done", 0)
            unique, total = (
                unique_message_ids(broker.bootstrap_servers, topic, delivered, timeout=30) if delivered else (0, 0)
            )
        if not args.keep:
            drop_schema(dsn, table)

    report = {
        "rows": args.rows,
        "bad": len(bad),
        "partitions": args.partitions,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "ordered": args.ordered,
        "settled": settled,
        "seconds": round(elapsed, 2),
        "statuses": statuses,
        "bad_rows_dead": bad_dead,
        "good_rows_dead": good_dead,
        "good_rows_by_attempts": dict(sorted(good_attempts.items())),
        "dead_reasons": dead_reasons,
        "burned_reasons": burned_reasons,
        "topic_unique_message_ids": unique,
        "topic_messages": total,
        "isolated_total": isolated,
    }
    lines = [
        f"rows {args.rows} ({len(bad)} violate the topic's schema), partitions {args.partitions}, "
        f"workers {args.workers}, "
        f"batch {args.batch_size}, ordered {args.ordered}",
        f"settled: {settled} after {elapsed:.2f} s",
        "statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())),
        f"dead: {bad_dead} bad rows, {good_dead} good rows",
        "good rows by attempts used: " + ", ".join(f"{k}: {v}" for k, v in sorted(good_attempts.items())),
        f"topic holds {total} messages, {unique} unique message ids",
        f"outbox_relay_isolated_total: {isolated if isolated is not None else 'n/a (metric not exported)'}",
        "dead reasons:",
        *(f"  {n:5d} x {reason}" for reason, n in sorted(dead_reasons.items(), key=lambda kv: -kv[1])),
        *(["last errors of good rows that used more than one attempt:"] if burned_reasons else []),
        *(f"  {n:5d} x {reason}" for reason, n in sorted(burned_reasons.items(), key=lambda kv: -kv[1])),
    ]
    emit(report, lines, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
