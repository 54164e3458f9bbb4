"""Message-by-message comparison of Debezium's outbox event router and outbox-relay.

Not a timing benchmark: it checks that ``kafka.message_format = "debezium"`` emits what
the router emits for the same rows. One outbox table (the relay's, ``migrate``d) on a
PostgreSQL with ``wal_level=logical`` is read by both: Kafka Connect standalone with
``debezium-connector-postgres`` (pgoutput, ``snapshot.mode=no_data``) and the
``EventRouter`` transform at its defaults mapped to the table's columns (as
bench/debezium.py runs it: key = aggregate_id, value = payload, StringConverter), and
the relay in the ``debezium`` format. Each writes to a topic of its own, both created
beforehand with ``--partitions`` partitions.

The rows are written (one transaction each, with ``enqueue``) once the connector's
replication slot is active, then the relay is started; when both topics hold every row,
the records are matched by the outbox id (the ``id`` header) and compared: key, value,
headers, partition; the record timestamps are reported (the router stamps the commit
time of the row's transaction, the relay the send time, or the insert time with
``kafka.timestamp = "created_at"``). Payloads cover what a JSON text can differ in:
key order, spacing, unicode, escapes, large and fractional numbers, nesting, empty
containers.

Debezium 3's connector adds headers of its own to every record
(``__debezium.context.connectorLogicalName``, ``connectorName``, ``runId``, ``taskId``:
which connector run produced it); they are listed, not compared.

Exit status: 0 when every record matches in key, value, headers and partition, 1 when
one differs or is missing (each difference is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c
import debezium as dbz
import psycopg

from outbox_relay import enqueue

#: Payloads that would show a difference in how the JSON text is rendered.
PAYLOADS: list[Any] = [
    {"id": 1, "customer": "c-1"},
    {"z": 1, "a": 2, "m": {"y": [3, 2, 1], "b": None}},
    {"text": "naïve café ☃ 🚀", "quote": 'say "hi"', "slash": "a\\b/c", "newline": "one\ntwo\ttab"},
    {"big": 12345678901234567890, "negative": -42, "fraction": 0.1, "exp": 1e20, "tiny": 1.5e-7},
    {"nested": {"deeper": {"deepest": [{"k": True}, {"k": False}]}}},
    {"empty_object": {}, "empty_list": [], "null": None},
    [1, "two", 3.0],
    '"a JSON string"',  # a str is JSON text to enqueue()
    42,
    {"control": "\u0001 and \u001f", "html": "<a href='x'>&amp;</a>"},
]


def write_rows(dsn: str, table: str, aggregates: int, rounds: int) -> list[int]:
    ids: list[int] = []
    with psycopg.connect(dsn, application_name="bench-writer") as conn:
        for n in range(rounds):
            for i, payload in enumerate(PAYLOADS):
                with conn.transaction():
                    ids.append(
                        int(
                            enqueue(
                                conn,
                                aggregate_type=dbz.AGGREGATE_TYPE,
                                aggregate_id=f"agg-{(n * len(PAYLOADS) + i) % aggregates}",
                                event_type=f"Event{i}",
                                payload=payload,
                                table=table,
                            )
                        )
                    )
    return ids


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float) -> list[Any]:
    """Every record of ``topic`` (all partitions, from offset 0) until ``expected`` arrived."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-compare-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=15).topics[topic]
        consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        records: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(records) < expected and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=500, timeout=0.5):
                if message.error() is None:
                    records.append(message)
        return records
    finally:
        consumer.close()


def summary(message: Any) -> dict[str, Any]:
    return {
        "key": message.key(),
        "value": message.value(),
        "headers": sorted((name, value) for name, value in (message.headers() or [])),
        "partition": message.partition(),
        "timestamp_ms": message.timestamp()[1],
    }


def by_outbox_id(records: list[Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        entry = summary(record)
        ids = [value for name, value in entry["headers"] if name == "id"]
        out[ids[0].decode() if ids else f"no-id-{len(out)}"] = entry
    return out


def wait_slot_active(dsn: str, slot: str, reader: dbz.Reader, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True, application_name="bench-monitor") as conn:
        while time.monotonic() < deadline:
            reader.check_alive()
            row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            if row is not None and row[0]:
                return
            time.sleep(0.5)
    raise TimeoutError(f"the connector's replication slot {slot} not active within {timeout:.0f}s")


#: Headers Debezium's connector adds to every record of its own (which connector, task and
#: run produced it; Debezium 3's ``extended.headers.enabled``, on by default): about the
#: connector, not the outbox row, so not compared but listed.
DEBEZIUM_CONTEXT_PREFIX = "__debezium.context."


def split_context_headers(records: dict[str, dict[str, Any]]) -> set[str]:
    """Take the connector's context headers out of ``records``; their names."""
    names: set[str] = set()
    for entry in records.values():
        names.update(name for name, _ in entry["headers"] if name.startswith(DEBEZIUM_CONTEXT_PREFIX))
        entry["headers"] = [(n, v) for n, v in entry["headers"] if not n.startswith(DEBEZIUM_CONTEXT_PREFIX)]
    return names


def compare(relay: dict[str, dict[str, Any]], router: dict[str, dict[str, Any]], ids: list[int]) -> list[str]:
    differences: list[str] = []
    for outbox_id in (str(i) for i in ids):
        mine, theirs = relay.get(outbox_id), router.get(outbox_id)
        if mine is None or theirs is None:
            differences.append(f"id {outbox_id}: missing from {'the relay' if mine is None else 'Debezium'}")
            continue
        for field in ("key", "value", "headers", "partition"):
            if mine[field] != theirs[field]:
                differences.append(f"id {outbox_id} {field}: relay {mine[field]!r} != Debezium {theirs[field]!r}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help=f"rounds of the {len(PAYLOADS)} payloads")
    parser.add_argument("--aggregates", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--created-at", action="store_true", help='the relay with kafka.timestamp = "created_at"')
    parser.add_argument("--connect-heap-mb", type=int, default=512)
    parser.add_argument(
        "--connector-prop",
        action="append",
        metavar="KEY=VALUE",
        help="a connector property (repeatable), e.g. transforms.outbox.table.field.event.timestamp=created_at",
    )
    parser.add_argument("--pg-bin", help="PostgreSQL bin directory (default: the embedded PostgreSQL 18's)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.workers, args.debezium_table, args.worker_prop = 2, "relay", None

    dbz.java_binary()
    dbz.debezium_classpath()
    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-compare-"))
    try:
        with (
            dbz.postgres(args, tmp) as dsn,
            c.servers(argparse.Namespace(**{**vars(args), "dsn": dsn})) as (_, bootstrap),
        ):
            assert bootstrap is not None
            table = c.new_table("compare")
            relay_prefix, router_prefix = f"cmp_{c.RUN_ID}_relay", f"cmp_{c.RUN_ID}_dbz"
            for prefix in (relay_prefix, router_prefix):
                c.create_topic(bootstrap, f"{prefix}.{dbz.AGGREGATE_TYPE}", args.partitions)
            (tmp / "debezium").mkdir()
            (tmp / "relay").mkdir()
            router = dbz.DebeziumReader(dsn, table, bootstrap, router_prefix, tmp / "debezium", args)
            relay = dbz.RelayReader(dsn, table, bootstrap, relay_prefix, tmp / "relay", args)
            if args.created_at:
                relay.env["OUTBOX_RELAY_KAFKA__TIMESTAMP"] = "created_at"
            try:
                c.say("starting Kafka Connect with Debezium's outbox event router ...")
                router.start()
                wait_slot_active(dsn, router.slot, router, args.timeout)
                ids = write_rows(dsn, table, args.aggregates, args.rounds)
                c.say(f"wrote {len(ids)} rows; starting outbox-relay (message_format = debezium) ...")
                relay.start()
                topic = f".{dbz.AGGREGATE_TYPE}"
                relay_records = by_outbox_id(read_topic(bootstrap, relay_prefix + topic, len(ids), args.timeout))
                router_records = by_outbox_id(read_topic(bootstrap, router_prefix + topic, len(ids), args.timeout))
            finally:
                relay.stop()
                router.stop()
                with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
                    router.cleanup(conn)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    context_headers = split_context_headers(router_records)
    differences = compare(relay_records, router_records, ids)
    lag_ms = [
        relay_records[str(i)]["timestamp_ms"] - router_records[str(i)]["timestamp_ms"]
        for i in ids
        if str(i) in relay_records and str(i) in router_records
    ]
    print(f"rows: {len(ids)}; relay records: {len(relay_records)}; Debezium records: {len(router_records)}")
    print(f"compared key, value, headers, partition: {len(ids) - len(differences)} rows equal")
    if lag_ms:
        print(
            "record timestamp, relay - Debezium: "
            f"min {min(lag_ms)} ms, max {max(lag_ms)} ms ({'created_at' if args.created_at else 'send_time'})"
        )
    if context_headers:
        print(f"Debezium's own context headers (not compared): {', '.join(sorted(context_headers))}")
    partitions = sorted({entry["partition"] for entry in relay_records.values()})
    print(f"partitions used: {partitions} of {args.partitions}")
    example = router_records.get(str(ids[0]))
    if example is not None:
        print(f"example (id {ids[0]}): {example}")
    for line in differences:
        print("DIFFERENT", line)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
