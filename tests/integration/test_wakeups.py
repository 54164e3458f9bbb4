"""LISTEN/NOTIFY wake-ups: with polling effectively off, only notifications can make
idle workers claim; they must keep working notification after notification."""

from __future__ import annotations

import time

import psycopg

from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, statuses, wait_for


def _flag(dsn, table):
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT relays_idle FROM "{schema}"."{name}_relay_state"').fetchone()[0]


def test_notifications_wake_idle_workers_again_and_again(make_settings, store, pg_dsn, table, broker):
    settings = make_settings(relay={"poll_interval_seconds": 600, "workers": 2})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: _flag(pg_dsn, table) is True, message="relays marked idle")
        for round_number in range(1, 4):
            insert_rows(pg_dsn, table, 5)
            # The poll interval is 10 minutes: only a notification can get these done.
            wait_for(
                lambda n=round_number: statuses(pg_dsn, table).get("done") == 5 * n,
                timeout=60,
                message=f"round {round_number} done",
            )
            wait_for(lambda: _flag(pg_dsn, table) is True, message="idle again")
            time.sleep(0.2)
        assert relay._listener is not None and relay._listener.is_alive()
    finally:
        relay.stop()


def test_busy_flag_means_inserts_do_not_notify(store, pg_dsn, table):
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.sql.channel}"')
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(store.sql.query("mark_busy"))
        insert_rows(pg_dsn, table, 3)
        assert list(listener.notifies(timeout=0.5)) == []
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(store.sql.query("mark_idle"))
        insert_rows(pg_dsn, table, 3)  # one statement per row, one transaction: folded
        assert len(list(listener.notifies(timeout=2.0, stop_after=1))) == 1


def _state_row_version(dsn, table):
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT xmin::text FROM "{schema}"."{name}_relay_state"').fetchone()[0]


def test_while_vacuum_is_held_back_the_idle_flag_stays_set(make_settings, store, pg_dsn, table, broker):
    """Under MVCC pressure (the claim cursor's full claims are slow) a notification
    wakes a worker but does not clear the idle flag: no flip, so no new dead version of
    the state row (which every insert's trigger reads) per notification. The one write
    of that row left under pressure is the publication of where the claims start, for
    `status` (at most one per BOUNDS_PUBLISH_INTERVAL_SECONDS per process)."""
    from outbox_relay.db.claim_cursor import BOUNDS_PUBLISH_INTERVAL_SECONDS, DueCursor

    settings = make_settings(relay={"poll_interval_seconds": 600, "workers": 2})
    relay = Relay(settings)
    # Every full claim counts as slow: fast claims are in use after the first three.
    relay.store.due_cursor = DueCursor(fast_above_seconds=0.0)
    relay.start()
    try:
        wait_for(lambda: _flag(pg_dsn, table) is True, message="relays marked idle")
        rounds_before_pressure = 0
        while not relay.store.due_cursor.fast_claims_in_use():
            rounds_before_pressure += 1
            insert_rows(pg_dsn, table, 1)
            wait_for(lambda n=rounds_before_pressure: statuses(pg_dsn, table).get("done") == n, timeout=60)
            wait_for(lambda: _flag(pg_dsn, table) is True, message="idle again")
        # The relay's own first mark_idle (the flag is already set by migrate) must have
        # been sent before counting: it is no flip of the flag under pressure.
        wait_for(lambda: relay.wakeup.relays_marked_idle, message="the relay's first mark_idle")
        version = _state_row_version(pg_dsn, table)
        counts_before = relay.store.statement_counts.snapshot()
        started = time.monotonic()
        for round_number in range(1, 4):
            insert_rows(pg_dsn, table, 5)
            # Only a notification can get these done (the poll interval is 10 minutes).
            wait_for(
                lambda n=round_number: statuses(pg_dsn, table).get("done") == rounds_before_pressure + 5 * n,
                timeout=60,
                message=f"round {round_number} done",
            )
            assert _flag(pg_dsn, table) is True
        elapsed = time.monotonic() - started
        counts = relay.store.statement_counts.snapshot()
        flips = sum(counts.get(kind, 0) - counts_before.get(kind, 0) for kind in ("mark_idle", "mark_busy"))
        assert flips == 0
        published = counts.get("gauge_bounds", 0) - counts_before.get("gauge_bounds", 0)
        assert published <= 1 + elapsed / BOUNDS_PUBLISH_INTERVAL_SECONDS, (published, elapsed)
        if published == 0:
            assert _state_row_version(pg_dsn, table) == version  # the state row was not updated
    finally:
        relay.stop()


def test_one_waker_among_replicas_and_the_next_takes_over(make_settings, store, pg_dsn, table, broker):
    """Two relays on one table: one holds the waker lock and listens, the other waits
    for it (no transaction while waiting). Notifications alone get rows delivered (the
    idle polls are 10 minutes apart), and when the waker stops the other takes over."""
    settings = make_settings(relay={"poll_interval_seconds": 600, "idle_poll_interval_seconds": 600, "workers": 2})
    first, second = Relay(settings), Relay(settings)
    first.start()
    try:
        wait_for(lambda: first._listener is not None and first._listener.is_waker, message="first is the waker")
        second.start()
        try:
            wait_for(lambda: second.wakeup.listening, message="second waits for the waker lock")
            time.sleep(0.5)
            assert first.wakeup.listening and second.wakeup.listening
            # Only one process listens: the channel has one listener backend.
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                waiting = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
                ).fetchone()[0]
            assert waiting == 1
            insert_rows(pg_dsn, table, 5)
            wait_for(lambda: statuses(pg_dsn, table).get("done") == 5, timeout=60, message="delivered by the waker")
            first.stop()
            wait_for(
                lambda: second._listener is not None and second._listener.is_waker,
                timeout=30,
                message="second took over",
            )
            insert_rows(pg_dsn, table, 5)
            wait_for(lambda: statuses(pg_dsn, table).get("done") == 10, timeout=60, message="delivered after handover")
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_row_announced_during_an_empty_claim_is_claimed_without_waiting_for_the_poll(
    make_settings, store, pg_dsn, table, broker, monkeypatch
):
    """A row that commits after an empty claim's snapshot, announced while that claim
    runs: the notification wakes nobody (the one worker is active and will look
    again), so the worker must claim once more rather than sleep until its poll
    (10 minutes here)."""
    from outbox_relay.runtime import wakeup as wakeup_module

    monkeypatch.setattr(wakeup_module, "COALESCE_SECONDS", 600.0)  # an active worker always counts as looking again
    settings = make_settings(relay={"poll_interval_seconds": 600, "idle_poll_interval_seconds": 600, "workers": 1})
    relay = Relay(settings)
    real_claim = relay.store.claim
    inserted: list[int] = []

    def claim_then_a_row_commits(**kwargs):
        result = real_claim(**kwargs)
        if not result.rows and not inserted and relay.wakeup.relays_marked_idle and relay.wakeup.listening:
            before = relay.wakeup.notices
            inserted.extend(insert_rows(pg_dsn, table, 1))
            wait_for(lambda: relay.wakeup.notices > before, timeout=10, message="the listener heard the insert")
        return result

    monkeypatch.setattr(relay.store, "claim", claim_then_a_row_commits)
    relay.start()
    try:
        wait_for(lambda: inserted != [], timeout=30, message="a row inserted during an empty claim")
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 1, timeout=20, message="the announced row delivered")
    finally:
        relay.stop()
