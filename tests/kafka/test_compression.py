"""Every compression codec the relay offers, end to end on Apache Kafka: the broker
accepts the compressed record batches (it validates them) and a consumer reads back
exactly what the rows held."""

from __future__ import annotations

import json

import pytest

from outbox_relay.embedded import read_messages
from outbox_relay.relay import Relay
from tests.helpers.db import insert_rows, statuses, wait_for

pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(180)]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_are_read_back(codec, broker, make_settings, store, pg_dsn, table, topic_prefix):
    if not hasattr(broker, "create_topic"):
        pytest.skip("needs the embedded Apache Kafka broker")
    topic = f"{topic_prefix}.{codec}"
    broker.create_topic(topic, partitions=2)
    ids = insert_rows(pg_dsn, table, 200, payload_size=500)  # compressible payloads
    settings = make_settings(kafka={"topic_template": topic, "compression_type": codec, "linger_ms": 20})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 200}, timeout=90, message=f"rows sent with {codec}")
    finally:
        relay.stop()
    read = read_messages(broker.bootstrap_servers, [topic], expected=200, timeout=60, partitions=2)
    by_id = {int(m["headers"]["message_id"]): m for m in read}
    assert set(by_id) == set(ids)
    for seq, row_id in enumerate(ids):
        assert json.loads(by_id[row_id]["value"]) == {"seq": seq, "pad": "x" * 500}
