"""Fixtures of the tests that need Apache Kafka itself (never tansu): a three-node
cluster, started once per module, and helpers to read the relay's view of it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from outbox_relay.embedded_kafka import KafkaCluster, kafka_available


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Nothing here can run on tansu: skip the directory when the suite runs there."""
    reason = None
    if os.environ.get("OUTBOX_RELAY_TEST_BROKER", "kafka").lower() == "tansu":
        reason = "needs Apache Kafka (OUTBOX_RELAY_TEST_BROKER=tansu)"
    elif os.environ.get("OUTBOX_RELAY_TEST_KAFKA"):
        reason = "starts its own Apache Kafka brokers (not run against OUTBOX_RELAY_TEST_KAFKA)"
    elif not kafka_available():
        reason = "needs Java and Maven to fetch Apache Kafka (./dev kafka)"
    if reason is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaCluster]:
    """Three combined broker + controller nodes: replication factor 3,
    min.insync.replicas=2. Tests restart what they stop (``heal``)."""
    started = time.monotonic()
    nodes = KafkaCluster(3).start()
    print(f"\n[kafka] 3-node cluster started in {time.monotonic() - started:.1f}s")
    try:
        yield nodes
    finally:
        nodes.remove()


def heal(cluster: KafkaCluster, topic: str | None = None, timeout: float = 120.0) -> None:
    """Start every stopped node, then (with ``topic``) wait until all its replicas are in sync."""
    stopped = [node for node in cluster.nodes if not node.running]
    for node in stopped:
        node.launch()
    for node in stopped:
        node.wait_ready(timeout)
    if topic is not None:
        wait_in_sync(cluster, topic, timeout)


def wait_in_sync(cluster: KafkaCluster, topic: str, timeout: float = 120.0) -> None:
    admin = cluster.admin(log_level=0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=5).topics.get(topic)
        if meta is not None and meta.partitions and all(
                len(p.isrs) == cluster.replication_factor for p in meta.partitions.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"{topic}: replicas not back in sync after {timeout:.0f}s")


def sample(relay: Any, name: str, labels: dict[str, str] | None = None) -> float:
    value = relay.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)
