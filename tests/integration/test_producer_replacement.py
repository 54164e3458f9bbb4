"""A replaced Kafka producer is released: its librdkafka instance (threads, buffers)
goes with it (docs/benchmarks/tansu-2core.md, "Soak": relay RSS at broker restarts)."""

from __future__ import annotations

import gc
import json
import os
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from outbox_relay.publisher import Message
from outbox_relay.publishers.kafka import from_settings
from tests.helpers.wait import wait_for

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


def test_replaced_producers_are_released_with_their_threads(make_settings, broker):
    topic = "replace-" + uuid.uuid4().hex[:8]
    messages = [
        Message(
            id=i,
            topic=topic,
            key=f"k{i}",
            value=json.dumps({"n": i}),
            headers=[],
            aggregate_type="a",
            aggregate_id=f"k{i}",
            event_type="E",
        )
        for i in range(50)
    ]
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
            wait_for(
                lambda generation=generation: publisher.generation > generation,
                timeout=10,
                interval=0.05,
                message="the producer to be replaced",
            )
            assert publisher.publish_batch(messages, timeout_seconds=20) == [None] * 50
        gc.collect()
        current = publisher._producer
        live = [o for o in gc.get_objects() if isinstance(o, Producer) and o is not current]
        # No replaced producer object is still alive (Producer takes no weak references).
        assert not [o for o in live if id(o) in replaced_ids]
        del current, live
        # One librdkafka instance for the current producer (none made for isolation here).
        assert publisher.isolation._producer is None
        wait_for(
            lambda: _librdkafka_instances() == before + 1,
            timeout=10,
            interval=0.05,
            message=f"one librdkafka instance more than {before}",
        )
    finally:
        publisher.close()
    wait_for(
        lambda: _librdkafka_instances() == before,
        timeout=10,
        interval=0.05,
        message=f"the librdkafka instances back to {before}",
    )
