"""Every named section of queries.sql formats with the identifiers of a table: a brace
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
    "value": sql.Literal("1000"),
}  # *_storage_parameter


@pytest.mark.parametrize("name", sorted(n for n in QUERIES if n != "dead_filter"))  # a fragment, not a statement
def test_section_formats(name: str) -> None:
    composed = TableSql("app.outbox").query(name, **EXTRA)
    assert isinstance(composed, sql.Composed) and len(list(composed)) > 0
