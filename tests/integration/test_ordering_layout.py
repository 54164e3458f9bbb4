"""The ordering index layout: dead rows leave the skip-scan index (a dead backlog costs the claim nothing), and
`migrate` brings any table to the layout idempotently, CONCURRENTLY on existing tables.
Runs in the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE)."""

from __future__ import annotations

import psycopg
import pytest

from outbox_relay.db import monitoring as monitoring_module
from outbox_relay.db.store import OutboxStore
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import ON_DONE, assert_delivered, rows

ALL = ["*"]


def _ordered_store(dsn: str, table: str) -> OutboxStore:
    s = OutboxStore(dsn, table, pool_size=4)
    s.open()
    s.migrate(ordering=True, on_done=ON_DONE)
    return s


@pytest.fixture
def ordered_store(pg_dsn, table):
    s = _ordered_store(pg_dsn, table)
    try:
        yield s
    finally:
        s.close()


def _sql(dsn: str, table: str, statement: str, params: tuple = ()) -> list[tuple]:
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement.replace("{t}", f'"{schema}"."{name}"'), params)
        return cur.fetchall() if cur.description else []


def _insert(dsn: str, table: str, spec: list[tuple[str, str]]) -> list[int]:
    """spec: (aggregate_id, status) in id order; dead rows look like the finalize leaves them."""
    ids = []
    for aggregate, status in spec:
        ids.append(
            _sql(
                dsn,
                table,
                "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, "
                "attempts, last_error) VALUES ('order', %s, 'E', '{}', %s, %s, %s) RETURNING id",
                (aggregate, status, 1 if status == "dead" else 0, "broken" if status == "dead" else None),
            )[0][0]
        )
    return ids


def _indexes(dsn: str, table: str) -> dict[str, bool]:
    return dict(
        _sql(
            dsn,
            table,
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c "
            "ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass",
            (table,),
        )
    )


def _claim(store, owner="A", batch=10, run_length=1):
    return [
        c.id
        for c in store.claim(
            owner=owner, batch=batch, lease_seconds=30, max_attempts=5, ordered_types=ALL, run_length=run_length
        ).rows
    ]


def test_dead_head_blocks_until_retry_or_skip_with_the_ordering_indexes(ordered_store, pg_dsn, table):
    s = ordered_store
    x1, x2, y1, y2, _z1 = _insert(
        pg_dsn, table, [("X", "pending"), ("X", "pending"), ("Y", "pending"), ("Y", "pending"), ("Z", "dead")]
    )
    first = s.claim(owner="A", batch=10, lease_seconds=30, max_attempts=5, ordered_types=ALL).rows
    assert [c.id for c in first] == [x1, y1]  # Z holds only a dead row: nothing to claim, not blocked
    assert s.mark_dead([(x1, first[0].lease_version, "permanent: broken")]) == {x1}
    assert s.mark_done([(y1, first[1].lease_version)]) == {y1}
    assert_delivered(pg_dsn, table, [y1])
    assert _claim(s, owner="B") == [y2]  # Y flows, X is blocked behind its dead head
    assert s.stats(ordered_types=ALL).blocked_aggregates == [("X", x1)]
    assert _claim(s, owner="C") == []
    assert s.dead_retry([x1]) == {x1}
    again = s.claim(owner="D", batch=10, lease_seconds=30, max_attempts=5, ordered_types=ALL).rows
    assert [c.id for c in again] == [x1]  # the retried head first, its follower still waits
    s.mark_dead([(x1, again[0].lease_version, "still broken")])
    assert _claim(s, owner="E") == []
    assert s.dead_skip([x1], "skipped: operator") == {x1}
    assert _claim(s, owner="F") == [x2]
    assert s.stats(ordered_types=ALL).blocked_aggregates == []


def test_a_dead_row_behind_the_head_ends_the_run(ordered_store, pg_dsn, table):
    # Possible when rows were delivered unordered before ordering was switched on.
    x1, x2, _x3, x4 = _insert(pg_dsn, table, [("X", "pending"), ("X", "pending"), ("X", "dead"), ("X", "pending")])
    assert _claim(ordered_store, run_length=10) == [x1, x2]  # x4 waits behind the dead x3
    assert x4 not in _claim(ordered_store, owner="B", run_length=10)


def test_blocked_aggregates_are_the_same_from_either_walk(ordered_store, pg_dsn, table, monkeypatch):
    spec = [(f"dead-only-{i}", "dead") for i in range(5)]  # nothing behind them: not blocked
    spec += [
        ("B1", "dead"),
        ("B1", "pending"),
        ("B2", "dead"),
        ("B2", "dead"),
        ("B2", "pending"),
        ("OK", "pending"),
        ("B3", "pending"),
    ]
    ids = _insert(pg_dsn, table, spec)
    _sql(
        pg_dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, "
        "last_error) VALUES ('order', 'B3', 'E', '{}', 'dead', 1, 'late')",
    )  # after B3's pending
    expected = [("B1", ids[5]), ("B2", ids[7])]
    from_dead = ordered_store.stats(ordered_types=ALL).blocked_aggregates
    monkeypatch.setattr(monitoring_module, "BLOCKED_FROM_DEAD_ROWS", 0)  # force the walk over aggregates with work
    from_aggregates = ordered_store.stats(ordered_types=ALL).blocked_aggregates
    assert from_dead == expected
    assert from_aggregates == expected


def test_migrate_brings_an_old_table_to_the_layout_concurrently_and_idempotently(pg_dsn, table):
    s = OutboxStore(pg_dsn, table, pool_size=2)
    s.open()
    try:
        s.migrate(on_done=ON_DONE)
        name = table.split(".")[1]
        # An earlier version's layout: one per-aggregate index over pending, processing
        # and dead rows, indexes on created_at and done_at, no fillfactor.
        _sql(
            pg_dsn,
            table,
            f'CREATE INDEX "{name}_aggregate_idx" ON {{t}} (aggregate_id, id) '
            "WHERE status IN ('pending', 'processing', 'dead')",
        )
        _sql(
            pg_dsn,
            table,
            f'CREATE INDEX "{name}_unfinished_created_idx" ON {{t}} (created_at) '
            "WHERE status IN ('pending', 'processing')",
        )
        _sql(pg_dsn, table, f"CREATE INDEX \"{name}_done_idx\" ON {{t}} (done_at) WHERE status = 'done'")
        _sql(pg_dsn, table, "ALTER TABLE {t} RESET (fillfactor)")
        _insert(pg_dsn, table, [("X", "pending"), ("X", "dead"), ("Y", "pending")])
        notes = s.migrate(ordering=True, on_done=ON_DONE)
        indexes = _indexes(pg_dsn, table)
        for old in ("aggregate", "unfinished_created", "done"):
            assert f"{name}_{old}_idx" not in indexes
        assert indexes[f"{name}_aggregate_active_idx"] and indexes[f"{name}_aggregate_dead_idx"]
        assert any("dropped index" in n for n in notes) and any("created index" in n for n in notes)
        assert any("fillfactor" in n for n in notes)
        assert _sql(
            pg_dsn,
            table,
            "SELECT array(SELECT o FROM pg_class, unnest(reloptions) AS o "
            "WHERE oid = %s::regclass AND o LIKE 'fillfactor=%%')",
            (table,),
        ) == [(["fillfactor=50"],)]
        assert s.migrate(ordering=True, on_done=ON_DONE) == []  # nothing left to do
        _sql(pg_dsn, table, "ALTER TABLE {t} SET (fillfactor = 80)")  # an operator's choice is kept
        assert s.migrate(ordering=True, on_done=ON_DONE) == []
        assert _sql(
            pg_dsn,
            table,
            "SELECT array(SELECT o FROM pg_class, unnest(reloptions) AS o "
            "WHERE oid = %s::regclass AND o LIKE 'fillfactor=%%')",
            (table,),
        ) == [(["fillfactor=80"],)]
        assert s.missing_ordering_indexes() == []

        # An interrupted CREATE INDEX CONCURRENTLY leaves an invalid index: rebuilt.
        _sql(
            pg_dsn,
            table,
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass",
            (f"{table.split('.')[0]}.{name}_aggregate_dead_idx",),
        )
        assert s.missing_ordering_indexes() == [f"{name}_aggregate_dead_idx"]
        assert s.migrate(ordering=True, on_done=ON_DONE) == [f"created index {name}_aggregate_dead_idx"]
        assert _indexes(pg_dsn, table)[f"{name}_aggregate_dead_idx"] is True

        # Without ordering configured the ordering indexes stay (other relays may be
        # ordered) until dropped explicitly.
        kept = s.migrate(on_done=ON_DONE)
        assert len(kept) == 1 and "--drop-ordering-indexes" in kept[0]
        s.migrate(drop_ordering_indexes=True, on_done=ON_DONE)
        assert set(s.missing_ordering_indexes()) == {f"{name}_aggregate_active_idx", f"{name}_aggregate_dead_idx"}
        assert [r[1] for r in rows(pg_dsn, table)] == ["pending", "dead", "pending"]  # no row touched
    finally:
        s.close()


def test_cli_run_waits_for_the_ordering_indexes_and_migrate_creates_them(pg_dsn, table, broker):
    env = cli_env(pg_dsn, table, broker.bootstrap_servers)
    assert cli("migrate", env=env).returncode == 0  # no ordering configured: no ordering indexes
    ordered = dict(env, OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES='["*"]', OUTBOX_RELAY_METRICS__PORT="0")
    # The relay waits for the indexes (a migrate may be building them); bounded here.
    waited = cli("run", env=dict(ordered, OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="1"), timeout=60)
    assert waited.returncode == 1
    waiting = [line for line in waited.stderr.splitlines() if "waiting for dependencies" in line]
    assert waiting and "ordering indexes" in waiting[0], waited.stderr
    last = waited.stderr.strip().splitlines()[-1]
    assert "ordering indexes" in last and "outbox-relay migrate" in last, last
    migrated = cli("migrate", env=ordered)
    assert migrated.returncode == 0, migrated.stderr
    assert "created index" in migrated.stdout
    with OutboxStore(pg_dsn, table, pool_size=1) as s:
        assert s.missing_ordering_indexes() == []
    refused_drop = cli("migrate", "--drop-ordering-indexes", env=ordered)
    assert refused_drop.returncode == 2 and "ordered" in refused_drop.stderr
