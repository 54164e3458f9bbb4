from tests.helpers.db import insert_rows, rows


def test_claim_and_finalize_round_trip(store, pg_dsn, table):
    ids = insert_rows(pg_dsn, table, 5)
    claimed = store.claim(owner="A", batch=10, lease_seconds=30, max_attempts=3).rows
    assert [c.id for c in claimed] == ids
    assert all(c.lease_version == 1 and c.attempts == 1 for c in claimed)
    assert store.mark_done([(c.id, c.lease_version) for c in claimed]) == set(ids)
    assert {r[1] for r in rows(pg_dsn, table)} == {"done"}


def test_depth_above_the_exact_count_cap_is_estimated(store, pg_dsn, table):
    import psycopg

    insert_rows(pg_dsn, table, 30)
    claimed = store.claim(owner="A", batch=20, lease_seconds=30, max_attempts=3).rows
    store.mark_done([(c.id, c.lease_version) for c in claimed])
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ANALYZE "{schema}"."{name}"')
    exact = store.stats()
    assert exact.queue_depth == {"pending": 10, "processing": 0, "done": 20, "dead": 0}
    assert exact.estimated_statuses == []
    capped = store.stats(count_cap=15)
    assert capped.estimated_statuses == ["done"]
    assert capped.queue_depth["done"] == 20  # planner statistics after ANALYZE
    assert capped.queue_depth["pending"] == 10
    assert sum(capped.attempts.values()) == 10
