"""Rows whose writer encoded the value (``enqueue(payload_bytes=...)``): the bytes are
published as they are, in every message format, to Apache Kafka and over HTTP, read
back from the real broker and the suite's HTTP target."""

from __future__ import annotations

import base64
import json
from typing import Any

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay.publishers.http import HttpPublisher
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import delivered, row_states, wait_for
from tests.helpers.http_target import HttpTarget
from tests.helpers.kafka_records import read_records

pytestmark = pytest.mark.first_pass_only

# Not UTF-8, with a NUL and every byte above 0x7F a text path would mangle.
ENCODED = b"\x00\x00\x00\x00\x07\x02\xff\xfe\x80binary\x00tail" + bytes(range(128, 256))


def write(dsn: str, table: str, aggregate_id: str, **extra: Any) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return int(
            enqueue(
                conn,
                aggregate_type="blob",
                aggregate_id=aggregate_id,
                event_type="BlobWritten",
                table=table,
                **{"payload": None, **extra},
            )
        )


def relay_until_delivered(settings: Any, dsn: str, table: str, ids: list[int]) -> None:
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(dsn, table, ids)) == len(ids), timeout=60, message="every row delivered")
    finally:
        relay.stop()


@pytest.mark.parametrize("message_format", ["contract", "debezium", "cloudevents-binary", "cloudevents-structured"])
def test_payload_bytes_to_kafka_in_every_format(
    message_format: str, make_settings: Any, store: Any, pg_dsn: str, table: str, broker: Any, topic_prefix: str
) -> None:
    typed = write(pg_dsn, table, "b-1", payload_bytes=ENCODED, headers={"content-type": "application/x-protobuf"})
    untyped = write(pg_dsn, table, "b-2", payload_bytes=bytearray(b"\x01\x02"))
    json_row = write(pg_dsn, table, "b-3", payload={"plain": "json"})
    settings = make_settings(kafka={"message_format": message_format, "topic_template": topic_prefix + ".blob"})
    relay_until_delivered(settings, pg_dsn, table, [typed, untyped, json_row])

    records = read_records(broker.bootstrap_servers, f"{topic_prefix}.blob", expected=3)
    by_key = {r.key: r for r in records}
    assert sorted(by_key) == [b"b-1", b"b-2", b"b-3"]
    first, second, plain = by_key[b"b-1"], by_key[b"b-2"], by_key[b"b-3"]
    if message_format == "contract":
        assert first.value == ENCODED and second.value == b"\x01\x02"
        assert first.headers["message_id"] == str(typed) and first.headers["content-type"] == "application/x-protobuf"
        assert json.loads(plain.value or b"") == {"plain": "json"}
    elif message_format == "debezium":
        assert first.value == ENCODED and first.headers["id"] == str(typed)
        assert second.value == b"\x01\x02" and second.headers["id"] == str(untyped)
    elif message_format == "cloudevents-binary":
        assert first.value == ENCODED and first.headers["content-type"] == "application/x-protobuf"
        assert first.headers["ce_id"] == str(typed) and first.headers["ce_type"] == "BlobWritten"
        assert second.value == b"\x01\x02" and second.headers["content-type"] == "application/octet-stream"
        assert plain.headers["content-type"] == "application/json"
    else:
        from cloudevents.core.formats.json import JSONFormat

        envelope = json.loads(first.value or b"")
        assert first.headers["content-type"] == "application/cloudevents+json"
        assert envelope["datacontenttype"] == "application/x-protobuf" and "data" not in envelope
        assert base64.b64decode(envelope["data_base64"]) == ENCODED
        # The CloudEvents SDK reads the JSON event format's binary data back as bytes.
        event = JSONFormat().read(None, first.value or b"")
        assert event.get_data() == ENCODED and event.get_id() == str(typed)
        second_envelope = json.loads(second.value or b"")
        assert second_envelope["datacontenttype"] == "application/octet-stream"
        assert base64.b64decode(second_envelope["data_base64"]) == b"\x01\x02"
        assert json.loads(plain.value or b"")["data"] == {"plain": "json"}


def test_payload_bytes_larger_than_a_message_go_dead_without_being_read(
    make_settings: Any, store: Any, pg_dsn: str, table: str, broker: Any, topic_prefix: str
) -> None:
    big = write(pg_dsn, table, "b-big", payload_bytes=b"\x00" * 20_000)
    small = write(pg_dsn, table, "b-small", payload_bytes=b"\x01")
    settings = make_settings(kafka={"message_max_bytes": 10_000, "topic_template": topic_prefix + ".blob"})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(
            lambda: (
                row_states(pg_dsn, table, [big], ("status",))[big][0] == "dead"
                and len(delivered(pg_dsn, table, [small])) == 1
            ),
            timeout=60,
            message="the large row dead, the small one delivered",
        )
    finally:
        relay.stop()
    # payload_bytes count in the claim's size (20000 bytes + the JSON null payload)
    assert "20004 bytes, above the publisher's limit" in row_states(pg_dsn, table, [big], ("last_error",))[big][0]


@pytest.mark.parametrize("message_format", ["contract", "cloudevents-binary", "cloudevents-structured"])
def test_payload_bytes_over_http(message_format: str, make_settings: Any, store: Any, pg_dsn: str, table: str) -> None:
    with HttpTarget() as target:
        typed = write(pg_dsn, table, "h-1", payload_bytes=ENCODED, headers={"content-type": "application/avro"})
        untyped = write(pg_dsn, table, "h-2", payload_bytes=b"\x01\x02")
        settings = make_settings(
            relay={"publisher": "http"},
            kafka={"message_format": message_format},
            http={"url_template": f"{target.base_url}/e/{{id}}"},
        )
        relay = Relay(settings, publisher=HttpPublisher.from_settings(settings))
        relay.start()
        try:
            wait_for(lambda: len(delivered(pg_dsn, table, [typed, untyped])) == 2, timeout=60, message="both delivered")
        finally:
            relay.stop()
        by_path = {r.decoded_path: r for r in target.requests}
        first, second = by_path[f"/e/{typed}"], by_path[f"/e/{untyped}"]
    if message_format == "cloudevents-structured":
        assert first.headers["content-type"] == "application/cloudevents+json"
        envelope = json.loads(first.body)
        assert envelope["datacontenttype"] == "application/avro"
        assert base64.b64decode(envelope["data_base64"]) == ENCODED
        return
    assert first.body == ENCODED and first.headers["content-type"] == "application/avro"
    assert second.body == b"\x01\x02" and second.headers["content-type"] == "application/octet-stream"
    if message_format == "cloudevents-binary":
        assert first.headers["ce-id"] == str(typed)


def test_payload_bytes_in_an_ordered_run(
    make_settings: Any, store: Any, pg_dsn: str, table: str, broker: Any, topic_prefix: str
) -> None:
    from tests.conftest import ON_DONE

    store.migrate(ordering=True, on_done=ON_DONE)  # the ordering indexes the ordered claim needs
    ids = [write(pg_dsn, table, "run-1", payload_bytes=bytes([n]) + ENCODED, ordered=True) for n in range(3)]
    settings = make_settings(kafka={"topic_template": topic_prefix + ".blob"}, relay={"ordered_event_types": ["*"]})
    relay_until_delivered(settings, pg_dsn, table, ids)
    records = read_records(broker.bootstrap_servers, f"{topic_prefix}.blob", expected=3)
    assert [r.value for r in sorted(records, key=lambda r: r.offset)] == [bytes([n]) + ENCODED for n in range(3)]
