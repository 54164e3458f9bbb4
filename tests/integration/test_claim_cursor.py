"""Claims that start past the dead entries of the due index never skip a row.

Fast claims start at a recent key of the due index (claim_cursor.py), or at the start
of a writer transaction they saw open; a row that becomes due below it (its writer's
transaction began before rows that were claimed already, and wrote and committed after)
must still be delivered, by the next full claim.
Real PostgreSQL, concurrent writers whose transactions commit out of id order.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
import re
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from outbox_relay.db.claim_cursor import ClaimOutcome, ClaimPlan, DueCursor
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import DELETE_MODE, held_snapshot, run_sql, wait_for

INSERT = (
    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
    "VALUES ('order', %s, 'OrderCreated', '{{}}'::jsonb) RETURNING id"
)


def _claim_all(store: OutboxStore, seen: dict[int, int], *, batch: int = 50, lease_seconds: float = 30) -> int:
    result = store.claim(owner="t", batch=batch, lease_seconds=lease_seconds, max_attempts=5)
    for row in result.rows:
        seen[row.id] = seen.get(row.id, 0) + 1
    if result.rows:
        assert store.mark_done([(r.id, r.lease_version) for r in result.rows]) == {r.id for r in result.rows}
    return len(result.rows)


def _insert(conn: psycopg.Connection[Any], table: str, aggregate: str) -> int:
    row = conn.execute(sql.SQL(INSERT).format(sql.Identifier(*table.split("."))), (aggregate,)).fetchone()
    assert row is not None
    return int(row[0])


BULK_INSERT = (
    "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT 'order', 'a', 'OrderCreated', '{{}}'::jsonb FROM generate_series(1, 1000)"
)


def _deliver_thousands(dsn: str, table: str, store: OutboxStore, seen: dict[int, int], *, rounds: int) -> None:
    """Insert and deliver ``rounds`` x 1 000 rows: under a held snapshot, each leaves its
    dead entries at the front of the claim's indexes."""
    for _ in range(rounds):
        run_sql(dsn, table, BULK_INSERT)
        while _claim_all(store, seen, batch=1000):
            pass


def test_a_row_committed_below_the_fast_claims_start_is_delivered(pg_dsn: str, table: str, store: OutboxStore) -> None:
    store.due_cursor = DueCursor(
        lag_seconds=0.2,
        rescan_min_seconds=1.0,
        rescan_max_seconds=1.0,
        rescan_quiet_max_seconds=1.0,
        fast_above_seconds=0.0,
    )
    seen: dict[int, int] = {}
    # A writer transaction that begins (available_at = its start) and inserts only
    # later, after the claims below: no claim sees it holding a write lock on the outbox.
    late = psycopg.connect(pg_dsn)
    late.execute("SELECT now()")
    time.sleep(0.05)
    # Meanwhile other rows are written (higher available_at) and claimed.
    with psycopg.connect(pg_dsn, autocommit=True) as writer:
        for _ in range(3):
            ids = [_insert(writer, table, "quick") for _ in range(5)]
            assert ids
            _claim_all(store, seen)
            time.sleep(0.3)  # the fast claims' start moves past the late row's key
    late_id = _insert(late, table, "late")
    late.commit()  # now due, with a key below where fast claims start
    late.close()
    [(late_key_at,)] = run_sql(pg_dsn, table, "SELECT available_at FROM {t} WHERE id = %s", (late_id,))
    start = store.due_cursor.start_key()
    assert start is not None and start > (late_key_at, late_id), "the test must exercise a late row"
    fulls_before = store.due_cursor.full_claims
    deadline = time.monotonic() + 15
    while late_id not in seen and time.monotonic() < deadline:
        _claim_all(store, seen)
        time.sleep(0.05)
    assert seen.get(late_id) == 1, "the late row was skipped"
    assert store.due_cursor.full_claims > fulls_before  # found by a full claim
    assert store.due_cursor.fast_claims > 0


def test_no_row_is_skipped_with_concurrent_writers_committing_out_of_id_order(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    store.due_cursor = DueCursor(
        lag_seconds=0.1,
        rescan_min_seconds=0.5,
        rescan_max_seconds=0.5,
        rescan_quiet_max_seconds=0.5,
        fast_above_seconds=0.0,
    )
    inserted: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(pg_dsn) as conn:
                while not stop.is_set():
                    ids = [_insert(conn, table, f"w{seed}") for _ in range(rng.randint(1, 5))]
                    # Some transactions stay open well past the cursor's lag: their rows
                    # commit after rows with higher ids (and later available_at) were claimed.
                    time.sleep(rng.choice((0.0, 0.0, 0.01, 0.05, 0.4, 1.2)))
                    conn.commit()
                    with lock:
                        inserted.update(ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    seen: dict[int, int] = {}
    seen_lock = threading.Lock()

    def claimer() -> None:
        local: dict[int, int] = {}
        try:
            while not stop.is_set():
                if _claim_all(store, local, batch=20) == 0:
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
        with seen_lock:
            for row_id, n in local.items():
                seen[row_id] = seen.get(row_id, 0) + n

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=claimer) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    # Drain what is left (the full claims come round within their interval).
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _claim_all(store, seen) == 0 and set(seen) >= inserted:
            break
        time.sleep(0.05)
    assert inserted and set(seen) >= inserted, f"skipped: {sorted(inserted - set(seen))[:20]}"
    assert all(n == 1 for n in seen.values())  # each claimed once: finalized at once
    assert store.due_cursor.fast_claims > 0 and store.due_cursor.full_claims > 0
    left = run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE status IN ('pending', 'processing')")
    assert left == [(0,)]
    if DELETE_MODE:
        assert run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE status = 'done'") == [(0,)]


def test_fast_claims_read_past_the_dead_entries_of_aheld_snapshot(pg_dsn: str, table: str, store: OutboxStore) -> None:
    """Under a held snapshot the full claim's due scan visits every delivered row's dead
    entry; the fast claim's scan starts past them (buffers read, not time)."""
    with held_snapshot(pg_dsn):
        store.due_cursor = DueCursor(
            lag_seconds=0.0, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0
        )
        seen: dict[int, int] = {}
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            for _ in range(20):
                for _ in range(100):
                    _insert(writer, table, "a")
                while _claim_all(store, seen, batch=100):
                    pass
            _insert(writer, table, "a")
        start = store.due_cursor.start_key()
        assert start is not None

        def due_scan_buffers(start: Any) -> int:
            start_at, start_id = start if start is not None else (None, None)
            query = sql.SQL(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM {} WHERE status = 'pending' "
                "AND available_at <= now() AND (%(from_at)s::timestamptz IS NULL "
                "OR (available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint)) "
                "ORDER BY available_at, id LIMIT 100"
            ).format(sql.Identifier(*table.split(".")))
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("SET enable_bitmapscan = off")
                conn.execute("SET plan_cache_mode = force_custom_plan")
                (doc,) = conn.execute(query, {"from_at": start_at, "from_id": start_id}).fetchone()  # type: ignore[misc]
            plan_node = doc[0]["Plan"]
            return int(plan_node["Shared Hit Blocks"]) + int(plan_node["Shared Read Blocks"])

        full_buffers = due_scan_buffers(None)
        fast_buffers = due_scan_buffers(start)
        assert fast_buffers * 10 < full_buffers, (fast_buffers, full_buffers)


def _explain_buffers(dsn: str, query: Any, params: dict[str, Any]) -> int:
    """Shared buffers (hit + read) of one statement, from EXPLAIN (ANALYZE, BUFFERS)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET enable_bitmapscan = off")  # as the store's stats() runs it
        (doc,) = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query, params).fetchone()  # type: ignore[misc]
    plan_node = doc[0]["Plan"]
    return int(plan_node["Shared Hit Blocks"]) + int(plan_node["Shared Read Blocks"])


def test_queue_gauges_start_where_fast_claims_start_under_aheld_snapshot(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """While fast claims are in use, the queue gauges read from their starts: the same
    figures as a read from the front, at a small fraction of the buffers."""
    with held_snapshot(pg_dsn):
        store.due_cursor = DueCursor(
            lag_seconds=0.0, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0
        )
        seen: dict[int, int] = {}
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            for _ in range(20):
                for _ in range(100):
                    _insert(writer, table, "a")
                # Short leases: the processing index's dead entries (lease_until in the
                # past) then lie below where the gauges start reading it.
                while _claim_all(store, seen, batch=100, lease_seconds=0.2):
                    pass
            time.sleep(1.5)  # past the cursor's lease margin (1 s)
            in_flight = [_insert(writer, table, "b") for _ in range(2)]
            claimed = store.claim(owner="t", batch=10, lease_seconds=30, max_attempts=5)
            assert sorted(r.id for r in claimed.rows) == in_flight  # processing, not finalized
            waiting = [_insert(writer, table, "c") for _ in range(3)]
        bounds = store.due_cursor.gauge_bounds()
        assert bounds is not None and bounds.leases_from is not None
        bounded = store.stats()
        assert bounded.bounded
        cold = OutboxStore(pg_dsn, table, pool_size=1)  # its cursor never claimed: from the front
        cold.open()
        try:
            front = cold.stats()
            exact_front = cold.exact_depth(budget_ms=10_000, statuses=["pending", "processing"])
        finally:
            cold.close()
        assert not front.bounded
        assert bounded.queue_depth["pending"] == front.queue_depth["pending"] == len(waiting)
        assert bounded.queue_depth["processing"] == front.queue_depth["processing"] == len(in_flight)
        assert bounded.attempts == front.attempts == {0: len(waiting), 1: len(in_flight)}
        assert bounded.expired_leases == front.expired_leases == 0
        assert 0 < bounded.oldest_pending_age_seconds <= front.oldest_pending_age_seconds
        exact_bounded = store.exact_depth(budget_ms=10_000, statuses=["pending", "processing"])
        assert {s: c.n for s, c in exact_bounded.items()} == {s: c.n for s, c in exact_front.items()}
        assert {s: c.n for s, c in exact_front.items()} == {"pending": len(waiting), "processing": len(in_flight)}

        from outbox_relay.db.monitoring import bound_params

        backlog = store.sql.query("stats_backlog")
        full_buffers = _explain_buffers(pg_dsn, backlog, {"cap": 1000, **bound_params(None)})
        bounded_buffers = _explain_buffers(pg_dsn, backlog, {"cap": 1000, **bound_params(bounds)})
        assert bounded_buffers * 5 < full_buffers, (bounded_buffers, full_buffers)


def _arrays_rescanned_per_row(node: dict[str, Any]) -> bool:
    """A nested loop of the plan reads the outbox on its outer side and a function scan
    (unnest of the batch's arrays) on its inner side, i.e. again for every outbox row."""

    def has(n: dict[str, Any], pred: Any) -> bool:
        return bool(pred(n)) or any(has(c, pred) for c in n.get("Plans", []))

    if node["Node Type"] == "Nested Loop":
        outer, inner = node["Plans"][0], node["Plans"][1]
        if has(outer, lambda n: n.get("Relation Name") == "outbox") and has(
            inner, lambda n: n["Node Type"] == "Function Scan"
        ):
            return True
    return any(_arrays_rescanned_per_row(c) for c in node.get("Plans", []))


def _unbounded_index_scans(node: dict[str, Any]) -> list[str]:
    """Index scans of the outbox without an index condition (the whole index)."""
    found = []
    if node.get("Relation Name") == "outbox" and "Index" in node["Node Type"] and "Index Cond" not in node:
        found.append(node.get("Index Name", "?"))
    for child in node.get("Plans", []):
        found += _unbounded_index_scans(child)
    return found


def test_claim_and_finalize_never_read_the_whole_table_after_an_analyze_under_aheld_snapshot(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """An ANALYZE taken while vacuum is held back sees a few live rows among many dead
    versions; the claim's UPDATE and the finalize must still find their rows by
    primary key (their planner settings), never by reading the whole heap."""
    from outbox_relay.db.delivery import CLAIM_SETTINGS, FINALIZE_SETTINGS, finalize_params
    from outbox_relay.model import FinalizeItem

    with held_snapshot(pg_dsn):
        seen: dict[int, int] = {}
        _deliver_thousands(pg_dsn, table, store, seen, rounds=15)
        run_sql(pg_dsn, table, "ANALYZE {t}")  # the queue drained: about no live row among the dead versions
        run_sql(pg_dsn, table, BULK_INSERT)
        claimed = store.claim(owner="t", batch=1000, lease_seconds=30, max_attempts=5)
        assert len(claimed.rows) == 1000
        items = [FinalizeItem(r.id, r.lease_version, "done") for r in claimed.rows]

        def plan_text(query: Any, params: dict[str, Any], settings: dict[str, str]) -> str:
            with psycopg.connect(pg_dsn) as conn:  # a transaction: rolled back, nothing finalized
                for name, value in settings.items():
                    conn.execute("SELECT set_config(%s, %s, true)", (name, value))
                rows = conn.execute(sql.SQL("EXPLAIN ") + query, params).fetchall()
                conn.rollback()
            return "\n".join(r[0] for r in rows)

        finalize_plan = plan_text(store.sql.query("finalize"), finalize_params(items), FINALIZE_SETTINGS)
        whole_table = re.compile(r"Seq Scan on outbox\b")  # the outbox, not its state table
        assert not whole_table.search(finalize_plan), finalize_plan
        # nor unnests the batch's arrays once per outbox row: a nested loop with the
        # outbox outside and a function scan inside (1 000 x 1 000 for a 1 000-row batch)
        with psycopg.connect(pg_dsn) as conn:
            for name, value in FINALIZE_SETTINGS.items():
                conn.execute("SELECT set_config(%s, %s, true)", (name, value))
            query = sql.SQL("EXPLAIN (FORMAT JSON) ") + store.sql.query("finalize")
            (doc,) = conn.execute(query, finalize_params(items)).fetchone()  # type: ignore[misc]
            conn.rollback()
        assert not _arrays_rescanned_per_row(doc[0]["Plan"]), finalize_plan
        claim_params = {
            "owner": "t", "batch": 1000, "lease_seconds": 30.0, "max_attempts": 5, "max_batch_bytes": 2**62,
            "candidates": 1000, "max_message_bytes": None, "excluded_types": [],
        }  # fmt: skip
        claim_plan = plan_text(store.sql.query("claim"), claim_params, CLAIM_SETTINGS)
        assert not whole_table.search(claim_plan), claim_plan
        # nor its whole primary key index (every dead version) on the outer side of a
        # nested loop: each outbox scan has an index condition
        with psycopg.connect(pg_dsn) as conn:
            for name, value in CLAIM_SETTINGS.items():
                conn.execute("SELECT set_config(%s, %s, true)", (name, value))
            query = sql.SQL("EXPLAIN (FORMAT JSON) ") + store.sql.query("claim")
            (doc,) = conn.execute(query, claim_params).fetchone()  # type: ignore[misc]
            conn.rollback()
        assert not _unbounded_index_scans(doc[0]["Plan"]), claim_plan
        assert store.mark_done([(r.id, r.lease_version) for r in claimed.rows]) == {r.id for r in claimed.rows}


def test_a_fast_claim_waits_for_an_open_writer_transaction_without_a_full_claim(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """A writer transaction that has inserted into the outbox and is still open holds a
    write lock on it: fast claims start no later than its start, so its rows (keyed by
    that start) are delivered by the fast claims that follow its commit, without
    waiting for a full claim."""
    store.due_cursor = DueCursor(
        lag_seconds=0.0, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0
    )
    seen: dict[int, int] = {}
    late = psycopg.connect(pg_dsn)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            _insert(writer, table, "first")
            assert _claim_all(store, seen) == 1  # the one full claim; every later claim is fast
            late.execute("SELECT now()")
            late_id = _insert(late, table, "late")
            time.sleep(0.05)
            for _ in range(3):
                ids = [_insert(writer, table, "quick") for _ in range(5)]
                assert min(ids) > late_id
                assert _claim_all(store, seen) == 5
                time.sleep(0.1)
        start = store.due_cursor.start_key()
        row = late.execute(
            sql.SQL("SELECT available_at FROM {} WHERE id = %s").format(sql.Identifier(*table.split("."))), (late_id,)
        ).fetchone()
        assert row is not None
        # Every claimed row's key is above the late row's; the start was held at the
        # open writer's start (its rows' available_at), not moved past it.
        assert start == (row[0], 0)
        late.commit()
    finally:
        late.close()
    fulls = store.due_cursor.full_claims
    assert _claim_all(store, seen) == 1 and seen.get(late_id) == 1, "the late row was not claimed"
    assert store.due_cursor.full_claims == fulls == 1  # by a fast claim


def test_the_fast_claim_statement_reads_past_the_dead_entries_of_aheld_snapshot(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """The claim statement itself, as the relay sends it: under a held snapshot the fast
    one (window start, no lease scan this time) reads a small fraction of the buffers
    of the full one, whose scans walk every delivered row's dead entries."""
    from outbox_relay.db.delivery import CLAIM_SETTINGS

    with held_snapshot(pg_dsn):
        store.due_cursor = DueCursor(
            lag_seconds=0.0, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0
        )
        seen: dict[int, int] = {}
        _deliver_thousands(pg_dsn, table, store, seen, rounds=10)
        run_sql(pg_dsn, table, BULK_INSERT)
        while _claim_all(store, seen, batch=100):  # the window: the last claim's 100 rows
            pass
        run_sql(pg_dsn, table, BULK_INSERT)
        start = store.due_cursor.start_key()
        assert start is not None
        params = {
            "owner": "t", "batch": 10, "lease_seconds": 30.0, "max_attempts": 5, "max_batch_bytes": 2**62,
            "candidates": 10, "max_message_bytes": None, "excluded_types": [],
        }  # fmt: skip

        def claim_buffers(statement: Any, extra: dict[str, Any]) -> int:
            with psycopg.connect(pg_dsn) as conn:  # a transaction: rolled back, nothing claimed
                for name, value in CLAIM_SETTINGS.items():
                    conn.execute("SELECT set_config(%s, %s, true)", (name, value))
                query = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + statement
                (doc,) = conn.execute(query, {**params, **extra}).fetchone()  # type: ignore[misc]
                conn.rollback()
            # The index scans' buffers (the CTEs that read the indexes), not the
            # UPDATE's, which writes the same claimed rows in both.
            return sum(
                int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])
                for node in doc[0]["Plan"]["Plans"]
                if node.get("Subplan Name") in ("CTE victims", "CTE expired", "CTE due")
            )

        full = claim_buffers(store._full_claim_statement, {})
        fast_params = {
            "from_at": start[0], "from_id": start[1], "leases_from": None, "lease_scan": False,
            "writers_check": True, "writers_within_seconds": 5.0,
        }  # fmt: skip
        fast = claim_buffers(store._claim_statement, fast_params)
        assert fast * 10 < full, (fast, full)


class _Traffic:
    """Rows flowing while a test runs: a writer inserting ``rows_per_insert`` rows every
    ``interval_seconds`` (autocommit) and two claimers delivering what they claim, as a
    relay's workers do. ``seen``: id -> times claimed, read under ``lock``."""

    def __init__(
        self, dsn: str, table: str, store: OutboxStore, *, rows_per_insert: int = 10, interval_seconds: float = 0.02
    ) -> None:
        self.seen: dict[int, int] = {}
        self.lock = threading.Lock()
        self.written = 0
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        insert = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', 'bg', 'OrderCreated', '{{}}'::jsonb FROM generate_series(1, %s)"
        ).format(sql.Identifier(*table.split(".")))

        def write() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    while not self._stop.is_set():
                        conn.execute(insert, (rows_per_insert,))
                        self.written += rows_per_insert
                        self._stop.wait(interval_seconds)
            except BaseException as exc:  # reported by stop()
                self._errors.append(exc)

        def claim() -> None:
            try:
                while not self._stop.is_set():
                    local: dict[int, int] = {}
                    if _claim_all(store, local, batch=500) == 0:
                        self._stop.wait(0.005)
                    with self.lock:
                        for row_id, n in local.items():
                            self.seen[row_id] = self.seen.get(row_id, 0) + n
            except BaseException as exc:
                self._errors.append(exc)

        # Two claimers, as two workers: their looks for open writers overlap.
        self._threads = [threading.Thread(target=write), threading.Thread(target=claim), threading.Thread(target=claim)]
        for thread in self._threads:
            thread.start()

    def claimed(self, ids: set[int]) -> bool:
        with self.lock:
            return ids <= self.seen.keys()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        assert not self._errors, self._errors
        assert all(n == 1 for n in self.seen.values())  # each claimed once: finalized at once


def _pressure_cursor(*, full_every_seconds: float, writers_within_seconds: float = 1.0) -> DueCursor:
    """Fast claims from the start (as under a held snapshot); a full claim every
    ``full_every_seconds``; writers open longer than ``writers_within_seconds`` are long."""
    return DueCursor(
        lag_seconds=0.1,
        rescan_min_seconds=full_every_seconds,
        rescan_max_seconds=full_every_seconds,
        rescan_quiet_max_seconds=full_every_seconds,
        fast_above_seconds=0.0,
        writers_within_seconds=writers_within_seconds,
    )


def _key_of(dsn: str, table: str, row_id: int) -> tuple[Any, int]:
    [(available_at,)] = run_sql(dsn, table, "SELECT available_at FROM {t} WHERE id = %s", (row_id,))
    return (available_at, row_id)


BATCH_INSERT = (
    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT 'order', 'batch', 'OrderCreated', '{{}}'::jsonb FROM generate_series(1, %s) RETURNING id"
)


def test_a_long_writer_transactions_rows_are_claimed_soon_after_its_commit_without_a_full_claim(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """A batch job writes thousands of rows in one transaction that stays open for
    longer than writers_within_seconds, while other rows flow and a snapshot is held.
    Its rows are keyed by its start, far below where fast claims start by its commit;
    the cursor remembered it open, and once it is gone one catch-up claim from its
    start, and the fast claims after it, take them all. Full claims come once an hour
    here: only the catch-up could have found them."""
    with held_snapshot(pg_dsn):
        store.due_cursor = _pressure_cursor(full_every_seconds=3600, writers_within_seconds=1.0)
        run_sql(pg_dsn, table, BULK_INSERT)
        assert _claim_all(store, {}, batch=1000) == 1000  # the one full claim; every later claim is fast
        traffic = _Traffic(pg_dsn, table, store)
        batch = psycopg.connect(pg_dsn)
        try:
            insert = sql.SQL(BATCH_INSERT).format(sql.Identifier(*table.split(".")))
            batch_ids = {r[0] for r in batch.execute(insert, (1000,)).fetchall()}
            time.sleep(1.5)  # open for longer than writers_within_seconds
            batch_ids |= {r[0] for r in batch.execute(insert, (2000,)).fetchall()}
            time.sleep(1.0)
            started = batch.execute("SELECT now()").fetchone()
            assert started is not None
            start = store.due_cursor.start_key()
            assert start is not None and start > (started[0], max(batch_ids)), "the test must exercise rows below"
            batch.commit()
            committed_at = time.monotonic()
        finally:
            batch.close()
        try:
            wait_for(lambda: traffic.claimed(batch_ids), timeout=10, interval=0.02, message="the batch's rows")
            delay = time.monotonic() - committed_at
        finally:
            traffic.stop()
        assert traffic.written > 0 and len(batch_ids) == 3000
        assert store.due_cursor.full_claims == 1, "a full claim came round"
        assert store.due_cursor.catch_up_claims >= 1
        assert delay <= 10  # bounded wait; the claim after the next look (0.04 s) takes them


def test_a_long_writer_that_rolls_back_costs_one_catch_up_claim_and_loses_nothing(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    with held_snapshot(pg_dsn):
        store.due_cursor = _pressure_cursor(full_every_seconds=3600, writers_within_seconds=0.5)
        run_sql(pg_dsn, table, BULK_INSERT)
        assert _claim_all(store, {}, batch=1000) == 1000
        traffic = _Traffic(pg_dsn, table, store)
        try:
            with psycopg.connect(pg_dsn) as batch:
                batch.execute(sql.SQL(BATCH_INSERT).format(sql.Identifier(*table.split("."))), (500,))
                time.sleep(1.5)
                batch.rollback()
            wait_for(lambda: store.due_cursor.catch_up_claims >= 1, timeout=10, interval=0.02, message="a catch-up")
            time.sleep(0.3)
        finally:
            traffic.stop()
        wait_for(lambda: _claim_all(store, traffic.seen, batch=1000) == 0, timeout=10, message="the rest")
        left = run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE status IN ('pending', 'processing')")
        assert left == [(0,)]
        assert len(traffic.seen) == traffic.written
        assert store.due_cursor.full_claims == 1


def _move_the_fast_start_past(pg_dsn: str, table: str, store: OutboxStore, seen: dict[int, int]) -> None:
    """Write and claim newer rows for a while: fast claims then start above any older key."""
    with psycopg.connect(pg_dsn, autocommit=True) as writer:
        for _ in range(3):
            for _ in range(5):
                _insert(writer, table, "quick")
            assert _claim_all(store, seen) == 5
            time.sleep(0.15)


def _delivered_by_a_full_claim(pg_dsn: str, table: str, store: OutboxStore, seen: dict[int, int], row_id: int) -> None:
    start = store.due_cursor.start_key()
    assert start is not None and start > _key_of(pg_dsn, table, row_id), "the test must exercise a row below"
    fulls_before = store.due_cursor.full_claims
    deadline = time.monotonic() + 15
    while row_id not in seen and time.monotonic() < deadline:
        _claim_all(store, seen)
        time.sleep(0.05)
    assert seen.get(row_id) == 1, "the row below the fast start was skipped"
    assert store.due_cursor.full_claims > fulls_before  # found by a full claim


def test_a_row_whose_claim_rolled_back_is_delivered(pg_dsn: str, table: str, store: OutboxStore) -> None:
    """A claim that rolled back (its connection lost before COMMIT) leaves its rows
    pending, while the other claims moved on past them."""
    store.due_cursor = _pressure_cursor(full_every_seconds=1.0)
    seen: dict[int, int] = {}
    with psycopg.connect(pg_dsn, autocommit=True) as writer:
        _insert(writer, table, "first")
        assert _claim_all(store, seen) == 1
        row_id = _insert(writer, table, "rolled-back")
    # The claim's own UPDATE, from a session of the relay (its application_name: the
    # look for open writers leaves it out), rolled back after the others claimed past it.
    with psycopg.connect(pg_dsn, application_name="outbox-relay") as claim:
        claim.execute(
            sql.SQL(
                "UPDATE {} SET status = 'processing', lease_owner = 'gone', lease_until = now() + interval '30 s', "
                "lease_version = lease_version + 1, attempts = attempts + 1 WHERE id = %s"
            ).format(sql.Identifier(*table.split("."))),
            (row_id,),
        )
        _move_the_fast_start_past(pg_dsn, table, store, seen)
        claim.rollback()
    _delivered_by_a_full_claim(pg_dsn, table, store, seen, row_id)


def test_a_row_with_an_explicit_past_available_at_is_delivered(pg_dsn: str, table: str, store: OutboxStore) -> None:
    store.due_cursor = _pressure_cursor(full_every_seconds=1.0)
    seen: dict[int, int] = {}
    _move_the_fast_start_past(pg_dsn, table, store, seen)
    [(row_id,)] = run_sql(
        pg_dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, available_at) "
        "VALUES ('order', 'past', 'OrderCreated', '{{}}'::jsonb, now() - interval '10 minutes') RETURNING id",
    )
    _delivered_by_a_full_claim(pg_dsn, table, store, seen, row_id)


def test_a_long_writer_the_relay_may_not_see_is_delivered_by_a_full_claim(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """Without pg_read_all_stats the relay's role does not see another role's
    transaction start: such a writer, however long, is neither held in the window nor
    remembered for a catch-up; its rows wait for a full claim."""
    role = "t_relay_" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        for statement in store.sql.grants("relay", role):
            if "pg_read_all_stats" not in statement.as_string(conn):
                conn.execute(statement)
    try:
        with OutboxStore(psycopg.conninfo.make_conninfo(pg_dsn, user=role), table, pool_size=2) as relay_store:
            relay_store.due_cursor = _pressure_cursor(full_every_seconds=1.0, writers_within_seconds=0.5)
            seen: dict[int, int] = {}
            with psycopg.connect(pg_dsn, autocommit=True) as writer:
                _insert(writer, table, "first")
            assert _claim_all(relay_store, seen) == 1
            with psycopg.connect(pg_dsn) as hidden:  # another role (the suite's superuser)
                hidden_id = _insert(hidden, table, "hidden")
                _move_the_fast_start_past(pg_dsn, table, relay_store, seen)
                time.sleep(0.6)  # older than writers_within_seconds
                _claim_all(relay_store, seen)
                hidden.commit()
            _delivered_by_a_full_claim(pg_dsn, table, relay_store, seen, hidden_id)
            assert relay_store.due_cursor.catch_up_claims == 0
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_claim_that_sees_a_long_writer_end_sends_the_catch_up_at_once(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """Nothing else flowing: the empty claim whose look saw the long writer gone sends
    the catch-up claim in the same call, rather than leaving the rows to the worker's
    next claim after its idle wait."""
    store.due_cursor = _pressure_cursor(full_every_seconds=3600, writers_within_seconds=0.5)
    seen: dict[int, int] = {}
    with psycopg.connect(pg_dsn, autocommit=True) as writer:
        _insert(writer, table, "first")
        assert _claim_all(store, seen) == 1
        with psycopg.connect(pg_dsn) as batch:
            ids = [r[0] for r in batch.execute(sql.SQL(BATCH_INSERT).format(sql.Identifier(*table.split("."))), (100,))]
            deadline = time.monotonic() + 1.0  # older than writers_within_seconds, seen by the looks meanwhile
            while time.monotonic() < deadline:
                _insert(writer, table, "quick")
                assert _claim_all(store, seen) == 1
                time.sleep(0.05)
            assert store.due_cursor._long_writers, "the look did not see the long writer"
            batch.commit()
    time.sleep(0.05)  # the next claim looks again
    result = store.claim(owner="t", batch=500, lease_seconds=30, max_attempts=5)
    assert sorted(r.id for r in result.rows) == sorted(ids)
    assert store.due_cursor.catch_up_claims == 1 and store.due_cursor.full_claims == 1


SWEEP_DUE_RANGE = (
    "SELECT id FROM {} WHERE status = 'pending' AND available_at <= now() "
    "AND (available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint) AND available_at <= %(to_at)s "
    "AND (available_at, id) < (%(to_at)s::timestamptz, %(to_id)s::bigint) ORDER BY available_at, id LIMIT 100"
)
SWEEP_LEASE_RANGE = (
    "SELECT id FROM {} WHERE status = 'processing' AND lease_until < now() "
    "AND lease_until >= %(leases_from)s::timestamptz AND lease_until < %(leases_to)s::timestamptz "
    "ORDER BY lease_until LIMIT 100"
)
FRONT = dt.datetime(1, 1, 2, tzinfo=dt.UTC)


def _step_buffers(dsn: str, table: str, plan: ClaimPlan) -> int:
    """Buffers the index scans of one sweep step read (the claim statement's due and
    expired-lease scans over the step's ranges), from EXPLAIN (ANALYZE, BUFFERS)."""
    ident = sql.Identifier(*table.split("."))
    assert plan.until is not None
    from_at, from_id = plan.start if plan.start is not None else (FRONT, 0)
    due = _explain_buffers(
        dsn,
        sql.SQL(SWEEP_DUE_RANGE).format(ident),
        {"from_at": from_at, "from_id": from_id, "to_at": plan.until[0], "to_id": plan.until[1]},
    )
    leases = _explain_buffers(
        dsn,
        sql.SQL(SWEEP_LEASE_RANGE).format(ident),
        {"leases_from": plan.leases_from or FRONT, "leases_to": plan.leases_until or FRONT},
    )
    return due + leases


class _MeasuredSweep:
    """The store's cursor, with each sweep step's cost taken from the buffers its
    ranges read (a count: the steps' widths then do not depend on this machine's speed)."""

    SECONDS_PER_BUFFER = 0.0005  # 2 000 buffers a second of a step's target

    def __init__(self, dsn: str, table: str, cursor: DueCursor) -> None:
        self.steps: list[tuple[ClaimPlan, int]] = []
        begin, end = cursor.begin, cursor.end

        def measured_end(plan: ClaimPlan, outcomes: list[ClaimOutcome], elapsed: float, claimed_rows: int = 0) -> None:
            if plan.sweep:
                buffers = _step_buffers(dsn, table, plan)
                self.steps.append((plan, buffers))
                cost = buffers * self.SECONDS_PER_BUFFER
                outcomes = [dataclasses.replace(o, server_seconds=cost / len(outcomes)) for o in outcomes]
            end(plan, outcomes, elapsed, claimed_rows)

        cursor.end = measured_end  # type: ignore[method-assign]
        self._begin = begin


def _front_buffers(dsn: str, table: str) -> int:
    """What the full claim's two scans read from the front of their indexes."""
    ident = sql.Identifier(*table.split("."))
    due = _explain_buffers(
        dsn,
        sql.SQL(
            "SELECT id FROM {} WHERE status = 'pending' AND available_at <= now() ORDER BY available_at, id LIMIT 100"
        ).format(ident),
        {},
    )
    leases = _explain_buffers(
        dsn,
        sql.SQL(
            "SELECT id FROM {} WHERE status = 'processing' AND lease_until < now() ORDER BY lease_until LIMIT 100"
        ).format(ident),
        {},
    )
    return due + leases


def test_a_full_claim_step_reads_a_bounded_range_as_dead_entries_grow_and_late_rows_are_still_delivered(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """Under a held snapshot the full claim is a sweep of key ranges: one step's scans
    read about its target's worth of buffers after 5 000 delivered rows as after
    30 000, while a scan from the front reads six times as many; a pass still finds a row written with
    an explicit available_at among the dead entries (below the fast start), and a row
    whose claim lease expired below the processing index's fast start."""
    with held_snapshot(pg_dsn):
        cursor = DueCursor(
            lag_seconds=0.1,
            rescan_min_seconds=3600,
            rescan_max_seconds=3600,
            rescan_quiet_max_seconds=3600,
            fast_above_seconds=0.0,
            sweep_step_seconds=0.05,
        )
        store.due_cursor = cursor
        measured = _MeasuredSweep(pg_dsn, table, cursor)
        seen: dict[int, int] = {}

        def deliver(rounds: int) -> None:
            for _ in range(rounds):  # 1 000 rows a round, a third of a second apart in key
                run_sql(pg_dsn, table, BULK_INSERT)
                while _claim_all(store, seen, batch=1000, lease_seconds=0.2):
                    pass
                time.sleep(0.3)
            time.sleep(1.2)  # their leases (0.2 s) older than the cursor's lease margin
            with psycopg.connect(pg_dsn, autocommit=True) as writer:
                _insert(writer, table, "newest")
            assert _claim_all(store, seen) == 1  # the processing index's fast start moves past them

        def one_pass() -> list[int]:
            """Steps, at once one after the other, until a pass that begins now has
            completed (after the one under way, if any): their buffers."""
            cursor._rescan_min = cursor._rescan_max = 0.0
            cursor._sweep_next_at = float("-inf")
            first = len(measured.steps)
            target = cursor.sweep.passes + (2 if cursor.sweep.under_way() else 1)
            deadline = time.monotonic() + 60
            while cursor.sweep.passes < target and time.monotonic() < deadline:
                _claim_all(store, seen, batch=100)
            assert cursor.sweep.passes >= target, "the pass did not complete"
            cursor._rescan_min = cursor._rescan_max = 3600.0
            cursor._sweep_next_at = time.monotonic() + 3600
            return [buffers for _, buffers in measured.steps[first:]]

        deliver(5)
        front_small = _front_buffers(pg_dsn, table)
        steps_small = one_pass()
        deliver(25)
        front_large = _front_buffers(pg_dsn, table)
        # Late rows among the dead entries: an explicit available_at in the past, and a
        # lease that expired below where fast claims read the processing index.
        [(past_id,)] = run_sql(
            pg_dsn,
            table,
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, available_at) "
            "VALUES ('order', 'past', 'OrderCreated', '{{}}'::jsonb, now() - interval '3 seconds') RETURNING id",
        )
        [(expired_id,)] = run_sql(
            pg_dsn,
            table,
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, lease_owner, lease_until, "
            "lease_version, attempts) VALUES ('order', 'expired', 'OrderCreated', '{{}}'::jsonb, 'processing', 'gone', "
            "now() - interval '4 seconds', 1, 1) RETURNING id",
        )
        start = cursor.start_key()
        bounds = cursor.gauge_bounds()
        assert start is not None and start > _key_of(pg_dsn, table, past_id), "the test must exercise a row below"
        assert bounds is not None and bounds.leases_from is not None
        [(expired_until,)] = run_sql(pg_dsn, table, "SELECT lease_until FROM {t} WHERE id = %s", (expired_id,))
        assert expired_until < bounds.leases_from, "the test must exercise a lease below"
        steps_large = one_pass()
        assert seen.get(past_id) == 1 and seen.get(expired_id) == 1, "a late row was skipped"
        assert cursor.start_key() is not None and cursor.start_key() >= start  # type: ignore[operator]
    # A step's target (0.05 s) is 100 buffers here. The steps through the dead entries
    # read about that many (a range's width is at most twice the last one's, so a step
    # just below an idle stretch of keys may read more), after 5 000 delivered rows as
    # after 30 000; a scan from the front reads six times as many, more than any step.
    target_buffers = 0.05 / _MeasuredSweep.SECONDS_PER_BUFFER
    assert front_large > 4 * front_small, (front_small, front_large)
    for steps, at_least in ((steps_small, 2), (steps_large, 6)):
        dense = sorted(b for b in steps if b > 20)  # the steps through the dead entries
        # the lower median: with two such steps, one may be the step just below an idle stretch
        assert len(dense) >= at_least and dense[(len(dense) - 1) // 2] <= 2 * target_buffers, steps
    assert front_large > 3 * max(steps_large), (steps_large, front_large)


def test_a_sweep_step_that_runs_out_of_its_own_timeout_is_tried_narrower_and_the_claim_goes_on(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """A step's own statement timeout (4 targets; 1 ms here) cancels it far below the
    claim's: the worker's claim does not fail, it claims from the fast start instead."""
    with held_snapshot(pg_dsn):
        cursor = DueCursor(
            lag_seconds=0.1,
            rescan_min_seconds=0.2,
            rescan_max_seconds=0.2,
            fast_above_seconds=0.0,
            sweep_step_seconds=0.00025,
        )
        store.due_cursor = cursor
        seen: dict[int, int] = {}
        _deliver_thousands(pg_dsn, table, store, seen, rounds=5)
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            waiting = {_insert(writer, table, "waiting") for _ in range(3)}
        cursor._sweep_next_at = float("-inf")
        failures_before = cursor.sweep_steps
        deadline = time.monotonic() + 20
        while not waiting <= seen.keys() and time.monotonic() < deadline:
            _claim_all(store, seen)  # never raises: a cancelled step is the cursor's affair
        assert waiting <= seen.keys()
        assert cursor.sweep_steps > failures_before
        assert cursor.sweep_timeouts > 0, "no step ran out of its own timeout"


STATIO = (
    "SELECT coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0), "
    "coalesce(idx_blks_read, 0) + coalesce(idx_blks_hit, 0) "
    "FROM pg_statio_user_tables WHERE relid = %s::regclass"
)


def _blocks_of(dsn: str, table: str, run: Any) -> tuple[int, int]:
    """(heap, index) blocks of the outbox read while ``run()`` ran in other sessions,
    from pg_statio_user_tables once the other sessions' statistics have arrived."""

    def now() -> tuple[int, int]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(STATIO, (table,)).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

    before = now()
    run()
    seen = now()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a backend reports its figures when it ends
        time.sleep(0.3)
        later = now()
        if later == seen:
            break
        seen = later
    return seen[0] - before[0], seen[1] - before[1]


def test_status_in_its_own_process_counts_from_where_the_relays_claims_start_under_aheld_snapshot(
    pg_dsn: str, table: str, store: OutboxStore, monkeypatch: Any
) -> None:
    """The relay publishes where its fast claims start while vacuum is held back;
    `status` in a process of its own starts its pending and processing figures there
    (and says so): the same figures as from the front, reading a small fraction of the
    index blocks. Once nothing is published, the counts read from the front again."""
    from outbox_relay.db import claim_cursor
    from tests.helpers.cli import cli, cli_env

    monkeypatch.setattr(claim_cursor, "BOUNDS_PUBLISH_INTERVAL_SECONDS", 0.0)  # every claim publishes
    # The blocks counted are every session's: an auto-ANALYZE of the freshly filled
    # table inside one of the two measurements would add up to the whole heap to it.
    run_sql(pg_dsn, table, "ALTER TABLE {t} SET (autovacuum_enabled = false)")
    with held_snapshot(pg_dsn):
        store.due_cursor = DueCursor(
            lag_seconds=0.0, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0
        )
        seen: dict[int, int] = {}
        for _ in range(20):
            run_sql(pg_dsn, table, BULK_INSERT)
            while _claim_all(store, seen, batch=1000, lease_seconds=0.2):
                pass
        time.sleep(1.5)  # their leases older than the cursor's lease margin
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            in_flight = [_insert(writer, table, "b") for _ in range(2)]
            claimed = store.claim(owner="t", batch=10, lease_seconds=30, max_attempts=5)  # publishes
            assert sorted(r.id for r in claimed.rows) == in_flight
            waiting = [_insert(writer, table, "c") for _ in range(3)]
        published = store.published_gauge_bounds()
        assert published is not None and published.due_from == store.due_cursor.gauge_bounds().due_from  # type: ignore[union-attr]
        env = cli_env(pg_dsn, table)
        docs: list[dict[str, Any]] = []

        def status() -> None:
            proc = cli("status", "--json", env=env)
            assert proc.returncode == 0, proc.stderr
            docs.append(json.loads(proc.stdout))

        bounded_heap, bounded_index = _blocks_of(pg_dsn, table, status)
        human = cli("status", env=env)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # none published any more
            state = sql.SQL(store.sql.regclass_of("relay_state"))
            conn.execute(sql.SQL("UPDATE {} SET gauge_bounds = '{{}}'::jsonb").format(state))
        front_heap, front_index = _blocks_of(pg_dsn, table, status)
    bounded, front = docs
    assert bounded["counted_from"]["pending_from"]["id"] == published.due_from[1]
    assert front["counted_from"] is None
    for doc in (bounded, front):
        assert doc["queue_depth"]["pending"] == len(waiting)
        assert doc["queue_depth"]["processing"] == len(in_flight)
        assert doc["expired_leases"] == 0 and doc["attempts"] == {"0": len(waiting), "1": len(in_flight)}
    assert "where the relays' claims start" in human.stdout
    [(heap_pages,)] = run_sql(pg_dsn, table, "SELECT pg_relation_size(%s::regclass) / 8192", (table,))
    # Done rows have no index: both read the table once for their count. Beyond that
    # pass, status from the published start reads a small fraction of the heap blocks
    # (one per dead entry's row, from the front) and of the index blocks.
    assert (bounded_heap - heap_pages) * 20 < front_heap - heap_pages, (heap_pages, bounded_heap, front_heap)
    assert bounded_index * 4 < front_index, (bounded_index, front_index)


def test_the_claim_finds_its_rows_by_primary_key_when_the_statistics_see_an_empty_table(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """Statistics taken while the outbox was empty (delete mode drains it; an ANALYZE then
    sees no row), then one writer transaction commits many rows: the claim's generic
    plan must still look its picked rows up by primary key. With the join to the picked
    rows alone, the planner (expecting one outbox row) read the whole primary key as the
    outer side of a nested loop, in the claim's UPDATE and in the reap's, on every claim:
    with 100 000 such rows each claim ran into its statement timeout for a minute."""
    from outbox_relay.db.delivery import INDEX_FRONT, PLAIN_CLAIM_SETTINGS

    rows_committed = 20_000
    insert = (
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'a' || (g %% 50), 'OrderCreated', '{{}}'::jsonb FROM generate_series(1, %s) AS g"
    )
    # A drained table: its pages are there (one row left at the end keeps VACUUM from
    # truncating them), its statistics count one live row in all of them.
    run_sql(pg_dsn, table, insert, (rows_committed,))
    run_sql(pg_dsn, table, "DELETE FROM {t} WHERE id < (SELECT max(id) FROM {t})")
    run_sql(pg_dsn, table, "UPDATE {t} SET status = 'done' WHERE status = 'pending'")
    run_sql(pg_dsn, table, "VACUUM (ANALYZE) {t}")
    run_sql(pg_dsn, table, insert, (rows_committed,))  # into the same pages: still "one row" to the planner
    for full_claim in (True, False):  # the statement from the front, and a fast claim's
        params: dict[str, Any] = {
            "owner": "t", "batch": 10, "lease_seconds": 30.0, "max_attempts": 5, "max_batch_bytes": 2**62,
            "candidates": 10, "max_message_bytes": None, "excluded_types": [], "ordered_types": [],
            "all_ordered": False, "generic_plan": True, "from_at": INDEX_FRONT, "from_id": 0,
            "leases_from": INDEX_FRONT, "lease_scan": True, "writers_check": True, "writers_within_seconds": 1.0,
            "full_claim": full_claim,
        }  # fmt: skip
        with psycopg.connect(pg_dsn) as conn:  # one transaction, rolled back: nothing claimed
            for _ in range(6):  # past the prepared statement's first executions, to its generic plan
                claimed: list[Any] = []
                store._plain_claim(conn.cursor(), dict(params), claimed, [], settings=PLAIN_CLAIM_SETTINGS)
                assert len(claimed) == 10
                conn.rollback()
            store._plain_claim(conn.cursor(), dict(params), claimed, [], settings=PLAIN_CLAIM_SETTINGS)
            fetched = conn.execute(
                "SELECT idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relid = %s::regclass", (table,)
            ).fetchone()
            conn.rollback()
        assert fetched is not None
        # 10 rows claimed: a few dozen index fetches, never the 20 000 committed rows
        assert int(fetched[0]) < 500, (full_claim, fetched)
