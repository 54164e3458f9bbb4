"""The types every layer shares: a claimed outbox row, its finalize decision, the message a
publisher sends and the outcomes it reports. Imports nothing of the package, so anything
may import it without creating a cycle.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta


# --- rows ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Claimed:
    """One row owned by this worker until ``lease_version`` changes."""

    id: int
    lease_version: int
    attempts: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    # JSON text exactly as stored (jsonb::text), never re-serialised; None when the
    # row is larger than the target accepts (see size_bytes): it was not fetched.
    payload: str | None
    topic: str | None
    headers: str | None  # JSON text or None
    created_at: dt.datetime
    size_bytes: int = 0  # payload + headers as text, as the claim measured them
    tombstone: bool = False  # send a null value (a delete on a compacted topic), not the payload
    partition: int | None = None  # the partition the row asks for; None: the partitioner chooses
    # The value as its writer encoded it (enqueue(payload_bytes=...)), published as it
    # is instead of the JSON payload; None: the payload is the value. Also None when the
    # row is larger than the target accepts (then payload is None too).
    payload_bytes: bytes | None = None


@dataclass(slots=True)  # not frozen: one per row of every batch, and a frozen __init__ costs ~3x
class FinalizeItem:
    """One row's decision as the fenced finalize writes it (see decision.Decision)."""

    id: int
    lease_version: int
    status: str  # done | pending | dead
    delay_seconds: float = 0.0
    error: str | None = None
    refund_attempt: bool = False


# --- message formats -----------------------------------------------------------------------
class MessageFormat(enum.StrEnum):
    CONTRACT = "contract"
    CLOUDEVENTS_BINARY = "cloudevents-binary"
    CLOUDEVENTS_STRUCTURED = "cloudevents-structured"
    DEBEZIUM = "debezium"

    @property
    def is_cloudevents(self) -> bool:
        return self in (MessageFormat.CLOUDEVENTS_BINARY, MessageFormat.CLOUDEVENTS_STRUCTURED)


# --- outcomes ------------------------------------------------------------------------------
class PublishOutcome(Exception):
    """Base of the outcome exceptions a publisher may report."""

    reason: str


class RetryableError(PublishOutcome):
    """A transient failure: retry later with backoff, consuming an attempt.

    ``retry_after_seconds`` is a floor for the backoff (e.g. HTTP Retry-After).
    ``transport`` marks a failure of the connection to the target as a whole (broker
    unreachable), which the circuit breaker counts instead of burning attempts.
    ``throttled`` marks the target saying it is asked too often (HTTP 429): a
    ``[[limits]]`` bucket of that destination then pauses for ``retry_after_seconds``.
    """

    def __init__(
        self,
        reason: str,
        *,
        retry_after_seconds: float | None = None,
        transport: bool = False,
        throttled: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_seconds = retry_after_seconds
        self.transport = transport
        self.throttled = throttled


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

    def __init__(self, delay: float | timedelta, reason: str) -> None:
        super().__init__(reason)
        self.delay = float(delay.total_seconds() if isinstance(delay, timedelta) else delay)
        self.reason = reason


Outcome = PublishOutcome | None

#: What ``Publisher.span_attributes`` returns: OpenTelemetry attribute names and values.
SpanAttributes = Mapping[str, str | int | float | bool]


# --- messages ------------------------------------------------------------------------------
@dataclass(slots=True)
class Message:
    """What gets published for one outbox row, in the configured message format."""

    id: int
    topic: str
    key: str
    # The payload as JSON text; bytes: the row's payload_bytes (encoded by its writer, sent
    # as they are); None: a tombstone (the row's ``tombstone``).
    value: str | bytes | None
    headers: list[tuple[str, str]]
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int = 0
    lease_version: int = 0
    created_at_epoch: float = 0.0
    #: The aggregate id when the event type is ordered (``relay.ordered_event_types``),
    #: else None. Messages with the same key form a run: a publisher must not send a
    #: message after a failed one of the same key (see ``outbox_relay.core.ordering``).
    order_key: str | None = None
    extra: dict[str, object] = field(default_factory=dict)  # free for plug-ins' own use
    #: The wire format ``key``/``value``/``headers`` are in (``kafka.message_format``).
    format: MessageFormat = MessageFormat.CONTRACT
    #: The record's timestamp in milliseconds since the Unix epoch (``kafka.timestamp =
    #: "created_at"``: the row's ``created_at``); None: the producer's clock at send time.
    timestamp_ms: int | None = None
    #: The partition the row asks for (its ``partition`` column); None: the partitioner
    #: chooses from the key (``kafka.partitioner``).
    partition: int | None = None

    @property
    def message_id(self) -> str:
        return str(self.id)


class PublisherObserver:
    """What a publisher reports besides outcomes. The relay attaches its metrics
    (``RelayMetrics`` implements this); the default does nothing. Called from any
    thread, so implementations must be thread-safe and quick."""

    def message_acknowledged(self, seconds_since_created: float) -> None:
        """The target acknowledged a message ``seconds_since_created`` after its row was written."""

    def messages_acknowledged(self, seconds_since_created: Sequence[float]) -> None:
        """Several acknowledgements at once (a batch's): one call instead of one per
        message. The default calls ``message_acknowledged`` for each."""
        for seconds in seconds_since_created:
            self.message_acknowledged(seconds)

    def client_replaced(self, reason: str) -> None:
        """The publisher replaced its client (e.g. a fatally failed Kafka producer)."""

    def messages_isolated(self, count: int) -> None:
        """``count`` messages rejected together were re-sent one by one to find the bad ones."""

    def topic_authorization_failed(self, topic: str) -> None:
        """The target refused a message for ``topic`` to this client's identity (an ACL)."""

    def rate_limit_waited(self, destination: str, seconds: float) -> None:
        """Messages to ``destination`` (``topic:<name>``, ``host:<name>``) were held
        ``seconds`` in all for a ``[[limits]]`` token before being sent."""

    def topic_missing(self, topic: str) -> None:
        """Messages for ``topic`` wait because the target has no such topic and does not create it."""

    def producer_errors(self, reported_by: str, code: str, count: int = 1) -> None:
        """The client reported ``count`` errors ``code`` (Kafka: librdkafka's error name),
        ``reported_by`` = ``delivery`` (per message, in delivery reports) or ``client`` (the
        client's own error callback: connections, brokers down)."""

    def unwritable_partitions(self, by_cause: Mapping[str, int]) -> None:
        """How many partitions the target does not take messages for now, by cause."""
