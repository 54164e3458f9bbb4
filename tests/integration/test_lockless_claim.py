"""The claim of a few rows without the row lock (delivery.sql "claim", ``{row_lock}``).

A relay that is not busy claims with its generic plan and without ``FOR UPDATE SKIP
LOCKED`` (one WAL record less per row). What SKIP LOCKED guaranteed must still hold:
a row another transaction changes while the claim waits for it is taken only if it is
still what the claim picked it as (never claimed twice, never a lease its owner just
extended or a row its owner just finished), and a row another transaction holds for
long does not stall the claim (past the lock_timeout it runs again with the lock and
passes that row by). The other transactions are real ones on their own connections;
the claim is seen waiting in ``pg_locks`` before they commit, so each case is the race
it names, not a row changed before the claim looked.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_relay.db import delivery
from outbox_relay.db.delivery import ClaimResult
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import insert_rows, row_state, run_sql
from tests.helpers.wait import wait_for


def small_claim(store: OutboxStore, owner: str = "claimer") -> ClaimResult:
    """What a worker that claims alone sends while its claims are small: the generic-plan
    claim without the row lock."""
    return store.claim(owner=owner, batch=10, lease_seconds=30, max_attempts=5, generic_plan=True, lock_rows=False)


def claim_while_holding(store: OutboxStore, pg_dsn: str, holder: psycopg.Connection[Any]) -> ClaimResult:
    """Run a small claim while ``holder``'s open transaction has changed one of its rows;
    once the claim is seen waiting for that row, commit the holder; the claim's result."""
    out: list[ClaimResult | BaseException] = []

    def run() -> None:
        try:
            out.append(small_claim(store))
        except BaseException as exc:  # the test reports it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: waiting_for_a_row_lock(pg_dsn, holder.info.backend_pid), timeout=30, message="claim waits")
    holder.commit()
    thread.join(timeout=30)
    result = out[0]
    assert isinstance(result, ClaimResult), result
    return result


def waiting_for_a_row_lock(pg_dsn: str, holder_pid: int) -> bool:
    """Is some backend waiting for a lock that ``holder_pid`` holds (the claim blocked
    on the row the holder changed)?"""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND %s = ANY(pg_blocking_pids(pid))",
            (holder_pid,),
        ).fetchone()
    return row is not None and row[0] > 0


@pytest.fixture
def long_lock_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim waits long enough for the test to see it waiting and commit the other
    transaction (the production bound is LOCKLESS_CLAIM_LOCK_TIMEOUT_MS)."""
    monkeypatch.setitem(delivery.LOCKLESS_CLAIM_SETTINGS, "lock_timeout", "60s")


def test_a_row_another_claim_takes_while_the_small_claim_waits_is_not_claimed_twice(
    store: OutboxStore, pg_dsn: str, table: str, long_lock_timeout: None
) -> None:
    first, second = insert_rows(pg_dsn, table, 2)
    ident = sql.Identifier(*table.split("."))
    with psycopg.connect(pg_dsn) as other:
        # Another claim of the first row, not yet committed.
        other.execute(
            sql.SQL(
                "UPDATE {} SET status = 'processing', lease_owner = 'other', lease_until = now() + interval '30 s', "
                "lease_version = lease_version + 1, attempts = attempts + 1 WHERE id = %s"
            ).format(ident),
            (first,),
        )
        result = claim_while_holding(store, pg_dsn, other)
    assert [r.id for r in result.rows] == [second]
    assert result.taken_by_others == 1  # the worker counts the claim as cut and looks again
    state = row_state(pg_dsn, table, first, ("status", "lease_owner", "lease_version", "attempts"))
    assert state == {"status": "processing", "lease_owner": "other", "lease_version": 1, "attempts": 1}


@pytest.mark.parametrize("change", ["extended", "finished"])
def test_an_expired_lease_its_owner_renews_or_finishes_while_the_small_claim_waits_stays_the_owners(
    store: OutboxStore, pg_dsn: str, table: str, long_lock_timeout: None, change: str
) -> None:
    (row_id,) = insert_rows(pg_dsn, table, 1)
    run_sql(
        pg_dsn,
        table,
        "UPDATE {t} SET status = 'processing', lease_owner = 'slow', lease_until = now() - interval '1 s', "
        "lease_version = 1, attempts = 1 WHERE id = %s",
        (row_id,),
    )
    ident = sql.Identifier(*table.split("."))
    statements: dict[str, str] = {
        # The lease keeper's extension and the owner's late finalize, both fenced by lease_version.
        "extended": "UPDATE {} SET lease_until = now() + interval '30 s' WHERE id = %s AND lease_version = 1",
        "finished": "UPDATE {} SET status = 'done', lease_owner = NULL, lease_until = NULL "
        "WHERE id = %s AND lease_version = 1",
    }
    with psycopg.connect(pg_dsn) as owner:
        cur: Any = owner.execute(sql.SQL(statements[change]).format(ident), (row_id,))
        assert cur.rowcount == 1
        result = claim_while_holding(store, pg_dsn, owner)
    assert result.rows == [] and result.taken_by_others == 1
    state = row_state(pg_dsn, table, row_id, ("status", "lease_owner", "lease_version"))
    expected = "processing" if change == "extended" else "done"
    assert state == {"status": expected, "lease_owner": "slow" if change == "extended" else None, "lease_version": 1}


def test_a_row_held_locked_for_long_does_not_stall_the_small_claim(store: OutboxStore, pg_dsn: str, table: str) -> None:
    held, *others = insert_rows(pg_dsn, table, 3)
    ident = sql.Identifier(*table.split("."))
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(sql.SQL("SELECT id FROM {} WHERE id = %s FOR UPDATE").format(ident), (held,))
        # Past the lock_timeout the claim runs again with the lock: SKIP LOCKED passes the held row by.
        result = small_claim(store)
        assert sorted(r.id for r in result.rows) == sorted(others)
        assert row_state(pg_dsn, table, held, ("status",)) == {"status": "pending"}
    assert [r.id for r in small_claim(store).rows] == [held]  # released: claimed by the next claim
