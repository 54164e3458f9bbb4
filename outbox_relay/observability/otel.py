"""OpenTelemetry tracing of the relay (``otel.enabled = true``, extra ``outbox-relay[otel]``).

Imported only when tracing is enabled (``tracing_factory.make_tracing``). Per batch:

- ``outbox claim`` (INTERNAL, a root span): the claim statement, for non-empty claims.
- one ``send <topic>`` span per published message (PRODUCER), following the
  OpenTelemetry messaging semantic conventions: ``messaging.system`` (the
  publisher: ``kafka``, ``http``, ...), ``messaging.operation.type = send``,
  ``messaging.operation.name = send``, ``messaging.destination.name`` (the topic),
  ``messaging.message.id`` (the outbox id), and the publisher's own attributes
  (``Publisher.span_attributes``; Kafka: ``messaging.kafka.message.key``). Its
  parent is the trace context stored in the row's ``traceparent``/``tracestate``
  headers (written by ``enqueue()`` or by the application's SQL), so the relay's
  span sits inside the writer's trace; a row without one starts a new trace. The
  message leaves with THIS span's ``traceparent`` (it replaces the row's), so the
  consumer continues the same trace as a child of the relay. The span ends when the
  outcome is known and records it: ``outbox_relay.outcome`` = done | retry | defer
  | dead | release, ``outbox_relay.lease_lost`` when the fenced finalize rejected
  it, and for a failure the status ERROR, ``error.type`` (the outcome class) and an
  ``exception`` event with the reason.
- ``outbox finalize`` (INTERNAL, a root span): the fenced finalize of the batch.

Message spans link to their batch's claim and finalize spans, and the finalize span
links to the message spans (the first ``OTEL_SPAN_LINK_COUNT_LIMIT``, default 128).

Configuration is the standard one: ``OTEL_SERVICE_NAME`` (default
``outbox-relay``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``),
``OTEL_TRACES_EXPORTER`` (``otlp`` — the default, OTLP over HTTP/protobuf —,
``console`` or ``none``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_EXPORTER_OTLP_TIMEOUT``, ``OTEL_BSP_*`` (the batch span processor). The relay
uses its own tracer provider; it never replaces the process's global one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from ..core.formats import TRACE_HEADERS
from ..errors import ConfigError
from .tracing import BatchTrace, TracedTarget, Tracing

if TYPE_CHECKING:
    from ..config import Settings
    from ..core.batch_result import BatchResult
    from ..db.store import ClaimResult
    from ..model import Message, Outcome, SpanAttributes

log = structlog.get_logger("outbox_relay.otel")

DEFAULT_SERVICE_NAME = "outbox-relay"
INSTRUMENTATION_NAME = "outbox_relay"
# Links kept on the finalize span; the SDK would drop those above its link limit anyway.
MAX_BATCH_LINKS = 128

_ROOT = Context()  # an empty context: the span starts a new trace
_HEX = frozenset("0123456789abcdef")


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:
        return "unknown"


def exporter_from_environment() -> SpanExporter | None:
    """The span exporter named by ``OTEL_TRACES_EXPORTER`` (default ``otlp``), or None for ``none``."""
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    if len(names) != 1 or names[0] not in ("otlp", "console", "none"):
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={os.environ.get('OTEL_TRACES_EXPORTER')!r}: outbox-relay supports "
            "one of otlp (OTLP over HTTP/protobuf), console, none"
        )
    name = names[0]
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(variable)
        if protocol is not None:
            if protocol.strip() != "http/protobuf":
                raise ConfigError(f"{variable}={protocol!r}: outbox-relay exports OTLP over http/protobuf only")
            break
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: OTEL_EXPORTER_OTLP_*


def parse_traceparent(traceparent: str, tracestate: str | None = None) -> SpanContext | None:
    """A W3C ``traceparent`` (and ``tracestate``) -> the remote span context, or None if
    invalid. What TraceContextTextMapPropagator.extract accepts, without its regular
    expressions and context objects: this runs once per message."""
    parts = traceparent.strip().split("-")
    if len(parts) < 4:
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if (
        len(version) != 2
        or version == "ff"
        or len(trace_hex) != 32
        or len(span_hex) != 16
        or len(flags_hex) != 2
        or not _HEX.issuperset(version + trace_hex + span_hex + flags_hex)
        or (version == "00" and len(parts) != 4)
    ):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    state = TraceState.from_header([tracestate]) if tracestate else TraceState()
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(flags_hex, 16)), trace_state=state)


def w3c_headers(context: trace.SpanContext) -> list[tuple[str, str]]:
    """A span context as W3C Trace Context headers (what TraceContextTextMapPropagator
    injects, formatted directly: this runs once per message)."""
    headers = [("traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}")]
    if context.trace_state:
        headers.append(("tracestate", context.trace_state.to_header()))
    return headers


class OtelTracing(Tracing):
    """Spans for claims, messages and finalizes on one tracer provider."""

    enabled = True

    def __init__(
        self,
        provider: trace.TracerProvider,
        *,
        table: str,
        publisher: TracedTarget | None = None,
        owns_provider: bool = False,
    ) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME, _package_version())
        self.table = table
        # messaging.system and the target's own span attributes come from the publisher contract.
        self.system = publisher.name if publisher is not None else "custom"
        self.span_attributes: Callable[[Message], SpanAttributes] | None = (
            publisher.span_attributes if publisher is not None else None
        )
        self._owns_provider = owns_provider

    @classmethod
    def from_environment(cls, settings: Settings, *, publisher: TracedTarget | None = None) -> OtelTracing:
        """A tracer provider configured by the standard ``OTEL_*`` variables."""
        resource = Resource.create({SERVICE_VERSION: _package_version()})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER
        exporter = exporter_from_environment()
        if exporter is not None:
            # The SDK's batch processor as configured by OTEL_BSP_*: when the exporter
            # falls behind, its queue (OTEL_BSP_MAX_QUEUE_SIZE, default 2048 spans)
            # drops spans; delivery never waits for telemetry.
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, table=settings.database.table, publisher=publisher, owns_provider=True)

    def batch(self, worker: str = "") -> BatchTrace:
        return OtelBatchTrace(self, worker)

    def close(self, timeout_seconds: float = 3.0) -> None:
        """Flush the queued spans, for at most ``timeout_seconds``: an unreachable
        collector (the exporter retries for OTEL_EXPORTER_OTLP_TIMEOUT) must not hold
        up a shutdown whose rows are already finalized."""
        if not self._owns_provider:
            return
        self._owns_provider = False  # a second close does nothing
        shutdown = getattr(self.provider, "shutdown", None)  # the SDK provider flushes its processors
        if shutdown is None:
            return
        flusher = threading.Thread(target=shutdown, name="otel-shutdown", daemon=True)
        flusher.start()
        flusher.join(timeout_seconds)
        if flusher.is_alive():
            log.warning(
                "tracing: spans not exported before shutdown (collector unreachable?)", timeout_seconds=timeout_seconds
            )


class OtelBatchTrace(BatchTrace):
    """The spans of one batch (used by one worker thread at a time)."""

    __slots__ = (
        "_claim_link",
        "_claim_started_ns",
        "_finalize_started_ns",
        "_message_ids",
        "_outcomes",
        "_published_ns",
        "_spans",
        "_tracing",
        "_worker",
    )

    def __init__(self, tracing: OtelTracing, worker: str) -> None:
        self._tracing = tracing
        self._worker = worker
        self._claim_started_ns = time.time_ns()
        self._claim_link: list[Link] = []
        self._spans: list[trace.Span] = []
        self._message_ids: list[int] = []
        self._outcomes: Sequence[Outcome] = ()
        self._published_ns: int | None = None
        self._finalize_started_ns: int | None = None

    def claimed(self, result: ClaimResult) -> None:
        if not result.rows and not result.reaped:
            return  # an idle poll: nothing worth a span
        t = self._tracing
        span = t.tracer.start_span(
            "outbox claim",
            context=_ROOT,
            kind=SpanKind.INTERNAL,
            start_time=self._claim_started_ns,
            attributes={
                "db.system.name": "postgresql",
                "db.collection.name": t.table,
                "messaging.batch.message_count": len(result.rows),
                "outbox_relay.reaped": len(result.reaped),
                "outbox_relay.worker": self._worker,
            },
        )
        span.end()
        self._claim_link = [Link(span.get_span_context())]

    def publishing(self, messages: Sequence[Message]) -> None:
        t = self._tracing
        tracer, system, own_attributes = t.tracer, t.system, t.span_attributes
        started_ns = time.time_ns()
        for message in messages:
            stored = {name: value for name, value in message.headers if name in TRACE_HEADERS}
            remote = (
                parse_traceparent(stored["traceparent"], stored.get("tracestate")) if "traceparent" in stored else None
            )
            # No valid stored context: the span starts a new trace.
            parent = trace.set_span_in_context(NonRecordingSpan(remote), _ROOT) if remote is not None else _ROOT
            # Few attributes: each one costs the SDK a validation per span.
            attributes: dict[str, str | int | float | bool] = {
                "messaging.system": system,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": message.topic,
                "messaging.message.id": message.message_id,
                "outbox_relay.event_type": message.event_type,
                "outbox_relay.attempt": message.attempts,
            }
            if own_attributes is not None:
                attributes.update(own_attributes(message))
            span = tracer.start_span(
                f"send {message.topic}",
                context=parent,
                kind=SpanKind.PRODUCER,
                attributes=attributes,
                links=self._claim_link,
                start_time=started_ns,
            )
            # The consumer continues the trace from the relay's span, not the writer's.
            headers = [(n, v) for n, v in message.headers if n not in TRACE_HEADERS] if stored else message.headers
            headers.extend(w3c_headers(span.get_span_context()))
            message.headers = headers
            self._spans.append(span)
            self._message_ids.append(message.id)

    def published(self, outcomes: Sequence[Outcome]) -> None:
        self._published_ns = time.time_ns()
        self._outcomes = outcomes

    def finalizing(self) -> None:
        self._finalize_started_ns = time.time_ns()

    def finalized(self, result: BatchResult) -> None:
        t = self._tracing
        spans = self._spans
        if not spans and not result.rows:
            return
        # Linked to the claim span (which every message span links to) and to the message spans.
        links = self._claim_link + [Link(s.get_span_context()) for s in spans[: MAX_BATCH_LINKS - 1]]
        finalize = t.tracer.start_span(
            "outbox finalize",
            context=_ROOT,
            kind=SpanKind.INTERNAL,
            start_time=self._finalize_started_ns or time.time_ns(),
            links=links,
            attributes={
                "db.system.name": "postgresql",
                "db.collection.name": t.table,
                "messaging.batch.message_count": len(result.rows),
                "outbox_relay.done": result.done,
                "outbox_relay.retried": result.retried,
                "outbox_relay.deferred": result.deferred,
                "outbox_relay.dead": result.dead,
                "outbox_relay.released": result.released,
                "outbox_relay.lost_leases": len(result.lost),
                "outbox_relay.unfinalized": len(result.unfinalized),
                "outbox_relay.worker": self._worker,
            },
        )
        finalize.end()
        if not spans:
            return
        decisions = {row.id: decision for row, decision in zip(result.rows, result.decisions, strict=True)}
        lost, unfinalized = set(result.lost), set(result.unfinalized)
        outcomes = self._outcomes
        ended_ns = self._published_ns or time.time_ns()
        for index, (span, message_id) in enumerate(zip(spans, self._message_ids, strict=True)):
            decision = decisions.get(message_id)
            if decision is not None:
                span.set_attribute("outbox_relay.outcome", decision.kind.value)
                if message_id in lost:
                    span.set_attribute("outbox_relay.lease_lost", True)
                elif message_id in unfinalized:
                    span.set_attribute("outbox_relay.unfinalized", True)
            outcome = outcomes[index] if index < len(outcomes) else None
            if outcome is not None:
                span.set_attribute("error.type", type(outcome).__name__)
                span.record_exception(outcome)
                span.set_status(Status(StatusCode.ERROR, outcome.reason))
            span.end(end_time=ended_ns)
