"""The Kafka publisher's error classification, its handshake-failure log and the
topic lookup that explains failures without a reason."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import ClusterMetadata, TopicMetadata

from outbox_relay.model import Message
from outbox_relay.publisher import (
    Defer,
    PermanentError,
    RetryableError,
)
from outbox_relay.publishers.kafka import KafkaPublisher, classify, topic_metadata_outcome


def test_a_topic_the_acl_refuses_defers_its_rows_without_burning_attempts():
    """An ACL mistake is the operator's to fix: the rows wait (Defer refunds the attempt)."""
    from outbox_relay.publishers.kafka import AUTHORIZATION_RETRY_SECONDS

    outcome = classify(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert isinstance(outcome, Defer) and outcome.delay == AUTHORIZATION_RETRY_SECONDS
    assert "TOPIC_AUTHORIZATION_FAILED" in outcome.reason and "ACL" in outcome.reason


@pytest.mark.parametrize(
    ("code", "kind", "transport"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, PermanentError, False),
        (KafkaError.INVALID_RECORD, PermanentError, False),
        (KafkaError._MSG_TIMED_OUT, RetryableError, True),
        (KafkaError._TRANSPORT, RetryableError, True),
        (KafkaError.NOT_ENOUGH_REPLICAS, RetryableError, True),
        (KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, RetryableError, True),
        (KafkaError.NOT_LEADER_FOR_PARTITION, RetryableError, False),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, RetryableError, False),
        (KafkaError.SASL_AUTHENTICATION_FAILED, RetryableError, True),
    ],
)
def test_kafka_error_classification(code, kind, transport):
    outcome = classify(KafkaError(code))
    assert type(outcome) is kind
    assert outcome is not None and outcome.reason.startswith("kafka: ")
    if isinstance(outcome, RetryableError):
        assert outcome.transport is transport


def test_kafka_connection_failures_in_the_tls_handshake_are_remembered_not_logged_twice():
    import logging

    from outbox_relay.publishers.kafka import _ProducerLog

    class Sink(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.levels: list[int] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.levels.append(record.levelno)

    publisher = KafkaPublisher({"bootstrap.servers": "b:9093", "security.protocol": "ssl"})
    logger = logging.getLogger("test.librdkafka")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    sink = Sink()
    logger.addHandler(sink)
    fmt = "%s [%s] %s"
    hung = "[thrd:ssl://b:9093/bootstrap]: ssl://b:9093/bootstrap: Connection setup timed out in state SSL_HANDSHAKE"
    as_configured = _ProducerLog(publisher, logger, forward_level=3)  # the relay's log_level
    assert publisher.probe_problem() is None
    as_configured.log(logging.WARNING, fmt, "FAIL", "p#1", hung)  # librdkafka's level 4: not passed on
    assert sink.levels == []
    assert publisher.probe_problem() == (
        "the TLS handshake failed (kafka.security_protocol = ssl: is the listener plaintext?): "
        "ssl://b:9093/bootstrap: Connection setup timed out in state SSL_HANDSHAKE"
    )
    as_configured.log(
        logging.ERROR,
        fmt,
        "FAIL",
        "p#1",
        "b:9093/bootstrap: Connect to ipv4#10.0.0.1:9093 failed: Connection refused (after 0ms in state CONNECT)",
    )
    assert sink.levels == [logging.ERROR] and publisher.probe_problem() is None  # the latest failure counts
    as_configured.log(
        logging.ERROR,
        fmt,
        "FAIL",
        "p#1",
        "ssl://b:9093/bootstrap: SSL handshake failed: "
        "Disconnected: SSL connection closed by peer: connecting to a PLAINTEXT broker listener?",
    )
    assert "connecting to a PLAINTEXT broker listener?" in (publisher.probe_problem() or "")
    _ProducerLog(publisher, logger, forward_level=7).log(logging.DEBUG, fmt, "BROKER", "p#1", "debug asked for")
    assert sink.levels == [logging.ERROR, logging.ERROR, logging.DEBUG]
    logger.removeHandler(sink)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (KafkaError.TOPIC_EXCEPTION, PermanentError),  # an invalid name: waiting cannot fix it
        (KafkaError.UNKNOWN_TOPIC_OR_PART, Defer),  # not created yet: the rows wait, attempt refunded
        (KafkaError.LEADER_NOT_AVAILABLE, type(None)),  # a passing state: the failure stays as it was
        (None, type(None)),  # the topic is there: nothing against it
    ],
)
def test_a_topic_s_metadata_decides_what_its_failed_rows_become(code, kind):
    outcome = topic_metadata_outcome("not a valid topic!", None if code is None else KafkaError(code))
    assert type(outcome) is kind
    if outcome is not None:
        assert outcome.reason.startswith("kafka: ") and "'not a valid topic!'" in outcome.reason
        assert KafkaError(code).name() in outcome.reason


class _KnownTopics:
    """A producer's metadata answer for given topics (the only producer call judge_topics makes)."""

    def __init__(self, errors: dict[str, int | None]) -> None:
        self.errors = errors
        self.asked: list[str] = []

    def list_topics(self, topic: str, timeout: float) -> ClusterMetadata:
        self.asked.append(topic)
        cluster, meta = ClusterMetadata(), TopicMetadata()
        meta.topic = topic
        code = self.errors[topic]
        meta.error = None if code is None else KafkaError(code)
        cluster.topics = {topic: meta}
        return cluster


def _to(topic: str, message_id: int) -> Message:
    return Message(
        id=message_id,
        topic=topic,
        key="k",
        value="{}",
        headers=[],
        aggregate_type="a",
        aggregate_id="k",
        event_type="E",
    )


def test_produce_refusing_an_unknown_topic_is_judged_by_the_topic_s_metadata():
    """librdkafka refuses produce() at once with _UNKNOWN_TOPIC once the producer learned
    a topic is invalid or absent (a metadata answer may come in before the message is
    queued: on a loaded machine even the topic's first message). Retrying cannot fix it
    on that producer, so the metadata's reason decides: an invalid name goes dead at
    once with the broker's reason, an absent topic waits, anything else stays retryable."""
    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000})
    producer = _KnownTopics(
        {"not a valid topic!": KafkaError.TOPIC_EXCEPTION, "absent": KafkaError.UNKNOWN_TOPIC_OR_PART, "fine": None}
    )
    publisher._producer = producer
    refused = KafkaError(KafkaError._UNKNOWN_TOPIC, "Unable to produce message: Local: Unknown topic")
    timed_out = KafkaError(KafkaError._MSG_TIMED_OUT)
    messages = [
        _to("not a valid topic!", 1),
        _to("not a valid topic!", 2),
        _to("absent", 3),
        _to("fine", 4),
        _to("fine", 5),
        _to("elsewhere", 6),
    ]
    errors = [refused, timed_out, refused, refused, None, KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)]
    outcomes = [classify(e) if e is not None else None for e in errors]

    judged = publisher.judge_topics(messages, outcomes, errors)

    assert producer.asked == ["not a valid topic!", "absent", "fine"]  # one lookup per topic, only after such failures
    for index in (0, 1):
        assert isinstance(judged[index], PermanentError)
        assert "TOPIC_EXCEPTION" in judged[index].reason and "'not a valid topic!'" in judged[index].reason
    assert isinstance(judged[2], Defer) and "UNKNOWN_TOPIC_OR_PART" in judged[2].reason
    assert "absent" in (publisher.held_back() or "")
    assert judged[3] is outcomes[3] and isinstance(judged[3], RetryableError)  # the topic is there: a retry
    assert judged[4] is None and judged[5] is outcomes[5]
