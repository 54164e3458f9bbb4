"""migrate sets queue-table autovacuum parameters on the outbox, never overwriting an
operator's own value; database.autovacuum overrides them (real PostgreSQL)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from outbox_relay.db.autovacuum import QUEUE_AUTOVACUUM, check_overrides, parse_reloptions
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE


def _options(dsn: str, table: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
    return {k: v for k, v in parse_reloptions(row[0] if row else None).items() if k != "fillfactor"}


def _alter(dsn: str, table: str, clause: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} " + clause).format(sql.Identifier(*table.split("."))))


def test_new_table_gets_the_queue_defaults_and_a_second_migrate_changes_nothing(pg_dsn: str, table: str) -> None:
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
        assert _options(pg_dsn, table) == QUEUE_AUTOVACUUM
        assert store.migrate(on_done=ON_DONE) == []


def test_existing_table_gets_them_on_the_next_migrate(pg_dsn: str, table: str) -> None:
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
        # As a table set up by an earlier version: no autovacuum parameters, no record.
        for name in QUEUE_AUTOVACUUM:
            _alter(pg_dsn, table, f"RESET ({name})")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER TABLE {} DROP COLUMN autovacuum_applied").format(
                    sql.Identifier(table.split(".")[0], "outbox_relay_state")
                )
            )
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE name = 'add_autovacuum_applied'").format(
                    sql.Identifier(table.split(".")[0], "outbox_migrations")
                )
            )
        notes = store.migrate(on_done=ON_DONE)
        assert any(n.startswith("autovacuum: ") for n in notes), notes
        assert _options(pg_dsn, table) == QUEUE_AUTOVACUUM


def test_operator_values_are_kept_and_config_overrides_apply(pg_dsn: str, table: str) -> None:
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
        _alter(pg_dsn, table, "SET (autovacuum_vacuum_threshold = 25000)")  # the operator's own
        _alter(pg_dsn, table, "RESET (autovacuum_vacuum_cost_delay)")  # the operator wants the default
        notes = store.migrate(on_done=ON_DONE)
        options = _options(pg_dsn, table)
        assert options["autovacuum_vacuum_threshold"] == "25000"
        assert "autovacuum_vacuum_cost_delay" not in options
        assert any("autovacuum_vacuum_threshold = 25000" in n for n in notes), notes
        store.migrate(on_done=ON_DONE)
        assert "autovacuum_vacuum_cost_delay" not in _options(pg_dsn, table)  # stays reset
        # database.autovacuum: applied on every migrate; "default" removes a parameter.
        store.migrate(
            on_done=ON_DONE,
            autovacuum={
                "autovacuum_vacuum_threshold": "5000",
                "autovacuum_analyze_threshold": "2000",
                "autovacuum_vacuum_scale_factor": "default",
            },
        )
        options = _options(pg_dsn, table)
        assert options["autovacuum_vacuum_threshold"] == "5000"
        assert options["autovacuum_analyze_threshold"] == "2000"
        assert "autovacuum_vacuum_scale_factor" not in options


def test_overrides_are_validated() -> None:
    assert check_overrides({"autovacuum_vacuum_threshold": 5000, "autovacuum_enabled": True}) == {
        "autovacuum_vacuum_threshold": "5000",
        "autovacuum_enabled": "true",
    }
    with pytest.raises(ValueError, match="not an autovacuum storage parameter"):
        check_overrides({"fillfactor; DROP TABLE x": "1"})
    with pytest.raises(ValueError, match="plain number"):
        check_overrides({"autovacuum_vacuum_threshold": "1); DROP TABLE x; --"})
