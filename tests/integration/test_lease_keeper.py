"""The lease keeper: a batch whose delivery runs long keeps its lease; a batch whose
lease was taken over stops waiting and counts its lost leases."""

from __future__ import annotations

import psycopg
import pytest

from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, rows, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


def _lease_until(dsn, table):
    return {r[0]: r[1] for r in rows(dsn, table, "id, lease_until")}


def test_slow_delivery_extends_the_lease(make_settings, store, pg_dsn, table, own_broker, topic_prefix):
    # The topic exists before the broker hangs, and the delivery timeout leaves a
    # resumed JVM broker seconds to answer: the test is about the lease, not about
    # how fast a broker creates a topic or wakes up.
    if hasattr(own_broker, "create_topic"):
        own_broker.create_topic(f"{topic_prefix}.order", partitions=4)
    settings = make_settings(
        kafka={"bootstrap_servers": own_broker.bootstrap_servers, "delivery_timeout_seconds": 16},
        relay={"lease_seconds": 20, "workers": 1},
    )
    relay = Relay(settings)
    relay.start()
    try:
        own_broker.pause()
        ids = insert_rows(pg_dsn, table, 5)
        wait_for(lambda: statuses(pg_dsn, table).get("processing") == 5, message="claimed")
        first = _lease_until(pg_dsn, table)
        wait_for(
            lambda: all(_lease_until(pg_dsn, table)[i] > first[i] for i in ids), timeout=30, message="lease extended"
        )
        own_broker.resume()
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 5, timeout=60, message="done")
    finally:
        own_broker.resume_quietly()
        relay.stop()
    # Extended, never reclaimed: one claim each.
    assert {r[3] for r in rows(pg_dsn, table)} == {1}


def test_lost_lease_during_delivery_stops_the_wait(make_settings, store, pg_dsn, table, own_broker):
    settings = make_settings(
        kafka={"bootstrap_servers": own_broker.bootstrap_servers, "delivery_timeout_seconds": 50},
        relay={"lease_seconds": 60, "workers": 1, "lease_extend_after_fraction": 0.05},
    )
    relay = Relay(settings)
    relay.start()
    schema, name = table.split(".")
    try:
        own_broker.pause()
        insert_rows(pg_dsn, table, 4)
        wait_for(lambda: statuses(pg_dsn, table).get("processing") == 4, message="claimed")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # another claim takes the rows over
            conn.execute(
                f'UPDATE "{schema}"."{name}" SET lease_version = lease_version + 1, lease_owner = %s', ("successor",)
            )
        wait_for(
            lambda: relay.metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 4,
            timeout=45,
            message="lost leases counted",
        )
    finally:
        own_broker.resume_quietly()
        relay.stop(timeout_seconds=1)
    # The stale worker wrote nothing: the successor's claim is intact.
    assert {(r[1], r[3]) for r in rows(pg_dsn, table)} == {("processing", 2)}
    assert {r[0] for r in rows(pg_dsn, table, "lease_owner")} == {"successor"}


def test_strict_policy_lease_keeper_does_not_revive_an_expired_lease(store, pg_dsn, table):
    from outbox_relay.runtime.lease_keeper import LeaseKeeper

    insert_rows(pg_dsn, table, 2)
    claimed = store.claim(owner="A", batch=10, lease_seconds=0.2, max_attempts=5).rows
    strict = LeaseKeeper(store, lease_seconds=30, extend_after_fraction=0.01, strict=True)
    lenient = LeaseKeeper(store, lease_seconds=30, extend_after_fraction=0.01, strict=False)
    wait_for(lambda: all(r[1] < r[2] for r in rows(pg_dsn, table, "id, lease_until, now()")), message="leases expired")
    batch = strict.track(claimed, "A")
    batch.extended_at -= 60  # due for an extension now
    strict.step()
    assert batch.lost == {c.id for c in claimed} and batch.cancel.is_set()
    batch = lenient.track(claimed, "A")
    batch.extended_at -= 60
    lenient.step()
    assert batch.lost == set() and batch.extensions == 1  # default policy: nobody reclaimed, keep going


def test_extension_racing_the_batch_finalize_does_not_judge_its_rows_lost(store, pg_dsn, table):
    """The keeper picks a due batch, then its worker untracks and finalizes it before the
    extension's UPDATE runs (the interleaving of a lease keeper's step with a batch that just
    finished). The rows were finalized by their own claim: not lost, no cancel."""
    from outbox_relay.runtime.lease_keeper import LeaseKeeper

    insert_rows(pg_dsn, table, 3)
    claimed = store.claim(owner="A", batch=10, lease_seconds=30, max_attempts=5).rows
    keeper = LeaseKeeper(store, lease_seconds=30, extend_after_fraction=0.01)
    batch = keeper.track(claimed, "A")
    batch.extended_at -= 60  # due now

    real_extend = store.extend_lease

    def worker_finishes_first(claims, lease_seconds, *, strict=False):
        keeper.untrack(batch)  # what Worker._wait_and_finalize does before finalizing
        assert len(store.mark_done([(c.id, c.lease_version) for c in claimed])) == 3
        return real_extend(claims, lease_seconds, strict=strict)

    store.extend_lease = worker_finishes_first
    try:
        keeper.step()
    finally:
        del store.extend_lease
    assert statuses(pg_dsn, table) == {"done": 3}
    assert batch.lost == set() and not batch.cancel.is_set()
