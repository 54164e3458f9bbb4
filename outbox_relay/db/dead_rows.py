"""DeadRowOps: what the operator reads and changes. Dead-letter retry and skip (by
id, or by filter chunk by chunk with an audit entry), filtered counts, pages and
summaries of dead rows, the audit log, one row's or one aggregate's detail."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import errors as pg_errors
from psycopg import sql

from ..core.filters import DeadFilter
from ..errors import DatabaseUnavailable, SchemaMissing
from .store_core import Count, StoreCore


@dataclass(slots=True)
class DeadSummary:
    """Matching dead rows grouped for an operator (top entries only)."""

    by_event_type: list[tuple[str, int]]
    by_error: list[tuple[str, int]]
    aggregates: int
    sample_aggregates: list[str]


class DeadRowOps(StoreCore):
    # --- dead-letter operations ------------------------------------------------------
    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        with self._mapped("look up rows"), self._pool.connection() as conn:
            return {r[0]: r[1] for r in conn.execute(self.sql.query("status_of"), {"ids": list(ids)}).fetchall()}

    def states(self, ids: Sequence[int]) -> dict[int, tuple[str, int]]:
        """id -> (status, lease_version)."""
        with self._mapped("look up rows"), self._pool.connection() as conn:
            return {r[0]: (r[1], r[2]) for r in conn.execute(self.sql.query("state_of"), {"ids": list(ids)}).fetchall()}

    def dead_retry(self, ids: Sequence[int]) -> set[int]:
        with self._mapped("dead retry"), self._pool.connection() as conn:
            return {r[0] for r in conn.execute(self.sql.query("dead_retry"), {"ids": list(ids)}).fetchall()}

    def dead_skip(self, ids: Sequence[int], reason: str) -> set[int]:
        with self._mapped("dead skip"), self._pool.connection() as conn:
            return {
                r[0] for r in conn.execute(self.sql.query("dead_skip"), {"ids": list(ids), "reason": reason}).fetchall()
            }

    # --- operator console / CLI: filters, exact counts, audit -------------------------------
    # Everything the CLI's filtered dead-letter commands and the console read or change.
    # Filters are bound parameters (filters.DeadFilter.sql_params); statements run with
    # prepare=False so PostgreSQL plans each one with the actual filter values (a
    # generic plan could not use the partial indexes). Bulk changes go chunk by chunk,
    # one short autocommit statement each, through operations.change_dead.
    def database_now(self) -> dt.datetime:
        with self._mapped("read clock"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("database_now")).fetchone()
            assert row is not None and isinstance(row[0], dt.datetime)  # timestamptz: an aware datetime
            return row[0]

    def audit_table_exists(self) -> bool:
        with self._mapped("check audit table"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("audit_table_exists"), {"audit_table": self.sql.audit_regclass_text}
            ).fetchone()
            return bool(row and row[0])

    def require_audit_table(self) -> None:
        if not self.audit_table_exists():
            raise SchemaMissing(
                f"the audit table of {self.table!r} does not exist: run `outbox-relay migrate` "
                "(this version records every retry/skip there); nothing was changed"
            )

    def dead_count(self, selector: DeadFilter, *, budget_ms: int, first_upto: int = 100_000) -> Count:
        """Dead rows matching ``selector`` (its limit applied), exactly while the budget lasts."""
        with self._mapped("count dead rows"):
            count = self._bounded_count(
                self.sql.query("dead_count_upto"), selector.sql_params(), first_upto=first_upto, budget_ms=budget_ms
            )
        if selector.limit is not None and count.n >= selector.limit:
            return Count(selector.limit, exact=True)
        return count

    def dead_page(self, selector: DeadFilter, *, after_id: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """One page of matching dead rows in id order after ``after_id``."""
        with self._mapped("dead list"), self._pool.connection() as conn:
            cur = conn.execute(
                self.sql.query("dead_page"), dict(selector.sql_params(), after_id=after_id, limit=limit), prepare=False
            )
            names = [d.name for d in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def dead_summary(self, selector: DeadFilter, *, timeout_ms: int, top: int = 10) -> DeadSummary | None:
        """Matching dead rows by event type, by error and by aggregate; None if the
        grouping did not finish within ``timeout_ms`` (huge dead-letter backlogs)."""
        params = dict(selector.sql_params(), top=top)
        try:
            with self._mapped("dead summary"), self._pool.connection() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, timeout_ms))))
                by_type = [
                    (r[0], int(r[1]))
                    for r in conn.execute(self.sql.query("dead_by_event_type"), params, prepare=False).fetchall()
                ]
                by_error = [
                    (r[0], int(r[1]))
                    for r in conn.execute(self.sql.query("dead_by_error"), params, prepare=False).fetchall()
                ]
                agg = conn.execute(self.sql.query("dead_aggregates"), params, prepare=False).fetchone()
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.QueryCanceled):
                return None
            raise
        return DeadSummary(
            by_event_type=by_type,
            by_error=by_error,
            aggregates=int(agg[0]) if agg else 0,
            sample_aggregates=list(agg[1]) if agg else [],
        )

    def dead_change_chunk(
        self, action: str, selector: DeadFilter, *, after_id: int, chunk: int, audit_id: int, reason: str | None = None
    ) -> list[int]:
        """Retry or skip the next ``chunk`` matching rows after ``after_id`` in one short
        transaction that also adds them to audit entry ``audit_id``; their ids, ascending."""
        name = {"retry": "dead_retry_chunk", "skip": "dead_skip_chunk"}[action]
        params = dict(selector.sql_params(), after_id=after_id, chunk=chunk, audit_id=audit_id, reason=reason)
        with self._mapped(f"dead {action}", commit_unknown=True), self._pool.connection() as conn:
            return [int(r[0]) for r in conn.execute(self.sql.query(name), params, prepare=False).fetchall()]

    def audit_begin(
        self,
        *,
        actor: str,
        source: str,
        action: str,
        selector: dict[str, Any],
        rows_matched: int | None,
        reason: str | None,
    ) -> int:
        with self._mapped("audit"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("audit_begin"),
                {
                    "actor": actor,
                    "source": source,
                    "action": action,
                    "selector": json.dumps(selector),
                    "rows_matched": rows_matched,
                    "reason": reason,
                },
            ).fetchone()
            assert row is not None
            return int(row[0])

    def audit_finish(self, audit_id: int) -> None:
        with self._mapped("audit"), self._pool.connection() as conn:
            conn.execute(self.sql.query("audit_finish"), {"audit_id": audit_id})

    def audit_list(self, *, limit: int = 50, before_id: int | None = None) -> list[dict[str, Any]]:
        """Audit entries, newest first."""
        with self._mapped("audit list"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("audit_list"), {"limit": limit, "before_id": before_id})
            names = [d.name for d in cur.description or ()]
            entries = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        for entry in entries:
            entry["selector"] = json.loads(entry["selector"])
        return entries

    def row_detail(self, row_id: int) -> dict[str, Any] | None:
        with self._mapped("read row"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("row_detail"), {"id": row_id})
            names = [d.name for d in cur.description or ()]
            row = cur.fetchone()
            return dict(zip(names, row, strict=True)) if row else None

    def aggregate_rows(self, aggregate_id: str, *, limit: int = 100) -> tuple[list[dict[str, Any]], int]:
        """An aggregate's first ``limit`` unfinished rows in id order, and how many it has."""
        with self._mapped("read aggregate"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("aggregate_rows"), {"aggregate_id": aggregate_id, "limit": limit})
            names = [d.name for d in cur.description or ()]
            found = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            total_row = conn.execute(
                self.sql.query("aggregate_unfinished_count"), {"aggregate_id": aggregate_id}
            ).fetchone()
        return found, int(total_row[0]) if total_row else 0
