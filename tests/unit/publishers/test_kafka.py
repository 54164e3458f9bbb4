"""The Kafka publisher's error classification and its handshake-failure log."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from outbox_relay.publisher import (
    PermanentError,
    RetryableError,
)
from outbox_relay.publishers.kafka import classify


def test_a_topic_the_acl_refuses_defers_its_rows_without_burning_attempts():
    """An ACL mistake is the operator's to fix: the rows wait (Defer refunds the attempt)."""
    from outbox_relay.publisher import Defer
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

    from outbox_relay.publishers.kafka import KafkaPublisher, _ProducerLog

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
