"""Apache Kafka's own refusals, which the relay must judge row by row.

One broker for the module, with automatic topic creation off (as most production
clusters run); every topic is created by the test.

- a topic whose ``max.message.bytes`` is smaller than a few rows of a batch: Kafka
  refuses the whole record batch of that partition (MSG_SIZE_TOO_LARGE); only the
  oversized rows go dead, with the broker's reason, and their neighbours are delivered;
- a missing topic: its rows wait (attempt refunded, ``/readyz`` and a metric name the
  topic) while the rows of other topics are delivered, and are delivered once it exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay.embedded import read_messages
from outbox_relay.embedded_kafka import KafkaBroker
from outbox_relay.relay import Relay
from tests.helpers.db import insert_rows, rows, statuses, wait_for
from tests.kafka.conftest import sample

pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def strict_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    log_file = tmp_path_factory.mktemp("strict-broker") / "broker.log"
    node = KafkaBroker(log_file=log_file, properties={"auto.create.topics.enable": "false"}).start()
    try:
        yield node
    finally:
        node.kill()
        node.remove()


def test_rows_above_the_topics_max_message_bytes_go_dead_alone(strict_broker, make_settings, store, pg_dsn, table,
                                                                 topic_prefix):
    limit, oversized = 20_000, 30_000
    topic = f"{topic_prefix}.sized"
    strict_broker.create_topic(topic, partitions=2, config={"max.message.bytes": limit})
    big_positions = {17, 18, 90}  # two neighbours in one batch, one alone in another
    ids: list[int] = []
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(150):
            pad = "x" * (oversized if i in big_positions else 50)
            ids.append(enqueue(conn, aggregate_type="order", aggregate_id=f"order-{i % 10}", event_type="E",
                               payload={"n": i, "pad": pad}, table=table))
    big = {ids[i] for i in big_positions}
    # The client's own limit is well above the topic's: only the broker can refuse these.
    settings = make_settings(kafka={"bootstrap_servers": strict_broker.bootstrap_servers, "topic_template": topic,
                                    "message_max_bytes": 1_000_000, "linger_ms": 50},
                             relay={"workers": 2, "batch_size": 50})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: sum(statuses(pg_dsn, table).get(s, 0) for s in ("done", "dead")) == 150, timeout=120,
                 message="every row done or dead")
    finally:
        relay.stop()
    by_id = {r[0]: r for r in rows(pg_dsn, table)}
    assert {i for i, r in by_id.items() if r[1] == "dead"} == big
    for i in big:
        assert "MSG_SIZE_TOO_LARGE" in by_id[i][4] and "rejected when produced alone" in by_id[i][4], by_id[i][4]
    # Neighbours are delivered (on their first attempt unless a re-produce alone
    # outlived the batch's deadline on a loaded machine: then on a later one).
    assert [r for i, r in by_id.items() if i not in big and r[1] != "done"] == []
    assert sample(relay, "outbox_relay_isolated_total") >= len(big)
    delivered = read_messages(strict_broker.bootstrap_servers, [topic], expected=147, timeout=60, partitions=2)
    assert {int(m["headers"]["message_id"]) for m in delivered} == set(ids) - big


def test_rows_of_a_missing_topic_wait_until_it_exists(strict_broker, make_settings, store, pg_dsn, table,
                                                      topic_prefix, record_property):
    present, missing = f"{topic_prefix}.present", f"{topic_prefix}.missing"
    strict_broker.create_topic(present, partitions=1)
    settings = make_settings(kafka={"bootstrap_servers": strict_broker.bootstrap_servers,
                                    "topic_template": topic_prefix + ".{aggregate_type}",
                                    "delivery_timeout_seconds": 4},
                             relay={"workers": 2, "batch_size": 20, "max_attempts": 2,
                                    "backoff_base_seconds": 0.1, "backoff_cap_seconds": 0.5})
    good = insert_rows(pg_dsn, table, 30, aggregate_type="present")
    waiting = insert_rows(pg_dsn, table, 10, aggregate_type="missing")
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 30, timeout=90, message="the present topic's rows")
        wait_for(lambda: sample(relay, "outbox_relay_missing_topic_deferrals_total", {"topic": missing}) >= 1,
                 timeout=60, message="the missing topic noticed")
        ready, why = relay.readiness()
        assert not ready and missing in why and "UNKNOWN_TOPIC_OR_PART" in why, why
        # Twice the delivery timeout and more than max_attempts cycles: nothing burns.
        time.sleep(10)
        by_id = {r[0]: r for r in rows(pg_dsn, table)}
        assert all(by_id[i][1] != "dead" for i in waiting), [by_id[i] for i in waiting]
        assert any("does not exist" in (by_id[i][4] or "") for i in waiting)
        created_at = time.monotonic()
        strict_broker.create_topic(missing, partitions=1)
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 40, timeout=120, message="the waiting rows")
        record_property("seconds_from_topic_created_to_delivered", round(time.monotonic() - created_at, 1))
        wait_for(lambda: relay.readiness()[0], timeout=60, message="ready again")
    finally:
        relay.stop()
    assert statuses(pg_dsn, table) == {"done": 40}
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    read = read_messages(strict_broker.bootstrap_servers, [missing], expected=10, timeout=60, partitions=1)
    assert {int(m["headers"]["message_id"]) for m in read} == set(waiting)
    assert {int(m['headers']['message_id']) for m in read_messages(
        strict_broker.bootstrap_servers, [present], expected=30, timeout=60, partitions=1)} == set(good)

