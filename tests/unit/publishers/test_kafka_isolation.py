"""Which messages of a refused record batch get judged alone (kafka_isolation.plan_isolation)."""

from __future__ import annotations

from confluent_kafka import KafkaError

from outbox_relay.publisher import Message, NotDelivered, Outcome
from outbox_relay.publishers.kafka import classify
from outbox_relay.publishers.kafka_isolation import ISOLATE_CODES, RejectionIsolator, plan_isolation

INVALID = KafkaError(KafkaError.INVALID_RECORD)
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
FENCED = KafkaError(KafkaError.PRODUCER_FENCED)
TIMED_OUT = KafkaError(KafkaError._MSG_TIMED_OUT)
NEIGHBOUR = KafkaError(KafkaError._INVALID_DIFFERENT_RECORD)


def _message(i: int, group: str | None = None) -> Message:
    return Message(
        id=i,
        topic="t",
        key=group or f"k{i}",
        value="{}",
        headers=[],
        aggregate_type="a",
        aggregate_id=group or f"k{i}",
        event_type="E",
        order_key=group,
    )


def _reports(*errors: KafkaError | None) -> tuple[list[Outcome], list[KafkaError | None]]:
    return [None if e is None else classify(e) for e in errors], list(errors)


def test_unordered_messages_with_a_batch_level_error_are_judged_alone_in_parallel():
    messages = [_message(i) for i in range(5)]
    outcomes, errors = _reports(None, INVALID, TOO_LARGE, TIMED_OUT, NEIGHBOUR)
    plan = plan_isolation(messages, outcomes, errors)
    assert plan.singles == [1, 2, 4]  # a timeout says nothing about a neighbour: left as it is
    assert plan.runs == []


def test_an_ordered_run_is_re_produced_in_order_from_its_first_refused_message():
    # g: delivered, refused, delivered (must land after the refused one), refused
    messages = [_message(0, "g"), _message(1, "g"), _message(2, "h"), _message(3, "g"), _message(4, "g")]
    outcomes, errors = _reports(None, INVALID, None, None, INVALID)
    plan = plan_isolation(messages, outcomes, errors)
    assert plan.runs == [[1, 3, 4]]
    assert plan.singles == []


def test_an_ordered_run_stopped_by_another_failure_is_left_to_the_worker():
    messages = [_message(0, "g"), _message(1, "g"), _message(2, "g")]
    outcomes, errors = _reports(TIMED_OUT, INVALID, INVALID)
    assert plan_isolation(messages, outcomes, errors).size == 0
    # A row refused by produce() itself (no delivery report) stops its run the same way.
    outcomes = [classify(TOO_LARGE), NotDelivered("released"), None]
    assert plan_isolation(messages, outcomes, [None, None, None]).size == 0


def test_producer_state_errors_are_judged_alone_too():
    messages = [_message(0), _message(1, "g"), _message(2, "g")]
    outcomes, errors = _reports(FENCED, FENCED, FENCED)
    plan = plan_isolation(messages, outcomes, errors)
    assert plan.singles == [0] and plan.runs == [[1, 2]]


def test_isolation_codes_exclude_errors_that_are_not_about_the_batch_content():
    assert KafkaError.INVALID_RECORD in ISOLATE_CODES
    assert KafkaError.MSG_SIZE_TOO_LARGE in ISOLATE_CODES
    for code in (
        KafkaError._MSG_TIMED_OUT,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError._TRANSPORT,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    ):
        assert code not in ISOLATE_CODES


def test_nothing_to_isolate_creates_no_producer():
    isolator = RejectionIsolator({"bootstrap.servers": "127.0.0.1:1"}, classify=classify)
    outcomes, errors = _reports(None, TIMED_OUT)
    assert isolator.resolve([_message(0), _message(1)], outcomes, errors, deadline=0.0) == outcomes
    assert isolator._producer is None  # no cost while no batch is refused
    isolator.close()
