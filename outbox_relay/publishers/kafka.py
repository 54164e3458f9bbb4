"""KafkaPublisher: one shared idempotent producer for all workers of a process.

- ``acks=all`` and ``enable.idempotence=true``: the broker de-duplicates the
  producer's own retries and keeps per-partition order across them.
- One poll thread serves every delivery report; a worker waits only for the
  reports of its own batch, with a deadline inside the lease.
- A producer that turns fatal (or keeps reporting fenced / unknown-producer /
  sequence errors, or times out deliveries: after that some brokers never accept
  its producer id again) is purged and replaced by a fresh one. Messages it still
  held get a retryable outcome, so their rows are published again later.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import structlog
from confluent_kafka import KafkaError, KafkaException, Producer

from ..core.ordering import RELEASED_AFTER_FAILURE, RunGuard
from ..errors import BrokerRefused
from ..model import (
    Defer,
    Message,
    NotDelivered,
    Outcome,
    PermanentError,
    PublishOutcome,
    RetryableError,
    SpanAttributes,
)
from ..observability.logs import SYSLOG_TO_STDLIB, RateLimiter, librdkafka_logger
from .base import PendingBatch, Publisher
from .kafka_diagnosis import KafkaDiagnosis
from .kafka_isolation import RejectionIsolator  # one bad record must not condemn its whole record batch
from .schema_registry import RegistryValueEncoder, SchemaFileRefused, encoder_from_settings

if TYPE_CHECKING:
    from ..config import Settings

log = structlog.get_logger("outbox_relay.kafka")

E = KafkaError

# Failures of the connection as a whole: the circuit breaker counts these.
TRANSPORT_CODES = frozenset(
    {
        E._MSG_TIMED_OUT,
        E._TRANSPORT,
        E._ALL_BROKERS_DOWN,
        E._TIMED_OUT,
        E.REQUEST_TIMED_OUT,
        E.NETWORK_EXCEPTION,
        E._PURGE_QUEUE,
        E._PURGE_INFLIGHT,
        E._RESOLVE,
        E._DESTROY,
        # Too few in-sync replicas for acks=all: a state of the cluster, the same for every
        # message to the partition (the producer retries it until its delivery timeout).
        E.NOT_ENOUGH_REPLICAS,
        E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        # Authorization and authentication fail for every message alike: usually an ACL or
        # credential mistake during a deploy. Treated as an outage (breaker, attempts
        # refunded) rather than dead-lettering the whole backlog.
        E.CLUSTER_AUTHORIZATION_FAILED,
        E.SASL_AUTHENTICATION_FAILED,
        E._AUTHENTICATION,
    }
)
# The message itself can never be accepted.
PERMANENT_CODES = frozenset(
    {
        E.MSG_SIZE_TOO_LARGE,
        E._MSG_SIZE_TOO_LARGE if hasattr(E, "_MSG_SIZE_TOO_LARGE") else E.MSG_SIZE_TOO_LARGE,
        E.INVALID_RECORD,
        E.TOPIC_EXCEPTION,
        E.RECORD_LIST_TOO_LARGE,
        E._INVALID_ARG,
        E.INVALID_REQUIRED_ACKS,
        E.POLICY_VIOLATION,
        E._BAD_MSG,
        E._KEY_SERIALIZATION,
        E._VALUE_SERIALIZATION,
    }
    | ({E.CORRUPT_MESSAGE} if hasattr(E, "CORRUPT_MESSAGE") else set())
)
# The producer's idempotence state is broken: replace the producer.
REPLACE_CODES = frozenset(
    {
        E._FATAL,
        E.PRODUCER_FENCED,
        E.UNKNOWN_PRODUCER_ID,
        E.OUT_OF_ORDER_SEQUENCE_NUMBER,
        E.INVALID_PRODUCER_EPOCH,
        E._FENCED,
        E.INVALID_PRODUCER_ID_MAPPING,
        E._MSG_TIMED_OUT,
        E._GAPLESS_GUARANTEE if hasattr(E, "_GAPLESS_GUARANTEE") else E._FATAL,
    }
)


#: produce()'s partition for "the partitioner chooses" (librdkafka's RD_KAFKA_PARTITION_UA).
UNASSIGNED = -1

UNPROVEN_ACK = (
    "kafka: acknowledged by a DUPLICATE_SEQUENCE_NUMBER answer (the broker says it already "
    "stored this batch, without an offset); not taken as proof of delivery: publishing it again"
)


def is_refusal(err: KafkaError) -> bool:
    """An error that waiting cannot fix: failed authentication, or a TLS handshake that
    failed on the certificate (not one that was merely cut off)."""
    code = err.code()
    if code in (E._AUTHENTICATION, E.SASL_AUTHENTICATION_FAILED):
        return True
    text = (err.str() or "").lower()
    return code == E._SSL and any(m in text for m in ("certificate", "verify", "unknown ca", "wrong version"))


_THREAD_PREFIX = re.compile(r"^\[thrd:[^\]]*\]: ")  # librdkafka's log lines start with their thread


def is_tls_handshake_failure(text: str) -> bool:
    """A librdkafka connection failure (a ``FAIL`` log line) during the TLS handshake:
    a listener that closed the connection on the ClientHello (``SSL handshake failed:
    Disconnected: ... connecting to a PLAINTEXT broker listener?``) or never answered it
    (``Connection setup timed out in state SSL_HANDSHAKE``)."""
    return "SSL handshake failed" in text or "in state SSL_HANDSHAKE" in text


class _ProducerLog:
    """The producer's ``logger``: librdkafka's lines go on to the structured logger when
    they are at or above ``forward_level`` (a syslog level: what ``log_level`` asked
    for), and every connection failure (facility ``FAIL``, whatever its level) tells
    the publisher whether it happened in the TLS handshake."""

    __slots__ = ("_logger", "_minimum", "_publisher")

    def __init__(self, publisher: KafkaPublisher, logger: logging.Logger, forward_level: int) -> None:
        self._publisher = publisher
        self._logger = logger
        # confluent-kafka hands over stdlib levels (ERROR for librdkafka's 3, WARNING for 4, ...).
        self._minimum = SYSLOG_TO_STDLIB.get(forward_level, logging.DEBUG)

    def log(self, level: int, msg: str, *args: Any) -> None:
        if len(args) == 3:
            if args[0] == "FAIL":
                self._publisher.connection_failed(str(args[2]))
            elif args[0] == "MSGSET":  # debug=msg only: a produce request's refusal, before its retry
                self._publisher.diagnosis.debug_line(str(args[2]))
        if level >= self._minimum:
            self._logger.log(level, msg, *args)


#: How long rows wait after the broker refused their topic to this client's principal
#: (TOPIC_AUTHORIZATION_FAILED). That is an ACL mistake an operator fixes, not a
#: property of the rows: they must not go dead, nor burn attempts while it lasts.
AUTHORIZATION_RETRY_SECONDS = 15.0
#: How long /readyz keeps naming a refused topic after its last refusal.
REFUSED_TOPIC_MEMORY_SECONDS = 3 * AUTHORIZATION_RETRY_SECONDS


#: How often librdkafka hands over its statistics (brokers' connection states, partitions'
#: leaders) for the diagnosis of /readyz; ``kafka.extra`` may set another interval.
STATISTICS_INTERVAL_MS = 5000
#: How long a lookup of a topic's min.insync.replicas may take (in its own thread).
MIN_INSYNC_LOOKUP_SECONDS = 3.0
# What an admin client for that lookup takes from the producer's configuration.
_ADMIN_KEYS = ("bootstrap.servers", "client.id", "security.protocol", "client.dns.lookup", "broker.address.family")
_ADMIN_PREFIXES = ("sasl.", "ssl.", "socket.")

#: At most this many distinct topics of one batch are looked up after delivery
#: timeouts or unknown-topic refusals (each lookup waits up to MISSING_TOPIC_LOOKUP_SECONDS).
MISSING_TOPIC_LOOKUPS = 4
MISSING_TOPIC_LOOKUP_SECONDS = 2.0
#: Failures that name no reason the topic's metadata may hold: a delivery timeout
#: (librdkafka waited for a topic the cluster does not have), or produce() refusing a
#: message at once with _UNKNOWN_TOPIC because this producer already learned the topic
#: does not exist or has an invalid name (a metadata answer that came in before the
#: message was queued: a first produce can get it too). Waiting cannot fix the second
#: case on this producer: every later produce() of the topic is refused the same way.
TOPIC_LOOKUP_CODES = frozenset({E._MSG_TIMED_OUT, E._UNKNOWN_TOPIC})


def topic_metadata_outcome(topic: str, metadata_error: KafkaError | None) -> Outcome | None:
    """The outcome of a message to ``topic`` (one that timed out, or that produce()
    refused as an unknown topic) from the error of the topic's metadata; None when the
    metadata holds nothing against the topic (the failure stays what it was).

    - ``TOPIC_EXCEPTION``: the cluster refuses the topic's name (Kafka: 1 to 249 of
      ``[a-zA-Z0-9._-]``, not ``.`` or ``..``): no wait can fix it, the row goes dead
      with the broker's reason.
    - ``UNKNOWN_TOPIC_OR_PART``: no such topic and the cluster does not create it, an
      operator has yet to: the rows wait (Defer, attempt refunded).
    """
    if metadata_error is None:
        return None
    code = metadata_error.code()
    if code == E.TOPIC_EXCEPTION:
        return PermanentError(
            f"kafka: {metadata_error.name()}: {metadata_error.str()}: the cluster refuses the topic name {topic!r}"
        )
    if code == E.UNKNOWN_TOPIC_OR_PART:
        return Defer(
            AUTHORIZATION_RETRY_SECONDS,
            f"kafka: UNKNOWN_TOPIC_OR_PART: topic {topic!r} does not exist and the cluster "
            "does not create it: the rows wait until it is created",
        )
    return None


def classify(err: KafkaError) -> Outcome:
    """Map a librdkafka error to an outcome."""
    code = err.code()
    text = f"kafka: {err.name()}: {err.str()}"
    if code == E.TOPIC_AUTHORIZATION_FAILED:
        return Defer(
            AUTHORIZATION_RETRY_SECONDS,
            f"{text} (the principal may not write to this topic: fix its ACL; the rows wait)",
        )
    if code == E._UNKNOWN_PARTITION:
        # Only a row's own ``partition`` can name one: the partitioner picks existing ones.
        return PermanentError(f"{text} (the row's partition is not one of the topic's partitions)")
    if code in PERMANENT_CODES:
        return PermanentError(text)
    # Unknown codes stay retryable: the attempt budget sends them dead eventually,
    # and losing nothing matters more than failing fast.
    return RetryableError(text, transport=code in TRANSPORT_CODES)


#: Diagnostics: a file to which every delivery report is appended (see ``DeliveryLog``).
DELIVERY_LOG_ENV = "OUTBOX_RELAY_DELIVERY_LOG"


class DeliveryLog:
    """Diagnostics, off unless ``OUTBOX_RELAY_DELIVERY_LOG`` names a file: one line per
    delivery report, ``time pid source message_id partition offset error`` (tab-separated;
    ``time`` = Unix seconds; ``source`` = ``main<generation>`` or ``isolation``;
    ``offset`` = ``None`` when the report has none; ``error`` = ``-`` for a success),
    appended with one ``write`` per line (O_APPEND), so several relays can share a file
    and a SIGKILLed relay loses no line it reported. Lets a test tell where the broker
    said it stored a message the relay then finalized as done (``bench/soak.py``)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pid = os.getpid()

    @classmethod
    def from_environment(cls) -> DeliveryLog | None:
        path = os.environ.get(DELIVERY_LOG_ENV)
        return cls(path) if path else None

    def record(self, source: str, message_id: int, err: KafkaError | None, msg: Any) -> None:
        try:
            partition, offset = (msg.partition(), msg.offset()) if msg is not None else (None, None)
        except Exception:  # a message object without them: log what there is
            partition, offset = None, None
        error = "-" if err is None else err.name()
        line = f"{time.time():.3f}\t{self._pid}\t{source}\t{message_id}\t{partition}\t{offset}\t{error}\n"
        try:
            os.write(self._fd, line.encode())
        except OSError:
            pass

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


class _BatchWaiter:
    """Collects the delivery reports of one batch (called from the poll thread)."""

    __slots__ = (
        "_created",
        "_generation",
        "_ids",
        "_latencies",
        "_lock",
        "_owner",
        "_source",
        "done",
        "errors",
        "outcomes",
        "remaining",
    )

    _UNSET: Any = object()

    def __init__(
        self, size: int, owner: KafkaPublisher, created: list[float], ids: list[int] | None = None, generation: int = 0
    ) -> None:
        self.outcomes: list[Any] = [self._UNSET] * size
        self.errors: list[KafkaError | None] = [None] * size  # delivery report errors, for isolation
        self._created = created
        self._ids = ids  # message ids, only when the delivery log is on
        self._generation = generation  # of the producer the batch was produced into
        self._source = f"main{generation}"
        self.remaining = size
        # Seconds from created_at to acknowledgement, collected here and handed to the
        # observer once per batch (take_latencies): one histogram update per batch
        # instead of one locked update per message on the poll thread.
        self._latencies: list[float] | None = []
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._owner = owner
        if size == 0:
            self.done.set()

    def settle(self, index: int, outcome: Outcome, latency_seconds: float | None = None) -> None:
        """Record the message's outcome (the first one wins); ``latency_seconds`` (an
        acknowledgement's) is kept for the batch's one histogram update."""
        with self._lock:
            if self.outcomes[index] is not self._UNSET:
                return
            self.outcomes[index] = outcome
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()
            if latency_seconds is None:
                return
            latencies = self._latencies
            if latencies is not None:
                latencies.append(latency_seconds)
                return
        # An acknowledgement after the batch's latencies were handed over (it timed out): alone.
        self._owner.observer.messages_acknowledged((latency_seconds,))

    def take_latencies(self) -> list[float]:
        """The latencies collected so far; later acknowledgements are reported one by one."""
        with self._lock:
            latencies, self._latencies = self._latencies or [], None
        return latencies

    def on_delivery(self, index: int, err: KafkaError | None, msg: Any) -> None:
        owner = self._owner
        if owner.delivery_log is not None and self._ids is not None:
            owner.delivery_log.record(self._source, self._ids[index], err, msg)
        if err is None:
            if owner.refused_topics:
                owner.topic_accepted(msg.topic())
            if owner.diagnosis.troubled and owner.diagnosis.delivered(msg.topic(), msg.partition()):
                owner.report_unwritable()
            if owner.duplicate_sequence_ack(self._generation, msg):
                self.settle(index, RetryableError(UNPROVEN_ACK))
                return
            self.settle(index, None, time.time() - self._created[index])
            return
        owner.delivery_failed(err, msg)
        if err.code() in REPLACE_CODES:
            self._owner.request_replacement(f"delivery error {err.name()}")
        elif err.code() == E.TOPIC_AUTHORIZATION_FAILED:
            owner.topic_refused(msg.topic(), err)
        self.errors[index] = err
        self.settle(index, classify(err))


class KafkaPublisher(Publisher):
    """Publisher on confluent-kafka; see the module docstring."""

    name: ClassVar[str] = "kafka"
    can_probe: ClassVar[bool] = True
    must_answer_at_start: ClassVar[bool] = True
    pipelines: ClassVar[bool] = True

    def __init__(self, config: dict[str, Any], value_encoder: RegistryValueEncoder | None = None) -> None:
        self._config = dict(config)
        # kafka.value_format = "avro" / "json-schema" / "protobuf": values encoded against the Schema
        # Registry before produce(); None (the default, "json"): values sent as they are.
        self.value_encoder = value_encoder
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self.generation = 0
        self._replace_reason: str | None = None
        self._stopping = threading.Event()
        # Set at the shutdown deadline: batches stop waiting and report NotDelivered.
        self.aborting = threading.Event()
        self._thread: threading.Thread | None = None
        self.replacements = 0
        # Acknowledgements that were DUPLICATE_SEQUENCE_NUMBER answers (see duplicate_sequence_ack).
        self._dupseq_lock = threading.Lock()
        self._dupseq_runs: dict[tuple[int, int], int] = {}  # (generation, partition) -> next offset of the run
        self.duplicate_sequence_acks = 0
        self.local_queue_full_waits = 0  # produce() calls that found the local queue full
        self._refusal: str | None = None  # the last authentication/TLS refusal (see is_refusal)
        self._tls_failure: str | None = None  # the last connection failure, if it was in the TLS handshake
        self._registry_wait: str | None = None  # why the schema files are not registered yet
        self._error_lines = RateLimiter(interval_seconds=10.0)
        self._last_probe: tuple[float, bool] = (0.0, False)
        # Topics the broker refused writes to (TOPIC_AUTHORIZATION_FAILED, or
        # UNKNOWN_TOPIC_OR_PART: not created): topic -> (monotonic time, error name).
        self.refused_topics: dict[str, tuple[float, str]] = {}
        # Why the cluster does not take messages, for /readyz and the metrics.
        self.diagnosis = KafkaDiagnosis()
        self._min_insync_lookup: threading.Thread | None = None
        self._admin: Any = None
        # Diagnostics (OUTBOX_RELAY_DELIVERY_LOG): every delivery report to a file.
        self.delivery_log = DeliveryLog.from_environment()
        # The messages of a refused record batch are judged one by one: one bad record must not condemn the rest.
        self.isolation = RejectionIsolator(
            self._config, classify=classify, on_isolated=lambda count: self.observer.messages_isolated(count)
        )
        if self.delivery_log is not None:
            self.isolation.delivery_log = self.delivery_log
        if value_encoder is not None:
            self.isolation.encode_value = value_encoder.encode

    # --- lifecycle -------------------------------------------------------------------
    def _new_producer(self) -> Producer:
        conf = dict(self._config)
        conf["error_cb"] = self._on_error
        # Brokers' connection states and partitions' leaders, for the diagnosis.
        conf["stats_cb"] = self._on_statistics
        conf.setdefault("statistics.interval.ms", STATISTICS_INTERVAL_MS)
        # librdkafka's own log lines go through the stdlib logger (served by poll()),
        # and from there through structlog: one structured, rate-limited line each.
        # A listener that never answers the TLS ClientHello (a plaintext one) is
        # reported only at warning level: librdkafka is asked for warnings too, and
        # only what log_level asked for is passed on.
        try:
            forward_level = int(conf.get("log_level", 6))  # librdkafka's default: 6
            conf["log_level"] = max(forward_level, 4)
        except ValueError:  # not a number: librdkafka refuses it with its own message
            forward_level = 7
        conf["logger"] = _ProducerLog(self, librdkafka_logger(), forward_level)
        return Producer(conf)

    def start(self) -> None:
        with self._lock:
            if self._producer is None:
                self._producer = self._new_producer()
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="kafka-poll", daemon=True)
            self._thread.start()

    def describe_target(self) -> str:
        return f"the Kafka cluster at {self._config.get('bootstrap.servers', '?')}"

    def publish_timeout_seconds(self, lease_seconds: float) -> float:
        """The producer's delivery timeout (message.timeout.ms) plus a grace period for
        the last report to arrive, still strictly inside the lease."""
        delivery = float(self._config["message.timeout.ms"]) / 1000.0
        return delivery + min(5.0, (lease_seconds - delivery) / 2)

    def max_message_bytes(self) -> int | None:
        return int(self._config["message.max.bytes"])

    def span_attributes(self, message: Message) -> SpanAttributes:
        return {"messaging.kafka.message.key": message.key}

    def abort(self) -> None:
        self.aborting.set()

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Flush what is queued (bounded), stop the poll thread. Safe to call twice."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            if self.aborting.is_set():
                # Rows of unreported messages were released to other relays; do not
                # also send what has not left this process yet.
                try:
                    producer.purge(in_queue=True, in_flight=False, blocking=False)
                except KafkaException:
                    pass
            producer.flush(timeout_seconds)
        self.isolation.close(timeout_seconds, discard_queued=self.aborting.is_set())  # its re-sends too
        self._admin = None  # the min.insync.replicas lookups' client, if one was made

    def duplicate_sequence_ack(self, generation: int, msg: Any) -> bool:
        """True if this successful delivery report came from a DUPLICATE_SEQUENCE_NUMBER
        answer, which is no proof that the broker stored the message.

        librdkafka takes that answer ("this producer's record batch with this sequence
        is already stored") as a success and numbers the batch's messages from the base
        offset of the error response, -1: the batch's first report has no offset
        (``msg.offset()`` is None or negative), the next ones 0, 1, 2, ... Apache Kafka
        answers a duplicate with the original offsets instead, so there this never
        happens; a broker that advances a producer's sequence before it stores the
        batch (tansu 0.6 on S3, killed in between) answers it for a batch it lost. The
        reports of one record batch are served one after another on the poll thread,
        so a run is tracked per producer generation and partition; a false positive
        costs a duplicate message, never a loss."""
        try:
            offset = msg.offset()
            if offset is not None and offset >= 0 and not self._dupseq_runs:
                return False  # the common case, without taking the lock: no run open
            partition = msg.partition()
        except Exception:  # no message object: nothing to judge by
            return False
        key = (generation, partition)
        if offset is None or offset < 0:
            with self._dupseq_lock:
                self._dupseq_runs[key] = 0
                self.duplicate_sequence_acks += 1
            allowed, suppressed = self._error_lines.allow("DUPLICATE_SEQUENCE_NUMBER")
            if allowed:
                log.warning(
                    "kafka acknowledgement without an offset (a DUPLICATE_SEQUENCE_NUMBER answer); "
                    "publishing the record batch's messages again",
                    partition=partition,
                    suppressed=suppressed,
                )
            return True
        with self._dupseq_lock:
            expected = self._dupseq_runs.get(key)
            if expected is None:
                return False
            if offset == expected:
                self._dupseq_runs[key] = offset + 1
                self.duplicate_sequence_acks += 1
                return True
            del self._dupseq_runs[key]
            return False

    # --- health ----------------------------------------------------------------------
    def _on_error(self, err: KafkaError) -> None:
        code = err.code()
        self.observer.producer_errors("client", err.name())
        self.diagnosis.client_error(err.name(), err.str())
        if is_refusal(err):
            # Credentials or certificates: a start-up probe reports this instead of waiting.
            self._refusal = f"{err.name()}: {err.str()}"
        if err.fatal():
            log.error("kafka producer fatal error", error=err.str(), code=err.name())
            self.request_replacement(f"fatal error {err.name()}")
        elif code not in (E._TRANSPORT, E._ALL_BROKERS_DOWN):
            allowed, suppressed = self._error_lines.allow(err.name())
            if allowed:
                log.warning("kafka producer error", error=err.str(), code=err.name(), suppressed=suppressed)

    def judge_topics(
        self, messages: Sequence[Message], outcomes: list[Outcome], errors: Sequence[KafkaError | None]
    ) -> list[Outcome]:
        """Messages that failed on their topic without a reason (``TOPIC_LOOKUP_CODES``:
        timed out waiting for it, or refused by produce() as unknown) get the one the
        topic's metadata gives (``topic_metadata_outcome``): an invalid name goes dead
        with the broker's reason; a topic the cluster does not have (its automatic
        creation is off) is one an operator has yet to create, not a fault of the rows,
        so they wait (Defer, attempt refunded) like those of a topic the ACL refuses.
        Looked up only after such a failure, a few topics per batch."""
        failed = [
            i
            for i, err in enumerate(errors)
            if err is not None and err.code() in TOPIC_LOOKUP_CODES and isinstance(outcomes[i], RetryableError)
        ]
        if not failed:
            return outcomes
        producer = self._producer
        verdicts: dict[str, Outcome] = {}
        missing: list[str] = []
        for topic in list(dict.fromkeys(messages[i].topic for i in failed))[:MISSING_TOPIC_LOOKUPS]:
            if producer is None:
                break
            try:
                meta = producer.list_topics(topic, timeout=MISSING_TOPIC_LOOKUP_SECONDS).topics.get(topic)
            except KafkaException:
                break  # the cluster does not answer: an outage, not a missing topic
            if meta is None:
                continue
            verdict = topic_metadata_outcome(topic, meta.error)
            if verdict is not None:
                verdicts[topic] = verdict
                if isinstance(verdict, Defer):
                    missing.append(topic)
            elif meta.error is None:
                self.diagnosis.metadata(topic, meta.partitions)
                if self.diagnosis.under_replicated(topic) and self.diagnosis.min_insync_wanted(topic):
                    self._read_min_insync(topic)
        self.report_unwritable()
        if not verdicts:
            return outcomes
        result = list(outcomes)
        for i in failed:
            verdict = verdicts.get(messages[i].topic)
            if verdict is not None:
                result[i] = verdict
        for topic in missing:
            self.topic_refused(topic, KafkaError(E.UNKNOWN_TOPIC_OR_PART, "topic does not exist"))
        return result

    def topic_refused(self, topic: str, err: KafkaError) -> None:
        """The broker refused writes to ``topic`` (its ACL, or it does not exist):
        remember it for /readyz, count it, and log it once per topic and 10 s."""
        first = topic not in self.refused_topics
        self.refused_topics[topic] = (time.monotonic(), err.name())
        if err.code() == E.TOPIC_AUTHORIZATION_FAILED:
            self.observer.topic_authorization_failed(topic)
        else:
            self.observer.topic_missing(topic)
        allowed, suppressed = self._error_lines.allow(f"acl:{topic}")
        if first or allowed:
            log.error(
                "kafka refuses writes to a topic: its rows wait",
                topic=topic,
                code=err.name(),
                detail=err.str(),
                retry_seconds=AUTHORIZATION_RETRY_SECONDS,
                suppressed=suppressed,
            )

    # --- why the cluster does not take messages (kafka_diagnosis.py) ----------------------
    def delivery_failed(self, err: KafkaError, msg: Any) -> None:
        """A delivery report with an error (poll thread): count it, remember its partition."""
        self.observer.producer_errors("delivery", err.name())
        try:
            topic, partition = msg.topic(), msg.partition()
        except Exception:  # a report without its message: nothing to place
            return
        if topic is not None and partition is not None:
            self.diagnosis.delivery_failed(topic, partition, err.name())

    def _on_statistics(self, stats_json: str) -> None:
        self.diagnosis.statistics(stats_json)
        self.report_unwritable()

    def report_unwritable(self) -> None:
        self.observer.unwritable_partitions(self.diagnosis.unwritable_partitions())

    def trouble(self) -> str | None:
        if self.value_encoder is not None:
            registry_problem = self.value_encoder.problem()
            if registry_problem is not None:
                return registry_problem
        return self.diagnosis.reason()

    def _read_min_insync(self, topic: str) -> None:
        """Read the topic's min.insync.replicas in a thread of its own (one at a time):
        the worker that asked has a batch to finalize within its lease."""
        with self._lock:
            running = self._min_insync_lookup
            if running is not None and running.is_alive():
                return
            self.diagnosis.min_insync(topic, None)  # asked: not again before it is due
            thread = threading.Thread(target=self._min_insync_of, args=(topic,), name="kafka-min-insync", daemon=True)
            self._min_insync_lookup = thread
        thread.start()

    def _min_insync_of(self, topic: str) -> None:
        # ConfigResource is public API, only not listed in the package's __all__.
        from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

        value: int | None = None
        try:
            if self._admin is None:
                conf = {k: v for k, v in self._config.items() if k in _ADMIN_KEYS or k.startswith(_ADMIN_PREFIXES)}
                # Its connection errors are the producer's too (reported there); a
                # lookup that fails is logged below, once.
                conf["log_level"] = 0
                self._admin = AdminClient(conf)
            futures = self._admin.describe_configs(
                [ConfigResource("topic", topic)], request_timeout=MIN_INSYNC_LOOKUP_SECONDS
            )
            for future in futures.values():
                entry = future.result(timeout=MIN_INSYNC_LOOKUP_SECONDS + 1).get("min.insync.replicas")
                if entry is not None and entry.value is not None:
                    value = int(entry.value)
        except Exception as exc:  # no answer (the controller may be gone too): unknown, said so
            log.info("could not read the topic's min.insync.replicas", topic=topic, error=str(exc))
            # The client keeps the cluster view it started with, and may keep sending the
            # request to a node that is down ("waiting for controller"): the next lookup
            # starts a fresh client, which asks the nodes that answer now.
            self._admin = None
        self.diagnosis.min_insync(topic, value)
        self.report_unwritable()

    def topic_accepted(self, topic: str) -> None:
        if self.refused_topics.pop(topic, None) is not None:
            log.info("kafka accepts writes to the topic again", topic=topic)

    def held_back(self) -> str | None:
        now = time.monotonic()
        for topic, (when, _) in list(self.refused_topics.items()):
            if now - when > REFUSED_TOPIC_MEMORY_SECONDS:
                self.refused_topics.pop(topic, None)
        if self.value_encoder is not None:
            registry_problem = self.value_encoder.problem()
            if registry_problem is not None:
                return f"{registry_problem}: the rows wait"
        if not self.refused_topics:
            return None
        topics = sorted(self.refused_topics.items())
        named = ", ".join(f"{topic} ({code})" for topic, (_, code) in topics[:5])
        if len(topics) > 5:
            named += f" and {len(topics) - 5} more"
        return f"kafka refuses writes to {named}: their rows wait"

    def connection_failed(self, text: str) -> None:
        """librdkafka's text for a failed broker connection (no credentials in it)."""
        self._tls_failure = _THREAD_PREFIX.sub("", text, count=1) if is_tls_handshake_failure(text) else None

    def probe_problem(self) -> str | None:
        failure = self._tls_failure
        if failure is None:
            return self._registry_wait
        return (
            f"the TLS handshake failed (kafka.security_protocol = {self._config.get('security.protocol')}: "
            f"is the listener plaintext?): {failure}"
        )

    def request_replacement(self, reason: str, generation: int | None = None) -> None:
        """Ask the poll thread for a fresh producer. With ``generation``, only if that
        producer is still the current one (a batch produced into an already replaced
        producer must not get the healthy new one replaced too)."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            if self._replace_reason is None:
                self._replace_reason = reason

    def probe(self, timeout_seconds: float = 2.0) -> bool:
        """True if a broker answers a metadata request now. Raises ``BrokerRefused``
        when it did not answer because it refused our credentials or certificate."""
        producer = self._producer
        if producer is None:
            return False
        try:
            producer.list_topics(timeout=timeout_seconds)
        except KafkaException:
            self._last_probe = (time.monotonic(), False)
            refusal = self._refusal
            if refusal is not None:
                raise BrokerRefused(f"{self.describe_target()} refused the connection: {refusal}") from None
            return False
        self._refusal = None
        self._tls_failure = None
        if self.value_encoder is not None and self.value_encoder.files_pending:
            # schema_registry.schema_files: registered before the first row is encoded.
            # A refusal is raised once (at start it stops the relay, exit 2); after
            # that the probe just fails, so the rows keep waiting.
            first_refusal = self.value_encoder.files_refused is None
            why_not = self.value_encoder.register_schema_files()
            if why_not is not None:
                self._registry_wait = why_not
                self._last_probe = (time.monotonic(), False)
                if self.value_encoder.files_refused is not None and first_refusal:
                    raise SchemaFileRefused(why_not)
                return False
            self._registry_wait = None
        self._last_probe = (time.monotonic(), True)
        return True

    def healthy(self, max_age_seconds: float = 5.0) -> bool:
        """Cached probe, for /readyz."""
        when, ok = self._last_probe
        if time.monotonic() - when > max_age_seconds:
            return self.probe(timeout_seconds=1.5)
        return ok

    # --- poll thread -----------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                producer = self._producer
                if producer is None:
                    time.sleep(0.05)
                    continue
                producer.poll(0.05)
                if self._replace_reason is not None:
                    self._replace()
            except Exception:  # this thread serves every delivery report: never let it die
                log.exception("kafka poll loop error; continuing")
                time.sleep(0.5)

    def check_alive(self) -> str | None:
        if self._thread is None or not self._thread.is_alive():
            return "the Kafka poll thread died"
        return None

    def _replace(self) -> None:
        new = self._new_producer()  # may raise: the reason stays set and we retry
        with self._lock:
            reason, self._replace_reason = self._replace_reason, None
            old = self._producer
            self._producer = new
            self.generation += 1
            self.replacements += 1
        log.warning("replacing kafka producer", reason=reason, generation=self.generation)
        self.observer.client_replaced(reason or "")
        if old is not None:
            # Everything the old producer still holds gets a _PURGE_* report, i.e. a
            # retryable outcome; serve those reports now, then let it go.
            try:
                old.purge(in_queue=True, in_flight=True, blocking=False)
            except KafkaException:
                pass
            deadline = time.monotonic() + 2.0
            while len(old) > 0 and time.monotonic() < deadline:
                old.poll(0.05)
            old.poll(0)

    # --- publishing ------------------------------------------------------------------
    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        """Produce the batch, wait for its reports until ``timeout_seconds``, a
        shutdown (``abort``) or ``cancel`` (the batch's leases were all lost)."""
        return self.submit(messages, timeout_seconds=timeout_seconds).wait(cancel=cancel)

    def submit(self, messages: Sequence[Message], *, timeout_seconds: float) -> KafkaPendingBatch:
        """Produce the batch and return at once; ``wait()`` collects the outcomes.
        Lets a worker claim its next batch while this one is being delivered."""
        deadline = time.monotonic() + timeout_seconds
        with self._lock:
            producer, generation = self._producer, self.generation
        waiter = _BatchWaiter(
            len(messages),
            self,
            [m.created_at_epoch for m in messages],
            [m.id for m in messages] if self.delivery_log is not None else None,
            generation,
        )
        if producer is None:
            raise RuntimeError("KafkaPublisher.start() was not called")
        runs = RunGuard()  # an ordered run stops at a row produce() refused
        on_delivery = waiter.on_delivery  # one bound method for the batch, not one per message
        encoder = self.value_encoder
        for index, message in enumerate(messages):
            if runs.stopped(message.order_key):
                waiter.settle(index, NotDelivered(RELEASED_AFTER_FAILURE))
                continue
            value: str | bytes | None = message.value
            if encoder is not None:
                encoded = encoder.encode(message)
                if isinstance(encoded, PublishOutcome):
                    waiter.settle(index, encoded)
                    runs.record(message.order_key, failed=True)
                    continue
                value = encoded
            callback = partial(on_delivery, index)
            # librdkafka copies the headers: the message's own list is passed as it is.
            wire_headers: Any = message.headers
            while True:
                try:
                    producer.produce(
                        message.topic,
                        value=value,
                        key=message.key,
                        headers=wire_headers,
                        on_delivery=callback,
                        timestamp=message.timestamp_ms or 0,  # 0: librdkafka stamps it at send time
                        partition=UNASSIGNED if message.partition is None else message.partition,
                    )
                    break
                except BufferError:
                    # The producer's local queue is full (queue.buffering.max.*): wait for
                    # the poll thread to drain it. It is not the row's fault, so a message
                    # still not queued at the deadline is released (attempt refunded),
                    # never failed; so is the rest of its ordered run.
                    self.local_queue_full_waits += 1
                    if self.aborting.is_set() or self._stopping.is_set():
                        waiter.settle(index, NotDelivered("shutting down before it could be produced"))
                        runs.record(message.order_key, failed=True)
                        break
                    if time.monotonic() > deadline:
                        waiter.settle(index, NotDelivered("kafka: local producer queue still full at the deadline"))
                        runs.record(message.order_key, failed=True)
                        break
                    time.sleep(0.005)
                except KafkaException as exc:
                    error = exc.args[0]
                    if error.code() in TOPIC_LOOKUP_CODES:
                        waiter.errors[index] = error  # judge_topics asks the topic's metadata why
                    waiter.settle(index, classify(error))
                    runs.record(message.order_key, failed=True)
                    break
                except (TypeError, ValueError) as exc:
                    waiter.settle(index, PermanentError(f"kafka: cannot produce: {exc}"))
                    runs.record(message.order_key, failed=True)
                    break
        return KafkaPendingBatch(self, waiter, len(messages), deadline, timeout_seconds, generation, messages)


class KafkaPendingBatch(PendingBatch):
    """A produced batch whose delivery reports are still arriving."""

    def __init__(
        self,
        publisher: KafkaPublisher,
        waiter: _BatchWaiter,
        size: int,
        deadline: float,
        timeout_seconds: float,
        generation: int,
        messages: Sequence[Message] = (),
    ) -> None:
        self._messages = messages
        self._generation = generation
        self._publisher = publisher
        self._waiter = waiter
        self._size = size
        self._deadline = deadline
        self._timeout = timeout_seconds

    def wait(self, cancel: threading.Event | None = None) -> list[Outcome]:
        waiter, publisher = self._waiter, self._publisher
        # Wait in slices so a shutdown (abort) or a lost lease (cancel) cuts it short.
        while not waiter.done.is_set() and not publisher.aborting.is_set():
            if cancel is not None and cancel.is_set():
                for index in range(self._size):
                    waiter.settle(index, RetryableError("lease lost while waiting for delivery"))
                break
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                break
            waiter.done.wait(min(remaining, 0.1))
        if publisher.aborting.is_set() and not waiter.done.is_set():
            for index in range(self._size):
                waiter.settle(index, NotDelivered("no delivery report before shutdown"))
        elif not waiter.done.is_set():
            # No report within the deadline: librdkafka's own message timeout should
            # have fired first, so this producer is stuck. Replace it; the purge
            # settles its messages as retryable, and so do we, right now.
            publisher.request_replacement("delivery reports overdue", generation=self._generation)
            for index in range(self._size):
                waiter.settle(
                    index, RetryableError(f"kafka: no delivery report within {self._timeout:.1f}s", transport=True)
                )
        outcomes = list(waiter.outcomes)
        latencies = waiter.take_latencies()
        if latencies:
            publisher.observer.messages_acknowledged(latencies)
        # --- a refused record batch does not condemn every message in it: re-sent one by one ---
        if self._messages and not publisher.aborting.is_set() and not (cancel is not None and cancel.is_set()):
            outcomes = publisher.isolation.resolve(
                self._messages,
                outcomes,
                waiter.errors,
                deadline=self._deadline,
                cancel=cancel,
                abort=publisher.aborting,
            )
            outcomes = publisher.judge_topics(self._messages, outcomes, waiter.errors)
        # --- end of the re-sends ---
        return outcomes


def from_settings(settings: Settings) -> KafkaPublisher:
    """The ``kafka`` built-in (``relay.publisher = "kafka"``, the default)."""
    if settings.kafka.value_format == "json":
        return KafkaPublisher(producer_config(settings))

    def log_missing(subject: str, text: str) -> None:
        log.warning(
            "schema registry: no schema registered for the subject; its rows wait",
            subject=subject,
            registry_answer=text,
        )

    return KafkaPublisher(producer_config(settings), encoder_from_settings(settings, log_missing))


def producer_config(settings: Settings) -> dict[str, Any]:
    """librdkafka properties from Settings (secrets included: never log the result)."""
    k = settings.kafka
    conf: dict[str, Any] = {
        "bootstrap.servers": k.bootstrap_servers,
        "client.id": k.client_id,
        "enable.idempotence": True,
        "acks": "all",
        "max.in.flight.requests.per.connection": 5,
        "linger.ms": k.linger_ms,
        "message.timeout.ms": int(settings.delivery_timeout_seconds * 1000),
        "message.max.bytes": k.message_max_bytes,
        "compression.type": k.compression_type,
        # The Java producer's placement of keyed messages by default (librdkafka's own
        # default, consistent_random, hashes keys with CRC32: other partitions).
        "partitioner": k.effective_partitioner,
        "security.protocol": k.security_protocol,
        # The relay never holds more than relay.max_in_flight_bytes of claimed rows (plus
        # one row above the budget, claimed alone), so the producer's queue is sized to
        # take all of it: a full queue is then a configuration error, not a hazard.
        "queue.buffering.max.messages": max(100_000, settings.relay.workers * settings.relay.batch_size * 4),
        "queue.buffering.max.kbytes": max(
            1024, -(-(settings.relay.max_in_flight_bytes + 2 * k.message_max_bytes) // 1024)
        ),
        "socket.keepalive.enable": True,
        "log_level": 3,
    }
    if k.sasl_mechanism:
        conf["sasl.mechanism"] = k.sasl_mechanism
    if k.sasl_username:
        conf["sasl.username"] = k.sasl_username
    if k.sasl_password is not None:
        conf["sasl.password"] = k.sasl_password.get_secret_value()
    for name, value in (
        ("ssl.ca.location", k.ssl_ca_location),
        ("ssl.certificate.location", k.ssl_certificate_location),
        ("ssl.key.location", k.ssl_key_location),
    ):
        if value:
            conf[name] = value
    if k.ssl_key_password is not None:
        conf["ssl.key.password"] = k.ssl_key_password.get_secret_value()
    conf.update(k.extra)
    return conf
