"""`replay` of delivered rows on a time-partitioned outbox (keep mode): the tests of
test_replay.py that run on a keep-mode table, collected again with this module's
``keep_table`` fixture, which migrates the table partitioned."""

from __future__ import annotations

import inspect

import pytest

from outbox_relay.db.partitions import PartitionLayout, partition_storage
from outbox_relay.db.store import OutboxStore
from tests.integration.test_replay import *  # noqa: F403  (the tests, collected again with the fixture below)

PARTITIONED = PartitionLayout(
    interval_seconds=86400, premake=1, retention_seconds=7 * 86400, storage=partition_storage({})
)


@pytest.fixture
def keep_table(pg_dsn: str, table: str) -> str:
    store = OutboxStore(pg_dsn, table, pool_size=2)
    store.open()
    try:
        store.migrate(on_done="keep", partitioning=PARTITIONED)
        assert store.is_partitioned()
    finally:
        store.close()
    return table


# Only the tests on a keep-mode table run again here (the others make their own tables).
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and "keep_table" not in inspect.signature(_test).parameters:
        del globals()[_name]
