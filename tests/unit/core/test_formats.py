"""The message formats as pure functions: row -> message, and the HTTP binding's headers.

What reached a real broker / HTTP server is checked in tests/integration/test_formats.py;
here every rule, and the CloudEvents SDK reading the pure output.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

from outbox_relay.config import load_settings
from outbox_relay.core.formats import WireFormat, http_headers, rfc3339
from outbox_relay.errors import ConfigError
from outbox_relay.model import Claimed, MessageFormat
from outbox_relay.publisher import MessageFormatError, build_message

CREATED = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))


def claimed(**overrides: object) -> Claimed:
    values: dict[str, object] = dict(
        id=42,
        lease_version=3,
        attempts=2,
        aggregate_type="order",
        aggregate_id="order 7/ü",
        event_type="OrderPaid",
        payload='{"a": 1, "b": "ü"}',
        topic=None,
        headers='{"tenant_hint": "acme", "ce_tenant": "acme"}',
        created_at=CREATED,
    )
    values.update(overrides)
    return Claimed(**values)  # type: ignore[arg-type]


def wire(fmt: str, **kw: str) -> WireFormat:
    return WireFormat(
        MessageFormat(fmt), kw.get("template", "outbox.{aggregate_type}"), kw.get("source", "/outbox-relay/app.outbox")
    )


def test_rfc3339_is_utc_with_z():
    assert rfc3339(CREATED) == "2026-01-02T01:04:05.123456Z"
    assert rfc3339(dt.datetime(2026, 1, 2, tzinfo=dt.UTC)) == "2026-01-02T00:00:00Z"


def test_contract_is_unchanged():
    m = build_message(claimed(), wire("contract"))
    assert (m.topic, m.key, m.value) == ("outbox.order", "order 7/ü", '{"a": 1, "b": "ü"}')
    assert m.headers == [
        ("message_id", "42"),
        ("event_type", "OrderPaid"),
        ("aggregate_type", "order"),
        ("aggregate_id", "order 7/ü"),
        ("tenant_hint", "acme"),
        ("ce_tenant", "acme"),
    ]
    assert m == build_message(claimed(), "outbox.{aggregate_type}")  # a plain template = the contract


def test_cloudevents_binary_read_by_the_sdk():
    m = build_message(claimed(), wire("cloudevents-binary"))
    assert (m.key, m.value) == ("order 7/ü", '{"a": 1, "b": "ü"}')
    assert m.headers == [
        ("ce_specversion", "1.0"),
        ("ce_id", "42"),
        ("ce_source", "/outbox-relay/app.outbox"),
        ("ce_type", "OrderPaid"),
        ("ce_subject", "order 7/ü"),
        ("ce_time", "2026-01-02T01:04:05.123456Z"),
        ("content-type", "application/json"),
        ("ce_tenant", "acme"),
        ("message_id", "42"),
        ("tenant_hint", "acme"),
    ]
    event = ce_kafka.from_binary(
        ce_kafka.KafkaMessage(
            headers={n: v.encode() for n, v in m.headers}, key=m.key.encode(), value=m.value.encode()
        ),
        JSONFormat(),
    )
    assert (event.get_specversion(), event.get_id(), event.get_source(), event.get_type(), event.get_subject()) == (
        "1.0",
        "42",
        "/outbox-relay/app.outbox",
        "OrderPaid",
        "order 7/ü",
    )
    assert event.get_time() == CREATED and event.get_datacontenttype() == "application/json"
    assert event.get_data() == {"a": 1, "b": "ü"} and event.get_extension("tenant") == "acme"


def test_cloudevents_structured_splices_the_payload_text():
    m = build_message(claimed(payload='{"b": 1.50, "a": [1, 2]}'), wire("cloudevents-structured"))
    assert m.value.endswith(', "data": {"b": 1.50, "a": [1, 2]}}')  # the stored text, not re-serialised
    assert m.headers == [
        ("content-type", "application/cloudevents+json"),
        ("message_id", "42"),
        ("tenant_hint", "acme"),
    ]
    assert json.loads(m.value) == {
        "specversion": "1.0",
        "id": "42",
        "source": "/outbox-relay/app.outbox",
        "type": "OrderPaid",
        "subject": "order 7/ü",
        "time": "2026-01-02T01:04:05.123456Z",
        "datacontenttype": "application/json",
        "tenant": "acme",
        "data": {"b": 1.5, "a": [1, 2]},
    }
    event = ce_kafka.from_kafka(
        ce_kafka.KafkaMessage(headers={n: v.encode() for n, v in m.headers}, key=None, value=m.value.encode()),
        JSONFormat(),
    )
    assert (event.get_id(), event.get_time(), event.get_extension("tenant")) == ("42", CREATED, "acme")


def test_debezium_key_value_id_header():
    m = build_message(claimed(headers='{"eventType": "OrderPaid"}'), wire("debezium"))
    assert (m.topic, m.key, m.value) == ("outbox.order", "order 7/ü", '{"a": 1, "b": "ü"}')
    assert m.headers == [("id", "42"), ("eventType", "OrderPaid")]


def test_debezium_routes_like_the_router_unless_a_template_is_set(monkeypatch):
    for key in ("OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE", "OUTBOX_RELAY_KAFKA__MESSAGE_FORMAT"):
        monkeypatch.delenv(key, raising=False)
    router = WireFormat.from_settings(load_settings(None, kafka={"message_format": "debezium"}))
    assert router.topic(claimed()) == "outbox.event.order"
    chosen = load_settings(None, kafka={"message_format": "debezium", "topic_template": "outbox.{aggregate_type}"})
    assert WireFormat.from_settings(chosen).topic(claimed()) == "outbox.order"  # set explicitly, even to the default
    assert WireFormat.from_settings(load_settings(None)).topic(claimed()) == "outbox.order"  # contract default
    monkeypatch.setenv("OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE", "x.{event_type}")
    from_env = WireFormat.from_settings(load_settings(None, kafka={"message_format": "debezium"}))
    assert from_env.topic(claimed()) == "x.OrderPaid"
    assert router.topic(claimed(topic="own")) == "own"  # the row's topic wins in every format


def test_cloudevents_source_defaults_to_the_table_and_is_validated():
    assert (
        WireFormat.from_settings(load_settings(None, database={"table": "app.events"})).cloudevents_source
        == "/outbox-relay/app.events"
    )
    own = load_settings(None, kafka={"cloudevents_source": "urn:shop:orders"})
    assert WireFormat.from_settings(own).cloudevents_source == "urn:shop:orders"
    with pytest.raises(ConfigError, match=r"kafka\.cloudevents_source"):
        load_settings(None, kafka={"cloudevents_source": "has space"})
    with pytest.raises(ConfigError, match=r"kafka\.message_format"):
        load_settings(None, kafka={"message_format": "avro"})


@pytest.mark.parametrize(
    ("fmt", "headers", "problem"),
    [
        ("cloudevents-binary", '{"ce_id": "x"}', "reserved: the relay sets the CloudEvents attribute 'id'"),
        ("cloudevents-structured", '{"ce_time": "x"}', "attribute 'time'"),
        ("cloudevents-binary", '{"Content-Type": "text/plain"}', "reserved in the CloudEvents formats"),
        ("cloudevents-binary", '{"ce_Bad_Name": "x"}', "extension name"),
        ("debezium", '{"id": "7"}', "'id' is reserved in the debezium format"),
        ("contract", '{"message_id": "7"}', "reserved"),
        ("debezium", '{"message_id": "7"}', "reserved"),  # the contract's names stay reserved in every format
    ],
)
def test_rows_that_a_format_cannot_carry_are_refused(fmt, headers, problem):
    with pytest.raises(MessageFormatError, match=problem):
        build_message(claimed(headers=headers), wire(fmt))


def test_http_binding_headers():
    trace = '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant_hint": "acme"}'
    binary = build_message(claimed(headers=trace), wire("cloudevents-binary"))
    headers = http_headers(binary.format, binary.headers)
    assert headers == [
        ("ce-specversion", "1.0"),
        ("ce-id", "42"),
        ("ce-source", "/outbox-relay/app.outbox"),
        ("ce-type", "OrderPaid"),
        ("ce-subject", "order%207/%C3%BC"),
        ("ce-time", "2026-01-02T01:04:05.123456Z"),
        ("Content-Type", "application/json"),
        ("X-Outbox-message-id", "42"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("X-Outbox-tenant-hint", "acme"),
    ]
    event = ce_http.from_binary(ce_http.HTTPMessage(headers=dict(headers), body=binary.value.encode()), JSONFormat())
    assert (event.get_subject(), event.get_time(), event.get_data()) == ("order 7/ü", CREATED, {"a": 1, "b": "ü"})
    contract = build_message(claimed(headers=trace), wire("contract"))
    assert http_headers(contract.format, contract.headers)[:2] == [
        ("X-Outbox-message-id", "42"),
        ("X-Outbox-event-type", "OrderPaid"),
    ]
    assert ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") in http_headers(
        contract.format, contract.headers
    )


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03 ",
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
        "not a traceparent",
        "",
    ],
)
def test_relay_reads_traceparent_as_the_w3c_propagator_does(value):
    """The relay parses the stored traceparent itself (it runs per message); it must
    accept and refuse exactly what OpenTelemetry's W3C propagator does."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from outbox_relay.observability.otel import parse_traceparent, w3c_headers

    carrier = {"traceparent": value, "tracestate": "shop=abc,vendor=x1"}
    expected = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
    parsed = parse_traceparent(value, carrier["tracestate"])
    if not expected.is_valid:
        assert parsed is None
        return
    assert parsed == expected
    assert parsed.trace_state.to_header() == "shop=abc,vendor=x1"
    injected: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(injected, context=trace.set_span_in_context(trace.NonRecordingSpan(parsed)))
    assert dict(w3c_headers(parsed)) == injected


@pytest.mark.parametrize("fmt", ["contract", "debezium", "cloudevents-binary", "cloudevents-structured"])
def test_a_tombstone_has_a_null_value_its_key_and_its_headers(fmt):
    m = build_message(claimed(tombstone=True, payload="null"), wire(fmt))
    assert m.value is None and m.key == "order 7/ü"
    names = [name for name, _ in m.headers]
    assert "content-type" not in names  # no data, no data content type (and never a structured envelope)
    if fmt.startswith("cloudevents"):
        assert {"ce_id", "ce_type", "ce_subject", "ce_tenant"} <= set(names)  # binary content mode


def test_partition_and_created_at_timestamp_reach_the_message():
    stamped = WireFormat(MessageFormat.CONTRACT, created_at_timestamp=True)
    m = build_message(claimed(partition=5), stamped)
    assert m.partition == 5
    assert m.timestamp_ms == 1767315845123  # 2026-01-02T01:04:05.123456Z, milliseconds cut, never rounded up
    plain = build_message(claimed(), wire("contract"))
    assert plain.partition is None and plain.timestamp_ms is None
    with pytest.raises(MessageFormatError, match="partition -1 is negative"):
        build_message(claimed(partition=-1), wire("contract"))
