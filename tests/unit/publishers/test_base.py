"""The publisher contract: SimplePublisher's runs and cancel, message building."""

from __future__ import annotations

import json

import pytest

from outbox_relay.core.ordering import OrderingRule
from outbox_relay.publisher import (
    Defer,
    Message,
    MessageFormatError,
    NotDelivered,
    RetryableError,
    SimplePublisher,
    build_message,
)
from tests.helpers.messages import claimed, message


def test_simple_publisher_stops_a_run_after_a_failure_and_honours_cancel():
    import threading

    sent: list[int] = []

    class Fails2(SimplePublisher):
        def publish(self, m: Message) -> None:
            sent.append(m.id)
            if m.id == 2:
                raise Defer(5, "later")

    outcomes = Fails2().publish_batch(
        [message(1, "a"), message(2, "a"), message(3, "a"), message(4)], timeout_seconds=5
    )
    assert sent == [1, 2, 4]
    assert outcomes[0] is None and isinstance(outcomes[1], Defer) and isinstance(outcomes[2], NotDelivered)
    cancel = threading.Event()
    cancel.set()
    assert all(
        isinstance(o, RetryableError) for o in Fails2().publish_batch([message(9)], timeout_seconds=5, cancel=cancel)
    )


def test_build_message_follows_the_contract():
    m = build_message(
        claimed(headers='{"trace_id": "t-1"}'), "outbox.{aggregate_type}.{event_type}", OrderingRule.of(["OrderPaid"])
    )
    assert (m.topic, m.key, m.value) == ("outbox.order.OrderPaid", "order-7", '{"a": 1}')
    assert m.headers == [
        ("message_id", "42"),
        ("event_type", "OrderPaid"),
        ("aggregate_type", "order"),
        ("aggregate_id", "order-7"),
        ("trace_id", "t-1"),
    ]
    assert (m.attempts, m.lease_version, m.order_key, m.message_id) == (2, 3, "order-7", "42")
    assert m.created_at_epoch == claimed().created_at.timestamp()
    assert build_message(claimed(topic="own.topic"), "x.{aggregate_type}").topic == "own.topic"
    assert build_message(claimed(), "x").order_key is None


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ('["a"]', "must be a JSON object"),
        ('{"n": 1}', "must be a string"),
        ('{"message_id": "1"}', "reserved"),
        ("{not json", "bad headers"),
    ],
)
def test_build_message_refuses_bad_headers(headers, problem):
    with pytest.raises(MessageFormatError, match=problem):
        build_message(claimed(headers=headers), "t")


def test_payload_is_never_reserialised():
    raw = '{"b": 1, "a": [1.50, "ü"]}'
    assert build_message(claimed(payload=raw), "t").value == raw
    assert json.loads(raw)  # the relay forwards the stored text as is
