"""`outbox-relay migrate` as an operator meets it: a table dropped while its migration
record was kept, and the SQL printed for teams that apply migrations with their own tool."""

from __future__ import annotations

import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from outbox_relay.db.migrations import STEPS
from outbox_relay.db.store import OutboxStore
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import ON_DONE, insert_rows, run_sql


def test_migrate_after_the_table_was_dropped_names_the_way_out_then_recreates(pg_dsn, table):
    env = cli_env(pg_dsn, table)
    assert cli("migrate", env=env).returncode == 0
    old_ids = insert_rows(pg_dsn, table, 3, dedup_key=None)
    run_sql(pg_dsn, table, "DROP TABLE {t}")

    refused = cli("migrate", env=env)
    assert refused.returncode == 1
    (line,) = refused.stderr.splitlines()
    assert "does not exist but" in line and f"records {len(STEPS)} migration steps" in line
    assert "outbox-relay migrate --recreate-from-id N" in line
    assert "run `outbox-relay migrate` first" not in line  # not the advice the user just followed

    recreated = cli("migrate", "--recreate-from-id", str(max(old_ids) + 100), env=env)
    assert recreated.returncode == 0, recreated.stderr
    assert f"ids from {max(old_ids) + 100}" in recreated.stdout
    assert insert_rows(pg_dsn, table, 1, dedup_key=None) == [max(old_ids) + 100]
    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr


def test_recreate_from_id_names_one_table():
    result = cli(
        "migrate", "--all-sources", "--recreate-from-id", "5", env=cli_env("postgresql://x@127.0.0.1:1/x", "o")
    )
    assert result.returncode == 2
    assert "--recreate-from-id names one table" in result.stderr


def _apply_script(dsn: str, script: str, tmp_path: Path) -> None:
    """The printed SQL applied the way a team would: psql in one transaction (psycopg where there is no psql)."""
    psql = shutil.which("psql")
    if psql is None:
        with psycopg.connect(dsn) as conn, conn.transaction():
            conn.execute(script.encode())
        return
    path = tmp_path / "outbox.sql"
    path.write_text(script)
    applied = subprocess.run(
        [psql, "--no-psqlrc", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-q", "-f", str(path), dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert applied.returncode == 0, applied.stderr


def test_print_sql_applied_to_an_empty_schema_is_what_migrate_makes(pg_dsn, table, tmp_path):
    ordered = {"OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES": '["OrderPaid"]'}
    env = cli_env(pg_dsn, table, **ordered)
    printed = cli("migrate", "--print-sql", "--relay", "outbox_relay", env=env)
    assert printed.returncode == 0, printed.stderr
    script = printed.stdout
    assert f"CREATE TABLE IF NOT EXISTS {_quoted(table)} (" in script
    assert "_aggregate_active_idx" in script  # the ordering indexes: relay.ordered_event_types is set
    assert "GRANT SELECT, UPDATE (status, available_at" in script  # the relay role's grants
    grants_start = script.index("-- outbox-relay grants for")
    _apply_script(pg_dsn, script[:grants_start], tmp_path)  # the roles do not exist here: the schema only

    # migrate finds nothing to do: no step, no index, no parameter, no mode, no trigger to add.
    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.splitlines() == [f"migrated {table}"]
    # (migrate creates a missing wake-up trigger without a note: look for it)
    assert run_sql(
        pg_dsn, table, "SELECT count(*) FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal", (table,)
    ) == [(1,)]
    # ... and the relay's statements work on it: a row enqueued is claimed.
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        assert store.run_problem(ordering=True, on_done=ON_DONE) is None
        (row_id,) = insert_rows(pg_dsn, table, 1, dedup_key=None)
        claimed = store.claim(owner="t", batch=5, lease_seconds=30, max_attempts=3)
        assert [row.id for row in claimed.rows] == [row_id]


def test_print_sql_a_second_time_on_an_installed_table_changes_nothing(pg_dsn, table, tmp_path):
    env = cli_env(pg_dsn, table)
    assert cli("migrate", env=env).returncode == 0
    script = cli("migrate", "--print-sql", env=env).stdout
    psql = shutil.which("psql")
    if psql is None:
        with pytest.raises(psycopg.errors.UniqueViolation), psycopg.connect(pg_dsn) as conn, conn.transaction():
            conn.execute(script.encode())
    else:
        path = tmp_path / "again.sql"
        path.write_text(script)
        again = subprocess.run(
            [psql, "--no-psqlrc", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-q", "-f", str(path), pg_dsn],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode != 0 and "duplicate key" in again.stderr
    assert cli("migrate", env=env).stdout.splitlines() == [f"migrated {table}"]


def test_print_sql_connects_to_nothing_and_refuses_what_does_not_apply():
    env = cli_env("postgresql://x@127.0.0.1:1/x", "app.outbox")
    printed = cli("migrate", "--print-sql", "--no-notify-trigger", env=env)
    assert printed.returncode == 0, printed.stderr
    assert "CREATE TRIGGER" not in printed.stdout and "notify_fn" not in printed.stdout
    assert 'CREATE SCHEMA IF NOT EXISTS "app";' in printed.stdout
    for flag in (["--all-sources"], ["--drop-ordering-indexes"], ["--recreate-from-id", "9"]):
        refused = cli("migrate", "--print-sql", *flag, env=env)
        assert refused.returncode == 2
        assert f"{flag[0]} does not apply" in refused.stderr
    alone = cli("migrate", "--relay", "r", env=env)
    assert alone.returncode == 2 and "go with --print-sql" in alone.stderr


def _partitioned_layout(dsn: str, table: str) -> dict[str, object]:
    """A partitioned outbox as the catalog describes it, its own names replaced by
    placeholders (T: the table, P: a partition) so that two tables compare: the
    partition key, the checks, every index of the table and of each partition, each
    partition's storage parameters, and the ranges relative to the first one."""
    schema, name = table.split(".")

    def normal(text: str, partition: str | None = None) -> str:
        if partition:
            text = text.replace(partition, "P")
        return text.replace(f'"{schema}".', "").replace(f"{schema}.", "").replace(name, "T")

    [(key,)] = run_sql(dsn, table, "SELECT pg_get_partkeydef(%s::regclass)", (table,))
    checks = run_sql(
        dsn,
        table,
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass",
        (table,),
    )
    parent_indexes = run_sql(
        dsn, table, "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s", (schema, name)
    )
    parts = run_sql(
        dsn,
        table,
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.reloptions FROM pg_inherits AS i "
        "JOIN pg_class AS c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass ORDER BY c.relname",
        (table,),
    )
    partitions = []
    for relname, bound, options in parts:
        indexes = run_sql(
            dsn, table, "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s", (schema, relname)
        )
        partitions.append(
            (
                normal(relname, None) if relname.endswith("_default") else "ranged",
                sorted(normal(i, relname) for (i,) in indexes),
                sorted(options or []),
                bound == "DEFAULT",
            )
        )
    return {
        "key": key,
        "checks": sorted((normal(n), d) for n, d in checks),
        "indexes": sorted(normal(i) for (i,) in parent_indexes),
        "partitions": partitions,
        "ranges": _ranges(dsn, table),
    }


def _ranges(dsn: str, table: str) -> list[tuple[str, int, int]]:
    """Each ranged partition: its name's suffix, its width and its start after the first one's (seconds)."""
    rows = run_sql(
        dsn,
        table,
        "SELECT c.relname, extract(epoch FROM b.from_at)::bigint, extract(epoch FROM b.to_at)::bigint "
        "FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid CROSS JOIN LATERAL ("
        "  SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([^'']+)''\\)'))[1]::timestamptz,"
        "         (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz"
        ") AS b(from_at, to_at) WHERE i.inhparent = %s::regclass AND b.from_at IS NOT NULL ORDER BY b.from_at",
        (table,),
    )
    first = rows[0][1]
    for relname, start, _end in rows:  # named after its start, to the minute
        assert relname.endswith("_p" + datetime.fromtimestamp(start, UTC).strftime("%Y%m%d%H%M")), relname
    return [("p", end - start, start - first) for _relname, start, end in rows]


def test_print_sql_of_a_partitioned_outbox_is_what_migrate_makes(pg_dsn, table, tmp_path):
    partitioning = {
        "OUTBOX_RELAY_PARTITIONING__INTERVAL": "5 minutes",
        "OUTBOX_RELAY_PARTITIONING__PREMAKE": "3",
        "OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES": '["OrderPaid"]',
        "OUTBOX_RELAY_DATABASE__AUTOVACUUM": '{"autovacuum_vacuum_threshold": 5000}',
    }
    printed = cli("migrate", "--print-sql", env=cli_env(pg_dsn, table, **partitioning))
    assert printed.returncode == 0, printed.stderr
    script = printed.stdout
    assert "PARTITION BY RANGE (created_at)" in script and "DEFAULT WITH (fillfactor = '50'" in script
    assert "autovacuum_vacuum_threshold = ''5000''" in script  # every partition gets database.autovacuum
    assert "SET (autovacuum" not in script  # a partitioned table has no storage of its own
    _apply_script(pg_dsn, script, tmp_path)

    # migrate finds nothing to do on it ...
    migrated = cli("migrate", env=cli_env(pg_dsn, table, **partitioning))
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.splitlines() == [f"migrated {table}"]
    # ... and it is the layout migrate makes on a database without the table.
    by_migrate = table + "_m"
    made = cli("migrate", env=cli_env(pg_dsn, by_migrate, **partitioning))
    assert made.returncode == 0, made.stderr
    applied_layout = _partitioned_layout(pg_dsn, table)
    assert applied_layout == _partitioned_layout(pg_dsn, by_migrate)
    assert applied_layout["ranges"] == [("p", 300, 300 * i) for i in range(4)]  # the current one, premake = 3
    assert [p[0] for p in applied_layout["partitions"]].count("T_default") == 1  # type: ignore[attr-defined]
    # The relay works on it: a row lands in the current partition (not the default one) and is claimed.
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        assert store.run_problem(ordering=True, on_done=ON_DONE) is None
        (row_id,) = insert_rows(pg_dsn, table, 1, dedup_key=None)
        assert run_sql(pg_dsn, table, "SELECT tableoid::regclass::text LIKE '%%_default' FROM {t}") == [(False,)]
        claimed = store.claim(owner="t", batch=5, lease_seconds=30, max_attempts=3)
        assert [row.id for row in claimed.rows] == [row_id]
    maintained = cli("maintain", env=cli_env(pg_dsn, table, **partitioning))
    assert maintained.returncode == 0, maintained.stdout + maintained.stderr


def _quoted(table: str) -> str:
    return ".".join(f'"{part}"' for part in table.split("."))
