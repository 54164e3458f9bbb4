"""The publisher contract, at the import path plug-ins use: ``from outbox_relay.publisher import ...``.

The contract itself lives in ``outbox_relay.publishers.base`` (the message and outcome
types in ``outbox_relay.model``); this module re-exports it so the path plug-ins were
written against keeps working.
"""

from __future__ import annotations

from .model import (
    Defer,
    Message,
    NotDelivered,
    Outcome,
    PermanentError,
    PublisherObserver,
    PublishOutcome,
    RetryableError,
    SpanAttributes,
)
from .publishers.base import (
    BUILTIN_PUBLISHERS,
    ENTRY_POINT_GROUP,
    RESERVED_HEADERS,
    Factory,
    MessageFormatError,
    PendingBatch,
    Publisher,
    SimplePublisher,
    build_message,
    load_publisher,
)

__all__ = [
    "BUILTIN_PUBLISHERS",
    "ENTRY_POINT_GROUP",
    "RESERVED_HEADERS",
    "Defer",
    "Factory",
    "Message",
    "MessageFormatError",
    "NotDelivered",
    "Outcome",
    "PendingBatch",
    "PermanentError",
    "PublishOutcome",
    "Publisher",
    "PublisherObserver",
    "RetryableError",
    "SimplePublisher",
    "SpanAttributes",
    "build_message",
    "load_publisher",
]
