"""Rows are turned into dataclasses by position on the claim path (no row factory: it
would cost a dict or a call per row on the relay's hottest statement). So the column
names the server reports for every statement that builds a ``Claimed`` must be, in
order, the dataclass's fields: reordering a RETURNING list fails here instead of
silently swapping two fields. The store takes ``Claimed(*record[1:12])`` plus
``tombstone``, ``partition``, ``payload_bytes`` from ``record[14:17]`` from the plain claim (column 0 says
whether the row was reaped, column 12 is the reaped row's owner, 13 a due row's key),
``Claimed(*row[:-2])`` from the ordered heads (the last columns are the round-robin
cursor and the clock), ``Claimed(*row[1:15])`` from the fast ordered heads (column 0
tells claimed rows from looks, the last one is a look's finding) and ``Claimed(*row)``
from the ordered runs."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from outbox_relay.db.pooler import execute_with_settings
from outbox_relay.db.store import CLAIM_SETTINGS
from outbox_relay.model import Claimed
from tests.helpers.db import make_row, run_sql

# The one column whose SQL name differs from its field: what the claim measured.
SQL_NAME_OF = {"size_bytes": "row_bytes"}
CLAIMED_COLUMNS = [SQL_NAME_OF.get(f.name, f.name) for f in dataclasses.fields(Claimed)]

PARAMS = {
    "owner": "mapping",
    "batch": 10,
    "lease_seconds": 30.0,
    "max_attempts": 5,
    "max_batch_bytes": 8 << 20,
    "candidates": 10,
    "max_message_bytes": None,
    "excluded_types": [],
    "after": None,
    "all_ordered": True,
    "ordered_types": [],
    "first_always": True,
    "run_length": 10,
    "room": 10,
    "aggregate_ids": ["agg-1"],
    "head_ids": [0],
    "bounds": [0],
}


def _columns(store, pg_dsn, name: str) -> list[str]:
    """Column names of one statement as the server describes them (run and rolled back)."""
    with psycopg.connect(pg_dsn) as conn:
        cur = conn.cursor()
        execute_with_settings(cur, store.sql.query(name), PARAMS, CLAIM_SETTINGS)
        assert cur.description is not None
        names = [column.name for column in cur.description]
        conn.rollback()
    return names


@pytest.mark.parametrize(
    ("statement", "taken"),
    [
        ("claim", slice(1, 12)),  # reaped flag first, reaped owner last
        ("claim_ordered_heads", slice(None, -2)),  # the round-robin cursor and the clock last
        ("claim_ordered_heads_bounded", slice(1, 15)),  # the kind first, a look's finding last
        ("claim_ordered_runs", slice(None)),
    ],
)
def test_every_statement_that_builds_a_claimed_returns_its_fields_in_order(store, pg_dsn, table, statement, taken):
    make_row(pg_dsn, table)  # something to claim, so every branch of the plan has a row
    columns = _columns(store, pg_dsn, statement)
    if statement == "claim":
        columns = [*columns[taken], *columns[14:17]]
    else:
        columns = columns[taken]
    assert columns == CLAIMED_COLUMNS


def test_the_plain_claim_keeps_the_reaped_columns_where_the_store_reads_them(store, pg_dsn, table):
    """Reaped rows are read as (record[1], record[2], record[12]): id, version, owner;
    record[13] is a claimed due row's key, where the claim cursor starts later claims;
    record[14:17] the claimed row's tombstone, partition and payload_bytes."""
    columns = _columns(store, pg_dsn, "claim")
    assert columns[0] == "reaped" and columns[1:3] == ["id", "lease_version"] and columns[12] == "reaped_owner"
    assert columns[13] == "due_at"
    assert columns[14:] == ["tombstone", "partition", "payload_bytes"]
    assert len(columns) == 17


def test_a_claimed_row_carries_each_column_in_its_own_field(store, pg_dsn, table):
    """Values distinct per field: a swap of two fields of the same type fails too."""
    row_id = make_row(
        pg_dsn,
        table,
        aggregate_type="type-a",
        aggregate_id="id-b",
        event_type="event-c",
        topic="topic-d",
        headers={"h": "e"},
        payload={"p": "f"},
        attempts=2,
        lease_version=7,
    )
    run_sql(pg_dsn, table, "UPDATE {t} SET tombstone = true, partition = 4 WHERE id = %s", (row_id,))
    [claimed] = store.claim(owner="mapping", batch=10, lease_seconds=30, max_attempts=5).rows
    assert (claimed.tombstone, claimed.partition) == (True, 4)
    assert (claimed.id, claimed.lease_version, claimed.attempts) == (row_id, 8, 3)
    assert (claimed.aggregate_type, claimed.aggregate_id, claimed.event_type, claimed.topic) == (
        "type-a",
        "id-b",
        "event-c",
        "topic-d",
    )
    assert (claimed.payload, claimed.headers) == ('{"p": "f"}', '{"h": "e"}')
    assert claimed.size_bytes == len('{"p": "f"}') + len('{"h": "e"}')
