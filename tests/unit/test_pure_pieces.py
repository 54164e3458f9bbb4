"""Unit tests of the pure pieces: backoff, ordering runs, message building, the error
classification of both publishers, Retry-After parsing, configuration typos, and the
publisher loader's resolution rules."""

from __future__ import annotations

import datetime as dt
import json
from email.utils import formatdate

import httpx
import pytest
from confluent_kafka import KafkaError

from outbox_relay.config import check_environment, load_settings
from outbox_relay.core.backoff import backoff_ceiling, full_jitter_backoff
from outbox_relay.core.ordering import RELEASED_AFTER_FAILURE, OrderingRule, RunGuard, chains, release_after_failures
from outbox_relay.errors import ConfigError
from outbox_relay.model import Claimed
from outbox_relay.operator.operations import blocking_head, diagnose_aggregate, row_states
from outbox_relay.publisher import (
    Defer,
    Message,
    MessageFormatError,
    NotDelivered,
    PermanentError,
    RetryableError,
    SimplePublisher,
    build_message,
)
from outbox_relay.publishers.http import HttpPublisher, parse_retry_after
from outbox_relay.publishers.kafka import classify


# --- backoff ---------------------------------------------------------------------------------
@pytest.mark.parametrize("attempt, ceiling", [(0, 1.0), (1, 2.0), (5, 32.0), (9, 300.0), (10_000, 300.0), (-1, 1.0)])
def test_backoff_ceiling(attempt, ceiling):
    assert backoff_ceiling(attempt, base=1.0, cap=300.0) == ceiling


def test_full_jitter_draws_from_zero_to_the_ceiling():
    draws = []
    full_jitter_backoff(3, base=0.5, cap=100, uniform=lambda low, high: draws.append((low, high)) or high)
    assert draws == [(0.0, 4.0)]
    assert all(0 <= full_jitter_backoff(4, base=1, cap=5) <= 5 for _ in range(200))


# --- ordering --------------------------------------------------------------------------------
def test_ordering_rule():
    assert not OrderingRule.of([]).enabled
    star = OrderingRule.of(["*"])
    assert star.enabled and star.all_types and star.is_ordered("Anything") and star.explicit_types == []
    named = OrderingRule.of(["B", "A"])
    assert named.is_ordered("A") and not named.is_ordered("C") and named.explicit_types == ["A", "B"]
    assert named.order_key("A", "agg-1") == "agg-1" and named.order_key("C", "agg-1") is None


def test_aggregate_diagnosis_uses_the_claims_ordering_rule():
    # `aggregate show` and the console's aggregate page judge rows with OrderingRule:
    # with named ordered types, an aggregate mixes ordered and unordered rows.
    now = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)

    def row(id_: int, event_type: str, status: str) -> dict[str, object]:
        return {"id": id_, "event_type": event_type, "status": status, "attempts": 5, "database_now": now,
                "lease_expired": False, "not_due": False, "lease_until": None, "lease_owner": None,
                "available_at": now}

    rows = [row(1, "Note", "pending"), row(2, "Paid", "dead"), row(3, "Note", "dead"), row(4, "Paid", "pending"),
            row(5, "Paid", "dead")]
    named = OrderingRule.of(["Paid"])
    assert row_states(rows, named) == ["due: the next claim takes it", "dead", "dead",
                                       "waits behind head 2", "dead (behind head 2)"]
    assert blocking_head(rows, named) == 2
    assert diagnose_aggregate(rows, named, max_attempts=5).startswith(
        "blocked by dead head 2 (Paid): retry it (`outbox-relay dead retry 2`)")
    assert diagnose_aggregate(rows, named, max_attempts=5).endswith("; 2 ordered row(s) wait behind it")
    star = OrderingRule.of(["*"])
    assert row_states(rows, star) == ["due: the next claim takes it", "dead (behind head 1)", "dead (behind head 1)",
                                      "waits behind head 1", "dead (behind head 1)"]
    assert blocking_head(rows, star) is None
    assert diagnose_aggregate(rows, star, max_attempts=5) == (
        "head 1 is due: the next claim takes it; 4 ordered row(s) wait behind it")
    unordered = OrderingRule.of([])
    assert row_states(rows, unordered)[1:3] == ["dead", "dead"] and blocking_head(rows, unordered) is None
    assert diagnose_aggregate(rows, unordered, max_attempts=5).startswith("not ordered")


def test_release_after_failures_stops_each_run_at_its_first_failure():
    keys = ["x", "x", "y", "x", None, "y", None]
    outcomes = [None, RetryableError("t"), None, None, PermanentError("p"), PermanentError("q"), None]
    release_after_failures(keys, outcomes)
    assert outcomes[0] is None and isinstance(outcomes[1], RetryableError)
    assert isinstance(outcomes[3], NotDelivered) and outcomes[3].reason == RELEASED_AFTER_FAILURE
    assert outcomes[2] is None and isinstance(outcomes[5], PermanentError)  # y's failure is its own
    assert isinstance(outcomes[4], PermanentError) and outcomes[6] is None  # unordered rows are independent


def test_run_guard_and_chains():
    guard = RunGuard()
    guard.record("x", failed=False)
    assert not guard.stopped("x")
    guard.record("x", failed=True)
    guard.record(None, failed=True)
    assert guard.stopped("x") and not guard.stopped("y") and not guard.stopped(None)
    msgs = [message(1, key="a"), message(2), message(3, key="a"), message(4, key="b"), message(5)]
    assert chains(msgs) == [[0, 2], [1], [3], [4]]


def message(i: int, key: str | None = None, event_type: str = "E") -> Message:
    return Message(id=i, topic="t", key="k", value="{}", headers=[("message_id", str(i))], aggregate_type="order",
                   aggregate_id=key or f"agg-{i}", event_type=event_type, order_key=key)


def test_simple_publisher_stops_a_run_after_a_failure_and_honours_cancel():
    import threading

    sent: list[int] = []

    class Fails2(SimplePublisher):
        def publish(self, m: Message) -> None:
            sent.append(m.id)
            if m.id == 2:
                raise Defer(5, "later")

    outcomes = Fails2().publish_batch([message(1, "a"), message(2, "a"), message(3, "a"), message(4)],
                                      timeout_seconds=5)
    assert sent == [1, 2, 4]
    assert outcomes[0] is None and isinstance(outcomes[1], Defer) and isinstance(outcomes[2], NotDelivered)
    cancel = threading.Event()
    cancel.set()
    assert all(isinstance(o, RetryableError) for o in Fails2().publish_batch([message(9)], timeout_seconds=5,
                                                                              cancel=cancel))


# --- message building ------------------------------------------------------------------------
def claimed(**overrides: object) -> Claimed:
    values: dict[str, object] = dict(id=42, lease_version=3, attempts=2, aggregate_type="order",
                                     aggregate_id="order-7", event_type="OrderPaid", payload='{"a": 1}', topic=None,
                                     headers=None, created_at=dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc))
    values.update(overrides)
    return Claimed(**values)  # type: ignore[arg-type]


def test_build_message_follows_the_contract():
    m = build_message(claimed(headers='{"trace_id": "t-1"}'), "outbox.{aggregate_type}.{event_type}",
                      OrderingRule.of(["OrderPaid"]))
    assert (m.topic, m.key, m.value) == ("outbox.order.OrderPaid", "order-7", '{"a": 1}')
    assert m.headers == [("message_id", "42"), ("event_type", "OrderPaid"), ("aggregate_type", "order"),
                         ("aggregate_id", "order-7"), ("trace_id", "t-1")]
    assert (m.attempts, m.lease_version, m.order_key, m.message_id) == (2, 3, "order-7", "42")
    assert m.created_at_epoch == claimed().created_at.timestamp()
    assert build_message(claimed(topic="own.topic"), "x.{aggregate_type}").topic == "own.topic"
    assert build_message(claimed(), "x").order_key is None


@pytest.mark.parametrize("headers, problem", [
    ('["a"]', "must be a JSON object"),
    ('{"n": 1}', "must be a string"),
    ('{"message_id": "1"}', "reserved"),
    ("{not json", "bad headers"),
])
def test_build_message_refuses_bad_headers(headers, problem):
    with pytest.raises(MessageFormatError, match=problem):
        build_message(claimed(headers=headers), "t")


# --- Kafka error classification ---------------------------------------------------------------
def test_a_topic_the_acl_refuses_defers_its_rows_without_burning_attempts():
    """An ACL mistake is the operator's to fix: the rows wait (Defer refunds the attempt)."""
    from outbox_relay.publishers.kafka import AUTHORIZATION_RETRY_SECONDS
    from outbox_relay.publisher import Defer

    outcome = classify(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert isinstance(outcome, Defer) and outcome.delay == AUTHORIZATION_RETRY_SECONDS
    assert "TOPIC_AUTHORIZATION_FAILED" in outcome.reason and "ACL" in outcome.reason


@pytest.mark.parametrize("code, kind, transport", [
    (KafkaError.MSG_SIZE_TOO_LARGE, PermanentError, False),
    (KafkaError.INVALID_RECORD, PermanentError, False),
    (KafkaError._MSG_TIMED_OUT, RetryableError, True),
    (KafkaError._TRANSPORT, RetryableError, True),
    (KafkaError.NOT_LEADER_FOR_PARTITION, RetryableError, False),
    (KafkaError.UNKNOWN_TOPIC_OR_PART, RetryableError, False),
    (KafkaError.SASL_AUTHENTICATION_FAILED, RetryableError, True),
])
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
        "ssl://b:9093/bootstrap: Connection setup timed out in state SSL_HANDSHAKE")
    as_configured.log(logging.ERROR, fmt, "FAIL", "p#1", "b:9093/bootstrap: Connect to ipv4#10.0.0.1:9093 failed: "
                                                         "Connection refused (after 0ms in state CONNECT)")
    assert sink.levels == [logging.ERROR] and publisher.probe_problem() is None  # the latest failure counts
    as_configured.log(logging.ERROR, fmt, "FAIL", "p#1", "ssl://b:9093/bootstrap: SSL handshake failed: "
                      "Disconnected: SSL connection closed by peer: connecting to a PLAINTEXT broker listener?")
    assert "connecting to a PLAINTEXT broker listener?" in (publisher.probe_problem() or "")
    _ProducerLog(publisher, logger, forward_level=7).log(logging.DEBUG, fmt, "BROKER", "p#1", "debug asked for")
    assert sink.levels == [logging.ERROR, logging.ERROR, logging.DEBUG]
    logger.removeHandler(sink)


# --- HTTP classification and Retry-After -------------------------------------------------------
def test_parse_retry_after():
    assert parse_retry_after(None) is None and parse_retry_after("  ") is None and parse_retry_after("soon") is None
    assert parse_retry_after("120") == 120.0 and parse_retry_after("-1") is None
    assert parse_retry_after("1e9") == 86400.0  # capped at a day
    now = 1_700_000_000.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0


@pytest.fixture(scope="module")
def http_publisher():
    publisher = HttpPublisher("http://127.0.0.1:9/e", timeout_seconds=1, done_statuses=[409, 404],
                              defer_statuses=[425], defer_seconds=7)
    yield publisher
    publisher.close()


@pytest.mark.parametrize("status, headers, body, kind, detail", [
    (200, {}, b"", type(None), None),
    (204, {}, b"", type(None), None),
    (409, {}, b"exists", type(None), None),
    (404, {}, b"gone", type(None), None),  # configured as done
    (425, {}, b"too early", Defer, 7.0),
    (425, {"Retry-After": "3"}, b"", Defer, 3.0),
    (429, {"Retry-After": "12"}, b"slow down", RetryableError, 12.0),
    (503, {}, b"<html>\n down \n</html>", RetryableError, None),
    (408, {}, b"", RetryableError, None),
    (400, {}, b"bad field x", PermanentError, None),
    (301, {"Location": "http://elsewhere/"}, b"", PermanentError, None),
])
def test_http_classification(http_publisher, status, headers, body, kind, detail):
    response = httpx.Response(status, headers=headers, content=body)
    outcome = http_publisher._classify(response, "POST http://127.0.0.1:9/e")
    assert type(outcome) is kind
    if isinstance(outcome, Defer):
        assert outcome.delay == detail
    if isinstance(outcome, RetryableError):
        assert outcome.retry_after_seconds == detail
        assert "\n" not in outcome.reason
    if isinstance(outcome, PermanentError) and status == 400:
        assert outcome.reason == "HTTP 400: bad field x"


# --- configuration typos -----------------------------------------------------------------------
@pytest.mark.parametrize("variable, expected", [
    ("OUTBOX_RELAY_KAFKAA__BOOTSTRAP_SERVERS", "did you mean OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS?"),
    ("OUTBOX_RELAY_RELAYY__WORKERS", "did you mean OUTBOX_RELAY_RELAY__WORKERS?"),
    ("OUTBOX_RELAY_RELAY__WORKRS", "did you mean OUTBOX_RELAY_RELAY__WORKERS?"),
    ("OUTBOX_RELAY_ZZZ__Q", "there is no settings section 'zzz'"),
])
def test_unknown_environment_variables_are_refused(variable, expected):
    with pytest.raises(ConfigError) as info:
        check_environment({variable: "x"})
    assert variable in str(info.value) and expected in str(info.value)


def test_variables_that_are_not_settings_are_left_alone():
    check_environment({"OUTBOX_RELAY_CONFIG": "/x.toml", "OUTBOX_RELAY_TEST_DSN": "postgresql://",
                       "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": "k:9092", "OUTBOX_RELAY_kafka__linger_ms": "3",
                       "OTHER__THING": "x"})


def test_unknown_toml_section_and_key_name_the_closest(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[relayy]\nworkers = 3\n[kafka]\nbootstrap_server = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    text = str(info.value)
    assert "unknown settings section [relayy]; did you mean [relay]?" in text
    assert "kafka.bootstrap_server: unknown setting; did you mean kafka.bootstrap_servers?" in text
    assert "\n" not in text


def test_payload_is_never_reserialised():
    raw = '{"b": 1, "a": [1.50, "ü"]}'
    assert build_message(claimed(payload=raw), "t").value == raw
    assert json.loads(raw)  # the relay forwards the stored text as is


@pytest.mark.parametrize("name", ["enable.idempotence", "acks", "message.timeout.ms", "delivery.timeout.ms",
                                  "message.max.bytes"])
def test_kafka_extra_cannot_override_what_the_guarantees_rest_on(name):
    with pytest.raises(ConfigError) as info:
        load_settings(None, kafka={"extra": {name: "1"}})
    assert f"'{name}' cannot be set through kafka.extra" in str(info.value)


def test_secrets_given_through_kafka_extra_are_scrubbed():
    settings = load_settings(None, kafka={"extra": {"sasl.oauthbearer.client.secret": "oauth-s3cret",
                                                    "ssl.keystore.password": "ks-s3cret", "linger.ms": "7"}})
    secrets = settings.secret_values
    assert "oauth-s3cret" in secrets and "ks-s3cret" in secrets and "7" not in secrets


@pytest.mark.parametrize("name", ["outbox\n", "app.outbox\n", "outbox;", "a b"])
def test_table_and_role_names_refuse_a_trailing_newline_and_other_junk(name):
    from outbox_relay.db.schema import ROLE_NAME_RE

    with pytest.raises(ConfigError):
        load_settings(None, database={"table": name})
    assert not ROLE_NAME_RE.match(name.split(".")[-1])
