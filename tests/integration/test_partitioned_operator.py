"""The operator's commands on a time-partitioned outbox: `dead list|retry|skip` with
their filters, dry runs and audit, `aggregate show` and `status` (tests of
tests/acceptance/test_cli_operator.py collected again with this module's ``store``
fixture, which migrates the table partitioned)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox_relay.db.partitions import PartitionLayout, partition_storage
from outbox_relay.db.store import OutboxStore
from tests.acceptance.test_cli_operator import *  # noqa: F403  (the tests, collected again with the fixture below)
from tests.helpers.db import ON_DONE

PARTITIONED = PartitionLayout(
    interval_seconds=86400, premake=1, retention_seconds=7 * 86400, storage=partition_storage({})
)


@pytest.fixture
def store(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    s = OutboxStore(pg_dsn, table, pool_size=8)
    s.open()
    s.migrate(on_done=ON_DONE, partitioning=PARTITIONED)
    assert s.is_partitioned()
    try:
        yield s
    finally:
        s.close()
