"""Message formats: what one outbox row looks like on the wire (``kafka.message_format``).

``build_message`` (publishers/base.py) is the one code path from a claimed row to a
``Message``; it asks a ``WireFormat`` for the topic, key, value and headers. Every
format keeps the payload exactly as stored (``jsonb::text``, never re-serialised)
and forwards the row's own ``headers``.

- ``contract`` (default): the design's message contract, unchanged — key
  ``aggregate_id``, value = payload, headers ``message_id``, ``event_type``,
  ``aggregate_type``, ``aggregate_id``, then the row's headers.
- ``cloudevents-binary``: CloudEvents 1.0, Kafka protocol binding, binary content
  mode — the attributes as ``ce_`` headers (``ce_specversion``, ``ce_id``,
  ``ce_source``, ``ce_type``, ``ce_subject``, ``ce_time``), ``content-type:
  application/json``, value = payload, key = ``aggregate_id``; the contract's
  ``message_id`` header stays.
- ``cloudevents-structured``: one ``application/cloudevents+json`` envelope as the
  value, the payload under ``data``; headers ``content-type`` and ``message_id``.
- ``debezium``: what Debezium's outbox event router emits by default — key =
  ``aggregate_id``, value = payload, one header ``id`` (the outbox id), topic
  ``outbox.event.{aggregate_type}`` unless ``kafka.topic_template`` is set.

The attributes: ``id`` is the outbox id (decimal), the same on every retry, lease
takeover and replica, unique within ``source``; ``source`` is
``kafka.cloudevents_source`` (default ``/outbox-relay/<table>``); ``type`` is the
event type; ``subject`` the aggregate id; ``time`` the row's ``created_at`` in
RFC 3339 (UTC). A row header ``ce_<name>`` (``name`` lower-case letters and digits)
becomes a CloudEvents extension attribute in both CloudEvents formats; the
attributes the relay sets cannot be overridden.

A replay (``outbox-relay replay``) sends a delivered row's message again, unchanged
but for one added header, ``replayed`` (``REPLAYED_HEADER``), whose value is the
replay's audit id; it is added by the replay, never by live delivery.

The HTTP publisher speaks the matching HTTP binding (``http_headers``): in the
CloudEvents formats the ``ce_`` headers become ``ce-`` headers (values
percent-encoded as the HTTP binding requires) and ``content-type`` the request's
``Content-Type``; every other header becomes ``X-Outbox-<name>``; the W3C trace
context (``traceparent``, ``tracestate``) keeps its own name in every format.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..model import MessageFormat

if TYPE_CHECKING:
    from ..config import Settings
    from ..model import Claimed


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MILLISECOND = dt.timedelta(milliseconds=1)

CONTRACT_TOPIC_TEMPLATE = "outbox.{aggregate_type}"
#: Debezium's outbox event router default (``route.topic.replacement = outbox.event.${routedByValue}``).
DEBEZIUM_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"

CE_SPECVERSION = "1.0"
CE_PREFIX = "ce_"  # Kafka binding: attribute names as header names
CE_HTTP_PREFIX = "ce-"  # HTTP binding
DATA_CONTENT_TYPE = "application/json"  # the payload is JSON (jsonb)
#: The data content type of a row's payload_bytes unless its ``content-type`` header names one.
BYTES_CONTENT_TYPE = "application/octet-stream"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"  # the JSON event format's media type
CONTENT_TYPE_HEADER = "content-type"

# The contract's headers; a row may not set them in any format (a second
# message_id would break deduplication, and switching formats must not change
# which rows are valid).
RESERVED_HEADERS = frozenset({"message_id", "event_type", "aggregate_type", "aggregate_id"})
# The header that marks a message sent again by a replay (operator/replay.py).
REPLAYED_HEADER = "replayed"
# The W3C trace context: forwarded under its own name (Kafka and HTTP alike); the
# relay's tracing replaces it with its own span's context.
TRACE_HEADERS = ("traceparent", "tracestate")
# Attributes the relay sets itself in the CloudEvents formats.
_CE_OWN_ATTRIBUTES = frozenset(
    {"specversion", "id", "source", "type", "subject", "time", "datacontenttype", "data", "data_base64", "dataschema"}
)
# CloudEvents attribute names: lower-case ASCII letters and digits (spec 1.0, "Attribute Naming Convention").
_CE_ATTRIBUTE_RE = re.compile(r"^[a-z0-9]{1,20}$")

HTTP_HEADER_PREFIX = "X-Outbox-"
# HTTP binding 3.1.3.2: percent-encode space, double quote, percent and everything
# outside printable ASCII; the rest of printable ASCII stays as it is.
_CE_HTTP_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ' "%')


class FormatError(ValueError):
    """A row that cannot be expressed in the configured format (build_message makes it dead)."""


def parse_row_headers(raw: str | None) -> list[tuple[str, str]]:
    """The row's ``headers`` column (JSON text) -> (name, value) pairs, validated:
    a JSON object of strings whose names are not reserved."""
    if raw is None:
        return []
    try:
        extra = json.loads(raw)
    except ValueError as exc:
        raise FormatError(f"bad headers: {exc}") from None
    if extra is None:
        return []
    if not isinstance(extra, dict):
        raise FormatError(f"headers must be a JSON object of string values, got {type(extra).__name__}")
    pairs: list[tuple[str, str]] = []
    for name, value in extra.items():
        if name in RESERVED_HEADERS:
            raise FormatError(f"header {name!r} is reserved for the relay's own headers")
        if not isinstance(value, str):
            raise FormatError(f"header {name!r} must be a string, got {type(value).__name__}")
        pairs.append((name, value))
    return pairs


def rfc3339(moment: dt.datetime) -> str:
    """``created_at`` -> RFC 3339 in UTC with a ``Z`` (microseconds kept when present)."""
    text = moment.astimezone(dt.UTC).isoformat()
    return text.removesuffix("+00:00") + "Z"


@functools.lru_cache(maxsize=4096)
def _routed_topic(template: str, aggregate_type: str, event_type: str) -> str:
    """The template filled in; cached, as a deployment has few (type, event) pairs and
    this runs for every message."""
    return template.format(aggregate_type=aggregate_type, event_type=event_type)


def default_cloudevents_source(table: str) -> str:
    return f"/outbox-relay/{table}"


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~3x, once per message
class Encoded:
    """One row in a wire format (before the relay's trace context is added)."""

    topic: str
    key: str
    value: str | bytes | None  # bytes: the row's payload_bytes; None: a tombstone
    headers: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class WireFormat:
    """A message format with everything it needs from the settings."""

    format: MessageFormat = MessageFormat.CONTRACT
    topic_template: str = CONTRACT_TOPIC_TEMPLATE
    cloudevents_source: str = default_cloudevents_source("outbox")
    #: ``kafka.timestamp = "created_at"``: records carry the row's creation time.
    created_at_timestamp: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> WireFormat:
        kafka = settings.kafka
        fmt = MessageFormat(kafka.message_format)
        template = kafka.topic_template
        # A Debezium drop-in routes like the router, unless the user chose a template.
        if fmt is MessageFormat.DEBEZIUM and "topic_template" not in kafka.model_fields_set:
            template = DEBEZIUM_TOPIC_TEMPLATE
        source = kafka.cloudevents_source or default_cloudevents_source(settings.database.table)
        return cls(fmt, template, source, kafka.timestamp == "created_at")

    def timestamp_ms(self, row: Claimed) -> int | None:
        """The record timestamp of ``row`` (None: the producer stamps it when it sends)."""
        if not self.created_at_timestamp:
            return None
        return (row.created_at - _EPOCH) // _MILLISECOND  # exact: no float rounding

    def topic(self, row: Claimed) -> str:
        return row.topic or _routed_topic(self.topic_template, row.aggregate_type, row.event_type)

    def encode(self, row: Claimed) -> Encoded:
        """Topic, key, value and headers of ``row``; raises ``FormatError``."""
        topic = self.topic(row)
        extra = parse_row_headers(row.headers)
        if not topic:
            raise FormatError("empty topic")
        if row.partition is not None and row.partition < 0:
            raise FormatError(f"partition {row.partition} is negative: a partition number is 0 or more")
        tombstone = row.tombstone
        if row.payload is None and not tombstone:
            raise FormatError("payload not fetched: the row is larger than the target accepts")
        fmt = self.format
        if row.payload_bytes is not None:
            if tombstone:
                raise FormatError("a tombstone carries no value, but the row has payload_bytes")
            return self._encode_bytes(row, topic, row.payload_bytes, extra)
        payload = None if tombstone else row.payload
        message_id = str(row.id)
        if fmt in (MessageFormat.CONTRACT, MessageFormat.DEBEZIUM):
            return self._encode_headers_only(row, topic, payload, extra)
        plain, extensions = _split_extensions(extra)
        attributes = [
            ("specversion", CE_SPECVERSION),
            ("id", message_id),
            ("source", self.cloudevents_source),
            ("type", row.event_type),
            ("subject", row.aggregate_id),
            ("time", rfc3339(row.created_at)),
        ]
        # A tombstone's value is null, which cannot hold a structured envelope: it goes in
        # binary content mode in both CloudEvents formats (an event without data, so
        # without a data content type).
        if fmt is MessageFormat.CLOUDEVENTS_BINARY or payload is None:
            headers = [(CE_PREFIX + name, value) for name, value in attributes]
            if payload is not None:
                headers.append((CONTENT_TYPE_HEADER, DATA_CONTENT_TYPE))
            headers.extend((CE_PREFIX + name, value) for name, value in extensions)
            headers.append(("message_id", message_id))
            headers.extend(plain)
            return Encoded(topic, row.aggregate_id, payload, headers)
        envelope = dict(attributes)
        envelope["datacontenttype"] = DATA_CONTENT_TYPE
        envelope.update(extensions)
        # The payload is spliced in as the JSON text it is stored as (data of a JSON
        # content type is the JSON value itself, JSON event format 3.1.1): no re-parse.
        value = json.dumps(envelope, ensure_ascii=False)[:-1] + ', "data": ' + payload + "}"
        headers = [(CONTENT_TYPE_HEADER, STRUCTURED_CONTENT_TYPE), ("message_id", message_id), *plain]
        return Encoded(topic, row.aggregate_id, value, headers)

    def _encode_headers_only(
        self, row: Claimed, topic: str, value: str | bytes | None, extra: list[tuple[str, str]]
    ) -> Encoded:
        """The contract and debezium formats: the value as it is, what describes it in
        headers (the contract's four; debezium's ``id``, the outbox id)."""
        message_id = str(row.id)
        if self.format is MessageFormat.CONTRACT:
            headers = [
                ("message_id", message_id),
                ("event_type", row.event_type),
                ("aggregate_type", row.aggregate_type),
                ("aggregate_id", row.aggregate_id),
                *extra,
            ]
            return Encoded(topic, row.aggregate_id, value, headers)
        if any(name == "id" for name, _ in extra):
            raise FormatError("header 'id' is reserved in the debezium format (it carries the outbox id)")
        return Encoded(topic, row.aggregate_id, value, [("id", message_id), *extra])

    def _encode_bytes(self, row: Claimed, topic: str, value: bytes, extra: list[tuple[str, str]]) -> Encoded:
        """A row whose writer encoded its value (``payload_bytes``): the bytes are the
        value as they are, in every format. Their data content type is the row's
        ``content-type`` header, else ``application/octet-stream``: in the CloudEvents
        formats it is the ``datacontenttype`` (binary mode: the ``content-type`` header;
        structured mode: the bytes go base64-encoded under ``data_base64``)."""
        message_id = str(row.id)
        fmt = self.format
        if fmt in (MessageFormat.CONTRACT, MessageFormat.DEBEZIUM):
            return self._encode_headers_only(row, topic, value, extra)
        content_types = [v for name, v in extra if name.lower() == CONTENT_TYPE_HEADER]
        if len(content_types) > 1:
            raise FormatError("more than one content-type header")
        content_type = content_types[0] if content_types else BYTES_CONTENT_TYPE
        plain, extensions = _split_extensions([(n, v) for n, v in extra if n.lower() != CONTENT_TYPE_HEADER])
        attributes = [
            ("specversion", CE_SPECVERSION),
            ("id", message_id),
            ("source", self.cloudevents_source),
            ("type", row.event_type),
            ("subject", row.aggregate_id),
            ("time", rfc3339(row.created_at)),
        ]
        if fmt is MessageFormat.CLOUDEVENTS_BINARY:
            headers = [(CE_PREFIX + name, attribute) for name, attribute in attributes]
            headers.append((CONTENT_TYPE_HEADER, content_type))
            headers.extend((CE_PREFIX + name, attribute) for name, attribute in extensions)
            headers.append(("message_id", message_id))
            headers.extend(plain)
            return Encoded(topic, row.aggregate_id, value, headers)
        envelope = dict(attributes)
        envelope["datacontenttype"] = content_type
        envelope.update(extensions)
        envelope["data_base64"] = base64.standard_b64encode(value).decode("ascii")
        headers = [(CONTENT_TYPE_HEADER, STRUCTURED_CONTENT_TYPE), ("message_id", message_id), *plain]
        return Encoded(topic, row.aggregate_id, json.dumps(envelope, ensure_ascii=False), headers)


def _split_extensions(extra: Sequence[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Row headers -> (plain headers, CloudEvents extension attributes from ``ce_<name>``)."""
    plain: list[tuple[str, str]] = []
    extensions: list[tuple[str, str]] = []
    for name, value in extra:
        if name.lower() == CONTENT_TYPE_HEADER:
            raise FormatError(f"header {name!r} is reserved in the CloudEvents formats (the data content type)")
        if name[:3].lower() != CE_PREFIX:
            plain.append((name, value))
            continue
        attribute = name[3:]
        if attribute in _CE_OWN_ATTRIBUTES:
            raise FormatError(f"header {name!r} is reserved: the relay sets the CloudEvents attribute {attribute!r}")
        if not _CE_ATTRIBUTE_RE.match(attribute):
            raise FormatError(
                f"header {name!r}: a CloudEvents extension name must be 1-20 lower-case letters or digits"
            )
        extensions.append((attribute, value))
    return plain, extensions


# --- HTTP binding ------------------------------------------------------------------------------
def http_header_name(name: str) -> str:
    """A contract header name as an HTTP header (``message_id`` -> ``X-Outbox-message-id``):
    ``_`` becomes ``-`` because proxies such as nginx drop names containing underscores."""
    return HTTP_HEADER_PREFIX + name.replace("_", "-")


def http_headers(fmt: MessageFormat, headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A message's headers as HTTP request headers, in the HTTP binding of its format."""
    out: list[tuple[str, str]] = []
    cloudevents = fmt.is_cloudevents
    for name, value in headers:
        if name in TRACE_HEADERS:
            out.append((name, value))
        elif cloudevents and name == CONTENT_TYPE_HEADER:
            out.append(("Content-Type", value))
        elif cloudevents and name.startswith(CE_PREFIX):
            out.append((CE_HTTP_PREFIX + name[3:], quote(value, safe=_CE_HTTP_SAFE)))
        else:
            out.append((http_header_name(name), value))
    return out
