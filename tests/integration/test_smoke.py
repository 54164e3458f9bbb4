from tests.conftest import insert_rows, rows


def test_claim_and_finalize_round_trip(store, pg_dsn, table):
    ids = insert_rows(pg_dsn, table, 5)
    claimed = store.claim(owner="A", batch=10, lease_seconds=30, max_attempts=3).rows
    assert [c.id for c in claimed] == ids
    assert all(c.lease_version == 1 and c.attempts == 1 for c in claimed)
    assert store.mark_done([(c.id, c.lease_version) for c in claimed]) == set(ids)
    assert {r[1] for r in rows(pg_dsn, table)} == {"done"}
