"""[[limits]] on real Apache Kafka: a 50/s token bucket on one topic while another
topic in the same batches runs unlimited. Rates are read from the records' own
timestamps (set by the producer when the relay hands a message over), so the
database's finalize lag does not blur them; the bounds are generous (shared machine)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay.config import RateLimitSettings
from outbox_relay.publishers.base import RateLimitedPublisher
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import DELETE_MODE, delivered, insert_rows, row_states
from tests.helpers.http_target import HttpTarget, Step
from tests.helpers.wait import wait_for

pytestmark = pytest.mark.first_pass_only

RATE_PER_SECOND = 50.0
BURST = 5
LIMITED_ROWS = 500
FREE_ROWS = 1500


def record_times(bootstrap: str, topic: str, expected: int, timeout: float = 60.0) -> list[float]:
    """The create timestamps (seconds) of ``expected`` records of ``topic``, sorted."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"limits-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        times: list[float] = []
        deadline = time.monotonic() + timeout
        while len(times) < expected and time.monotonic() < deadline:
            for record in consumer.consume(500, timeout=0.5):
                if not record.error():
                    times.append(record.timestamp()[1] / 1000.0)
        return sorted(times)
    finally:
        consumer.close()


def count_between(times: list[float], start: float, end: float) -> int:
    return sum(1 for t in times if start <= t < end)


def test_a_limited_topic_runs_at_its_rate_while_another_runs_unlimited(
    make_settings, broker, store, pg_dsn, table, topic_prefix
):
    limited_topic, free_topic = f"{topic_prefix}.limited", f"{topic_prefix}.free"
    settings = make_settings(relay={"workers": 4, "batch_size": 200})
    settings = settings.model_copy(
        update={"limits": [RateLimitSettings(topic=limited_topic, rate_per_second=RATE_PER_SECOND, burst=BURST)]}
    )
    # Both topics exist before the first message (no auto-creation race in the counts).
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for future in admin.create_topics(
        [NewTopic(t, num_partitions=4, replication_factor=1) for t in (limited_topic, free_topic)]
    ).values():
        future.result(timeout=30)
    # Interleaved, so every claimed batch mixes both topics.
    limited_ids: list[int] = []
    free_ids: list[int] = []
    for _ in range(20):
        limited_ids += insert_rows(pg_dsn, table, LIMITED_ROWS // 20, aggregate_type="limited")
        free_ids += insert_rows(pg_dsn, table, FREE_ROWS // 20, aggregate_type="free")

    relay = Relay(settings)
    relay.start()
    try:
        assert isinstance(relay.publisher, RateLimitedPublisher)
        wait_for(
            lambda: len(delivered(pg_dsn, table, limited_ids + free_ids)) == LIMITED_ROWS + FREE_ROWS,
            timeout=120,
            interval=0.5,
            message="every row delivered",
        )
    finally:
        relay.stop()

    limited = record_times(broker.bootstrap_servers, limited_topic, LIMITED_ROWS)
    free = record_times(broker.bootstrap_servers, free_topic, FREE_ROWS)
    assert len(limited) >= LIMITED_ROWS and len(free) >= FREE_ROWS

    # The limited topic: measured over 7 s after its first second (the burst, the start).
    window_start, window_seconds = limited[0] + 1.0, 7.0
    in_window = count_between(limited, window_start, window_start + window_seconds)
    measured = in_window / window_seconds
    assert RATE_PER_SECOND * 0.9 <= measured <= RATE_PER_SECOND * 1.1, (measured, in_window)
    # Never above the bucket in any one-second window (rate + burst, +1 for the boundary).
    for start in [limited[0] + 0.5 * k for k in range(int((limited[-1] - limited[0]) / 0.5))]:
        assert count_between(limited, start, start + 1.0) <= RATE_PER_SECOND + BURST + 1, start

    # The free topic: not held to 50/s (its rows went out in the same batches).
    free_span = max(free[-1] - free[0], 0.001)
    assert FREE_ROWS / free_span >= 3 * RATE_PER_SECOND, (FREE_ROWS, free_span)
    # Most of it was out before the limited topic was a third of the way through.
    assert count_between(free, free[0], limited[LIMITED_ROWS // 3]) >= 0.9 * FREE_ROWS

    # Waiting burned no attempt, and the time held is on the limited topic only.
    outcomes = {
        sample.labels["outcome"]: sample.value
        for metric in relay.metrics.registry.collect()
        if metric.name == "outbox_relay_published"
        for sample in metric.samples
        if sample.name == "outbox_relay_published_total"
    }
    assert outcomes["defer"] > 0 and outcomes["retry"] == 0 and outcomes["dead"] == 0, outcomes
    if not DELETE_MODE:
        states = row_states(pg_dsn, table, limited_ids)
        assert set(states.values()) == {("done", 1)}, (outcomes, [(i, s) for i, s in states.items() if s[1] != 1])
    waited = relay.metrics.registry.get_sample_value(
        "outbox_relay_rate_limit_wait_seconds_total", {"destination": f"topic:{limited_topic}"}
    )
    assert waited is not None and waited > 0
    free_waited: Any = relay.metrics.registry.get_sample_value(
        "outbox_relay_rate_limit_wait_seconds_total", {"destination": f"topic:{free_topic}"}
    )
    assert free_waited is None


def test_a_429_with_retry_after_pauses_the_host_and_waiting_burns_no_attempt(make_settings, store, pg_dsn, table):
    with HttpTarget() as target:
        target.script("/e/Limited", Step(429, headers={"Retry-After": "1"}, body="slow down"), Step(200))
        settings = make_settings(
            relay={"publisher": "http", "workers": 1, "backoff_base_seconds": 0.05, "backoff_cap_seconds": 0.2},
            http={"url_template": f"{target.base_url}/e/{{event_type}}"},
        )
        settings = settings.model_copy(
            update={"limits": [RateLimitSettings(host="127.0.0.1", rate_per_second=20, burst=1)]}
        )
        ids = insert_rows(pg_dsn, table, 10, event_type="Limited")
        relay = Relay(settings)
        relay.start()
        try:
            wait_for(lambda: len(delivered(pg_dsn, table, ids)) == len(ids), timeout=60, message="rows delivered")
        finally:
            relay.stop()
        requests = sorted(target.snapshot(), key=lambda r: r.at)
    throttled, later = requests[0], requests[1:]
    assert len(later) == len(ids)  # every row once, the throttled one twice
    # Nothing went to the host during the second it asked for ...
    assert all(r.at >= throttled.at + 0.95 for r in later), [round(r.at - throttled.at, 3) for r in later]
    # ... and afterwards the bucket's pace: 10 requests at 20/s with a burst of 1 span at
    # least 9 x 50 ms from the first to the last as sent. Arrival times carry the
    # machine's jitter (a late first arrival shortens the span), so the check is the
    # order of magnitude: well above what an unlimited sender takes (a few ms).
    span = later[-1].at - later[0].at
    assert span >= 0.6 * (len(later) - 1) / 20, [round(r.at - throttled.at, 3) for r in later]
    if not DELETE_MODE:
        attempts = {i: state[1] for i, state in row_states(pg_dsn, table, ids).items()}
        assert attempts[throttled.message_id] == 2  # the 429 itself is a retry
        assert {a for i, a in attempts.items() if i != throttled.message_id} == {1}  # held rows: refunded
    waited = relay.metrics.registry.get_sample_value(
        "outbox_relay_rate_limit_wait_seconds_total", {"destination": "host:127.0.0.1"}
    )
    assert waited is not None and waited > 0
