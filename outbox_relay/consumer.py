"""The consumer's side of at-least-once: process each message once, with an inbox table.

The relay delivers every row at least once: a lease that expires while its message
is in flight, a lost finalize reply or a released batch can put a message on the
topic twice. ``Inbox`` makes a consumer that writes to PostgreSQL apply each
message exactly once: in the SAME transaction as the consumer's own writes it
inserts the message's delivery id into an inbox table; a duplicate finds the id
there and is skipped, and a rollback removes the id together with the writes, so
the redelivered message is processed then.

    from confluent_kafka import Consumer
    from outbox_relay.consumer import Inbox

    inbox = Inbox("inbox")                       # a table in the consumer's database
    with psycopg.connect(dsn) as conn:
        inbox.create(conn)                       # idempotent
        while True:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            inbox.process(conn, msg, apply)      # apply(conn, msg) runs only for a first delivery
            consumer.commit(message=msg, asynchronous=False)   # after the database commit

The delivery id is ``(source, message_id)``: ``message_id`` is the ``message_id``
header (contract and CloudEvents formats), else ``ce_id`` (CloudEvents binary), the
``id`` of a structured CloudEvents envelope, or the ``id`` header (debezium format);
``source`` is the CloudEvents ``source`` when the message has one, else the inbox's
``source`` (default ``""``) — give each outbox a different one if a consumer reads
several outboxes in the contract or debezium format, because outbox ids are unique
per table only. ``record_id`` takes an id directly (e.g. an HTTP receiver's
``X-Outbox-message-id`` / ``ce-id``).

The inbox grows by one row per message: ``purge(conn, older_than_seconds)``
deletes ids older than any redelivery you expect (days, not seconds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeVar

from psycopg import Connection

from .core.formats import STRUCTURED_CONTENT_TYPE
from .db.schema import TableSql


class KafkaMessageLike(Protocol):
    """What ``Inbox`` reads from a message: confluent-kafka's ``Message`` has both."""

    def headers(self) -> Iterable[tuple[str, bytes | str | None]] | None: ...

    def value(self) -> bytes | str | None: ...


M = TypeVar("M", bound=KafkaMessageLike)


@dataclass(frozen=True, slots=True)
class DeliveryId:
    """What identifies a message across redeliveries."""

    source: str
    message_id: str


def _text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def delivery_id(message: KafkaMessageLike, *, default_source: str = "") -> DeliveryId:
    """The delivery id of a message in any of the relay's formats; ``ValueError`` if it has none."""
    headers: dict[str, str] = {}
    for name, value in message.headers() or ():
        text = _text(value)
        if text is not None:
            headers.setdefault(name, text)  # the first occurrence of a repeated name counts
    source = headers.get("ce_source")
    message_id = headers.get("message_id") or headers.get("ce_id")
    if headers.get("content-type", "").lower().startswith(STRUCTURED_CONTENT_TYPE):
        try:
            envelope = json.loads(_text(message.value()) or "")
        except ValueError:
            envelope = None
        if isinstance(envelope, dict):
            source = source or _str_or_none(envelope.get("source"))
            message_id = message_id or _str_or_none(envelope.get("id"))
    message_id = message_id or headers.get("id")
    if not message_id:
        raise ValueError("the message carries no message_id, ce_id or id: it did not come from outbox-relay")
    return DeliveryId(source or default_source, message_id)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


class Inbox:
    """Deduplication by delivery id in the consumer's own transaction (see the module docstring)."""

    def __init__(self, table: str = "inbox", *, source: str = "") -> None:
        from .config import _TABLE_RE

        if not _TABLE_RE.match(table):
            raise ValueError(f"invalid inbox table name {table!r}: use 'name' or 'schema.name'")
        self.table = table
        self.source = source

    @cached_property
    def _sql(self) -> TableSql:
        return TableSql(self.table)  # the name is always quoted (psycopg.sql.Identifier)

    def create(self, conn: Connection[Any]) -> None:
        """Create the inbox table if it does not exist (commits only if ``conn`` is in autocommit)."""
        conn.execute(self._sql.query("inbox_create"))

    def record_id(self, conn: Connection[Any], delivery: DeliveryId) -> bool:
        """Insert ``delivery`` in the current transaction of ``conn``: True the first
        time, False for a duplicate. Never aborts the transaction."""
        cur = conn.execute(
            self._sql.query("inbox_record"), {"source": delivery.source, "message_id": delivery.message_id}
        )
        return cur.fetchone() is not None

    def record(self, conn: Connection[Any], message: KafkaMessageLike) -> bool:
        """``record_id`` for a Kafka message (its id read by ``delivery_id``)."""
        return self.record_id(conn, delivery_id(message, default_source=self.source))

    def process(self, conn: Connection[Any], message: M, handler: Callable[[Connection[Any], M], object]) -> bool:
        """In one transaction on ``conn``: record the message and, if it is its first
        delivery, call ``handler(conn, message)``. True if the handler ran. An
        exception from the handler rolls both back (the message is processed when it
        is delivered again) and propagates."""
        with conn.transaction():
            if not self.record(conn, message):
                return False
            handler(conn, message)
            return True

    def purge(self, conn: Connection[Any], older_than_seconds: float) -> int:
        """Delete ids recorded more than ``older_than_seconds`` ago; return how many."""
        cur = conn.execute(self._sql.query("inbox_purge"), {"older_than_seconds": float(older_than_seconds)})
        return cur.rowcount
