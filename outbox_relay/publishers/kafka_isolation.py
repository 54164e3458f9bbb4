"""Isolation of a rejected record batch: judge each of its messages on its own.

A Kafka broker validates a produce request's record batch (all messages of one
partition sent together) as a whole. When a broker that checks records (Confluent
Server's broker-side schema validation, Redpanda's schema ID validation, tansu with
``--schema-registry``, a topic's ``max.message.bytes``) finds one bad record, it
rejects the whole batch, and librdkafka reports that error for every message in it.
Trusting it would send every good neighbour of one bad row to ``dead``.

So when delivery reports fail with a code that one record can cause
(:data:`BATCH_REJECTION_CODES`), or with librdkafka's ``_INVALID_DIFFERENT_RECORD``
(KIP-467: "a neighbour was the invalid one"), :class:`RejectionIsolator` re-produces
those messages **one message per record batch** through a second producer and takes
the verdict of that:

- a message rejected on its own keeps the broker's reason (``PermanentError``);
- a message accepted on its own is delivered (success) in the same batch cycle;
- a message without a verdict by the batch's publish deadline is released
  (``NotDelivered``: back to pending, due now, attempt refunded).

Messages that failed because the idempotent producer's identity broke
(:data:`PRODUCER_STATE_CODES`: fenced, unknown producer id, sequence gap) or that
the relay purged from a producer it replaced (:data:`PURGED_CODES`) were not judged
at all; they take the same path. A broker without KIP-360 epoch bumps (tansu 0.6)
fences an idempotent producer after any rejected batch, the relay then replaces it
and purges what it still held: without this, every batch in flight at that moment
would burn an attempt because of one bad row. (If the broker is down instead, these
messages get no verdict by the deadline and are released, attempt refunded.)

Ordered runs (messages with an order key: the same aggregate, produced in order)
keep their rule: from the first of its messages that needs a verdict, an
aggregate's messages are re-produced one at a time, each only after the previous
one was accepted; the first one rejected on its own stops the run and the ones
after it are released. Other aggregates, and unordered messages, go in parallel.

The second producer is **not idempotent** (``enable.idempotence=false``,
``acks=all``, ``linger.ms=0``, ``batch.num.messages=1``): an idempotent producer
bumps its epoch after every rejected batch (on tansu 0.6 that fences it), and with
one message per record batch and at most one message of an ordered run in flight
there is nothing for idempotence to protect. A retry of a lost acknowledgement may
duplicate a message: delivery is at least once anyway (consumers deduplicate on
``message_id``).

Cost: nothing while no batch is rejected. A rejected batch of N messages costs N
extra produce requests (pipelined; an ordered run's messages one round trip after
another), counted in ``outbox_relay_isolated_total``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException, Producer

from ..core.ordering import RELEASED_AFTER_FAILURE
from ..model import Message, NotDelivered, Outcome, PermanentError, PublishOutcome, RetryableError

log = structlog.get_logger("outbox_relay.kafka")

E = KafkaError

#: Broker errors for a record batch that a single record of it can cause: the
#: broker rejects the whole batch, so the error says nothing certain about any one
#: message. INVALID_RECORD: a record failed broker-side validation (schema, key of a
#: compacted topic, KIP-467). MSG_SIZE_TOO_LARGE from a delivery report: the batch
#: exceeds the topic's ``max.message.bytes`` (the client's own size check raises in
#: ``produce()`` instead and is exact). RECORD_LIST_TOO_LARGE: the batch exceeds the
#: segment size. POLICY_VIOLATION: a broker-side produce policy plug-in.
#: INVALID_MSG (CORRUPT_MESSAGE): librdkafka retries it itself; should it still
#: surface, one record may be the cause.
BATCH_REJECTION_CODES: frozenset[int] = frozenset(
    {
        E.INVALID_RECORD,
        E.MSG_SIZE_TOO_LARGE,
        E.RECORD_LIST_TOO_LARGE,
        E.POLICY_VIOLATION,
        E.INVALID_MSG,
    }
)

#: librdkafka >= 2.4 (KIP-467): the broker named other records of this batch as the
#: invalid ones; this message was not judged.
INNOCENT_NEIGHBOUR_CODES: frozenset[int] = frozenset(
    {E._INVALID_DIFFERENT_RECORD} if hasattr(E, "_INVALID_DIFFERENT_RECORD") else set()
)

#: The idempotent producer's state, not the message, made the broker refuse the
#: batch (nothing was written).
PRODUCER_STATE_CODES: frozenset[int] = frozenset(
    {
        E.PRODUCER_FENCED,
        E.INVALID_PRODUCER_EPOCH,
        E.UNKNOWN_PRODUCER_ID,
        E.OUT_OF_ORDER_SEQUENCE_NUMBER,
        *([E._GAPLESS_GUARANTEE] if hasattr(E, "_GAPLESS_GUARANTEE") else []),
    }
)

#: The relay purged the message from a producer it replaced (after a fenced or
#: otherwise broken producer, or one that timed out): the broker never judged it.
#: (A purge at shutdown never gets here: nothing is isolated once ``abort`` is set.)
PURGED_CODES: frozenset[int] = frozenset({E._PURGE_QUEUE, E._PURGE_INFLIGHT})

#: A message that failed with one of these gets judged on its own.
ISOLATE_CODES: frozenset[int] = BATCH_REJECTION_CODES | INNOCENT_NEIGHBOUR_CODES | PRODUCER_STATE_CODES | PURGED_CODES

# Overrides of the main producer's configuration for the isolation producer.
_ISOLATION_OVERRIDES: dict[str, Any] = {
    "enable.idempotence": False,
    "acks": "all",
    "linger.ms": 0,
    "batch.num.messages": 1,
    "max.in.flight.requests.per.connection": 5,
}
# Settings of the main producer that make no sense for a non-idempotent one.
_ISOLATION_DROPPED = ("transactional.id", "enable.gapless.guarantee", "error_cb")

_POLL_SLICE_SECONDS = 0.02


def needs_verdict(outcome: Outcome, error: KafkaError | None) -> bool:
    return outcome is not None and error is not None and error.code() in ISOLATE_CODES


@dataclass(slots=True)
class IsolationPlan:
    """What to re-produce alone: independent messages (all at once) and ordered
    runs (each one message at a time, in order). Indexes into the batch."""

    singles: list[int] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.singles) + sum(len(run) for run in self.runs)


def plan_isolation(
    messages: Sequence[Message], outcomes: Sequence[Outcome], errors: Sequence[KafkaError | None]
) -> IsolationPlan:
    """Pure: which messages of a batch get judged on their own.

    An unordered message needs a verdict when its delivery failed with one of
    :data:`ISOLATE_CODES`. For an ordered run, only its first failure counts: if
    that one needs a verdict, it and every later message of the run in this batch
    (delivered or not: they must land after it) form the run to re-produce in
    order; if it does not, the run stays stopped there (the worker releases the
    rest) and nothing of it is re-produced."""
    plan = IsolationPlan()
    first_failure: dict[str, bool] = {}  # order key -> its first failure needs a verdict
    runs: dict[str, list[int]] = {}
    for index, message in enumerate(messages):
        key = message.order_key
        if key is None:
            if needs_verdict(outcomes[index], errors[index]):
                plan.singles.append(index)
            continue
        if key in first_failure:
            if first_failure[key]:
                runs[key].append(index)
            continue
        if outcomes[index] is None:
            continue  # delivered, and no earlier failure in its run
        first_failure[key] = needs_verdict(outcomes[index], errors[index])
        if first_failure[key]:
            runs[key] = [index]
    plan.runs = list(runs.values())
    return plan


class _Verdict:
    """The isolation producer's delivery report for one message."""

    __slots__ = ("delivery_log", "done", "error", "message_id")

    def __init__(self, message_id: int = 0, delivery_log: Any = None) -> None:
        self.done = False
        self.error: KafkaError | None = None
        self.message_id = message_id
        self.delivery_log = delivery_log  # kafka_publisher.DeliveryLog (diagnostics) or None

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if self.delivery_log is not None:
            self.delivery_log.record("isolation", self.message_id, err, msg)
        self.error = err
        self.done = True


class RejectionIsolator:
    """Re-produces the messages of rejected record batches one per record batch.

    Narrow interface for :class:`~outbox_relay.publishers.kafka.KafkaPublisher`:
    ``resolve(messages, outcomes, errors, ...)`` returns the outcomes to report;
    ``close()``. Safe to call from several worker threads at once (one shared
    producer, created on first need; each caller polls until its own reports are in).
    """

    def __init__(
        self,
        producer_config: dict[str, Any],
        *,
        classify: Callable[[KafkaError], Outcome],
        on_isolated: Callable[[int], None] | None = None,
    ) -> None:
        config = {k: v for k, v in producer_config.items() if k not in _ISOLATION_DROPPED}
        config.update(_ISOLATION_OVERRIDES)
        self._config = config
        self._classify = classify
        self.on_isolated = on_isolated  # called with the number of messages re-produced alone
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self.isolated_total = 0
        self.delivery_log: Any = None  # kafka_publisher.DeliveryLog when OUTBOX_RELAY_DELIVERY_LOG is set
        # The record value of a message when it is not message.value (kafka.value_format
        # "avro" / "json-schema": encoded against the Schema Registry), or its outcome.
        self.encode_value: Callable[[Message], bytes | Outcome | None] | None = None

    # --- lifecycle -------------------------------------------------------------------
    def _get_producer(self) -> Producer:
        with self._lock:
            if self._producer is None:
                conf = dict(self._config)
                conf["error_cb"] = self._on_error
                self._producer = Producer(conf)
            return self._producer

    @staticmethod
    def _on_error(err: KafkaError) -> None:
        if err.code() not in (E._TRANSPORT, E._ALL_BROKERS_DOWN):
            log.warning("kafka isolation producer error", error=err.str(), code=err.name())

    def close(self, timeout_seconds: float = 5.0, *, discard_queued: bool = False) -> None:
        """Flush (bounded) and drop the producer. ``discard_queued``: purge what has
        not been sent yet (its rows were released at shutdown)."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is None:
            return
        if discard_queued:
            try:
                producer.purge(in_queue=True, in_flight=False, blocking=False)
            except KafkaException:
                pass
        producer.flush(timeout_seconds)

    # --- the verdicts ----------------------------------------------------------------
    def resolve(
        self,
        messages: Sequence[Message],
        outcomes: Sequence[Outcome],
        errors: Sequence[KafkaError | None],
        *,
        deadline: float,
        cancel: threading.Event | None = None,
        abort: threading.Event | None = None,
    ) -> list[Outcome]:
        """Outcomes of a batch after judging its rejected messages alone.

        ``outcomes``/``errors``: per message, the outcome of the batch produce and
        the delivery report's error (None when it had none). ``deadline``:
        ``time.monotonic()`` by which an answer is due; ``cancel`` (the batch's
        leases are lost) and ``abort`` (shutdown) cut the wait short."""
        result = list(outcomes)
        plan = plan_isolation(messages, outcomes, errors)
        if not plan.size:
            return result
        first_errors = (errors[i] for i in plan.singles + [run[0] for run in plan.runs])
        rejected = sorted({error.name() for error in first_errors if error is not None})
        log.warning(
            "kafka record batch refused; producing its messages one by one to find the bad ones",
            messages=plan.size,
            ordered_runs=len(plan.runs),
            errors=rejected,
        )
        produced = self._run(messages, plan, result, deadline=deadline, cancel=cancel, abort=abort)
        # A message whose producer broke (or was purged) and that gets no verdict in
        # time keeps its original outcome: releasing it with the attempt refunded could
        # repeat forever (e.g. a topic that never resolves); only a batch refusal, which
        # may be a neighbour's fault, earns the refund.
        for index, error in enumerate(errors):
            if (
                error is not None
                and error.code() in PRODUCER_STATE_CODES | PURGED_CODES
                and isinstance(result[index], NotDelivered)
                and result[index] is not outcomes[index]
                and str(result[index]).startswith("released: no verdict")
            ):
                result[index] = outcomes[index]
        if produced:
            self.isolated_total += produced
            if self.on_isolated is not None:
                self.on_isolated(produced)
        dead = sum(
            1 for i in plan.singles + [i for run in plan.runs for i in run] if isinstance(result[i], PermanentError)
        )
        delivered = sum(1 for i in plan.singles + [i for run in plan.runs for i in run] if result[i] is None)
        log.warning(
            "kafka isolation finished",
            produced_alone=produced,
            rejected_alone=dead,
            delivered=delivered,
            unresolved=plan.size - dead - delivered,
        )
        return result

    def _produce(self, producer: Producer, message: Message, verdict: _Verdict, deadline: float) -> Outcome | None:
        """Produce one message; an outcome if ``produce()`` itself refused it (or the
        local queue stayed full until the deadline)."""
        headers: list[tuple[str, str | bytes | None]] = list(message.headers)
        value: str | bytes | None = message.value
        if self.encode_value is not None:
            encoded = self.encode_value(message)
            if isinstance(encoded, PublishOutcome):
                return encoded
            value = encoded
        while True:
            try:
                producer.produce(
                    message.topic,
                    value=value,
                    key=message.key,
                    headers=headers,
                    on_delivery=verdict.on_delivery,
                    timestamp=message.timestamp_ms or 0,  # the same record as first produced
                    partition=-1 if message.partition is None else message.partition,  # -1: the partitioner decides
                )
                return None
            except BufferError:
                if time.monotonic() >= deadline:
                    return NotDelivered("released: the local producer queue stayed full until the publish deadline")
                producer.poll(_POLL_SLICE_SECONDS)  # local queue full: serve reports, then retry
            except KafkaException as exc:
                return self._alone(exc.args[0])
            except (TypeError, ValueError) as exc:
                return PermanentError(f"kafka: cannot produce: {exc}")

    def _alone(self, err: KafkaError) -> Outcome:
        """The outcome of a message that failed on its own."""
        if err.code() in BATCH_REJECTION_CODES:
            return PermanentError(f"kafka: {err.name()}: {err.str()} (rejected when produced alone)")
        return self._classify(err)

    def _run(
        self,
        messages: Sequence[Message],
        plan: IsolationPlan,
        result: list[Outcome],
        *,
        deadline: float,
        cancel: threading.Event | None,
        abort: threading.Event | None,
    ) -> int:
        producer = self._get_producer()
        produced = 0
        pending: dict[int, _Verdict] = {}  # batch index -> verdict, produced and unanswered

        def start(index: int) -> bool:
            """Produce ``messages[index]``; False if produce() refused it (outcome set)."""
            nonlocal produced
            verdict = _Verdict(messages[index].id, self.delivery_log)
            refused = self._produce(producer, messages[index], verdict, deadline)
            if refused is not None:
                result[index] = refused
                return False
            pending[index] = verdict
            produced += 1
            return True

        for index in plan.singles:
            start(index)
        # Each ordered run: the position of its message in flight.
        runs = [run for run in plan.runs if run]
        position = [0] * len(runs)
        live = []
        for r, run in enumerate(runs):
            if self._advance(run, position, r, start, result):
                live.append(r)

        while pending:
            if abort is not None and abort.is_set():
                self._give_up(
                    result, pending, runs, position, live, lambda: NotDelivered("no delivery report before shutdown")
                )
                break
            if cancel is not None and cancel.is_set():
                self._give_up(
                    result,
                    pending,
                    runs,
                    position,
                    live,
                    lambda: RetryableError("lease lost while waiting for delivery"),
                )
                break
            if time.monotonic() >= deadline:
                self._give_up(
                    result,
                    pending,
                    runs,
                    position,
                    live,
                    lambda: NotDelivered(
                        "released: no verdict on the message alone before the "
                        "publish deadline (its record batch was refused)"
                    ),
                )
                break
            producer.poll(_POLL_SLICE_SECONDS)
            for index in [i for i, v in pending.items() if v.done]:
                verdict = pending.pop(index)
                result[index] = None if verdict.error is None else self._alone(verdict.error)
            # Ordered runs: next message once the current one is accepted.
            still_live = []
            for r in live:
                run = runs[r]
                current = run[position[r]]
                if current in pending:
                    still_live.append(r)
                    continue
                if result[current] is not None:
                    self._release_rest(run, position[r] + 1, result)
                    continue
                position[r] += 1
                if self._advance(run, position, r, start, result):
                    still_live.append(r)
            live = still_live
        return produced

    @staticmethod
    def _advance(
        run: list[int], position: list[int], r: int, start: Callable[[int], bool], result: list[Outcome]
    ) -> bool:
        """Start the run's message at ``position[r]``; False when the run is over."""
        if position[r] >= len(run):
            return False
        if start(run[position[r]]):
            return True
        RejectionIsolator._release_rest(run, position[r] + 1, result)
        return False

    @staticmethod
    def _release_rest(run: list[int], start_at: int, result: list[Outcome]) -> None:
        for index in run[start_at:]:
            result[index] = NotDelivered(RELEASED_AFTER_FAILURE)

    @staticmethod
    def _give_up(
        result: list[Outcome],
        pending: dict[int, _Verdict],
        runs: list[list[int]],
        position: list[int],
        live: list[int],
        outcome: Callable[[], Outcome],
    ) -> None:
        for index in pending:
            result[index] = outcome()
        for r in live:
            run = runs[r]
            for index in run[position[r] :]:
                if index not in pending:
                    result[index] = NotDelivered("released: an earlier row of this aggregate has no verdict yet")
        pending.clear()
