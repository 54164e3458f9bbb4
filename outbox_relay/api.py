"""The write side: ``enqueue`` inserts an outbox row in the caller's transaction."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from datetime import timedelta
from functools import lru_cache
from typing import Any

from psycopg import Connection
from psycopg.sql import SQL, Composable, Composed
from psycopg.types.json import Jsonb

from .db.schema import TableSql

_RECORD_COLUMNS = SQL(", tombstone, partition")
_RECORD_VALUES = SQL(", %(tombstone)s, %(partition)s")
_BYTES_COLUMN = SQL(", payload_bytes")
_BYTES_VALUE = SQL(", %(payload_bytes)s")
_NOTHING = SQL("")


@lru_cache(maxsize=64)
def _table_sql(table: str) -> TableSql:
    from .config import _TABLE_RE

    if not _TABLE_RE.match(table):
        raise ValueError(f"invalid table name {table!r}: use 'name' or 'schema.name'")
    return TableSql(table)


def current_trace_headers() -> dict[str, str]:
    """The caller's W3C trace context (``traceparent`` and, if any, ``tracestate``)
    when OpenTelemetry is in use and a span is active; else ``{}``.

    OpenTelemetry is never imported here: if the application has not imported it, no
    span can be active, and an application without it pays one dictionary lookup."""
    if "opentelemetry.trace" not in sys.modules:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


class EnqueueResult(int):
    """The row id (an int), with ``.duplicate`` True when a ``dedup_key`` already existed."""

    duplicate: bool

    def __new__(cls, value: int, duplicate: bool = False) -> EnqueueResult:
        obj = super().__new__(cls, value)
        obj.duplicate = duplicate
        return obj


def enqueue(
    conn: Connection[Any],
    *,
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    payload: Any,
    topic: str | None = None,
    headers: Mapping[str, str] | None = None,
    table: str = "outbox",
    ordered: bool = False,
    dedup_key: str | None = None,
    delay: float | timedelta = 0.0,
    trace_context: bool = True,
    tombstone: bool = False,
    partition: int | None = None,
    payload_bytes: bytes | bytearray | memoryview | None = None,
) -> EnqueueResult:
    """Insert one outbox row on ``conn``, inside the caller's transaction; return its id.

    Nothing is committed here: the row becomes visible to the relay when the caller
    commits its business changes, and disappears with them on rollback.

    ``ordered=True`` first takes a transaction-scoped advisory lock on
    (table, aggregate_id), so concurrent writers of one aggregate commit in the
    order they obtain ids — the premise of per-aggregate ordered delivery. The lock
    is held until the caller's transaction ends; keep such transactions short.

    ``dedup_key``: at most one row per key, ever: the key is recorded in the table's
    dedup key table (created by ``migrate``), which keeps it after the row was
    delivered and deleted (``relay.on_done = "delete"``) or purged, until ``purge
    --older-than`` removes keys older than its cutoff whose row is gone. On a
    duplicate nothing is inserted, the transaction is *not* aborted, and the first
    row's id is returned with ``.duplicate = True`` (that row may be gone by now).

    ``payload`` is any JSON-serialisable value (or a ``str`` holding JSON text);
    ``headers`` must map strings to strings. They reach Kafka as message headers.

    ``trace_context`` (default True): when OpenTelemetry is in use and a span is
    active, the current W3C trace context is stored in the row's headers
    (``traceparent``, ``tracestate``), so the relay's span joins the caller's trace.
    A ``traceparent`` in ``headers`` wins; ``trace_context=False`` stores nothing.

    ``tombstone=True`` (Kafka): the message's value is null, so a compacted topic
    deletes the key (``aggregate_id``), e.g. to erase a person's data. Pass
    ``payload=None``: a tombstone carries no payload. The HTTP publisher cannot send
    one: such a row goes dead there with the reason.

    ``partition`` (Kafka): the partition to write to, 0 or more; None (default) leaves
    it to ``kafka.partitioner``. A partition the topic does not have sends the row dead
    with the reason. Ignored by the HTTP publisher.

    Both need the table's ``tombstone`` and ``partition`` columns (``outbox-relay
    migrate``); without them, an enqueue that uses neither still works.

    ``payload_bytes``: the message value already encoded by the writer (Avro,
    Protobuf, a Confluent-framed value, any bytes), published as it is instead of a
    JSON payload; pass ``payload=None`` with it. Kafka (contract, debezium): the
    record's value; the registry value formats do not encode it again. CloudEvents:
    the event's data, its ``datacontenttype`` the row's ``content-type`` header (else
    ``application/octet-stream``); structured mode carries it base64-encoded under
    ``data_base64``. HTTP: the request body, ``Content-Type`` likewise. Needs the
    table's ``payload_bytes`` column (``outbox-relay migrate``).
    """
    if headers is not None:
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise TypeError("headers must be a mapping of str to str")
        from .core.formats import RESERVED_HEADERS

        reserved = RESERVED_HEADERS.intersection(headers)
        if reserved:
            raise ValueError(f"headers {sorted(reserved)} are reserved: the relay sets them")
    for name, value in (("aggregate_type", aggregate_type), ("aggregate_id", aggregate_id), ("event_type", event_type)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string")
    if tombstone and payload is not None:
        raise ValueError("a tombstone carries no payload: pass payload=None with tombstone=True")
    if payload_bytes is not None:
        if not isinstance(payload_bytes, bytes | bytearray | memoryview):
            raise TypeError(f"payload_bytes must be bytes, not {type(payload_bytes).__name__}")
        if payload is not None:
            raise ValueError("payload_bytes is the value: pass payload=None with it")
        if tombstone:
            raise ValueError("a tombstone carries no value: payload_bytes and tombstone=True exclude each other")
        payload_bytes = bytes(payload_bytes)
    if partition is not None and (isinstance(partition, bool) or not isinstance(partition, int) or partition < 0):
        raise ValueError(f"partition must be an int of 0 or more (or None), not {partition!r}")
    if isinstance(payload, str | bytes):
        payload_value: Any = Jsonb(json.loads(payload))
    else:
        payload_value = Jsonb(payload)
    if trace_context and (headers is None or "traceparent" not in headers):
        trace_headers = current_trace_headers()
        if trace_headers:
            headers = {**trace_headers, **(headers or {})}
    delay_seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    sql = _table_sql(table)
    params = {
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "event_type": event_type,
        "payload": payload_value,
        "topic": topic,
        "headers": Jsonb(dict(headers)) if headers is not None else None,
        "delay_seconds": delay_seconds,
        "dedup_key": dedup_key,
        "lock_key": f"outbox-relay:{table}:{aggregate_id}",
        "tombstone": tombstone,
        "partition": partition,
        "payload_bytes": payload_bytes,
    }
    # The record columns only when asked for: a plain enqueue works on a table that
    # migrate has not given them yet (an application upgraded before its migrate).
    asked = tombstone or partition is not None
    columns: Composable = _RECORD_COLUMNS if asked else _NOTHING
    values: Composable = _RECORD_VALUES if asked else _NOTHING
    if payload_bytes is not None:  # likewise: the column only when used
        columns, values = Composed([columns, _BYTES_COLUMN]), Composed([values, _BYTES_VALUE])
    with conn.cursor() as cur:
        if ordered:
            cur.execute(sql.query("aggregate_lock"), params)
        if dedup_key is None:
            cur.execute(sql.query("enqueue", record_columns=columns, record_values=values), params)
            row = cur.fetchone()
            assert row is not None
            return EnqueueResult(row[0])
        # Two statements: the key first (the key table decides, and keeps the key after
        # the row is delivered and deleted or purged), then the row linked to it.
        cur.execute(sql.query("enqueue_dedup_key"), params)
        if cur.fetchone() is not None:
            cur.execute(sql.query("enqueue_dedup", record_columns=columns, record_values=values), params)
            row = cur.fetchone()
            if row is not None:
                return EnqueueResult(row[0])
        cur.execute(sql.query("find_dedup"), params)
        existing = cur.fetchone()
        if existing is None or existing[0] is None:
            raise RuntimeError(f"dedup_key {dedup_key!r} conflicted but no row holds it")
        return EnqueueResult(existing[0], duplicate=True)
