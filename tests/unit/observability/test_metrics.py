"""observe_many (metrics.py) must expose exactly what observing one value at a time does."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox_relay.observability.metrics import _LATENCY_BUCKETS, observe_many
from outbox_relay.publisher import PublisherObserver

CASES = {
    "empty": [],
    "typical": [0.004, 0.012, 0.012, 0.3, 0.03, 7.5],
    "on the bounds": list(_LATENCY_BUCKETS),
    "negative and huge": [-1.0, 0.0, 1e9, 3600.0001],
    "nan": [0.01, math.nan, 0.02],
}


def _exposition(values, *, bulk):
    registry = CollectorRegistry()
    histogram = Histogram("latency_seconds", "x", buckets=_LATENCY_BUCKETS, registry=registry)
    if bulk:
        observe_many(histogram, values)
    else:
        for value in values:
            histogram.observe(value)
    return b"\n".join(line for line in generate_latest(registry).splitlines() if b"_created" not in line)


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_observe_many_exposes_what_one_by_one_does(values):
    assert _exposition(values, bulk=True) == _exposition(values, bulk=False)


def test_the_default_observer_forwards_a_batch_one_by_one():
    seen = []

    class Observer(PublisherObserver):
        def message_acknowledged(self, seconds_since_created):
            seen.append(seconds_since_created)

    Observer().messages_acknowledged([0.1, 0.2])
    assert seen == [0.1, 0.2]


def test_a_batch_hands_its_latencies_over_once_and_a_late_ack_alone():
    """KafkaPublisher's batch waiter keeps acknowledged messages' latencies for one
    observer call per batch; an acknowledgement after that (the batch timed out) is
    reported on its own, never lost."""
    import time

    from outbox_relay.publishers.kafka import KafkaPublisher, _BatchWaiter

    calls = []

    class Observer(PublisherObserver):
        def messages_acknowledged(self, seconds_since_created):
            calls.append(list(seconds_since_created))

    class Report:
        def partition(self):
            return 0

        def offset(self):
            return 7

    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:1"})
    publisher.observer = Observer()
    created = time.time() - 2.0
    waiter = _BatchWaiter(3, publisher, [created] * 3)
    waiter.on_delivery(0, None, Report())
    waiter.on_delivery(1, None, Report())
    waiter.on_delivery(1, None, Report())  # a second report for one message: its first outcome stands
    assert calls == []  # nothing per message
    latencies = waiter.take_latencies()
    assert len(latencies) == 2 and all(1.9 < s < 10 for s in latencies)
    waiter.on_delivery(2, None, Report())  # after the hand-over
    assert len(calls) == 1 and len(calls[0]) == 1 and 1.9 < calls[0][0] < 10
    assert waiter.done.is_set() and waiter.outcomes == [None, None, None]
