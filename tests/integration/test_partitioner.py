"""Keyed messages land where Apache Kafka's Java producer puts the same key.

The expected partition comes from Kafka's own jar (``BuiltInPartitioner.partitionForKey``,
run by ``tests/helpers/java_partition.py``); the actual one from the broker, for every
message the relay delivered through the real claim -> produce -> finalize path."""

from __future__ import annotations

import uuid
import zlib
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay._embedded.embedded import read_messages
from outbox_relay._embedded.kafka import kafka_available
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import assert_delivered, delivered, run_sql, wait_for
from tests.helpers.java_partition import java_partitions

pytestmark = [
    pytest.mark.first_pass_only,
    pytest.mark.skipif(not kafka_available(), reason="needs Java and Kafka's jars (./dev kafka)"),
]

PARTITION_COUNTS = (3, 7, 12)


def sample_keys() -> list[str]:
    """A few hundred distinct aggregate ids of the shapes applications use."""
    ascii_ids = [f"order-{i}" for i in range(100)] + [str(uuid.uuid5(uuid.NAMESPACE_OID, str(i))) for i in range(50)]
    multibyte = [f"客户-{i}-ü-😀" for i in range(40)] + ["é" * i + "ß" for i in range(1, 21)]
    long_ids = [f"{i}-" + "k" * 1000 for i in range(20)] + ["ж" * 500 + str(i) for i in range(20)]  # ~1 KB
    one_byte = [chr(c) for c in range(33, 127)]
    keys = ascii_ids + multibyte + long_ids + one_byte
    assert len(set(keys)) == len(keys)
    return keys


def create_topics(bootstrap: str, partitions_by_topic: dict[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=n, replication_factor=1) for topic, n in partitions_by_topic.items()],
        operation_timeout=10,
        request_timeout=15,
    )
    for future in futures.values():
        future.result(timeout=15)


def insert_keyed_rows(dsn: str, table: str, aggregate_type: str, keys: list[str]) -> list[int]:
    """One row per key (SQL, as any writer may insert: enqueue() refuses an empty id)."""
    found = run_sql(
        dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT %s, k, 'Placed', '{{}}'::jsonb FROM unnest(%s::text[]) AS k RETURNING id",
        (aggregate_type, keys),
    )
    return [int(r[0]) for r in found]


def relay_all(settings: Any, dsn: str, table: str, ids: list[int]) -> None:
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(dsn, table, ids)) == len(ids), timeout=120, message="every row delivered")
    finally:
        relay.stop()
    assert_delivered(dsn, table, ids)


def placements(bootstrap: str, topics: list[str], expected: int) -> dict[tuple[str, str], int]:
    messages = read_messages(bootstrap, topics, expected=expected, timeout=60)
    assert len(messages) == expected
    found: dict[tuple[str, str], int] = {}
    for m in messages:
        found[(m["topic"], m["key"])] = m["partition"]
    assert len(found) == expected  # one message per (topic, key)
    return found


def test_keys_land_where_the_java_producer_puts_them(make_settings, pg_dsn, table, store, broker, topic_prefix):
    keys = sample_keys()
    # The empty key is hashed by both sides (only a null key is placed at random).
    keyed = [*keys, ""]
    topics = {f"{topic_prefix}.p{n}": n for n in PARTITION_COUNTS}
    create_topics(broker.bootstrap_servers, topics)
    ids = [row_id for n in PARTITION_COUNTS for row_id in insert_keyed_rows(pg_dsn, table, f"p{n}", keyed)]

    relay_all(make_settings(relay={"batch_size": 200}), pg_dsn, table, ids)  # kafka.partitioner: the default

    expected = java_partitions([k.encode() for k in keyed], PARTITION_COUNTS)
    found = placements(broker.bootstrap_servers, list(topics), len(ids))
    mismatches = [
        (key[:40], n, found[(f"{topic_prefix}.p{n}", key)], expected[index][column])
        for index, key in enumerate(keyed)
        for column, n in enumerate(PARTITION_COUNTS)
        if found[(f"{topic_prefix}.p{n}", key)] != expected[index][column]
    ]
    assert mismatches == []
    # Not vacuous: the keys spread over every partition of every topic.
    for n in PARTITION_COUNTS:
        assert {found[(f"{topic_prefix}.p{n}", key)] for key in keys} == set(range(n))


def test_a_partitioner_passed_through_extra_still_wins(make_settings, pg_dsn, table, store, broker, topic_prefix):
    keys = [f"order-{i}" for i in range(60)]
    topic = f"{topic_prefix}.crc"
    create_topics(broker.bootstrap_servers, {topic: 7})
    ids = insert_keyed_rows(pg_dsn, table, "crc", keys)

    settings = make_settings(kafka={"extra": {"partitioner": "consistent"}})
    assert settings.kafka.effective_partitioner == "consistent"
    relay_all(settings, pg_dsn, table, ids)

    found = placements(broker.bootstrap_servers, [topic], len(ids))
    # librdkafka's consistent partitioner: CRC32 of the key modulo the partition count.
    assert {key: found[(topic, key)] for key in keys} == {key: zlib.crc32(key.encode()) % 7 for key in keys}
    java = java_partitions([k.encode() for k in keys], [7])
    assert any(found[(topic, key)] != java[i][0] for i, key in enumerate(keys))  # another placement indeed
