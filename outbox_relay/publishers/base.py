"""The publisher contract: the boundary between the relay loop and the outside world.

A publisher turns messages into one outcome each. For every message it reports:

- success (``None``): the target has the message; the row becomes ``done``;
- ``RetryableError``: a technical failure (timeout, connection, 5xx, throttling);
  the row goes back to ``pending`` with full-jitter backoff, consuming an attempt,
  and ``dead`` once ``max_attempts`` is used up;
- ``Defer(delay, reason)``: a business "not yet"; back to ``pending`` after
  ``delay`` with the attempt refunded;
- ``PermanentError``: retrying cannot help (too large, invalid, forbidden); ``dead``.

Any other exception escaping a publisher is a bug: it is not swallowed as
retryable. The batch's lease runs out and the attempt budget decides.

``Publisher`` below lists every hook the relay calls, each with a default, so a
plug-in implements only what it needs: usually just ``publish`` on
``SimplePublisher``. Built-in publishers (``kafka``, ``http``), installed plug-ins
(entry point group ``outbox_relay.publishers``) and ``package.module:factory``
references are all loaded by ``load_publisher``.

Delivery is **at least once**: a message can be published and its row not yet
finalized when a worker dies, and a stale owner's in-flight publish can land after
its successor's. Every message carries a stable ``message_id`` (the outbox id) so
consumers can deduplicate.
"""

from __future__ import annotations

import abc
import importlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from ..core.formats import RESERVED_HEADERS as RESERVED_HEADERS  # re-exported: the contract's reserved header names
from ..core.formats import FormatError, WireFormat
from ..core.ordering import RELEASED_AFTER_FAILURE, RunGuard
from ..core.rate_limit import LimitRule, RateLimits, TokenBucket
from ..errors import ConfigError, PublisherLoadError
from ..model import (
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

if TYPE_CHECKING:
    from ..config import Settings
    from ..core.ordering import OrderingRule
    from ..model import Claimed


_NO_SPAN_ATTRIBUTES: SpanAttributes = MappingProxyType({})


class MessageFormatError(PermanentError):
    """The row cannot be turned into a message (bad headers, bad topic template)."""


def build_message(row: Claimed, topic_template: str | WireFormat, ordering: OrderingRule | None = None) -> Message:
    """Row -> message in the configured format (``outbox_relay.formats``): topic
    routing, key, value and headers. A plain ``topic_template`` string means the
    contract format with that template.

    Raises ``MessageFormatError`` (a ``PermanentError``) for a row that cannot be
    sent: headers that are not a JSON object of strings or use a reserved name, an
    empty topic.
    """
    wire = topic_template if isinstance(topic_template, WireFormat) else WireFormat(topic_template=topic_template)
    try:
        encoded = wire.encode(row)
    except FormatError as exc:
        raise MessageFormatError(str(exc)) from None
    # Positional: this runs once per message, and keyword matching of 16 arguments
    # costs more than the rest of the construction (the order is Message's fields').
    return Message(
        row.id,
        encoded.topic,
        encoded.key,
        encoded.value,
        encoded.headers,
        row.aggregate_type,
        row.aggregate_id,
        row.event_type,
        row.attempts,
        row.lease_version,
        row.created_at.timestamp(),
        ordering.order_key(row.event_type, row.aggregate_id) if ordering is not None else None,
        {},
        wire.format,
        wire.timestamp_ms(row),
        row.partition,
    )


def not_ready_because(state: str, trouble: str | None) -> str:
    """The ``/readyz`` text of a target that does not take messages: ``state`` (breaker
    open, no answer) and, when the publisher knows it, why (``Publisher.trouble``)."""
    return f"not ready: {state}" if trouble is None else f"not ready: {state} ({trouble})"


# --- the contract --------------------------------------------------------------------------
class PendingBatch(abc.ABC):
    """A submitted batch whose outcomes are collected by ``wait``."""

    @abc.abstractmethod
    def wait(self, cancel: threading.Event | None = None) -> list[Outcome]:
        """Block until every message has an outcome, the deadline given to ``submit``
        passes, or ``cancel`` is set (the batch's leases were all lost); return one
        outcome per message, in order."""


class _PublishOnWait(PendingBatch):
    """The default ``submit``: nothing happens until ``wait`` publishes the batch."""

    def __init__(self, publisher: Publisher, messages: Sequence[Message], timeout_seconds: float) -> None:
        self._publisher = publisher
        self._messages = messages
        self._timeout_seconds = timeout_seconds

    def wait(self, cancel: threading.Event | None = None) -> list[Outcome]:
        return self._publisher.publish_batch(self._messages, timeout_seconds=self._timeout_seconds, cancel=cancel)


class Publisher(abc.ABC):
    """Every hook the relay uses, with defaults. Only ``publish_batch`` is required
    (``SimplePublisher`` implements it on top of a one-message ``publish``).

    Thread safety: one publisher serves all worker threads of a process, so
    ``publish_batch``/``submit`` are called concurrently.
    """

    #: The target system's name: the ``messaging.system`` attribute of tracing spans.
    name: ClassVar[str] = "custom"
    #: True if ``probe()`` really checks the target. Enables the circuit breaker: a
    #: batch that failed only on transport then releases its rows (attempt refunded)
    #: and claiming pauses until ``probe()`` succeeds again.
    can_probe: ClassVar[bool] = False
    #: True if the relay must refuse to start while ``probe()`` fails.
    must_answer_at_start: ClassVar[bool] = False
    #: True if ``submit()`` returns before delivery, so a worker may claim and submit
    #: its next batch while this one is being acknowledged (pipelining).
    pipelines: ClassVar[bool] = False

    #: Receives acknowledgements and client replacements (metrics). Set by the relay.
    observer: PublisherObserver = PublisherObserver()

    def start(self) -> None:
        """Open clients and threads. An exception here refuses the start (exit 2)."""
        return None

    def close(self) -> None:
        """Release everything; called once at shutdown (must tolerate a second call)."""
        return None

    def describe_target(self) -> str:
        """Where messages go, for error messages (never include credentials)."""
        return f"the target of {type(self).__name__}"

    def probe(self, timeout_seconds: float) -> bool:
        """Does the target answer now? Only called when ``can_probe`` is true."""
        return True

    def probe_problem(self) -> str | None:
        """Why the last failed ``probe()`` failed, when the publisher knows more than
        "no answer" (Kafka: a TLS handshake that did not complete), for the start-up
        wait's log line and error. None: nothing more is known. Never include credentials."""
        return None

    def healthy(self) -> bool:
        """Cheap readiness check for ``/readyz`` (may use a cached probe)."""
        return True

    def check_alive(self) -> str | None:
        """None while the publisher's own background threads run, else why not (``/healthz``)."""
        return None

    def held_back(self) -> str | None:
        """Why some messages wait although the target answers (Kafka: topics whose ACL
        refuses this principal, or missing topics), for ``/readyz``; None when nothing is held back."""
        return None

    def trouble(self) -> str | None:
        """Why the target does not take messages, as far as the publisher knows (Kafka:
        partitions without enough in-sync replicas or without a reachable leader, brokers
        down), for ``/readyz`` while the circuit breaker is open or the target does not
        answer. None: nothing known. Never include credentials."""
        return None

    def abort(self) -> None:
        """The shutdown deadline passed: stop waiting now and report every message
        without an outcome as ``NotDelivered`` (its row is released to another relay)."""
        return None

    def max_message_bytes(self) -> int | None:
        """The largest payload + headers the target accepts (None: no limit). A bigger
        row goes dead at once, without its payload ever being fetched into memory."""
        return None

    def limit_keys(self, message: Message) -> Mapping[str, str]:
        """What a ``[[limits]]`` entry can match for ``message``: its ``topic``; the HTTP
        publisher adds the ``host`` it sends the message to."""
        return {"topic": message.topic}

    def span_attributes(self, message: Message) -> SpanAttributes:
        """With tracing on (``otel.enabled``): attributes of the target system for the
        message's ``send`` span, beyond the generic ``messaging.*`` ones (Kafka:
        ``messaging.kafka.message.key``). Called once per message from any worker
        thread, so keep it cheap; the default adds none."""
        return _NO_SPAN_ATTRIBUTES

    def publish_timeout_seconds(self, lease_seconds: float) -> float:
        """How long a batch may take before its outcomes are due: comfortably inside
        the lease, so a row is not reclaimed while its outcome is still coming."""
        return lease_seconds * 0.8

    def submit(self, messages: Sequence[Message], *, timeout_seconds: float) -> PendingBatch:
        """Start publishing and return at once (pipelining publishers override this);
        the default publishes when ``wait()`` is called."""
        return _PublishOnWait(self, messages, timeout_seconds)

    @abc.abstractmethod
    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        """Publish and return one outcome per message, in order, by ``timeout_seconds``.
        Rows with the same ``order_key`` must be sent in order, stopping at a failure.
        ``cancel`` is set when every lease of the batch was lost: stop early."""


class SimplePublisher(Publisher):
    """Base for a plug-in that publishes one message at a time: implement ``publish``.

    ``publish`` returns normally on success and raises ``RetryableError``,
    ``PermanentError`` or ``Defer`` otherwise. Messages are published in order; after
    a failure the rest of that message's ordered run is not published (released).
    A message not started by the batch's deadline (``timeout_seconds``, inside the
    lease) or after ``abort()`` is released unpublished, so a slow target never keeps
    publishing rows whose lease may already belong to another worker.
    """

    _abort_requested = False  # set on the instance by abort()

    @abc.abstractmethod
    def publish(self, message: Message) -> None:
        """Publish one message or raise an outcome exception."""

    def abort(self) -> None:
        self._abort_requested = True

    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        deadline = time.monotonic() + timeout_seconds
        outcomes: list[Outcome] = []
        runs = RunGuard()
        for message in messages:
            if cancel is not None and cancel.is_set():
                outcomes.append(RetryableError("lease lost before this message was published"))
                continue
            if self._abort_requested:
                outcomes.append(NotDelivered("shutting down before this message was published"))
                continue
            if time.monotonic() >= deadline:
                outcomes.append(NotDelivered("not published before the batch deadline"))
                continue
            if runs.stopped(message.order_key):
                outcomes.append(NotDelivered(RELEASED_AFTER_FAILURE))
                continue
            outcome: Outcome = None
            try:
                self.publish(message)
            except PublishOutcome as exc:
                outcome = exc
            runs.record(message.order_key, outcome is not None)
            outcomes.append(outcome)
        return outcomes


# --- loading -------------------------------------------------------------------------------
#: The built-in publishers: ``relay.publisher`` name -> factory reference.
BUILTIN_PUBLISHERS: dict[str, str] = {
    "kafka": "outbox_relay.publishers.kafka:from_settings",
    "http": "outbox_relay.publishers.http:from_settings",
}
ENTRY_POINT_GROUP = "outbox_relay.publishers"

Factory = Callable[["Settings"], object]


@runtime_checkable
class _BatchShaped(Protocol):
    """A plug-in object written against the earlier protocol (not a Publisher subclass)."""

    def publish_batch(self, messages: Sequence[Message], *, timeout_seconds: float) -> list[Outcome]: ...


@runtime_checkable
class _PublishShaped(Protocol):
    def publish(self, message: Message) -> None: ...


class _BatchAdapter(Publisher):
    """Wraps an object with ``publish_batch(messages, *, timeout_seconds)`` (and optionally ``close()``)."""

    def __init__(self, inner: _BatchShaped) -> None:
        self._inner = inner

    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        return self._inner.publish_batch(messages, timeout_seconds=timeout_seconds)

    def close(self) -> None:
        _close_if_possible(self._inner)


class _SequentialAdapter(SimplePublisher):
    """Wraps an object that only has ``publish(message)`` (and optionally ``close()``)."""

    def __init__(self, inner: _PublishShaped) -> None:
        self._inner = inner

    def publish(self, message: Message) -> None:
        self._inner.publish(message)

    def close(self) -> None:
        _close_if_possible(self._inner)


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


def _close_if_possible(obj: object) -> None:
    if isinstance(obj, _Closable):  # close() is optional on these older plug-in shapes
        obj.close()


def _resolve_reference(setting: str, reference: str) -> Factory:
    """``package.module:attribute`` -> the attribute (a dotted attribute path is allowed)."""
    module_name, _, attr_path = reference.partition(":")
    if not module_name or not attr_path:
        raise PublisherLoadError(
            f"relay.publisher {setting!r} is not 'kafka', 'http' or 'package.module:factory', "
            f"nor an installed plug-in (entry point group {ENTRY_POINT_GROUP})"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, but also a SyntaxError or a crash at import
        raise PublisherLoadError(
            f"relay.publisher {setting!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise PublisherLoadError(
                f"relay.publisher {setting!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return target  # type: ignore[no-any-return]  # checked by the caller: callable or a publisher


def _find_factory(setting: str) -> Factory | object:
    if setting in BUILTIN_PUBLISHERS:
        return _resolve_reference(setting, BUILTIN_PUBLISHERS[setting])
    if ":" not in setting:
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == setting]
        if matches:
            try:
                loaded: object = matches[0].load()
            except Exception as exc:
                raise PublisherLoadError(
                    f"relay.publisher {setting!r}: the installed plug-in {matches[0].value!r} cannot be loaded: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
            return loaded
    return _resolve_reference(setting, setting)


# --- [[limits]]: token buckets in front of any publisher --------------------------------------
#: How long one batch may hold its messages for [[limits]] tokens: this share of its
#: publish timeout, at most RATE_LIMIT_MAX_WAIT_SECONDS. A worker holding a batch sends
#: nothing else, so the wait is short; messages that would wait longer are deferred.
RATE_LIMIT_WAIT_SHARE = 0.25
RATE_LIMIT_MAX_WAIT_SECONDS = 1.0
#: Messages whose tokens fall due within this of each other are sent together.
RATE_LIMIT_GROUP_SECONDS = 0.005
RATE_LIMIT_MIN_DEFER_SECONDS = 0.05


class RateLimitedPublisher(Publisher):
    """Holds each message until its destination's token bucket (``[[limits]]``) gives it
    a token, then hands it to the publisher it wraps; every other hook goes straight
    through. Messages to unlimited destinations go at once.

    A message that cannot get a token within its batch's wait (``RATE_LIMIT_WAIT_SHARE``
    of the publish timeout, at most ``RATE_LIMIT_MAX_WAIT_SECONDS``) is reported as
    ``Defer``: its row becomes due again when the bucket should have room, attempt
    refunded, as for any other "not yet". So are the later messages of its ordered run.
    A ``RetryableError`` marked ``throttled`` (HTTP 429) with ``retry_after_seconds``
    pauses the destination's bucket for that long. Buckets are per process."""

    def __init__(
        self,
        inner: Publisher,
        limits: RateLimits,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.limits = limits
        self.clock = clock
        self.aborting = threading.Event()

    @property  # the relay sets it; the wrapped publisher reports through it
    def observer(self) -> PublisherObserver:
        return self.inner.observer

    @observer.setter
    def observer(self, value: PublisherObserver) -> None:
        self.inner.observer = value

    # Everything but publishing is the wrapped publisher's.
    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()

    def describe_target(self) -> str:
        return self.inner.describe_target()

    def probe(self, timeout_seconds: float) -> bool:
        return self.inner.probe(timeout_seconds)

    def probe_problem(self) -> str | None:
        return self.inner.probe_problem()

    def healthy(self) -> bool:
        return self.inner.healthy()

    def check_alive(self) -> str | None:
        return self.inner.check_alive()

    def held_back(self) -> str | None:
        return self.inner.held_back()

    def trouble(self) -> str | None:
        return self.inner.trouble()

    def abort(self) -> None:
        self.aborting.set()
        self.inner.abort()

    def max_message_bytes(self) -> int | None:
        return self.inner.max_message_bytes()

    def span_attributes(self, message: Message) -> SpanAttributes:
        return self.inner.span_attributes(message)

    def publish_timeout_seconds(self, lease_seconds: float) -> float:
        return self.inner.publish_timeout_seconds(lease_seconds)

    def limit_keys(self, message: Message) -> Mapping[str, str]:
        return self.inner.limit_keys(message)

    # Publishing.
    def submit(self, messages: Sequence[Message], *, timeout_seconds: float) -> PendingBatch:
        batch = _PacedBatch(self, messages, timeout_seconds)
        if self.inner.pipelines:
            # What may go now goes now; the rest is handed over by a thread of the batch's
            # own as its tokens fall due. Submitting must not block: one thread submits
            # every worker's batches (runtime/submitter.py).
            batch.start_sending()
        return batch

    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        return _PacedBatch(self, messages, timeout_seconds).wait(cancel)


class _PacedBatch(PendingBatch):
    """One batch behind the buckets: which message goes when, or is deferred."""

    def __init__(self, owner: RateLimitedPublisher, messages: Sequence[Message], timeout_seconds: float) -> None:
        self.owner = owner
        self.messages = messages
        self.started = owner.clock()
        self.deadline = self.started + max(0.0, timeout_seconds)
        self.outcomes: list[Outcome | None] = [None] * len(messages)
        self.settled = [False] * len(messages)
        self.buckets: list[tuple[LimitRule, TokenBucket] | None] = [None] * len(messages)
        self.pending: list[tuple[list[int], PendingBatch]] = []
        self.was_sent = False
        self.cancel: threading.Event | None = None  # wait()'s, read by the sending thread
        self.sender: threading.Thread | None = None
        self.groups = self._plan(max(0.0, timeout_seconds))

    def _settle(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        self.settled[index] = True

    def _plan(self, timeout_seconds: float) -> list[tuple[float, list[int]]]:
        """Book a token for every limited message; group the messages by when they may go."""
        owner, now = self.owner, self.started
        max_wait = min(RATE_LIMIT_MAX_WAIT_SECONDS, RATE_LIMIT_WAIT_SHARE * timeout_seconds)
        ready = [0.0] * len(self.messages)
        run_ready: dict[str, float] = {}
        run_deferred: dict[str, Defer] = {}
        deferred_ahead: dict[str, int] = {}
        waited: dict[str, float] = {}
        for index, message in enumerate(self.messages):
            key = message.order_key
            if key is not None and key in run_deferred:  # an earlier message of its run waits
                self._settle(index, run_deferred[key])
                continue
            found = owner.limits.match(owner.inner.limit_keys(message))
            self.buckets[index] = found
            if found is not None:
                rule, bucket = found
                wait = bucket.reserve(now, max_wait)
                if wait is None:
                    ahead = deferred_ahead.get(rule.destination, 0)
                    deferred_ahead[rule.destination] = ahead + 1
                    # Due again while the bucket still has bookings ahead of it, so it never idles.
                    delay = max(RATE_LIMIT_MIN_DEFER_SECONDS, bucket.wait_for(now, ahead) - max_wait / 2)
                    outcome = Defer(
                        delay,
                        f"rate limit of {rule.destination} ({rule.rate_per_second:g}/s, burst {rule.burst}): "
                        "no token within the batch",
                    )
                    self._settle(index, outcome)
                    if key is not None:
                        run_deferred[key] = outcome
                    continue
                ready[index] = wait
                waited[rule.destination] = waited.get(rule.destination, 0.0) + wait
            if key is not None:
                run_ready[key] = max(run_ready.get(key, 0.0), ready[index])
        for destination, seconds in waited.items():
            if seconds > 0:
                owner.observer.rate_limit_waited(destination, seconds)
        # An ordered run goes in one piece, when its last booked token falls due, so the
        # wrapped publisher keeps its order and stops it at a failure.
        order = []
        for index, message in enumerate(self.messages):
            if self.settled[index]:
                continue
            key = message.order_key
            order.append((run_ready[key] if key is not None else ready[index], index))
        order.sort()
        groups: list[tuple[float, list[int]]] = []
        for due, index in order:
            if groups and due - groups[-1][0] <= RATE_LIMIT_GROUP_SECONDS and groups[-1][1]:
                groups[-1] = (due, [*groups[-1][1], index])  # the group goes when its last member may
            else:
                groups.append((due, [index]))
        return groups

    def start_sending(self) -> None:
        """Pipelining: submit the groups due now, start a thread for the later ones."""
        self.was_sent = True
        now_due = [g for g in self.groups if g[0] <= 0.0]
        later = self.groups[len(now_due) :]
        self._send(now_due)
        if later:
            self.sender = threading.Thread(target=self._send, args=(later,), name="rate-limit-pacing", daemon=True)
            self.sender.start()

    def _send(self, groups: Sequence[tuple[float, list[int]]]) -> None:
        """Hand each group to the wrapped publisher at its time (pipelining: ``submit``;
        otherwise ``publish_batch``, whose outcomes arrive here)."""
        owner, inner = self.owner, self.owner.inner
        for due_offset, indexes in groups:
            due = self.started + due_offset
            stopped: str | None = None
            while True:
                now = owner.clock()
                cancel = self.cancel
                if owner.aborting.is_set():
                    stopped = "shutting down before its rate limit token fell due"
                elif cancel is not None and cancel.is_set():
                    stopped = "lease lost while waiting for a rate limit token"
                elif now >= self.deadline - 0.01:
                    stopped = "not sent before the batch deadline"
                if stopped or now >= due:
                    break
                owner.aborting.wait(min(due - now, 0.1))
            if stopped:
                for index in indexes:
                    self._settle(index, NotDelivered(stopped))
                continue
            indexes = self._hold_paused(indexes, now)
            if not indexes:
                continue
            chunk = [self.messages[i] for i in indexes]
            remaining = max(0.0, self.deadline - owner.clock())
            if inner.pipelines:
                self.pending.append((indexes, inner.submit(chunk, timeout_seconds=remaining)))
            else:
                self._take(indexes, inner.publish_batch(chunk, timeout_seconds=remaining, cancel=cancel))

    def _hold_paused(self, indexes: list[int], now: float) -> list[int]:
        """Defer the messages whose destination asked, since their tokens were booked,
        to be left alone (a 429 with Retry-After), with the rest of their ordered runs;
        return the others."""
        kept: list[int] = []
        held_runs: dict[str, Defer] = {}
        for index in indexes:
            key = self.messages[index].order_key
            found = self.buckets[index]
            paused = found[1].paused_for(now) if found is not None else 0.0
            if key is not None and key in held_runs:
                self._settle(index, held_runs[key])
            elif found is not None and paused > 0:
                outcome = Defer(paused, f"{found[0].destination} asked to wait (Retry-After)")
                self._settle(index, outcome)
                if key is not None:
                    held_runs[key] = outcome
            else:
                kept.append(index)
        return kept

    def _take(self, indexes: list[int], outcomes: Sequence[Outcome]) -> None:
        now = self.owner.clock()
        for index, outcome in zip(indexes, outcomes, strict=True):
            self._settle(index, outcome)
            found = self.buckets[index]
            if (
                found is not None
                and isinstance(outcome, RetryableError)
                and outcome.throttled
                and outcome.retry_after_seconds is not None
            ):
                found[1].back_off(now, outcome.retry_after_seconds)

    def wait(self, cancel: threading.Event | None = None) -> list[Outcome]:
        self.cancel = cancel
        if not self.was_sent:  # not pipelining: everything is sent from here
            self.was_sent = True
            self._send(self.groups)
        if self.sender is not None:
            self.sender.join()  # bounded: it gives up at the batch deadline, an abort or the cancel
        for indexes, pending in self.pending:
            self._take(indexes, pending.wait(cancel=cancel))
        self.pending = []
        return [outcome if self.settled[i] else NotDelivered("no outcome") for i, outcome in enumerate(self.outcomes)]


def rate_limits_from_settings(settings: Settings, *, now: float) -> RateLimits:
    rules = [
        LimitRule(
            "topic" if limit.topic is not None else "host",
            limit.topic if limit.topic is not None else (limit.host or ""),
            limit.rate_per_second,
            limit.burst,
        )
        for limit in settings.limits
    ]
    return RateLimits(rules, now=now)


def with_rate_limits(publisher: Publisher, limits: RateLimits) -> Publisher:
    """``publisher`` behind ``limits``; the wrapper carries the wrapped publisher's class
    attributes (``name``, ``can_probe``, ``pipelines``, ...), so the relay treats it alike."""
    inner_class = type(publisher)
    wrapper_class = type(
        f"RateLimited{inner_class.__name__}",
        (RateLimitedPublisher,),
        {
            "name": inner_class.name,
            "can_probe": inner_class.can_probe,
            "must_answer_at_start": inner_class.must_answer_at_start,
            "pipelines": inner_class.pipelines,
        },
    )
    wrapped: Publisher = wrapper_class(publisher, limits)
    return wrapped


def load_publisher(settings: Settings) -> Publisher:
    """``relay.publisher`` -> a started-not-yet ``Publisher``, behind the ``[[limits]]``
    token buckets when any are configured (``RateLimitedPublisher``)."""
    publisher = _load_publisher(settings)
    if settings.limits:
        return with_rate_limits(publisher, rate_limits_from_settings(settings, now=time.monotonic()))
    return publisher


def _load_publisher(settings: Settings) -> Publisher:
    """``relay.publisher`` -> a started-not-yet ``Publisher``.

    Accepted: a built-in name (``kafka``, ``http``), the name of an entry point in the
    group ``outbox_relay.publishers`` (a plug-in installed as a package), or
    ``package.module:factory``. A factory is called with the ``Settings`` and returns
    a ``Publisher`` (or, for plug-ins written before the base class existed, an object
    with ``publish_batch(messages, *, timeout_seconds)`` or ``publish(message)``).
    Anything else raises ``PublisherLoadError`` (a start-up error, exit 2)."""
    setting = settings.relay.publisher
    found = _find_factory(setting)
    if isinstance(found, Publisher):
        return found
    if callable(found):
        try:
            obj = found(settings)
        except ConfigError:  # a setting the publisher refused: already one readable line
            raise
        except Exception as exc:
            raise PublisherLoadError(
                f"relay.publisher {setting!r}: the factory failed: {type(exc).__name__}: {exc}"
            ) from None
    else:
        obj = found
    if isinstance(obj, Publisher):
        return obj
    if isinstance(obj, _BatchShaped):
        return _BatchAdapter(obj)
    if isinstance(obj, _PublishShaped):
        return _SequentialAdapter(obj)
    raise PublisherLoadError(
        f"relay.publisher {setting!r} returned {type(obj).__name__}, which has neither publish_batch() nor publish()"
    )
