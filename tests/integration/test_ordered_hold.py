"""Ordered claims under a held snapshot (ordered_bounds.py): fast ordered claims read
each aggregate's index from a proven bound and find new aggregates in the due index
from where their cursor starts, so they read past the dead entries a held xmin horizon
leaves; and the order of every aggregate holds, a row committed late below the fast
start included.

Real PostgreSQL; counts (buffers from EXPLAIN (ANALYZE, BUFFERS), rows, claims), no
timing targets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_relay.db.claim_cursor import DueCursor
from outbox_relay.db.delivery import CLAIM_SETTINGS, INDEX_FRONT, ORDERED_DISCOVER_ROWS
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE, held_snapshot, run_sql

ALL = ["*"]
AGGREGATES = 10
ROUND_ROWS = 1000
BULK_INSERT = (
    "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
    "SELECT 'order', 'a' || (g %% " + str(AGGREGATES) + "), 'OrderCreated', '{{}}'::jsonb "
    "FROM generate_series(1, %s) AS g"
)


@pytest.fixture
def store(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    s = OutboxStore(pg_dsn, table, pool_size=4)
    s.open()
    s.migrate(ordering=True, on_done=ON_DONE)
    try:
        yield s
    finally:
        s.close()


def _fast_ordered_cursor() -> DueCursor:
    """Fast ordered claims from the first claim on (as under a held horizon), one full
    claim (the first: the cursor has no start yet) and no other during the test."""
    return DueCursor(
        lag_seconds=0.2,
        rescan_min_seconds=600.0,
        rescan_max_seconds=600.0,
        rescan_quiet_max_seconds=600.0,
        fast_above_seconds=0.0,
    )


def _claim_and_finish(store: OutboxStore, delivered: list[tuple[str, int]], *, run_length: int = 20) -> int:
    rows = store.claim(
        owner="t", batch=200, lease_seconds=30, max_attempts=5, ordered_types=ALL, run_length=run_length
    ).rows
    if rows:
        assert store.mark_done([(r.id, r.lease_version) for r in rows]) == {r.id for r in rows}
        delivered.extend((r.aggregate_id, r.id) for r in sorted(rows, key=lambda r: r.id))
    return len(rows)


def _drain(store: OutboxStore, delivered: list[tuple[str, int]], *, claims: int = 200) -> None:
    empty = 0
    for _ in range(claims):  # bounded
        if _claim_and_finish(store, delivered):
            empty = 0
        else:
            empty += 1
            if empty >= 3:
                return


def _explain(dsn: str, query: Any, params: dict[str, Any]) -> int:
    """Shared buffers (hit + read) of one statement run under the claim's planner
    settings, from EXPLAIN (ANALYZE, BUFFERS); rolled back."""
    with psycopg.connect(dsn) as conn:
        for name, value in CLAIM_SETTINGS.items():
            conn.execute("SELECT set_config(%s, %s, true)", (name, value))
        (doc,) = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query, params).fetchone()  # type: ignore[misc]
        conn.rollback()
    plan_node = doc[0]["Plan"]
    return int(plan_node["Shared Hit Blocks"]) + int(plan_node["Shared Read Blocks"])


def _ids(dsn: str, query: Any, params: dict[str, Any], *, kind: str | None = None) -> set[int]:
    """The rows a claim statement claims (rolled back)."""
    with psycopg.connect(dsn) as conn:
        for name, value in CLAIM_SETTINGS.items():
            conn.execute("SELECT set_config(%s, %s, true)", (name, value))
        found = conn.execute(query, params).fetchall()
        conn.rollback()
    if kind is None:
        return {int(r[0]) for r in found}
    return {int(r[1]) for r in found if r[0] == kind}


def _claim_params(**extra: Any) -> dict[str, Any]:
    return {
        "owner": "explain",
        "batch": 100,
        "lease_seconds": 30.0,
        "max_attempts": 5,
        "ordered_types": [],
        "all_ordered": True,
        "max_batch_bytes": 2**62,
        "first_always": True,
        "max_message_bytes": None,
        **extra,
    }


def _assert_in_id_order(delivered: list[tuple[str, int]]) -> None:
    last: dict[str, int] = {}
    for aggregate_id, row_id in delivered:
        assert row_id > last.get(aggregate_id, 0), f"{aggregate_id}: {row_id} delivered after {last[aggregate_id]}"
        last[aggregate_id] = row_id


def test_fast_ordered_claims_read_past_the_dead_entries_and_keep_the_order(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    store.ordered_cursor = _fast_ordered_cursor()
    delivered: list[tuple[str, int]] = []
    inserted: set[int] = set()
    with held_snapshot(pg_dsn):
        # Rows delivered behind the held snapshot: each leaves two dead entries in the
        # aggregate index (its pending and its processing version).
        for _ in range(3):
            inserted |= {int(r[0]) for r in run_sql(pg_dsn, table, BULK_INSERT + " RETURNING id", (ROUND_ROWS,))}
            _drain(store, delivered)
        assert store.ordered_cursor.full_claims == 1 and store.ordered_cursor.fast_claims > 10

        # A writer transaction that began before the claims above moved on (its rows'
        # available_at, its start, is below where the discovery starts) and writes a row
        # of an aggregate delivered already and one of a new aggregate only now.
        late = psycopg.connect(pg_dsn, application_name="late-writer")
        late.execute("SELECT now()")
        time.sleep(0.3)
        inserted |= {int(r[0]) for r in run_sql(pg_dsn, table, BULK_INSERT + " RETURNING id", (ROUND_ROWS,))}
        _drain(store, delivered)
        time.sleep(0.3)  # the claims after the writer's start leave the cursor's window
        late_ids = [
            int(
                late.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
                        "VALUES ('order', %s, 'OrderCreated', '{{}}'::jsonb) RETURNING id"
                    ).format(sql.Identifier(*table.split("."))),
                    (aggregate_id,),
                ).fetchone()[0]  # type: ignore[index]
            )
            for aggregate_id in ("a3", "late-new")
        ]
        [(late_at,)] = run_sql(pg_dsn, table, "SELECT now()")  # not yet committed: invisible
        start = store.ordered_cursor.start_key()
        # Claims while it is open: their look for open writers sees it.
        for _ in range(5):
            _claim_and_finish(store, delivered)
            time.sleep(0.05)
        late.commit()
        late.close()
        inserted |= set(late_ids)
        [(late_key_at,)] = run_sql(pg_dsn, table, "SELECT available_at FROM {t} WHERE id = %s", (late_ids[0],))
        assert start is not None and start > (late_key_at, late_ids[1]), "the test must exercise a late row"
        # More rows of the same aggregates after it.
        inserted |= {int(r[0]) for r in run_sql(pg_dsn, table, BULK_INSERT + " RETURNING id", (ROUND_ROWS,))}
        _drain(store, delivered)
        assert late_at is not None
        assert {row_id for _, row_id in delivered} == inserted, "every row delivered"
        assert len(delivered) == len(inserted), "each once"
        _assert_in_id_order(delivered)
        assert store.ordered_cursor.full_claims == 1, "all found by fast claims"

        # Now the claim statements themselves, with one pending row per aggregate.
        heads = {int(r[0]) for r in run_sql(pg_dsn, table, BULK_INSERT + " RETURNING id", (AGGREGATES,))}
        aggregates = [f"a{i}" for i in range(AGGREGATES)]
        bounds = [store.ordered_bounds.bound(a) for a in aggregates]
        assert min(bounds) > 0
        full_query = store.sql.query("claim_ordered_heads")
        bounded_query = store.sql.query("claim_ordered_heads_bounded")
        full_params = _claim_params(after=None)
        bounded_params = _claim_params(aggregate_ids=aggregates, bounds=bounds)
        # The same heads either way.
        assert _ids(pg_dsn, full_query, full_params) == heads
        assert _ids(pg_dsn, bounded_query, bounded_params, kind="claimed") == heads
        start = store.ordered_cursor.start_key()
        assert start is not None
        discover_params = {
            "max_attempts": 5,
            "from_at": start[0],
            "from_id": start[1],
            "leases_from": INDEX_FRONT,
            "lease_scan": False,
            "reap": False,
            "writers_check": False,
            "writers_within_seconds": 5.0,
            "scan_rows": ORDERED_DISCOVER_ROWS,
            "ordered_types": [],
            "all_ordered": True,
        }
        full_buffers = _explain(pg_dsn, full_query, full_params)
        bounded_buffers = _explain(pg_dsn, bounded_query, bounded_params)
        discover_buffers = _explain(pg_dsn, store._ordered_discover_statement, discover_params)
        fast_buffers = bounded_buffers + discover_buffers
        # 4 000 rows delivered behind the snapshot: the claim from the front visits
        # their 8 000 dead entries; the fast one a few per aggregate.
        assert full_buffers > 2000, full_buffers
        assert fast_buffers * 5 < full_buffers, (bounded_buffers, discover_buffers, full_buffers)
        # And the relay's next claim (fast) takes exactly those heads.
        fulls = store.ordered_cursor.full_claims
        rows = store.claim(owner="t", batch=200, lease_seconds=30, max_attempts=5, ordered_types=ALL).rows
        assert {r.id for r in rows} == heads
        assert store.ordered_cursor.full_claims == fulls


def _install_audit(dsn: str, table: str) -> None:
    """Records every delivery (done, or the deletion in delete mode) in commit order."""
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".audit (seq bigserial PRIMARY KEY, id bigint, aggregate_id text)')
        conn.execute(f'''CREATE FUNCTION "{schema}".audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF TG_OP = 'DELETE' OR NEW.status = 'done' THEN
                INSERT INTO "{schema}".audit (id, aggregate_id) VALUES (OLD.id, OLD.aggregate_id);
              END IF;
              RETURN NULL;
            END $$''')
        conn.execute(
            f'CREATE TRIGGER audit_trg AFTER UPDATE OF status OR DELETE ON "{schema}"."{name}" '
            f'FOR EACH ROW WHEN (pg_trigger_depth() = 0) EXECUTE FUNCTION "{schema}".audit_fn()'
        )


def test_concurrent_fast_and_full_ordered_claims_keep_every_aggregates_order_under_aheld_snapshot(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """Writers that commit in id order per aggregate (enqueue(ordered=True)), three
    workers claiming runs and sometimes releasing an aggregate's rows to retry them
    later, fast claims with a full claim every half second, behind a held snapshot:
    every row delivered once, each aggregate's in id order (as committed)."""
    import random
    import threading

    from outbox_relay import enqueue
    from outbox_relay.db.delivery import Reschedule

    store.ordered_cursor = DueCursor(
        lag_seconds=0.1,
        rescan_min_seconds=0.5,
        rescan_max_seconds=0.5,
        rescan_quiet_max_seconds=0.5,
        fast_above_seconds=0.0,
    )
    _install_audit(pg_dsn, table)
    inserted: set[int] = set()
    lock = threading.Lock()
    writing = threading.Event()
    writing.set()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(pg_dsn) as conn:
                while writing.is_set():
                    aggregate_id = f"g{rng.randrange(6)}"  # one per transaction: the aggregate locks never cross
                    with conn.transaction():
                        ids = [
                            int(
                                enqueue(
                                    conn,
                                    aggregate_type="order",
                                    aggregate_id=aggregate_id,
                                    event_type="OrderCreated",
                                    payload={"w": seed},
                                    table=table,
                                    ordered=True,
                                )
                            )
                            for _ in range(rng.randint(1, 3))
                        ]
                        time.sleep(rng.choice((0.0, 0.0, 0.01, 0.05)))
                    with lock:
                        inserted.update(ids)
        except BaseException as exc:
            errors.append(exc)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                rows = store.claim(
                    owner=f"w{seed}", batch=20, lease_seconds=30, max_attempts=50, ordered_types=ALL, run_length=5
                ).rows
                if not rows:
                    time.sleep(0.01)
                    continue
                # Now and then an aggregate's rows of this batch are released (to be
                # retried a little later), all of them: the ones after a failed row follow it.
                released = {r.aggregate_id for r in rows if rng.random() < 0.1}
                store.reschedule(
                    [Reschedule(r.id, r.lease_version, 0.05, None, True) for r in rows if r.aggregate_id in released]
                )
                store.mark_done([(r.id, r.lease_version) for r in rows if r.aggregate_id not in released])
        except BaseException as exc:
            errors.append(exc)

    with held_snapshot(pg_dsn):
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=worker, args=(10 + i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(3.0)
        writing.clear()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not errors:
            with lock:
                expected = set(inserted)
            done = {int(r[0]) for r in run_sql(pg_dsn, table, 'SELECT id FROM "' + table.split(".")[0] + '".audit')}
            if expected and done >= expected and not threads[0].is_alive() and not threads[1].is_alive():
                break
            time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join(10)
    assert not errors, errors
    audit = run_sql(pg_dsn, table, 'SELECT id, aggregate_id FROM "' + table.split(".")[0] + '".audit ORDER BY seq')
    assert sorted(int(i) for i, _ in audit) == sorted(inserted), "every row delivered once"
    _assert_in_id_order([(a, int(i)) for i, a in audit])
    assert store.ordered_cursor.fast_claims > store.ordered_cursor.full_claims > 1


def test_a_dead_row_blocks_its_aggregate_in_fast_claims_and_its_retry_goes_first(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    """A bound never passes a dead row: when it is retried (pending again, its id below
    the rows waiting behind it), the fast claims take it before them."""
    store.ordered_cursor = _fast_ordered_cursor()
    with held_snapshot(pg_dsn):
        ids = [int(r[0]) for r in run_sql(pg_dsn, table, BULK_INSERT + " RETURNING id", (3 * AGGREGATES,))]
        x = [i for i in ids if (i - ids[0]) % AGGREGATES == 0]  # aggregate 'a1': three rows in id order

        def claim() -> list[Any]:
            return store.claim(owner="t", batch=50, lease_seconds=30, max_attempts=5, ordered_types=ALL).rows

        first = claim()  # the full claim: every aggregate's head
        assert store.ordered_cursor.full_claims == 1 and x[0] in {r.id for r in first}
        head = next(r for r in first if r.id == x[0])
        assert store.mark_dead([(head.id, head.lease_version, "broken")]) == {head.id}
        store.mark_done([(r.id, r.lease_version) for r in first if r.id != x[0]])
        for _ in range(3):  # fast claims: the others go on, this aggregate is blocked
            rows = claim()
            assert x[1] not in {r.id for r in rows}
            store.mark_done([(r.id, r.lease_version) for r in rows])
        assert store.ordered_cursor.fast_claims >= 3
        assert store.dead_retry([x[0]]) == {x[0]}
        order: list[int] = []
        for _ in range(5):
            rows = [r for r in claim() if r.aggregate_id == head.aggregate_id]
            order += [r.id for r in rows]
            store.mark_done([(r.id, r.lease_version) for r in rows])
        assert order == x, "the retried row first, then the rows behind it, in id order"
        assert store.ordered_cursor.full_claims == 1


def test_fast_ordered_claims_of_some_types_leave_the_others_to_the_plain_claim(
    pg_dsn: str, table: str, store: OutboxStore
) -> None:
    store.ordered_cursor = _fast_ordered_cursor()
    insert = (
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'a' || (g %% 5), CASE WHEN g %% 4 = 0 THEN 'Note' ELSE 'OrderCreated' END, '{{}}'::jsonb "
        "FROM generate_series(1, 400) AS g RETURNING id, event_type"
    )
    delivered: list[tuple[str, int]] = []
    types: dict[int, str] = {}
    with held_snapshot(pg_dsn):
        for _ in range(3):
            types.update({int(i): t for i, t in run_sql(pg_dsn, table, insert)})
            for _ in range(100):  # bounded
                rows = store.claim(
                    owner="t", batch=100, lease_seconds=30, max_attempts=5, ordered_types=["OrderCreated"]
                ).rows
                if not rows:
                    break
                store.mark_done([(r.id, r.lease_version) for r in rows])
                delivered += [(r.aggregate_id, r.id) for r in sorted(rows, key=lambda r: r.id)]
    assert sorted(i for _, i in delivered) == sorted(types), "every row delivered once"
    _assert_in_id_order([(a, i) for a, i in delivered if types[i] == "OrderCreated"])
    assert store.ordered_cursor.full_claims == 1 and store.ordered_cursor.fast_claims > 3
