"""OpenTelemetry through the outbox, with the OpenTelemetry SDK and real servers:

writer span --enqueue()--> row headers --relay--> PRODUCER span (child of the writer's)
--> traceparent on the Kafka message / HTTP request (the relay span's) --> consumer.

In process with the SDK's in-memory exporter, and end to end with the real CLI
exporting OTLP/HTTP to a receiver started here that decodes the protobuf.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import messaging_attributes as semconv
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from outbox_relay.core.batch_result import BatchResult
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.observability.otel import OtelTracing
from outbox_relay.publisher import Message, SimplePublisher, load_publisher
from outbox_relay.publishers.http import HttpPublisher
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import run_sql, statuses, wait_for
from tests.helpers.http_target import HttpTarget, Step
from tests.helpers.otlp_receiver import OtlpReceiver

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


def sdk(name: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def traceparent(trace_id: int, span_id: int, flags: int = 1) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def context_header(context: Any) -> str:
    """The traceparent of a span context (the SDK may set the W3C level-2 random flag too)."""
    return traceparent(context.trace_id, context.span_id, int(context.trace_flags))


def write(dsn: str, table: str, aggregate_id: str, **extra: Any) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return int(
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id=aggregate_id,
                event_type="OrderPaid",
                payload={"a": aggregate_id},
                table=table,
                **extra,
            )
        )


def test_one_trace_from_writer_through_relay_to_kafka(make_settings, store, pg_dsn, table, broker, topic_prefix):
    writer_provider, writer_spans = sdk("writer")
    writer = writer_provider.get_tracer("shop")
    with writer.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request_span:
        traced = write(pg_dsn, table, "traced")
        opted_out = write(pg_dsn, table, "opted-out", trace_context=False)
        own = traceparent(0x5BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
        explicit = write(pg_dsn, table, "explicit", headers={"traceparent": own})  # the caller's wins
    untraced = write(pg_dsn, table, "untraced")  # no active span
    request = request_span.get_span_context()
    stored = dict(run_sql(pg_dsn, table, "SELECT id, headers FROM {t}"))
    assert stored[traced] == {"traceparent": context_header(request)}
    assert stored[opted_out] is None and stored[untraced] is None
    assert stored[explicit] == {"traceparent": own}

    relay_provider, exported = sdk("relay")
    settings = make_settings()
    publisher = load_publisher(settings)
    tracing = OtelTracing(relay_provider, table=table, publisher=publisher)
    publisher.start()
    try:
        cfg = WorkerConfig.from_settings(settings, publisher, owner="tracing")
        assert Worker(0, store, publisher, cfg, RelayMetrics(), tracing=tracing).run_once().done == 4
    finally:
        publisher.close()

    spans: list[ReadableSpan] = list(exported.get_finished_spans())
    sends = {int(s.attributes["messaging.message.id"]): s for s in spans if s.kind is SpanKind.PRODUCER}
    [claim] = [s for s in spans if s.name == "outbox claim"]
    [finalize] = [s for s in spans if s.name == "outbox finalize"]
    assert set(sends) == {traced, opted_out, untraced, explicit}
    assert sends[explicit].parent.span_id == 0x00F067AA0BA902B7

    # The relay's span is a child of the writer's request span: one trace.
    send = sends[traced]
    assert send.context.trace_id == request.trace_id
    assert send.parent is not None and send.parent.span_id == request.span_id and send.parent.is_remote
    # A row without a stored context starts a new trace (a root span).
    for row_id in (opted_out, untraced):
        assert sends[row_id].parent is None and sends[row_id].context.trace_id != request.trace_id
    assert len({s.context.trace_id for s in sends.values()}) == 4
    # Batch spans are roots, linked both ways with the message spans.
    assert claim.parent is None and finalize.parent is None
    assert claim.attributes["messaging.batch.message_count"] == 4
    for s in sends.values():
        assert [link.context.span_id for link in s.links] == [claim.context.span_id]
    assert {link.context.span_id for link in finalize.links} == {claim.context.span_id} | {
        s.context.span_id for s in sends.values()
    }
    assert finalize.attributes["outbox_relay.done"] == 4

    # Messaging semantic conventions (names checked against the semconv package).
    topic = f"{topic_prefix}.order"
    assert send.name == f"send {topic}"
    assert send.attributes[semconv.MESSAGING_SYSTEM] == "kafka"
    assert send.attributes[semconv.MESSAGING_OPERATION_TYPE] == semconv.MessagingOperationTypeValues.SEND.value
    assert send.attributes[semconv.MESSAGING_OPERATION_NAME] == "send"
    assert send.attributes[semconv.MESSAGING_DESTINATION_NAME] == topic
    assert send.attributes[semconv.MESSAGING_MESSAGE_ID] == str(traced)
    assert send.attributes[semconv.MESSAGING_KAFKA_MESSAGE_KEY] == "traced"
    assert send.attributes["outbox_relay.outcome"] == "done"
    assert send.status.status_code is StatusCode.UNSET
    assert send.start_time <= send.end_time

    # Each Kafka message carries ITS relay span's traceparent (the row's was replaced).
    messages = read_messages(broker.bootstrap_servers, [topic], expected=4, timeout=30)
    assert len(messages) == 4
    for m in messages:
        s = sends[int(m["headers"]["message_id"])]
        assert m["headers"]["traceparent"] == context_header(s.context)
    assert writer_spans.get_finished_spans()[0].context.span_id == request.span_id
    # A consumer continues the trace from the header (docs/how-to/tracing.md): writer -> relay -> consumer.
    [message] = [m for m in messages if m["headers"]["message_id"] == str(traced)]
    consumer_provider, consumer_spans = sdk("consumer")
    parent = TraceContextTextMapPropagator().extract(message["headers"])
    with consumer_provider.get_tracer("billing").start_as_current_span(
        "process OrderPaid", context=parent, kind=SpanKind.CONSUMER
    ):
        pass
    [consumed] = consumer_spans.get_finished_spans()
    assert consumed.context.trace_id == request.trace_id and consumed.parent.span_id == send.context.span_id


def test_http_request_carries_the_relay_span_and_spans_record_outcomes(make_settings, store, pg_dsn, table):
    tracestate = "shop=abc,vendor=x1"
    writer_trace, writer_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    # An SQL writer sets the header itself (docs/how-to/tracing.md).
    stored = {"traceparent": traceparent(writer_trace, writer_span), "tracestate": tracestate}
    ok = write(pg_dsn, table, "ok", headers=stored)
    flaky = write(pg_dsn, table, "flaky", headers=stored)
    bad = write(pg_dsn, table, "bad", headers={"traceparent": "not a traceparent"})
    relay_provider, exported = sdk("relay")
    with HttpTarget() as target:
        target.script_id(flaky, Step(503, body="down for a moment"))
        target.script_id(bad, Step(400, body="no such order"))
        settings = make_settings(
            relay={"publisher": "http", "max_attempts": 5}, http={"url_template": f"{target.base_url}/events"}
        )
        publisher = HttpPublisher.from_settings(settings)
        tracing = OtelTracing(relay_provider, table=table, publisher=publisher)
        try:
            cfg = WorkerConfig.from_settings(settings, publisher, owner="tracing")
            result = Worker(0, store, publisher, cfg, RelayMetrics(), tracing=tracing).run_once()
        finally:
            publisher.close()
        requests = {r.message_id: r for r in target.snapshot()}
    assert (result.done, result.retried, result.dead) == (1, 1, 1)
    sends = {
        int(s.attributes["messaging.message.id"]): s
        for s in exported.get_finished_spans()
        if s.kind is SpanKind.PRODUCER
    }
    for row_id, outcome, error_type in (
        (ok, "done", None),
        (flaky, "retry", "RetryableError"),
        (bad, "dead", "PermanentError"),
    ):
        s = sends[row_id]
        assert s.attributes["messaging.system"] == "http"
        assert semconv.MESSAGING_KAFKA_MESSAGE_KEY not in s.attributes  # Kafka's own attribute only
        assert s.attributes["outbox_relay.outcome"] == outcome
        headers = requests[row_id].headers
        assert headers["traceparent"] == context_header(s.context)
        assert "x-outbox-traceparent" not in headers
        if error_type is None:
            assert s.status.status_code is StatusCode.UNSET and "error.type" not in s.attributes
        else:
            assert s.status.status_code is StatusCode.ERROR
            assert s.attributes["error.type"] == error_type
            [event] = s.events
            assert event.name == "exception" and event.attributes["exception.type"].endswith(error_type)
    for row_id in (ok, flaky):  # inside the writer's trace; the tracestate travels on
        assert sends[row_id].context.trace_id == writer_trace and sends[row_id].parent.span_id == writer_span
        assert requests[row_id].headers["tracestate"] == tracestate
    assert sends[bad].parent is None  # an invalid stored context: a new trace
    assert "503" in sends[flaky].status.description and "400" in sends[bad].status.description


def test_span_attributes_come_from_the_publisher_contract():
    # messaging.system is Publisher.name and the target's own attributes come from
    # Publisher.span_attributes: a plug-in publishing to Kafka adds the key too.
    class KafkaBridge(SimplePublisher):
        name = "kafka-bridge"

        def publish(self, message: Message) -> None:
            pass

        def span_attributes(self, message: Message) -> dict[str, str | int | float | bool]:
            return {semconv.MESSAGING_KAFKA_MESSAGE_KEY: message.key, "bridge.partition_hint": 3}

    class Plain(SimplePublisher):  # the default span_attributes: none
        name = "plain"

        def publish(self, message: Message) -> None:
            pass

    def message(row_id: int) -> Message:
        return Message(
            id=row_id,
            topic="outbox.order",
            key=f"order-{row_id}",
            value="{}",
            headers=[],
            aggregate_type="order",
            aggregate_id=f"order-{row_id}",
            event_type="OrderPaid",
        )

    for publisher, expected in (
        (KafkaBridge(), {semconv.MESSAGING_KAFKA_MESSAGE_KEY: "order-7", "bridge.partition_hint": 3}),
        (Plain(), {}),
    ):
        provider, exported = sdk("relay")
        batch = OtelTracing(provider, table="outbox", publisher=publisher).batch("w")
        batch.publishing([message(7)])
        batch.published([None])
        batch.finalizing()
        batch.finalized(BatchResult())
        [send] = [s for s in exported.get_finished_spans() if s.kind is SpanKind.PRODUCER]
        assert send.attributes[semconv.MESSAGING_SYSTEM] == publisher.name
        own = {
            k: v
            for k, v in send.attributes.items()
            if not k.startswith(("messaging.operation", "outbox_relay."))
            and k not in (semconv.MESSAGING_SYSTEM, semconv.MESSAGING_DESTINATION_NAME, semconv.MESSAGING_MESSAGE_ID)
        }
        assert own == expected


def test_otlp_http_export_from_the_cli(store, pg_dsn, table, broker, topic_prefix):
    writer_provider, _ = sdk("writer")
    with writer_provider.get_tracer("shop").start_as_current_span("checkout") as checkout:
        row_id = write(pg_dsn, table, "order-1")
    untraced = write(pg_dsn, table, "order-2")
    writer = checkout.get_span_context()
    with OtlpReceiver() as receiver:
        env = cli_env(
            pg_dsn,
            table,
            broker.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
            OUTBOX_RELAY_METRICS__ENABLED="false",
            OUTBOX_RELAY_RELAY__WORKERS="1",
            OUTBOX_RELAY_OTEL__ENABLED="true",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_SERVICE_NAME="relay-under-test",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_RELAY_", "OTEL_"))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_relay.operator.cli", "run"],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: statuses(pg_dsn, table).get("done") == 2, timeout=60, message="rows done")
            spans = receiver.wait_for(lambda spans: sum(s.kind == "PRODUCER" for s in spans) == 2)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    sends = {int(s.attributes["messaging.message.id"]): s for s in spans if s.kind == "PRODUCER"}
    send = sends[row_id]
    assert send.resource["service.name"] == "relay-under-test" and send.scope == "outbox_relay"
    assert send.trace_id == f"{writer.trace_id:032x}"  # one trace id: writer -> relay -> Kafka
    assert send.parent_span_id == f"{writer.span_id:016x}"
    assert send.attributes["messaging.destination.name"] == f"{topic_prefix}.order"
    assert send.attributes["outbox_relay.outcome"] == "done"
    assert sends[untraced].parent_span_id == "" and sends[untraced].trace_id != send.trace_id
    claims = [s for s in spans if s.name == "outbox claim"]
    assert claims and all(s.parent_span_id == "" for s in claims)
    assert {(claim.trace_id, claim.span_id) for claim in claims} & set(send.links)
    messages = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=2, timeout=30)
    by_id = {int(m["headers"]["message_id"]): m for m in messages}
    assert by_id[row_id]["headers"]["traceparent"].startswith(f"00-{send.trace_id}-{send.span_id}-")


def test_tracing_off_imports_no_opentelemetry():
    code = """
import sys
from outbox_relay.config import load_settings
from outbox_relay.observability.tracing_factory import make_tracing
from outbox_relay.api import current_trace_headers
import outbox_relay.operator.cli, outbox_relay.runtime.relay, outbox_relay.runtime.worker, outbox_relay.publishers.http
tracing = make_tracing(load_settings(None))
assert not tracing.enabled and current_trace_headers() == {}
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_unsupported_exporter_settings_exit_2(pg_dsn, table, broker, monkeypatch):
    env = cli_env(
        pg_dsn,
        table,
        broker.bootstrap_servers,
        OUTBOX_RELAY_OTEL__ENABLED="true",
        OUTBOX_RELAY_METRICS__ENABLED="false",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
    )
    result = cli("run", env=env, timeout=60)
    assert result.returncode == 2 and "http/protobuf only" in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1
    from outbox_relay.errors import ConfigError
    from outbox_relay.observability.otel import exporter_from_environment

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        exporter_from_environment()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert exporter_from_environment() is None


def test_enabled_without_opentelemetry_installed_is_a_config_error():
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from outbox_relay.config import load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.observability.tracing_factory import make_tracing
try:
    make_tracing(load_settings(None, otel={"enabled": True}))
except ConfigError as exc:
    print(exc)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "otel.enabled is true but OpenTelemetry is not installed" in result.stdout
    assert "pip install 'outbox-relay[otel]'" in result.stdout
