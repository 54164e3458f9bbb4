"""The relay in process against real servers: bad rows, broker restart, hand-off."""

from __future__ import annotations

import time

import psycopg
import pytest

from outbox_relay._embedded.embedded import read_messages
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, rows, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


def test_oversized_and_malformed_rows_go_dead_and_block_nothing(
    make_settings, store, pg_dsn, table, broker, topic_prefix
):
    settings = make_settings(kafka={"message_max_bytes": 10_000})
    good = insert_rows(pg_dsn, table, 50, aggregate_type="order")
    big = insert_rows(pg_dsn, table, 1, aggregate_type="order", payload_size=50_000)[0]
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        bad_headers = conn.execute(
            f'INSERT INTO "{schema}"."{name}" (aggregate_type, aggregate_id, event_type, payload, headers) '
            "VALUES ('order', 'x', 'E', '{}', '{\"n\": 1}') RETURNING id"
        ).fetchone()[0]
        not_object = conn.execute(
            f'INSERT INTO "{schema}"."{name}" (aggregate_type, aggregate_id, event_type, payload, headers) '
            "VALUES ('order', 'x', 'E', '{}', '[\"a\"]') RETURNING id"
        ).fetchone()[0]
    more = insert_rows(pg_dsn, table, 50, aggregate_type="order")
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 100, message="good rows done")
        wait_for(lambda: statuses(pg_dsn, table).get("dead") == 3, message="bad rows dead")
    finally:
        relay.stop()
    by_id = {r[0]: r for r in rows(pg_dsn, table)}
    assert by_id[big][1] == "dead" and "MSG_SIZE_TOO_LARGE" in by_id[big][4]
    assert by_id[bad_headers][1] == "dead" and "header 'n' must be a string" in by_id[bad_headers][4]
    assert by_id[not_object][1] == "dead" and "JSON object" in by_id[not_object][4]
    assert all(by_id[i][1] == "done" for i in good + more)
    assert by_id[big][2] == 1  # permanent: dead on the first attempt


def test_broker_restart_mid_run_replaces_producer_and_delivers(
    make_settings, store, pg_dsn, table, durable_broker, topic_prefix
):
    """The broker hangs, then is killed and restarted on the same (durable) storage: the
    producer is replaced, and every row, acknowledged before or after, is readable."""
    own_broker = durable_broker
    settings = make_settings(
        kafka={"bootstrap_servers": own_broker.bootstrap_servers},
        relay={"lease_seconds": 6, "backoff_base_seconds": 0.1, "backoff_cap_seconds": 1, "max_attempts": 50},
    )
    relay = Relay(settings)
    relay.start()
    try:
        first = insert_rows(pg_dsn, table, 200)
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 200, message="first rows done")
        # Hang the broker so deliveries time out inside the idempotent producer, then
        # replace it with a fresh process on the same port and storage.
        own_broker.pause()
        second = insert_rows(pg_dsn, table, 300)
        time.sleep(settings.delivery_timeout_seconds + 1)
        own_broker.restart()
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 500, timeout=120, message="all rows done")
    finally:
        relay.stop()
    assert relay.publisher.replacements >= 1
    assert relay.metrics.registry.get_sample_value("outbox_relay_producer_replacements_total") >= 1
    every_id = set(first) | set(second)
    messages = read_messages(
        own_broker.bootstrap_servers,
        [f"{topic_prefix}.order"],
        expected=len(every_id),
        timeout=60,
        stop_when=lambda out: every_id <= {int(m["headers"]["message_id"]) for m in out},
    )
    delivered = {int(m["headers"]["message_id"]) for m in messages}
    # Nothing acknowledged before the restart was lost with the old broker process.
    assert every_id - delivered == set()
    assert statuses(pg_dsn, table) == {"done": 500}


def test_graceful_stop_releases_unacknowledged_rows(make_settings, store, pg_dsn, table, own_broker):
    """SIGTERM hand-off: rows without a delivery report go back to pending, due now,
    attempt refunded, so another replica takes them at once."""
    settings = make_settings(
        kafka={"bootstrap_servers": own_broker.bootstrap_servers},
        relay={"lease_seconds": 60, "workers": 2, "shutdown_timeout_seconds": 1},
    )
    relay = Relay(settings)
    relay.start()
    own_broker.pause()  # deliveries hang
    try:
        insert_rows(pg_dsn, table, 20)
        wait_for(lambda: statuses(pg_dsn, table).get("processing") == 20, message="rows claimed")
    finally:
        started = time.monotonic()
        relay.stop()
        stop_seconds = time.monotonic() - started
        own_broker.resume()
    result = rows(pg_dsn, table, "id, status, attempts, lease_owner, lease_until")
    assert {r[1] for r in result} == {"pending"}
    assert all(r[2] == 0 and r[3] is None and r[4] is None for r in result)
    assert relay.metrics.registry.get_sample_value("outbox_relay_released_total") == 20
    assert stop_seconds < settings.relay.lease_seconds  # released, not left to lease expiry


@pytest.mark.parametrize("strict", [False, True])
def test_relay_drains_with_both_lease_policies(make_settings, store, pg_dsn, table, broker, strict):
    settings = make_settings(relay={"strict_lease": strict})
    insert_rows(pg_dsn, table, 300)
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 300, message="done")
    finally:
        relay.stop()
    assert relay.metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "done"}) == 300


def test_topic_the_broker_rejects_goes_dead_alone(make_settings, store, pg_dsn, table, broker):
    settings = make_settings()
    good = insert_rows(pg_dsn, table, 20)
    bad = insert_rows(pg_dsn, table, 1, topic="not a valid topic!")[0]
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 20, "dead": 1}, message="good done, bad dead")
    finally:
        relay.stop()
    by_id = {r[0]: r for r in rows(pg_dsn, table)}
    assert "TOPIC_EXCEPTION" in by_id[bad][4] and by_id[bad][2] == 1
    assert all(by_id[i][1] == "done" for i in good)


def test_a_topic_the_producer_already_knows_is_invalid_sends_its_next_row_dead_at_once(
    make_settings, store, pg_dsn, table, broker
):
    """Once the producer learned a topic name is invalid, produce() refuses the topic's
    next messages at once (_UNKNOWN_TOPIC, no delivery report): a row produced then
    must still go dead on its first attempt, with the broker's reason."""
    settings = make_settings()
    relay = Relay(settings)
    relay.start()
    try:
        first = insert_rows(pg_dsn, table, 1, topic="not a valid topic!")[0]
        wait_for(lambda: statuses(pg_dsn, table) == {"dead": 1}, message="first bad row dead")
        second = insert_rows(pg_dsn, table, 1, topic="not a valid topic!")[0]
        wait_for(lambda: statuses(pg_dsn, table) == {"dead": 2}, message="second bad row dead")
    finally:
        relay.stop()
    by_id = {r[0]: r for r in rows(pg_dsn, table)}
    for row_id in (first, second):
        assert "TOPIC_EXCEPTION" in by_id[row_id][4] and by_id[row_id][2] == 1, by_id[row_id]


def test_reserved_header_names_are_refused(store, pg_dsn, table):
    from outbox_relay import enqueue

    with psycopg.connect(pg_dsn) as conn, pytest.raises(ValueError, match="reserved"):
        enqueue(
            conn,
            aggregate_type="a",
            aggregate_id="1",
            event_type="E",
            payload={},
            headers={"message_id": "forged"},
            table=table,
        )
