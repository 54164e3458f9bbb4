"""The lean index layout (fewer indexes to write per row): no index on done_at or created_at. Purge walks the
primary key; the backlog gauges read the claim's own indexes."""

from __future__ import annotations

from tests.helpers.db import make_row, run_sql


def test_purge_walks_the_primary_key_and_stops_at_rows_newer_than_the_cutoff(store, pg_dsn, table):
    old = [make_row(pg_dsn, table, status="done", created_ago_seconds=3 * 3600) for _ in range(3)]
    run_sql(pg_dsn, table, "UPDATE {t} SET done_at = now() - interval '2 hours' WHERE id = ANY(%s)", (old,))
    kept_dead = make_row(pg_dsn, table, status="dead", created_ago_seconds=3 * 3600)
    new = [make_row(pg_dsn, table, status="done") for _ in range(2)]

    assert store.purge_chunk(3600, 2, 0) == (2, old[1])
    assert store.purge_chunk(3600, 2, old[1]) == (1, kept_dead)  # the dead row stays
    # A chunk holding no row created before the cutoff ends the walk: nothing later can be old enough.
    assert store.purge_chunk(3600, 2, kept_dead) == (0, None)
    remaining = [r[0] for r in run_sql(pg_dsn, table, "SELECT id FROM {t} ORDER BY id")]
    assert remaining == [kept_dead, *new]


def test_backlog_gauges_read_the_pending_and_processing_indexes(store, pg_dsn, table):
    make_row(pg_dsn, table, status="pending", attempts=2, created_ago_seconds=300, available_in_seconds=600)
    make_row(pg_dsn, table, status="pending", created_ago_seconds=10)
    make_row(pg_dsn, table, status="processing", attempts=1, created_ago_seconds=100)
    make_row(pg_dsn, table, status="done", created_ago_seconds=900)  # finished: not in the backlog
    stats = store.stats()
    assert 300 <= stats.oldest_pending_age_seconds < 400  # the row waiting for its retry is the oldest
    assert stats.attempts == {0: 1, 1: 1, 2: 1}
    assert stats.queue_depth == {"pending": 2, "processing": 1, "done": 1, "dead": 0}
    assert stats.estimated_statuses == []
    indexes = {
        r[0]
        for r in run_sql(
            pg_dsn, table, "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (table.split(".")[0],)
        )
    }
    assert not {i for i in indexes if i.endswith(("_done_idx", "_unfinished_created_idx", "_aggregate_idx"))}


def test_migrate_converges_an_old_layout_while_a_relay_drains_it(make_settings, store, pg_dsn, table):
    """Indexes built and dropped CONCURRENTLY, fillfactor set: the relay keeps claiming
    and finalizing through it, and nothing is lost."""
    from outbox_relay.runtime.relay import Relay
    from tests.helpers.db import insert_rows, statuses, wait_for

    name = table.split(".")[1]
    run_sql(
        pg_dsn,
        table,
        f'CREATE INDEX "{name}_unfinished_created_idx" ON {{t}} (created_at) '
        "WHERE status IN ('pending', 'processing')",
    )
    run_sql(pg_dsn, table, f"CREATE INDEX \"{name}_done_idx\" ON {{t}} (done_at) WHERE status = 'done'")
    run_sql(pg_dsn, table, "ALTER TABLE {t} RESET (fillfactor)")
    insert_rows(pg_dsn, table, 3000)
    relay = Relay(make_settings(relay={"batch_size": 50}))
    relay.start()
    try:
        notes = store.migrate(ordering=True)  # drops two indexes, builds two, while the relay works
        insert_rows(pg_dsn, table, 500)
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 3500}, message="all rows done")
    finally:
        relay.stop()
    assert sum("dropped index" in n for n in notes) == 2 and sum("created index" in n for n in notes) == 2
    assert store.missing_ordering_indexes() == []


def _claim_plan(store, pg_dsn, *, settings, batch):
    """EXPLAIN ANALYZE (rolled back) of the plain claim, run the way the store runs it:
    execute_with_settings(...) with the given planner settings in front of it."""
    import psycopg

    from outbox_relay.db.pooler import execute_with_settings

    params = {
        "owner": "plan",
        "batch": batch,
        "lease_seconds": 30.0,
        "max_attempts": 5,
        "max_batch_bytes": 8 << 20,
        "candidates": batch,
        "max_message_bytes": None,
        "excluded_types": [],
    }
    query = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + store.sql.query("claim")
    with psycopg.connect(pg_dsn) as conn:
        cur = conn.cursor()
        execute_with_settings(cur, query, params, settings)
        plan = cur.fetchone()[0]
        conn.rollback()

    def nodes(node):
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    return list(nodes(plan[0]["Plan"]))


def test_claim_reads_the_front_of_the_backlog_even_without_statistics(store, pg_dsn, table):
    """A 20 000-row backlog in a table never analyzed (filled faster than autovacuum's
    ANALYZE follows, or restored / pg_upgraded without statistics): the planner then
    expects a few hundred pending rows, fewer than the relay's default batch. Under the
    claim's settings the claim still walks the pending index in order and stops after
    the batch; without them it bitmap-scans and sorts the whole backlog (the control
    below), which made every claim O(backlog) and a drain quadratic."""
    from outbox_relay.db.store import CLAIM_SETTINGS

    run_sql(
        pg_dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'agg-' || (g %% 100), 'OrderCreated', jsonb_build_object('seq', g) "
        "FROM generate_series(1, 20000) AS g",
    )
    batch = 1000  # relay.batch_size's default

    plan = _claim_plan(store, pg_dsn, settings=CLAIM_SETTINGS, batch=batch)
    # (the claim's scan for paused rows to park runs only while an operator pause is active)
    scans = [n for n in plan if n.get("Index Name", "").endswith("_pending_idx") and n["Actual Loops"] > 0]
    assert [n["Node Type"] for n in scans] == ["Index Scan"]
    assert scans[0]["Actual Rows"] == batch  # stopped at the batch: the backlog was not read
    assert not [n for n in plan if n["Node Type"].startswith("Bitmap") and n["Actual Rows"] > batch]

    control = _claim_plan(store, pg_dsn, settings={}, batch=batch)
    bitmap = [n for n in control if n["Node Type"] == "Bitmap Heap Scan"]
    assert bitmap and max(n["Actual Rows"] for n in bitmap) == 20000  # the hazard the settings avoid

    claimed = store.claim(owner="A", batch=batch, lease_seconds=30, max_attempts=5).rows
    assert [r.id for r in claimed] == list(range(claimed[0].id, claimed[0].id + batch))
