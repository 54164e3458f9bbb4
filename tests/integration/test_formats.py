"""Every message format through the real claim -> publish -> finalize path, read back from
a real broker (and a real HTTP server) and parsed by the official CloudEvents SDK."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.publisher import load_publisher
from outbox_relay.publishers.http import HttpPublisher
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.db import run_sql
from tests.helpers.http_target import HttpTarget

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only

PAYLOADS = [{"order_id": 1, "amount": 12.5, "note": "ü"}, {"order_id": 2, "lines": [1, 2, 3]}]


def write_rows(dsn: str, table: str, aggregate_type: str, headers: dict[str, str]) -> list[int]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return [
            int(
                enqueue(
                    conn,
                    aggregate_type=aggregate_type,
                    aggregate_id=f"order {i}/ü",
                    event_type="OrderPaid",
                    payload=payload,
                    headers=headers,
                    table=table,
                )
            )
            for i, payload in enumerate(PAYLOADS)
        ]


def created_at(dsn: str, table: str) -> dict[int, Any]:
    return dict(run_sql(dsn, table, "SELECT id, created_at FROM {t}"))  # type: ignore[arg-type]


def relay_once(settings: Any, store: Any) -> None:
    """One batch through a Worker configured as Relay.start() does, on the configured publisher."""
    publisher = load_publisher(settings)
    publisher.start()
    try:
        cfg = WorkerConfig.from_settings(settings, publisher, owner="formats")
        assert Worker(0, store, publisher, cfg, RelayMetrics()).run_once().done == len(PAYLOADS)
    finally:
        publisher.close()


def kafka_message(m: dict[str, Any]) -> ce_kafka.KafkaMessage:
    return ce_kafka.KafkaMessage(
        headers={n: (v or "").encode() for n, v in m["headers"].items()},
        key=m["key"].encode(),
        value=m["value"].encode(),
    )


@pytest.mark.parametrize("fmt", ["cloudevents-binary", "cloudevents-structured"])
def test_cloudevents_on_kafka_read_by_the_sdk(fmt, make_settings, store, pg_dsn, table, broker, topic_prefix):
    settings = make_settings(kafka={"message_format": fmt})
    ids = write_rows(pg_dsn, table, "order", {"ce_tenant": "acme", "tenant_hint": "eu"})
    relay_once(settings, store)
    times = created_at(pg_dsn, table)
    stored = dict(run_sql(pg_dsn, table, "SELECT id, payload::text FROM {t}"))
    messages = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=len(ids), timeout=30)
    assert len(messages) == len(ids)
    for m in messages:
        kafka = kafka_message(m)
        event = (
            ce_kafka.from_binary(kafka, JSONFormat())
            if fmt == "cloudevents-binary"
            else ce_kafka.from_structured(kafka, JSONFormat())
        )
        assert ce_kafka.from_kafka(kafka, JSONFormat()).get_attributes() == event.get_attributes()  # mode detected
        row_id = int(event.get_id())
        index = ids.index(row_id)
        assert event.get_specversion() == "1.0"
        assert event.get_source() == f"/outbox-relay/{table}"
        assert event.get_type() == "OrderPaid"
        assert event.get_subject() == f"order {index}/ü"
        assert event.get_time() == times[row_id]  # created_at, RFC 3339 (microseconds kept)
        assert event.get_datacontenttype() == "application/json"
        assert event.get_data() == PAYLOADS[index]
        assert event.get_extension("tenant") == "acme"  # a ce_<name> row header = an extension attribute
        assert event.get_extension("partitionkey") == f"order {index}/ü"  # the SDK reads the key as partitionkey
        assert event.get_dataschema() is None
        assert m["key"] == f"order {index}/ü"
        assert m["headers"]["message_id"] == str(row_id)  # the contract's dedup header stays
        assert m["headers"]["tenant_hint"] == "eu"
        if fmt == "cloudevents-binary":
            assert m["value"] == stored[row_id]  # the payload exactly as stored (jsonb::text)
            assert m["headers"]["content-type"] == "application/json"
            assert sorted(n for n in m["headers"] if n.startswith("ce_")) == [
                "ce_id",
                "ce_source",
                "ce_specversion",
                "ce_subject",
                "ce_tenant",
                "ce_time",
                "ce_type",
            ]
        else:
            assert m["headers"]["content-type"] == "application/cloudevents+json"
            assert not [n for n in m["headers"] if n.startswith("ce_")]  # else receivers would see binary mode
            assert set(m["headers"]) == {"content-type", "message_id", "tenant_hint"}


def test_debezium_format_is_what_the_router_emits(make_settings, store, pg_dsn, table, broker, topic_prefix):
    # No topic_template set by the user: the router's outbox.event.{aggregate_type}
    # (the aggregate type is unique to this test, so is the topic on the shared broker).
    settings = make_settings(kafka={"message_format": "debezium"})
    settings.kafka = settings.kafka.model_validate(
        {k: v for k, v in settings.kafka.model_dump().items() if k != "topic_template"}
    )
    aggregate_type = topic_prefix
    ids = write_rows(pg_dsn, table, aggregate_type, {"eventType": "OrderPaid"})
    relay_once(settings, store)
    messages = read_messages(
        broker.bootstrap_servers, [f"outbox.event.{aggregate_type}"], expected=len(ids), timeout=30
    )
    assert sorted(int(m["headers"]["id"]) for m in messages) == ids
    for m in messages:
        index = ids.index(int(m["headers"]["id"]))
        assert m["key"] == f"order {index}/ü"
        assert json.loads(m["value"]) == PAYLOADS[index]
        assert m["headers"] == {"id": str(ids[index]), "eventType": "OrderPaid"}  # nothing else


@pytest.mark.parametrize("fmt", ["cloudevents-binary", "cloudevents-structured"])
def test_cloudevents_over_http_read_by_the_sdk(fmt, make_settings, store, pg_dsn, table):
    with HttpTarget() as target:
        settings = make_settings(
            kafka={"message_format": fmt, "cloudevents_source": "urn:shop:orders"},
            relay={"publisher": "http"},
            http={"url_template": f"{target.base_url}/events", "headers": {"Content-Type": "text/plain"}},
        )
        ids = write_rows(pg_dsn, table, "order", {"ce_tenant": "acme", "tenant_hint": "eu"})
        publisher = HttpPublisher.from_settings(settings)
        try:
            cfg = WorkerConfig.from_settings(settings, publisher, owner="formats")
            assert Worker(0, store, publisher, cfg, RelayMetrics()).run_once().done == len(ids)
        finally:
            publisher.close()
        requests = target.snapshot()
    times = created_at(pg_dsn, table)
    assert sorted(r.message_id or 0 for r in requests) == ids  # X-Outbox-message-id stays
    for r in requests:
        message = ce_http.HTTPMessage(headers=r.headers, body=r.body)
        if fmt == "cloudevents-binary":
            event = ce_http.from_binary(message, JSONFormat())
            assert r.headers["content-type"] == "application/json"  # the binding's, not http.headers'
            assert r.headers["ce-subject"].startswith("order%20")  # percent-encoded as the binding requires
        else:
            event = ce_http.from_structured(message, JSONFormat())
            assert r.headers["content-type"] == "application/cloudevents+json"
            assert not [n for n in r.headers if n.startswith("ce-")]
        assert ce_http.from_http(message, JSONFormat()).get_attributes() == event.get_attributes()
        row_id = int(event.get_id())
        index = ids.index(row_id)
        assert (event.get_specversion(), event.get_source(), event.get_type()) == (
            "1.0",
            "urn:shop:orders",
            "OrderPaid",
        )
        assert event.get_subject() == f"order {index}/ü"
        assert event.get_time() == times[row_id]
        assert event.get_datacontenttype() == "application/json"
        assert event.get_data() == PAYLOADS[index]
        assert event.get_extension("tenant") == "acme"
        assert r.headers["x-outbox-tenant-hint"] == "eu"
        assert r.idempotency_key == f"outbox-{row_id}"
