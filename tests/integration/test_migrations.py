"""Numbered migrations: each step applied once per table and recorded with it, on a
new table, on an installation of the layout migrate made before steps were recorded,
and when two migrates of one table run at the same time."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from outbox_relay.db import migrations
from outbox_relay.db.schema import TableSql
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE, insert_rows, run_sql, statuses

FIXTURE = Path(__file__).parent.parent / "fixtures" / "layout_before_recorded_migrations.sql"
ALL_STEPS = [step.number for step in migrations.STEPS]


def _recorded(dsn: str, table: str) -> list[tuple[int, str]]:
    """The steps recorded for the table, from its companion ``<table>_migrations``."""
    schema, name = table.split(".")
    record = sql.Identifier(schema, name + "_migrations")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL("SELECT step, name FROM {} ORDER BY step").format(record)).fetchall()


def _install_old_layout(dsn: str, table: str) -> None:
    """The frozen pg_dump of a table migrated before steps were recorded (table named "outbox")."""
    schema = table.split(".")[0]
    assert table.split(".")[1] == "outbox"
    quoted = sql.Identifier(schema).as_string(None)
    ddl = (
        FIXTURE.read_text(encoding="utf-8")
        .replace('"__SCHEMA__"', quoted)
        .replace("outbox_relay___SCHEMA___outbox_wake", TableSql(table).channel)
        .replace("__SCHEMA__", quoted)
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl.encode())


def _layout(dsn: str, table: str) -> dict[str, object]:
    """What a rewrite would change: the table's file, its columns, indexes, trigger, options."""
    ((relfilenode, options),) = run_sql(
        dsn, table, "SELECT relfilenode, reloptions FROM pg_class WHERE oid = %s::regclass", (table,)
    )
    columns = run_sql(
        dsn,
        table,
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (table,),
    )
    indexes = run_sql(
        dsn,
        table,
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
        "WHERE indrelid = %s::regclass ORDER BY 1",
        (table,),
    )
    triggers = run_sql(
        dsn, table, "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal", (table,)
    )
    return {
        "relfilenode": relfilenode,
        "options": options,
        "columns": columns,
        "indexes": indexes,
        "triggers": triggers,
    }


def test_a_new_table_records_every_step_once_and_a_second_migrate_applies_none(pg_dsn, table):
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
        assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
        before = _layout(pg_dsn, table)
        assert store.migrate(on_done=ON_DONE) == []
    assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
    assert _layout(pg_dsn, table) == before


def test_an_installation_of_the_layout_before_recorded_steps_is_recognised_without_a_rewrite(pg_dsn, table):
    _install_old_layout(pg_dsn, table)
    ids = insert_rows(pg_dsn, table, 20, dedup_key=None)
    run_sql(pg_dsn, table, "UPDATE {t} SET status = 'dead', last_error = 'boom' WHERE id = %s", (ids[0],))
    before = _layout(pg_dsn, table)
    rows_before = run_sql(pg_dsn, table, "SELECT * FROM {t} ORDER BY id")
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        notes = store.migrate(ordering=True, on_done="keep")
        # Nothing of that layout changes; what it lacked is the queue's autovacuum
        # parameters (storage parameters) and the record columns of a later step,
        # added without a rewrite of the table (the same relfilenode).
        assert [n for n in notes if not n.startswith("autovacuum:")] == []
        assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
        after = _layout(pg_dsn, table)
        assert after["columns"] == [
            *before["columns"],
            ("tombstone", "boolean"),
            ("partition", "integer"),
            ("payload_bytes", "bytea"),
        ]  # type: ignore[misc]
        unchanged = ("options", "columns")
        assert {k: v for k, v in after.items() if k not in unchanged} == {
            k: v for k, v in before.items() if k not in unchanged
        }
        assert "autovacuum_vacuum_scale_factor=0" in after["options"]
        assert set(before["options"] or ()) <= set(after["options"])
        assert run_sql(pg_dsn, table, "SELECT * FROM {t} ORDER BY id") == [(*r, False, None, None) for r in rows_before]
        assert store.run_problem(ordering=True, on_done="keep") is None
        if ON_DONE == "delete":  # the mode is an every-run setting, not a step
            assert any("deletes delivered rows" in n for n in store.migrate(ordering=True, on_done="delete"))
            assert store.on_done_mode() == "delete"
    assert statuses(pg_dsn, table) == {"pending": 19, "dead": 1}


def test_an_older_installation_gets_what_it_lacks_and_keeps_its_rows(pg_dsn, table):
    """A table from before the dedup column, the mode, the audit and the key tables:
    the baseline steps add exactly those, the rows stay as they were."""
    _install_old_layout(pg_dsn, table)
    schema = sql.Identifier(table.split(".")[0]).as_string(None)
    run_sql(pg_dsn, table, f"DROP TABLE {schema}.outbox_audit, {schema}.outbox_dedup_keys")
    run_sql(pg_dsn, table, f"ALTER TABLE {schema}.outbox_relay_state DROP COLUMN on_done")
    run_sql(pg_dsn, table, f"DROP INDEX {schema}.outbox_dedup_key_idx")
    run_sql(pg_dsn, table, "ALTER TABLE {t} DROP COLUMN dedup_key")
    run_sql(
        pg_dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'agg-' || i, 'OrderCreated', '{{}}' FROM generate_series(1, 5) AS i",
    )
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        assert store.run_problem(ordering=False, on_done="keep") is not None  # an older layout: migrate first
        store.migrate(on_done=ON_DONE)
        assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
        assert store.run_problem(ordering=False, on_done=ON_DONE) is None
        assert store.on_done_mode() == ON_DONE
        assert store.audit_table_exists()
    assert statuses(pg_dsn, table) == {"pending": 5}
    [first] = insert_rows(pg_dsn, table, 1, dedup_key="k-1")  # the column and the key table are back
    [again] = insert_rows(pg_dsn, table, 1, dedup_key="k-1")
    assert (again, again.duplicate) == (first, True)
    with pytest.raises(psycopg.errors.UniqueViolation):  # and the column's unique index
        run_sql(
            pg_dsn,
            table,
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, dedup_key) "
            "VALUES ('order', 'agg-1', 'OrderCreated', '{{}}', 'k-1')",
        )


def test_a_step_added_later_runs_once_on_a_recorded_table(pg_dsn, table, monkeypatch):
    calls: list[str] = []
    later = migrations.Step(len(ALL_STEPS) + 1, "test_later_step", lambda run: calls.append(run.sql.table))
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
        monkeypatch.setattr(migrations, "STEPS", (*migrations.STEPS, later))
        notes = store.migrate(on_done=ON_DONE)
        assert store.migrate(on_done=ON_DONE) == []
    assert calls == [table]
    assert notes == [f"applied migration steps {later.number:04d} test_later_step"]
    assert _recorded(pg_dsn, table)[-1] == (later.number, "test_later_step")


def test_two_concurrent_migrates_apply_each_step_once(pg_dsn, table, monkeypatch):
    """Both start together on a missing table: the advisory lock makes one wait for the
    other, which then finds every step recorded. Counted at the step functions."""
    applied: list[int] = []
    lock = threading.Lock()

    def counted(step: migrations.Step) -> migrations.Step:
        def apply(run: migrations.MigrationRun) -> None:
            with lock:
                applied.append(step.number)
            step.apply(run)

        return migrations.Step(step.number, step.name, apply)

    monkeypatch.setattr(migrations, "STEPS", tuple(counted(s) for s in migrations.STEPS))
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            with OutboxStore(pg_dsn, table, pool_size=1) as store:
                start.wait(timeout=30)
                store.migrate(ordering=True, on_done=ON_DONE)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert sorted(applied) == ALL_STEPS
    assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        assert store.missing_ordering_indexes() == []


def test_a_dropped_table_whose_record_was_kept_is_refused_then_recreated_with_ids_after_the_old_ones(pg_dsn, table):
    """Someone dropped the outbox table but not <table>_migrations: migrate names the
    option instead of 'run migrate first'; with it, the table and everything the schema
    needs come back in one transaction, ids counting from the given one."""
    from outbox_relay.errors import SchemaMissing

    with OutboxStore(pg_dsn, table, pool_size=2) as store:
        store.migrate(on_done=ON_DONE)
        old_ids = insert_rows(pg_dsn, table, 5, dedup_key=None)
        layout = _layout(pg_dsn, table)
        run_sql(pg_dsn, table, "DROP TABLE {t}")

        with pytest.raises(
            SchemaMissing, match=rf"records {len(ALL_STEPS)} migration steps .*migrate --recreate-from-id N"
        ):
            store.migrate(on_done=ON_DONE)
        assert run_sql(pg_dsn, table, "SELECT to_regclass(%s)", (table,)) == [(None,)]  # nothing half-made

        notes = store.migrate(on_done=ON_DONE, recreate_from_id=max(old_ids) + 1000)
        assert any(n.startswith("recreated ") and f"ids from {max(old_ids) + 1000}" in n for n in notes), notes
        assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
        recreated = _layout(pg_dsn, table)
        # The same columns, indexes, trigger and storage parameters (autovacuum included) as before.
        assert {k: v for k, v in recreated.items() if k != "relfilenode"} == {
            k: v for k, v in layout.items() if k != "relfilenode"
        }
        (new_id,) = insert_rows(pg_dsn, table, 1, dedup_key=None)
        assert new_id == max(old_ids) + 1000
        claimed = store.claim(owner="t", batch=10, lease_seconds=30, max_attempts=3)
        assert [row.id for row in claimed.rows] == [new_id]
        assert store.migrate(on_done=ON_DONE) == []  # nothing left to do
        assert store.migrate(on_done=ON_DONE, recreate_from_id=1) == []  # the table exists: the option does nothing
    assert _recorded(pg_dsn, table) == [(s.number, s.name) for s in migrations.STEPS]
