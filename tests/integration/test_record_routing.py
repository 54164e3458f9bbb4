"""What a row asks of its Kafka record besides the key and value — a null value
(``tombstone``), its partition (``partition``), the record timestamp
(``kafka.timestamp``) — read back from Apache Kafka through the real relay."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from confluent_kafka import TIMESTAMP_CREATE_TIME
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay import enqueue
from outbox_relay._embedded.kafka import kafka_available
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import assert_delivered, delivered, make_row, row_state, run_sql, wait_for
from tests.helpers.kafka_records import read_records

pytestmark = pytest.mark.first_pass_only

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def relay_all(settings: Any, dsn: str, table: str, ids: list[int]) -> None:
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(dsn, table, ids)) == len(ids), timeout=60, message="every row delivered")
    finally:
        relay.stop()
    assert_delivered(dsn, table, ids)


def created_ms(dsn: str, table: str, row_id: int) -> int:
    created = run_sql(dsn, table, "SELECT created_at FROM {t} WHERE id = %s", (row_id,))[0][0]
    return int((created - EPOCH) // dt.timedelta(milliseconds=1))


@pytest.mark.parametrize("stamp", ["send_time", "created_at"])
def test_record_timestamp_as_configured(stamp, make_settings, store, pg_dsn, table, broker, topic_prefix):
    # A row written an hour ago (with a sub-millisecond part) and one written now.
    old = make_row(pg_dsn, table, aggregate_type="stamped", aggregate_id="a-1", created_ago_seconds=3600.0004)
    new = make_row(pg_dsn, table, aggregate_type="stamped", aggregate_id="a-2")
    settings = make_settings(kafka={"timestamp": stamp})
    before_ms = int(time.time() * 1000)
    relay_all(settings, pg_dsn, table, [old, new])
    after_ms = int(time.time() * 1000)

    records = read_records(broker.bootstrap_servers, f"{topic_prefix}.stamped", expected=2)
    by_id = {int(r.headers["message_id"]): r for r in records}
    assert sorted(by_id) == [old, new]
    for row_id, record in by_id.items():
        assert record.timestamp_type == TIMESTAMP_CREATE_TIME
        if stamp == "created_at":
            assert record.timestamp_ms == created_ms(pg_dsn, table, row_id)
        else:
            assert before_ms - 1000 <= record.timestamp_ms <= after_ms + 1000  # the send time
    if stamp == "created_at":
        assert by_id[old].timestamp_ms < before_ms - 3_500_000  # the hour-old row keeps its age


def create_topic(bootstrap: str, topic: str, partitions: int, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=config or {})],
        operation_timeout=10,
        request_timeout=15,
    )
    for future in futures.values():
        future.result(timeout=15)


def write(dsn: str, table: str, aggregate_type: str, aggregate_id: str, **extra: Any) -> int:
    extra.setdefault("payload", {"aggregate": aggregate_id})
    with psycopg.connect(dsn) as conn, conn.transaction():
        return int(
            enqueue(
                conn,
                aggregate_type=aggregate_type,
                aggregate_id=aggregate_id,
                event_type="CustomerErased" if extra.get("tombstone") else "CustomerChanged",
                table=table,
                **extra,
            )
        )


@pytest.mark.parametrize("fmt", ["contract", "debezium", "cloudevents-binary", "cloudevents-structured"])
def test_a_tombstone_row_is_a_null_value_with_its_key(fmt, make_settings, store, pg_dsn, table, broker, topic_prefix):
    topic = f"{topic_prefix}.customer"
    create_topic(broker.bootstrap_servers, topic, 2, {"cleanup.policy": "compact"})  # where tombstones matter
    kept = write(pg_dsn, table, "customer", "c-1")
    erased = write(pg_dsn, table, "customer", "c-2", payload=None, tombstone=True)
    settings = make_settings(kafka={"message_format": fmt, "topic_template": topic_prefix + ".{aggregate_type}"})
    relay_all(settings, pg_dsn, table, [kept, erased])

    records = read_records(broker.bootstrap_servers, topic, expected=2)
    by_key = {r.key: r for r in records}
    assert set(by_key) == {b"c-1", b"c-2"}
    assert by_key[b"c-2"].value is None  # the tombstone: the key, a null value
    assert by_key[b"c-1"].value is not None
    headers = by_key[b"c-2"].headers
    if fmt == "contract":
        assert headers["message_id"] == str(erased) and headers["event_type"] == "CustomerErased"
    elif fmt == "debezium":
        assert headers == {"id": str(erased)}
    else:
        # Both CloudEvents formats send it in binary content mode (a null value cannot
        # hold a structured envelope): an event without data, read so by the SDK.
        message = ce_kafka.KafkaMessage(
            headers={n: v.encode() for n, v in headers.items()}, key=by_key[b"c-2"].key, value=b""
        )
        event = ce_kafka.from_kafka(message, JSONFormat())
        assert event.get_id() == str(erased)
        assert event.get_type() == "CustomerErased"
        assert event.get_subject() == "c-2"
        assert "content-type" not in headers  # no data, no data content type


@pytest.mark.skipif(not kafka_available(), reason="needs Java and Kafka's jars (./dev kafka)")
def test_a_rows_partition_is_honoured_and_a_missing_one_goes_dead(
    make_settings, store, pg_dsn, table, broker, topic_prefix
):
    from tests.helpers.java_partition import java_partitions

    topic = f"{topic_prefix}.placed"
    create_topic(broker.bootstrap_servers, topic, 4)
    keys = [f"order-{i}" for i in range(12)]
    natural = [p for (p,) in java_partitions([k.encode() for k in keys], [4])]
    asked = [(p + 1 + i % 3) % 4 for i, p in enumerate(natural)]  # never the partitioner's choice
    placed = [write(pg_dsn, table, "placed", key, partition=p) for key, p in zip(keys, asked, strict=True)]
    free = write(pg_dsn, table, "placed", "order-free")  # NULL: the partitioner decides
    missing = write(pg_dsn, table, "placed", "order-x", partition=9)  # the topic has 4
    relay = Relay(make_settings())
    relay.start()
    try:
        wait_for(
            lambda: (
                len(delivered(pg_dsn, table, [*placed, free])) == len(placed) + 1
                and row_state(pg_dsn, table, missing)["status"] == "dead"
            ),
            timeout=60,
            message="placed rows delivered, the one asking for a missing partition dead",
        )
    finally:
        relay.stop()
    dead = row_state(pg_dsn, table, missing, ("status", "attempts", "last_error"))
    assert dead["attempts"] == 1  # dead at once: waiting cannot create the partition
    assert "the row's partition is not one of the topic's partitions" in dead["last_error"]

    records = read_records(broker.bootstrap_servers, topic, expected=len(placed) + 1)
    found = {r.key.decode(): r.partition for r in records if r.key is not None}
    assert {key: found[key] for key in keys} == dict(zip(keys, asked, strict=True))
    assert found["order-free"] == java_partitions([b"order-free"], [4])[0][0]
    assert "order-x" not in found
