"""A replaced Kafka producer is released: its librdkafka instance (threads, buffers)
goes with it (docs/benchmarks/tansu-2core.md, "Soak": relay RSS at broker restarts)."""

from __future__ import annotations

import gc
import json
import os
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from outbox_relay.publisher import Message
from outbox_relay.publishers.kafka import from_settings

# Exercises the broker rather than PostgreSQL's SQL: ./dev runs it on the first pass only.
pytestmark = pytest.mark.first_pass_only


def _librdkafka_instances() -> int:
    """librdkafka instances alive in this process: each has one ``rdk:main`` thread."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{task}/comm").read_text().strip() == "rdk:main":
                count += 1
        except OSError:
            pass  # the thread ended meanwhile
    return count


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_replaced_producers_are_released_with_their_threads(make_settings, broker):
    topic = "replace-" + uuid.uuid4().hex[:8]
    messages = [Message(id=i, topic=topic, key=f"k{i}", value=json.dumps({"n": i}), headers=[],
                        aggregate_type="a", aggregate_id=f"k{i}", event_type="E") for i in range(50)]
    publisher = from_settings(make_settings())
    before = _librdkafka_instances()
    publisher.start()
    try:
        assert publisher.publish_batch(messages, timeout_seconds=20) == [None] * 50
        replaced_ids = []
        for _ in range(5):
            replaced_ids.append(id(publisher._producer))
            generation = publisher.generation
            publisher.request_replacement("test")
            assert _wait_for(lambda generation=generation: publisher.generation > generation)
            assert publisher.publish_batch(messages, timeout_seconds=20) == [None] * 50
        gc.collect()
        current = publisher._producer
        live = [o for o in gc.get_objects() if isinstance(o, Producer) and o is not current]
        # No replaced producer object is still alive (Producer takes no weak references).
        assert not [o for o in live if id(o) in replaced_ids]
        del current, live
        # One librdkafka instance for the current producer (none made for isolation here).
        assert publisher.isolation._producer is None
        assert _wait_for(lambda: _librdkafka_instances() == before + 1), (before, _librdkafka_instances())
    finally:
        publisher.close()
    assert _wait_for(lambda: _librdkafka_instances() == before)
