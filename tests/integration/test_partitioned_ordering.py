"""Ordered delivery (test_ordering.py) on a time-partitioned outbox: the ordered claim's
skip scan and head lookups read the per-aggregate indexes of every partition, and
Kafka order per key still equals id order. Every test of that module is collected
here with this module's ``store`` fixture (partitioned, with the ordering indexes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox_relay.db.partitions import PartitionLayout, partition_storage
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE
from tests.integration.test_ordering import *  # noqa: F403  (the tests, collected again with the fixture below)

PARTITIONED = PartitionLayout(interval_seconds=3600, premake=2, retention_seconds=86400, storage=partition_storage({}))


@pytest.fixture
def store(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    s = OutboxStore(pg_dsn, table, pool_size=8)
    s.open()
    s.migrate(ordering=True, on_done=ON_DONE, partitioning=PARTITIONED)
    assert s.is_partitioned()
    try:
        yield s
    finally:
        s.close()
