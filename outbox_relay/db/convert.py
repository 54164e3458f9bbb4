"""``migrate --convert-to-partitioned``: an existing plain outbox becomes a partitioned
one ([partitioning]) without moving a row.

The plain table is attached, as it is, as the partition of every ``created_at`` before
a boundary at least one partition width ahead; new partitions start at the boundary,
and maintenance drops the old table like any partition once the retention has passed
its boundary and it holds nothing to handle. Why this way and not a copy: a copy
writes every row again (WAL, time, disk twice) and needs writers switched over; here
only catalog changes happen under the one ACCESS EXCLUSIVE lock.

The steps, each safe to interrupt and run again:

1. Without blocking writers: a unique index on (id, created_at) (the partitioned
   table's primary key needs a match in the partition) and a plain dedup index, both
   built CONCURRENTLY; a CHECK (created_at < boundary) added NOT VALID (a catalog
   change under lock_timeout) and validated (SHARE UPDATE EXCLUSIVE: writers go on).
2. One short transaction under lock_timeout (retried): the plain table and its
   indexes are renamed out of the way, its primary key on id gives way to the index on
   (id, created_at), its identity is dropped; the
   partitioned table is created under the old name with the same privileges, its ids
   continuing after the highest one used; the plain table is attached over
   (MINVALUE, boundary), which the validated check lets PostgreSQL do without a scan,
   and every index of the partitioned table finds its match (nothing is built).
3. The usual migrate then adds the default partition and the wake-up trigger, and
   maintenance the partitions from the boundary on.

A writer that sets created_at at or after the boundary between step 1 and step 2
fails the check (the default created_at, now(), never does): such writers are told
about in the how-to page.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import DatabaseError
from .partitions import PartitionLayout, database_now, range_start
from .schema import BASE_INDEXES, OBSOLETE_INDEXES, ORDERING_INDEXES, TableSql, short_name

#: Name of the converted table once it is a partition ("<table>_p_before").
BEFORE_SUFFIX = "p_before"


def _one(conn: psycopg.Connection[Any], statement: sql.Composed, params: dict[str, Any] | None = None) -> Any:
    row = conn.execute(statement, params).fetchone()
    return row[0] if row else None


def convert_to_partitioned(
    conn: psycopg.Connection[Any],
    table_sql: TableSql,
    layout: PartitionLayout,
    *,
    wanted_indexes: list[str],
    attempts: int = 5,
) -> list[str]:
    """Steps 1 and 2 (the module docstring) on an autocommit connection holding
    migrate's lock. Returns notes for the operator."""
    regclass = table_sql.regclass_text
    name = table_sql.table_name
    id_index = short_name(name, "id_created_at_idx")
    dedup_index = short_name(name, "dedup_plain_idx")
    check = short_name(name, "before_check")
    before = table_sql.partition_name(BEFORE_SUFFIX)

    # Step 1: indexes CONCURRENTLY (an invalid leftover of an interrupted build is rebuilt).
    valid = {str(r[0]): bool(r[1]) for r in conn.execute(table_sql.query("table_indexes"), {"table": regclass})}
    for index, section in ((id_index, "convert_index_id_created_at"), (dedup_index, "convert_index_dedup_plain")):
        if valid.get(index) is False:
            conn.execute(
                table_sql.query(
                    "drop_index", index=table_sql.partition_ident(index), concurrently=sql.SQL("CONCURRENTLY")
                )
            )
        conn.execute(table_sql.query(section, index=sql.Identifier(index)))
    if _one(conn, table_sql.query("convert_range_check_exists"), {"table": regclass, "constraint": check}):
        boundary: datetime = _one(
            conn, table_sql.query("convert_range_check_bound"), {"table": regclass, "constraint": check}
        )
    else:
        step = timedelta(seconds=layout.interval_seconds)
        boundary = range_start(database_now(conn, table_sql) + step, layout.interval_seconds) + step
        _with_lock_timeout(
            conn,
            table_sql,
            layout,
            attempts,
            lambda: conn.execute(
                table_sql.query(
                    "convert_add_range_check", constraint=sql.Identifier(check), boundary=sql.Literal(boundary)
                )
            ),
        )
    conn.execute(table_sql.query("convert_validate_range_check", constraint=sql.Identifier(check)))

    # Step 2: the swap, in one transaction.
    def swap() -> None:
        conn.execute(table_sql.query("convert_lock"))
        privileges = conn.execute(table_sql.query("table_privileges"), {"table": regclass}).fetchall()
        pkey = _one(conn, table_sql.query("primary_key_name"), {"table": regclass})
        existing = {str(r[0]) for r in conn.execute(table_sql.query("table_indexes"), {"table": regclass})}
        checks: dict[str, sql.Composable] = {
            ("lease_check" if is_lease else "status_check"): sql.Identifier(str(conname))
            for conname, is_lease in conn.execute(
                table_sql.query("check_constraints"), {"table": regclass, "range_check": check}
            )
        }
        conn.execute(table_sql.query("rename_table", new_name=sql.Identifier(before)))
        part = table_sql.partition_ident(before)
        if pkey:  # the index on (id, created_at) becomes the primary key the partitioned table's pairs with
            conn.execute(table_sql.query("drop_primary_key", partition=part, constraint=sql.Identifier(pkey)))
        for key in (*BASE_INDEXES, *ORDERING_INDEXES, *OBSOLETE_INDEXES):
            index = table_sql.index_name(key)
            if index in existing:
                conn.execute(
                    table_sql.query(
                        "rename_index",
                        index=table_sql.partition_ident(index),
                        new_name=sql.Identifier(short_name(before, f"{key}_idx")),
                    )
                )
        conn.execute(table_sql.query("drop_identity", partition=part))
        conn.execute(
            table_sql.query("drop_trigger_of", partition=part, trigger=sql.Identifier(table_sql.notify_trigger_name))
        )
        max_id = int(_one(conn, table_sql.query("max_id_of", partition=part)) or 0)
        conn.execute(table_sql.query("create_partitioned_table", strict=False, **checks))
        # The columns later migration steps added (7: tombstone, partition; 10:
        # payload_bytes), as the table has them: a partition must have its parent's columns.
        conn.execute(table_sql.query("add_record_columns"))
        conn.execute(table_sql.query("add_payload_bytes"))
        conn.execute(table_sql.query("restart_ids", first_id=sql.Literal(max_id + 1)))
        for key in wanted_indexes:
            conn.execute(table_sql.index_ddl(key, concurrently=False, partitioned=True))
        conn.execute(
            table_sql.query(
                "primary_key_using_index",
                partition=part,
                constraint=sql.Identifier(short_name(before, "pkey")),
                index=sql.Identifier(id_index),
            )
        )
        conn.execute(table_sql.query("attach_first_partition", partition=part, to_at=sql.Literal(boundary)))
        for grantee, privilege in privileges:
            conn.execute(
                table_sql.query(
                    "grant_privilege",
                    privilege=sql.SQL(str(privilege)),  # a privilege keyword as aclexplode names it
                    grantee=sql.SQL("PUBLIC") if grantee == "PUBLIC" else sql.Identifier(str(grantee)),
                )
            )

    _with_lock_timeout(conn, table_sql, layout, attempts, swap)
    return [
        f"converted {table_sql.table} to a partitioned table: the former table is partition {before} "
        f"(created_at before {boundary.isoformat()}), new partitions start there"
    ]


def _with_lock_timeout(
    conn: psycopg.Connection[Any], table_sql: TableSql, layout: PartitionLayout, attempts: int, change: Any
) -> None:
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction():
                conn.execute(
                    table_sql.query("maintenance_lock_timeout"),
                    {"lock_timeout": f"{layout.lock_timeout_ms}ms"},
                )
                change()
            return
        except pg_errors.LockNotAvailable:
            if attempt == attempts:
                raise DatabaseError(
                    f"convert: a lock on the outbox was not available within {layout.lock_timeout_ms} ms, "
                    f"{attempt} times: a long transaction holds the table; run the conversion again when it ended"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
