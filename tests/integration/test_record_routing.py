"""What a row asks of its Kafka record besides the key and value: the record timestamp
(``kafka.timestamp``), read back from Apache Kafka through the real relay."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME

from outbox_relay.runtime.relay import Relay
from tests.helpers.db import assert_delivered, delivered, make_row, run_sql, wait_for
from tests.helpers.kafka_records import read_records

pytestmark = pytest.mark.first_pass_only

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def relay_all(settings: Any, dsn: str, table: str, ids: list[int]) -> None:
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(dsn, table, ids)) == len(ids), timeout=60, message="every row delivered")
    finally:
        relay.stop()
    assert_delivered(dsn, table, ids)


def created_ms(dsn: str, table: str, row_id: int) -> int:
    created = run_sql(dsn, table, "SELECT created_at FROM {t} WHERE id = %s", (row_id,))[0][0]
    return int((created - EPOCH) // dt.timedelta(milliseconds=1))


@pytest.mark.parametrize("stamp", ["send_time", "created_at"])
def test_record_timestamp_as_configured(stamp, make_settings, store, pg_dsn, table, broker, topic_prefix):
    # A row written an hour ago (with a sub-millisecond part) and one written now.
    old = make_row(pg_dsn, table, aggregate_type="stamped", aggregate_id="a-1", created_ago_seconds=3600.0004)
    new = make_row(pg_dsn, table, aggregate_type="stamped", aggregate_id="a-2")
    settings = make_settings(kafka={"timestamp": stamp})
    before_ms = int(time.time() * 1000)
    relay_all(settings, pg_dsn, table, [old, new])
    after_ms = int(time.time() * 1000)

    records = read_records(broker.bootstrap_servers, f"{topic_prefix}.stamped", expected=2)
    by_id = {int(r.headers["message_id"]): r for r in records}
    assert sorted(by_id) == [old, new]
    for row_id, record in by_id.items():
        assert record.timestamp_type == TIMESTAMP_CREATE_TIME
        if stamp == "created_at":
            assert record.timestamp_ms == created_ms(pg_dsn, table, row_id)
        else:
            assert before_ms - 1000 <= record.timestamp_ms <= after_ms + 1000  # the send time
    if stamp == "created_at":
        assert by_id[old].timestamp_ms < before_ms - 3_500_000  # the hour-old row keeps its age
