"""observe_many (metrics.py) must expose exactly what observing one value at a time does."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox_relay.metrics import _LATENCY_BUCKETS, observe_many
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
