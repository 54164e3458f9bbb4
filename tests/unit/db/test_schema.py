"""Every named section of db/sql/*.sql formats with the identifiers of a table: a brace
in a comment that ends a section (or a missing placeholder) fails here, not at the
first call in production."""

from __future__ import annotations

import pytest
from psycopg import sql

from outbox_relay.db.schema import QUERIES, TableSql

# Placeholders that only some statements have (filled in by their callers).
EXTRA = {
    "status": sql.Literal("dead"),
    "concurrently": sql.SQL(""),
    "index": sql.Identifier("some_idx"),
    "role": sql.Identifier("some_role"),
    "database": sql.Identifier("some_db"),  # grant_* sections
    "parameter": sql.SQL("autovacuum_vacuum_threshold"),
    "value": sql.Literal("1000"),  # *_storage_parameter
    "table_oid": sql.Literal('"app"."outbox"'),
    "first_id": sql.Literal(1000),  # restart_ids
    "constraint": sql.Identifier("some_check"),  # drop_audit_check, add_audit_replay_check
    # sql/partitions.sql: a partition, its bounds and storage, conversion's names
    "partition": sql.Identifier("app", "outbox_p2026120300"),
    "from_at": sql.Literal("2026-12-03 00:00:00+00"),
    "to_at": sql.Literal("2026-12-04 00:00:00+00"),
    "storage": sql.SQL("fillfactor = 50"),
    "boundary": sql.Literal("2026-12-04 00:00:00+00"),
    "new_name": sql.Identifier("outbox_p_before"),
    "trigger": sql.Identifier("outbox_notify_trg"),
    "privilege": sql.SQL("INSERT"),
    "grantee": sql.Identifier("some_role"),
    "partition_index": sql.Identifier("app", "outbox_p2026120300_pending_idx"),
    # create_partitions_ahead_at_apply (migrate --print-sql)
    "width_seconds": sql.Literal(300),
    "premake": sql.Literal(4),
    "name_prefix": sql.Literal("outbox_p"),
    "name_format": sql.Literal("YYYYMMDDHH24MI"),
    "schema": sql.Literal("app"),
    "table_text": sql.Literal('"app"."outbox"'),
}


# dead_filter and done_filter are fragments, not statements.
@pytest.mark.parametrize("name", sorted(n for n in QUERIES if n not in ("dead_filter", "done_filter")))
def test_section_formats(name: str) -> None:
    composed = TableSql("app.outbox").query(name, **EXTRA)
    assert isinstance(composed, sql.Composed) and len(list(composed)) > 0


def test_every_file_of_the_sql_folder_is_loaded():
    """A section in a file the loader does not list would be missing at run time."""
    from importlib import resources

    from outbox_relay.db import schema

    on_disk = {p.name for p in resources.files(schema.__package__).joinpath("sql").iterdir() if p.name.endswith(".sql")}
    assert on_disk == set(schema.SQL_FILES)
