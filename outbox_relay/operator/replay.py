"""Replay delivered rows: send them again, to their own topic or to another one, audited.

Shared by the CLI (``outbox-relay replay``) and the console (``POST /api/replay`` and
its preview -> confirm pages): the rules of a request (``check_replay``), the preview
of a dry run (``preview_replay``) and the replay itself (``replay_delivered``).

The design, and the rules it protects:

- A replay publishes directly, from the process that asks (the CLI or the console),
  with the configured publisher (``relay.publisher``, built by ``load_publisher`` as
  the relay builds it) and the configured message format. It never changes an outbox
  row: flipping delivered rows back to ``pending`` would rewrite delivered history
  (``done_at``, ``attempts``), make the rows wait behind the live backlog, and put
  them back into the claim, where an ordered aggregate's new rows would wait behind
  its old ones. Live delivery is not paused or disturbed.
- A replayed message is the relay's message for that row (same key, value and
  headers, the same ``message_id``, so consumers that deduplicate recognise it) plus
  one header, ``replayed``, whose value is the replay's audit id. ``to_topic`` sends
  every message to that topic instead of the row's own (e.g. a new consumer's).
- Each aggregate's rows of an ordered event type (``relay.ordered_event_types``) are
  sent in id order: the rows are read in id order, chunk by chunk, a chunk is only
  sent once the previous one is acknowledged, and a failed row stops the rest of its
  aggregate (as in live delivery). Replayed messages and live ones are independent:
  a consumer of the row's own topic sees replayed events interleaved with live ones,
  told apart by the ``replayed`` header.
- Rows an operator skipped were never published: they are never replayed. With
  ``relay.on_done = delete`` delivered rows are gone, and nothing can be replayed.
- Every replay that sends anything is an audit entry (action ``replay``): the filter,
  the target topic, how many rows matched, how many messages were acknowledged (kept
  exact chunk by chunk) and, at the end, how many could not be sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..core.filters import DeadFilter
from ..core.formats import REPLAYED_HEADER, WireFormat
from ..core.ordering import OrderingRule
from ..db.store import Count, OutboxStore
from ..errors import BrokerUnavailable, ConfigError
from ..model import Claimed, Defer, Message, Outcome, PermanentError, RetryableError
from ..publishers.base import MessageFormatError, Publisher, build_message, load_publisher
from .operations import MAX_REASON_CHARS, OperatorRuleError, selector_description

DEFAULT_CHUNK_ROWS = 1000  # rows read, sent and acknowledged together
WALK_WINDOW_ROWS = 10_000  # rows of the table one read of the walk looks at, at most
SEND_ROUNDS = 3  # a chunk's retryable failures are sent again up to this many times in all
MAX_RETRY_PAUSE_SECONDS = 5.0
SAMPLE_ROWS = 10  # rows a dry run shows
FAILURES_KEPT = 20  # failed rows a result names (all are counted)
MAX_TOPIC_CHARS = 249  # Apache Kafka's longest topic name
# A console request waits for its replay to finish: bigger replays belong to the CLI.
CONSOLE_MAX_REPLAY_ROWS = 100_000


@dataclass(frozen=True, slots=True)
class ReplayWording:
    """How a surface names the inputs of a replay, for the rules' error messages."""

    ids: str
    filters: str
    reason: str
    to_topic: str


CLI_REPLAY_WORDING = ReplayWording(
    ids="row ids",
    filters="filters (--event-type, --aggregate-type, --aggregate-id, --since, --until)",
    reason="--reason",
    to_topic="--to-topic",
)
API_REPLAY_WORDING = ReplayWording(
    ids='"ids": [...]', filters='"filter": {...}', reason='"reason"', to_topic='"to_topic"'
)


def check_to_topic(to_topic: str | None, wording: ReplayWording) -> str | None:
    """The target topic as given (None: each row's own), or ``OperatorRuleError``."""
    if to_topic is None:
        return None
    if not to_topic.strip():
        raise OperatorRuleError(f"{wording.to_topic} is empty: leave it out to send each row to its own topic")
    if len(to_topic) > MAX_TOPIC_CHARS:
        raise OperatorRuleError(f"{wording.to_topic} must be at most {MAX_TOPIC_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in to_topic):
        raise OperatorRuleError(f"{wording.to_topic} must not contain spaces or control characters")
    return to_topic


def check_replay(
    *, ids: bool, filtered: bool, reason: str | None, dry_run: bool, to_topic: str | None, wording: ReplayWording
) -> tuple[str | None, str | None]:
    """The rules of every replay, whichever surface asks:

    - exactly one selection: row ids or a filter (never both; never none: sending
      every delivered event again is not what an empty request may mean);
    - a replay that sends needs a reason (recorded in the audit trail); a dry run needs none;
    - a reason is at most ``MAX_REASON_CHARS`` characters; a target topic a plausible name.

    Returns (reason as recorded, target topic), or raises ``OperatorRuleError``."""
    if ids == filtered:
        raise OperatorRuleError(f"give exactly one of {wording.ids} or {wording.filters}")
    cleaned = reason.strip() if reason else None
    if cleaned and len(cleaned) > MAX_REASON_CHARS:
        raise OperatorRuleError(f"{wording.reason} must be at most {MAX_REASON_CHARS} characters")
    if not dry_run and not cleaned:
        raise OperatorRuleError(
            f"say why these events are replayed ({wording.reason}): the reason is recorded in the audit trail"
        )
    return cleaned or None, check_to_topic(to_topic, wording)


def delete_mode_refusal(table: str) -> str:
    return f"table {table} deletes delivered rows (relay.on_done = delete): they are gone, so nothing can be replayed"


@dataclass(slots=True)
class ReplayPreview:
    """What a replay would send, before sending anything."""

    matched: Count
    sample: list[dict[str, Any]] | None  # None: finding the first rows ran out of time
    to_topic: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched.n,
            "matched_exact": self.matched.exact,
            "to_topic": self.to_topic,
            "sample": self.sample,
        }


def preview_replay(store: OutboxStore, selector: DeadFilter, *, to_topic: str | None, budget_ms: int) -> ReplayPreview:
    matched = store.replay_count(selector, budget_ms=budget_ms)
    sample = store.replay_sample(selector, limit=SAMPLE_ROWS, timeout_ms=budget_ms) if matched.n else []
    return ReplayPreview(matched=matched, sample=sample, to_topic=to_topic)


@dataclass(slots=True)
class ReplayResult:
    matched: Count
    audit_id: int
    to_topic: str | None
    sent: int = 0
    failed: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)  # (row id, why), the first few

    def as_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched.n,
            "matched_exact": self.matched.exact,
            "to_topic": self.to_topic,
            "sent": self.sent,
            "failed": self.failed,
            "failures": [{"id": i, "error": why} for i, why in self.failures],
            "audit_id": self.audit_id,
            "dry_run": False,
        }


def replay_message(
    row: Claimed, wire: WireFormat, ordering: OrderingRule, *, replay_id: int, to_topic: str | None
) -> Message:
    """The relay's message for ``row`` (``build_message``), marked as replay ``replay_id``
    and sent to ``to_topic`` when given. Built here rather than in ``build_message``, so
    live delivery's per-message path carries no replay parameter at all. A row header
    named ``replayed`` gives way to the replay's own. A tombstone stays a tombstone; a
    row's own partition is kept on its own topic and left to the partitioner on
    ``to_topic`` (another topic need not have that partition)."""
    message = build_message(row, wire, ordering)
    if to_topic is not None:
        message.topic = to_topic
        message.partition = None
    message.headers = [(name, value) for name, value in message.headers if name != REPLAYED_HEADER]
    message.headers.append((REPLAYED_HEADER, str(replay_id)))
    return message


def open_publisher(settings: Settings, *, probe_seconds: float = 5.0) -> Publisher:
    """The configured publisher, started; ``BrokerUnavailable`` (nothing sent, no audit
    entry) when a target that must answer at start (Kafka) does not."""
    publisher = load_publisher(settings)
    try:
        publisher.start()
    except Exception as exc:  # e.g. KafkaException: an unknown property (as the relay reports it)
        raise ConfigError(f"cannot create the publisher: {exc}") from None
    if publisher.must_answer_at_start and not publisher.probe(timeout_seconds=probe_seconds):
        why = publisher.probe_problem() or "no answer"
        publisher.close()
        raise BrokerUnavailable(f"cannot reach {publisher.describe_target()}: {why}; nothing was sent")
    return publisher


def replay_delivered(
    store: OutboxStore,
    publisher: Publisher,
    settings: Settings,
    selector: DeadFilter,
    *,
    to_topic: str | None,
    actor: str,
    source: str,
    reason: str | None,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    budget_ms: int = 10_000,
    matched: Count | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Send the delivered rows ``selector`` matches again, chunk by chunk, audited.

    ``publisher`` is started (``open_publisher``); the caller closes it. ``progress(n)``
    is called after each chunk with the rows it settled (sent or failed)."""
    store.require_replay_audit()
    if matched is None:
        matched = store.replay_count(selector, budget_ms=budget_ms)
    upto_id = store.replay_upto_id()
    description = selector_description(selector) | {"to_topic": to_topic}
    audit_id = store.audit_begin(
        actor=actor,
        source=source,
        action="replay",
        selector=description,
        rows_matched=matched.n if matched.exact else None,
        reason=reason,
    )
    result = ReplayResult(matched=matched, audit_id=audit_id, to_topic=to_topic)
    wire = WireFormat.from_settings(settings)
    ordering = OrderingRule.of(settings.relay.ordered_event_types)
    timeout_seconds = publisher.publish_timeout_seconds(settings.relay.lease_seconds)
    stopped_keys: set[str] = set()  # ordered aggregates with a row that failed: the rest is not sent
    after_id = 0 if selector.ids is None else min(selector.ids) - 1
    if selector.ids is not None:
        upto_id = min(upto_id, max(selector.ids))
    try:
        while True:
            size = chunk_size
            if selector.limit is not None:
                size = min(size, selector.limit - result.sent - result.failed)
                if size <= 0:
                    break
            step = store.replay_step(
                selector, after_id=after_id, upto_id=upto_id, chunk=size, window=max(size, WALK_WINDOW_ROWS)
            )
            if step.rows:
                sent = _send_chunk(
                    publisher, step.rows, wire, ordering, result, stopped_keys, audit_id, to_topic, timeout_seconds
                )
                if sent:
                    store.audit_add_changed(audit_id, sent)
                if progress is not None:
                    progress(len(step.rows))
            if step.finished:
                break
            after_id = step.after_id
    finally:
        store.audit_finish_replay(audit_id, failed=result.failed)
    return result


def _send_chunk(
    publisher: Publisher,
    rows: list[Claimed],
    wire: WireFormat,
    ordering: OrderingRule,
    result: ReplayResult,
    stopped_keys: set[str],
    audit_id: int,
    to_topic: str | None,
    timeout_seconds: float,
) -> int:
    """Send one chunk (rows in id order) until every message is acknowledged or has
    failed for good; count both in ``result``; return how many were acknowledged."""

    def fail(row_id: int, why: str, order_key: str | None) -> None:
        result.failed += 1
        if len(result.failures) < FAILURES_KEPT:
            result.failures.append((row_id, why))
        if order_key is not None:
            stopped_keys.add(order_key)

    pending: list[Message] = []
    for row in rows:
        key = ordering.order_key(row.event_type, row.aggregate_id)
        if key is not None and key in stopped_keys:
            fail(row.id, "not sent: an earlier row of its ordered aggregate failed", key)
            continue
        try:
            pending.append(replay_message(row, wire, ordering, replay_id=audit_id, to_topic=to_topic))
        except MessageFormatError as exc:
            fail(row.id, exc.reason, key)
    acknowledged = 0
    for round_number in range(1, SEND_ROUNDS + 1):
        if not pending:
            break
        outcomes = publisher.publish_batch(pending, timeout_seconds=timeout_seconds)
        again: list[Message] = []
        pause = 0.0
        for message, outcome in zip(pending, outcomes, strict=True):
            if outcome is None:
                acknowledged += 1
            elif message.order_key is not None and message.order_key in stopped_keys:
                fail(message.id, "not sent: an earlier row of its ordered aggregate failed", message.order_key)
            elif _worth_again(outcome) and round_number < SEND_ROUNDS:
                again.append(message)
                pause = max(pause, _pause_of(outcome))
            else:
                fail(message.id, getattr(outcome, "reason", str(outcome)), message.order_key)
        pending = again
        if pending:
            time.sleep(min(MAX_RETRY_PAUSE_SECONDS, max(0.5, pause)))
    result.sent += acknowledged
    return acknowledged


def _worth_again(outcome: Outcome) -> bool:
    return isinstance(outcome, (RetryableError, Defer)) and not isinstance(outcome, PermanentError)


def _pause_of(outcome: Outcome) -> float:
    if isinstance(outcome, Defer):
        return outcome.delay
    if isinstance(outcome, RetryableError) and outcome.retry_after_seconds:
        return outcome.retry_after_seconds
    return 0.0
