"""An idle pool falls back to its one connection: a source that was busy for a moment
must not keep its spare connections for psycopg_pool's default ten minutes (a hundred
idle sources would hold twice the connections they need)."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from outbox_relay.db.store import OutboxStore
from outbox_relay.db.store_core import pool_max_idle

pytestmark = pytest.mark.first_pass_only


def _connections(dsn: str, application_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("bound", "size", "expected"), [(60.0, 2, 30.0), (60.0, 6, 10.0), (2.0, 4, 1.0)])
def test_max_idle_is_the_bound_over_the_pool_size(bound, size, expected):
    assert pool_max_idle(bound, size) == expected


def test_a_pool_grown_to_two_shrinks_back_to_one_within_the_bound(pg_dsn, table):
    application_name = "pool-idle-" + uuid.uuid4().hex[:8]
    bound_seconds = 3.0
    store = OutboxStore(
        pg_dsn, table, pool_size=2, application_name=application_name, pool_max_idle_seconds=bound_seconds
    )
    store.open()
    try:
        store.migrate()
        # Two statements at once: the pool grows to its second connection.
        both_in_use = threading.Barrier(2, timeout=30)

        def use_one() -> None:
            with store.connection() as conn:
                conn.execute("SELECT 1")
                both_in_use.wait()

        users = [threading.Thread(target=use_one) for _ in range(2)]
        for user in users:
            user.start()
        for user in users:
            user.join(timeout=30)
        assert _connections(pg_dsn, application_name) == 2
        idle_since = time.monotonic()
        # Back to one within the bound (a little more for a loaded machine), never below.
        deadline = idle_since + bound_seconds * 3 + 5
        count = 2
        while time.monotonic() < deadline:
            count = _connections(pg_dsn, application_name)
            if count == 1:
                break
            time.sleep(0.2)
        assert count == 1, f"still {count} connections {time.monotonic() - idle_since:.1f} s after the last use"
        time.sleep(bound_seconds)
        assert _connections(pg_dsn, application_name) == 1  # the pool's minimum stays
        with store.connection() as conn:  # and serves at once
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store.close()
