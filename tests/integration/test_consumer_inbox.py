"""The consumer's inbox against a forced redelivery: a worker claims and publishes a batch
and dies before its finalize; after the lease expires another worker claims the rows
again and publishes them a second time. A real Kafka consumer (confluent-kafka)
reads both copies; ``Inbox`` applies each message once, in the consumer's own
transaction, in every message format."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from outbox_relay.consumer import DeliveryId, Inbox, delivery_id
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.publisher import build_message, load_publisher
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.db import insert_rows, run_sql, statuses, wait_for

ROWS = 12


def consume(bootstrap: str, topic: str, expected: int, handle: Any, timeout: float = 30.0) -> int:
    """Read ``topic`` from offset 0 with a real consumer, calling ``handle(msg)``; commit
    each offset after it was handled (as the recipe does). Returns messages read."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"inbox-test-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])  # no group join (tansu is slow at it)
        read = 0
        deadline = time.monotonic() + timeout
        while read < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            read += 1
            handle(msg)
            consumer.commit(message=msg, asynchronous=False)
        return read
    finally:
        consumer.close()


@pytest.mark.parametrize("fmt", ["contract", "cloudevents-binary", "cloudevents-structured", "debezium"])
def test_redelivered_messages_are_applied_once(fmt, make_settings, store, pg_dsn, table, broker, topic_prefix):
    settings = make_settings(kafka={"message_format": fmt}, relay={"lease_seconds": 3.0})
    ids = insert_rows(pg_dsn, table, ROWS, aggregate_type="order")
    publisher = load_publisher(settings)
    publisher.start()
    try:
        # Worker 1 claims (with a short lease), publishes, then "dies": no finalize.
        cfg = WorkerConfig.from_settings(settings, publisher, owner="crashing", lease_seconds=0.5)
        crashed = Worker(0, store, publisher, cfg, RelayMetrics())
        claimed = crashed.claim()
        messages = [build_message(row, cfg.wire_format or cfg.topic_template) for row in claimed]
        assert publisher.publish_batch(messages, timeout_seconds=10) == [None] * ROWS
        wait_for(
            lambda: run_sql(
                pg_dsn,
                table,
                "SELECT bool_and(lease_until < now()) FROM {t} WHERE id = ANY(%s)",
                ([c.id for c in claimed],),
            )[0][0],
            timeout=10,
            interval=0.05,
            message="the crashed worker's leases to expire",
        )
        # Worker 2 takes the expired leases over and publishes everything again.
        survivor = Worker(
            1, store, publisher, WorkerConfig.from_settings(settings, publisher, owner="survivor"), RelayMetrics()
        )
        assert survivor.run_once().done == ROWS
    finally:
        publisher.close()
    assert statuses(pg_dsn, table) == {"done": ROWS}

    inbox = Inbox(table.split(".")[0] + ".inbox")
    applied: list[DeliveryId] = []
    failed_once: set[str] = set()

    def apply(conn: psycopg.Connection[Any], msg: Any) -> None:
        delivery = delivery_id(msg)
        conn.execute(f'INSERT INTO "{table.split(".")[0]}".effects (message_id) VALUES (%s)', (delivery.message_id,))
        if delivery.message_id == str(ids[0]) and not failed_once:
            failed_once.add(delivery.message_id)
            raise RuntimeError("consumer crashed while applying")  # rolls back the effect AND the inbox id
        applied.append(delivery)

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        inbox.create(conn)
        inbox.create(conn)  # idempotent
        conn.execute(f'CREATE TABLE "{table.split(".")[0]}".effects (message_id text NOT NULL)')
        outcomes: list[bool] = []

        def handle(msg: Any) -> None:
            try:
                outcomes.append(inbox.process(conn, msg, apply))
            except RuntimeError:
                outcomes.append(False)

        read = consume(broker.bootstrap_servers, f"{topic_prefix}.order", 2 * ROWS, handle)
        effects = [r[0] for r in conn.execute(f'SELECT message_id FROM "{table.split(".")[0]}".effects')]
        recorded = conn.execute(f'SELECT count(*) FROM "{table.split(".")[0]}".inbox').fetchone()
        assert inbox.purge(conn, older_than_seconds=3600) == 0
    assert read == 2 * ROWS  # every message arrived twice
    assert sorted(int(d.message_id) for d in applied) == ids  # ... and was applied once
    assert sorted(int(e) for e in effects) == ids  # the failed attempt left nothing behind
    assert recorded == (ROWS,)
    assert outcomes.count(True) == ROWS and failed_once == {str(ids[0])}
    if fmt.startswith("cloudevents"):
        assert {d.source for d in applied} == {f"/outbox-relay/{table}"}
    else:
        assert {d.source for d in applied} == {""}


def test_delivery_id_needs_an_id_and_names_are_quoted(pg_dsn, table):
    class Msg:
        def __init__(self, headers: list[tuple[str, bytes]], value: bytes = b"{}") -> None:
            self._headers, self._value = headers, value

        def headers(self) -> list[tuple[str, bytes]]:
            return self._headers

        def value(self) -> bytes:
            return self._value

    with pytest.raises(ValueError, match="no message_id, ce_id or id"):
        delivery_id(Msg([("event_type", b"X")]))
    assert delivery_id(Msg([("ce_id", b"7"), ("ce_source", b"/s")])) == DeliveryId("/s", "7")
    assert delivery_id(Msg([("id", b"9")]), default_source="orders") == DeliveryId("orders", "9")
    with pytest.raises(ValueError, match="invalid inbox table name"):
        Inbox('inbox"; DROP TABLE x; --')
    mixed = Inbox(table.split(".")[0] + ".Inbox_Mixed")  # quoted: the case is kept
    with psycopg.connect(pg_dsn) as conn:
        mixed.create(conn)
        assert mixed.record_id(conn, DeliveryId("", "1")) is True
        assert mixed.record_id(conn, DeliveryId("", "1")) is False  # same transaction: not aborted
        assert mixed.record_id(conn, DeliveryId("other", "1")) is True
        assert conn.execute(f'SELECT count(*) FROM "{table.split(".")[0]}"."Inbox_Mixed"').fetchone() == (2,)
