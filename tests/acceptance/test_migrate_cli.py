"""`outbox-relay migrate` as an operator meets it: a table dropped while its migration
record was kept, and the SQL printed for teams that apply migrations with their own tool."""

from __future__ import annotations

from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, run_sql


def test_migrate_after_the_table_was_dropped_names_the_way_out_then_recreates(pg_dsn, table):
    env = cli_env(pg_dsn, table)
    assert cli("migrate", env=env).returncode == 0
    old_ids = insert_rows(pg_dsn, table, 3, dedup_key=None)
    run_sql(pg_dsn, table, "DROP TABLE {t}")

    refused = cli("migrate", env=env)
    assert refused.returncode == 1
    (line,) = refused.stderr.splitlines()
    assert "does not exist but" in line and "records 6 migration steps" in line
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
