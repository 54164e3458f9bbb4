"""Test support for the database side: put rows in any state, read them back, run SQL.

- ``make_row``: one row in any state in one line (River's ``testfactory.Job``), e.g.
  ``make_row(dsn, table, status="dead", attempts=3, last_error="boom")`` or an
  expired lease: ``make_row(dsn, table, status="processing", lease_seconds=-5)``.
- ``insert_rows``: n fresh rows through the real ``enqueue()``.
- ``run_sql``: the one way to run a statement against the test table (``{t}`` is the
  quoted table name).
- ``rows``/``statuses``: read back; ``row_states``/``row_state``: the one way to read
  given rows' state (id -> chosen columns); ``wait_for`` (from ``tests.helpers.wait``,
  re-exported here): the one bounded correctness wait.
- ``ON_DONE``: the ``relay.on_done`` mode the suite runs in (``OUTBOX_RELAY_TEST_ON_DONE``,
  default keep; ``./dev test`` has a pass in delete mode). The ``store`` and
  ``make_settings`` fixtures and ``cli_env`` use it, so the table's mode and the
  relay's setting agree. ``delivered``/``assert_delivered``: what a done finalize left,
  in either mode (keep: the row is ``done``; delete: the row is gone).
- ``held_snapshot``: MVCC pressure, a REPEATABLE READ snapshot held for the block.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from tests.helpers.wait import wait_for as wait_for  # re-exported: tests import it with the db helpers

ON_DONE = os.environ.get("OUTBOX_RELAY_TEST_ON_DONE", "keep")
if ON_DONE not in ("keep", "delete"):
    raise RuntimeError(f"OUTBOX_RELAY_TEST_ON_DONE must be keep or delete, not {ON_DONE!r}")
DELETE_MODE = ON_DONE == "delete"


def run_sql(dsn: str, table: str, query: str, params: Sequence[object] | Mapping[str, object] = ()) -> list[tuple]:
    """Run one statement in autocommit; ``{t}`` in ``query`` is the (quoted) test table."""
    ident = sql.Identifier(*table.split("."))
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.SQL(query).format(t=ident), params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def make_row(
    dsn: str,
    table: str,
    *,
    status: str = "pending",
    aggregate_type: str = "order",
    aggregate_id: str = "agg-1",
    event_type: str = "OrderCreated",
    payload: Any = None,
    topic: str | None = None,
    headers: Mapping[str, str] | None = None,
    attempts: int = 0,
    lease_version: int | None = None,
    lease_owner: str | None = None,
    lease_seconds: float = 30.0,
    last_error: str | None = None,
    available_in_seconds: float = 0.0,
    created_ago_seconds: float = 0.0,
    dedup_key: str | None = None,
) -> int:
    """Insert one row directly in ``status``; return its id.

    processing rows get ``lease_until = now() + lease_seconds`` (negative: already
    expired), an owner and a lease_version of at least 1; done rows get ``done_at``.
    """
    if status not in ("pending", "processing", "done", "dead"):
        raise ValueError(f"unknown status {status!r}")
    processing = status == "processing"
    version = lease_version if lease_version is not None else (max(1, attempts) if status != "pending" else 0)
    [(row_id,)] = run_sql(
        dsn,
        table,
        """
        INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, topic, headers, status, attempts,
                         lease_version, lease_owner, lease_until, last_error, available_at, created_at, done_at,
                         dedup_key)
        VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s::jsonb, %(topic)s,
                %(headers)s::jsonb, %(status)s, %(attempts)s, %(version)s, %(owner)s,
                CASE WHEN %(processing)s THEN now() + make_interval(secs => %(lease)s) END,
                %(last_error)s, now() + make_interval(secs => %(available_in)s),
                now() - make_interval(secs => %(created_ago)s),
                CASE WHEN %(status)s = 'done' THEN now() END, %(dedup_key)s)
        RETURNING id""",
        {
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "event_type": event_type,
            "payload": json.dumps(payload if payload is not None else {"made_by": "make_row"}),
            "topic": topic,
            "headers": json.dumps(dict(headers)) if headers is not None else None,
            "status": status,
            "attempts": attempts,
            "version": version,
            "owner": lease_owner if lease_owner is not None else ("test-owner" if processing else None),
            "processing": processing,
            "lease": float(lease_seconds),
            "last_error": last_error,
            "available_in": float(available_in_seconds),
            "created_ago": float(created_ago_seconds),
            "dedup_key": dedup_key,
        },
    )
    return int(row_id)


def insert_rows(
    dsn: str,
    table: str,
    n: int,
    *,
    aggregate_type: str = "order",
    aggregates: int = 10,
    event_type: str = "OrderCreated",
    payload_size: int = 0,
    **extra: Any,
) -> list[int]:
    """Insert n rows with enqueue() in one transaction; return their ids."""
    from outbox_relay import enqueue

    ids = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for i in range(n):
            payload: dict[str, Any] = {"seq": i}
            if payload_size:
                payload["pad"] = "x" * payload_size
            ids.append(
                enqueue(
                    conn,
                    aggregate_type=aggregate_type,
                    aggregate_id=f"agg-{i % aggregates}",
                    event_type=event_type,
                    payload=payload,
                    table=table,
                    **extra,
                )
            )
    return ids


def rows(dsn: str, table: str, columns: str = "id, status, attempts, lease_version, last_error") -> list[tuple]:
    return run_sql(dsn, table, f"SELECT {columns} FROM {{t}} ORDER BY id")


def statuses(dsn: str, table: str) -> dict[str, int]:
    """Row count per status."""
    return {status: int(n) for status, n in run_sql(dsn, table, "SELECT status, count(*) FROM {t} GROUP BY status")}


ROW_STATE_COLUMNS = ("status", "attempts", "lease_version", "lease_owner", "lease_until", "last_error", "done_at")


def row_states(
    dsn: str, table: str, ids: Sequence[int], columns: Sequence[str] = ("status", "attempts")
) -> dict[int, tuple[Any, ...]]:
    """The one way to read rows' state: id -> the values of ``columns`` (row ids that
    do not exist are absent)."""
    query = sql.SQL("SELECT id, {} FROM {} WHERE id = ANY(%s)").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(*table.split("."))
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(query, (list(ids),)).fetchall()}


def row_state(dsn: str, table: str, row_id: int, columns: Sequence[str] = ROW_STATE_COLUMNS) -> dict[str, Any]:
    """One row's state by column name (``row_states`` for one id); KeyError if it is gone."""
    return dict(zip(columns, row_states(dsn, table, [row_id], columns)[row_id], strict=True))


def delivered(dsn: str, table: str, ids: Sequence[int]) -> set[int]:
    """The ids among ``ids`` a done finalize has finished, in the suite's ``ON_DONE``
    mode: keep, the row is ``done``; delete, the row is gone (in these tests nothing
    else deletes a row: no purge runs). A row left ``done`` in delete mode (or gone in
    keep mode) does not count."""
    present = dict(run_sql(dsn, table, "SELECT id, status FROM {t} WHERE id = ANY(%s)", (list(ids),)))
    if DELETE_MODE:
        return {i for i in ids if i not in present}
    return {i for i in ids if present.get(i) == "done"}


def assert_delivered(dsn: str, table: str, ids: Sequence[int]) -> None:
    """Every row of ``ids`` was finalized as delivered, as the table's mode says: keep,
    each row is ``done`` with ``done_at`` set, its lease and last error cleared;
    delete, none of them is left in the table."""
    found = run_sql(
        dsn,
        table,
        "SELECT id, status, done_at IS NOT NULL, lease_owner, lease_until, last_error "
        "FROM {t} WHERE id = ANY(%s) ORDER BY id",
        (list(ids),),
    )
    if DELETE_MODE:
        assert found == [], f"delete mode: delivered rows still in the table: {found}"
        return
    assert [r[0] for r in found] == sorted(ids), "keep mode: delivered rows missing from the table"
    wrong = [r for r in found if r[1:] != ("done", True, None, None, None)]
    assert wrong == [], f"keep mode: rows not left done (id, status, done_at set, owner, lease, error): {wrong}"


@contextlib.contextmanager
def held_snapshot(dsn: str) -> Iterator[None]:
    """A REPEATABLE READ transaction that has taken its snapshot: nothing deleted or
    updated after it is removable, nor marked dead in an index, until it ends."""
    holder = psycopg.connect(dsn)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1").fetchone()
    try:
        yield
    finally:
        holder.rollback()
        holder.close()
