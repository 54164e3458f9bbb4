"""Publishers: the boundary between the relay loop and the outside world.

The contract of a publisher is its outcomes. For each message it reports exactly one of:

- success (``None``): the target has the message, the row becomes ``done``;
- ``RetryableError``: a technical failure (timeout, connection, 5xx, throttling);
  the row goes back to ``pending`` with full-jitter backoff, consuming an attempt,
  and ``dead`` once ``max_attempts`` is used up;
- ``Defer(delay, reason)``: a business "not yet"; back to ``pending`` after
  ``delay`` with the attempt refunded;
- ``PermanentError``: retrying cannot help (too large, invalid, forbidden); ``dead``.

Any other exception escaping a publisher is a bug: it is not swallowed as
retryable. The batch's lease runs out and the attempt budget decides.

Delivery is **at least once**: a message can be published and its row not yet
finalized when a worker dies, and a stale owner's in-flight publish can land after
its successor's. Every message carries a stable ``message_id`` (the outbox id) so
consumers can deduplicate.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .store import Claimed


class PublishOutcome(Exception):
    """Base of the outcome exceptions a publisher may report."""


class RetryableError(PublishOutcome):
    """A transient failure: retry later with backoff, consuming an attempt.

    ``retry_after_seconds`` is a floor for the backoff (e.g. HTTP Retry-After).
    ``transport`` marks a failure of the connection to the target as a whole (broker
    unreachable), which the circuit breaker counts instead of burning attempts.
    """

    def __init__(self, reason: str, *, retry_after_seconds: float | None = None, transport: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_seconds = retry_after_seconds
        self.transport = transport


class NotDelivered(RetryableError):
    """No outcome when the relay had to stop waiting (shutdown, or an earlier row of
    the same ordered run failed): the row is released unpublished-as-far-as-we-know,
    due now, attempt refunded."""


class PermanentError(PublishOutcome):
    """Retrying cannot succeed: the row goes dead for a person to look at."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Defer(PublishOutcome):
    """Not yet: reschedule after ``delay`` seconds without consuming an attempt."""

    def __init__(self, delay: float, reason: str) -> None:
        super().__init__(reason)
        self.delay = float(delay.total_seconds() if hasattr(delay, "total_seconds") else delay)
        self.reason = reason


Outcome = PublishOutcome | None


@dataclass(slots=True)
class Message:
    """What gets published for one outbox row (the contract's message format)."""

    id: int
    topic: str
    key: str
    value: str  # the payload as JSON text
    headers: list[tuple[str, str]]
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int = 0
    lease_version: int = 0
    created_at_epoch: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def message_id(self) -> str:
        return str(self.id)


@runtime_checkable
class Publisher(Protocol):
    """Publishes a batch and reports one outcome per message, in order.

    ``timeout_seconds`` is the time left before the batch's lease is at risk; a
    publisher must return by then, reporting unfinished messages as
    ``RetryableError``. It must be safe to call from several worker threads at once.
    """

    def publish_batch(self, messages: Sequence[Message], *, timeout_seconds: float) -> list[Outcome]: ...

    def close(self) -> None: ...


class SimplePublisher(abc.ABC):
    """Base for a plug-in that publishes one message at a time: implement ``publish``.

    ``publish`` returns normally on success and raises ``RetryableError``,
    ``PermanentError`` or ``Defer`` otherwise.
    """

    @abc.abstractmethod
    def publish(self, message: Message) -> None:
        """Publish one message or raise an outcome exception."""

    def publish_batch(self, messages: Sequence[Message], *, timeout_seconds: float) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for message in messages:
            try:
                self.publish(message)
                outcomes.append(None)
            except PublishOutcome as outcome:
                outcomes.append(outcome)
        return outcomes

    def close(self) -> None:
        return None

    def healthy(self) -> bool:
        return True


class MessageFormatError(PermanentError):
    """The row cannot be turned into a message (bad headers, bad topic template)."""


# The contract's headers; a row may not set them (a second message_id would break dedup).
RESERVED_HEADERS = frozenset({"message_id", "event_type", "aggregate_type", "aggregate_id"})


def build_message(row: Claimed, topic_template: str) -> Message:
    """Row -> message: topic routing, key, value and headers of the contract."""
    topic = row.topic or topic_template.format(aggregate_type=row.aggregate_type, event_type=row.event_type)
    headers = [
        ("message_id", str(row.id)),
        ("event_type", row.event_type),
        ("aggregate_type", row.aggregate_type),
        ("aggregate_id", row.aggregate_id),
    ]
    if row.headers is not None:
        extra = json.loads(row.headers)
        if extra is not None:
            if not isinstance(extra, dict):
                raise MessageFormatError(
                    f"headers must be a JSON object of string values, got {type(extra).__name__}"
                )
            for name, value in extra.items():
                if name in RESERVED_HEADERS:
                    raise MessageFormatError(f"header {name!r} is reserved for the relay's own headers")
                if not isinstance(value, str):
                    raise MessageFormatError(
                        f"header {name!r} must be a string, got {type(value).__name__}"
                    )
                headers.append((name, value))
    if not topic:
        raise MessageFormatError("empty topic")
    return Message(
        id=row.id,
        topic=topic,
        key=row.aggregate_id,
        value=row.payload,
        headers=headers,
        aggregate_type=row.aggregate_type,
        aggregate_id=row.aggregate_id,
        event_type=row.event_type,
        attempts=row.attempts,
        lease_version=row.lease_version,
        created_at_epoch=row.created_at.timestamp(),
    )
