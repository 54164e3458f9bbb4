"""PauseOps: the statements of operator pauses (sql/pauses.sql): the pauses table, and
parking / unparking the pending rows a pause matches, chunk by chunk.

operator/pauses.py holds the rules (what a pause may select, the audit entry, the
order of the steps); this module only reads and writes. Each chunk is one short
transaction that also adds its rows to the operation's audit entry, so the trail
stays exact if the operation is interrupted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from ..errors import SchemaMissing
from .delivery import CLAIM_SETTINGS
from .pooler import execute_with_settings
from .schema import PARK_FLOOR_SQL
from .store_core import StoreCore

#: A pending row due at or after this moment is parked by an operator pause (sql/pauses.sql).
PARKED_FROM = dt.datetime.fromisoformat(PARK_FLOOR_SQL.split("'")[1])


@dataclass(frozen=True, slots=True)
class PauseRow:
    """One pause as stored: active while ``resumed_at`` is None."""

    id: int
    selector: str  # event_type | topic | aggregate_type
    value: str
    reason: str
    paused_by: str
    paused_from: str  # cli | console
    paused_at: dt.datetime
    resumed_at: dt.datetime | None = None
    resumed_by: str | None = None


@dataclass(frozen=True, slots=True)
class ChunkStep:
    """One park/unpark chunk: rows moved, where the next chunk starts, whether it was the last."""

    moved: int
    after: tuple[dt.datetime, int] | None
    finished: bool


class PauseOps(StoreCore):
    def pauses_table_exists(self) -> bool:
        with self._mapped("check pauses table"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("pauses_table_exists"), {"pauses_table": self.sql.pauses_regclass_text}
            ).fetchone()
            return bool(row and row[0])

    def require_pauses_table(self) -> None:
        if not self.pauses_table_exists():
            raise SchemaMissing(
                f"the pauses table of {self.table!r} does not exist: run `outbox-relay migrate` "
                "(migration step 9, create_pauses); nothing was changed"
            )

    def pause_insert(self, *, selector: str, value: str, reason: str, actor: str, source: str) -> PauseRow | None:
        """A new active pause; None when the same selector and value is already paused."""
        with self._mapped("pause"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("pause_insert"),
                {"selector": selector, "value": value, "reason": reason, "actor": actor, "source": source},
            ).fetchone()
        if row is None:
            return None
        return PauseRow(int(row[0]), selector, value, reason, actor, source, row[1])

    def pause_end(
        self, *, actor: str, pause_id: int | None = None, selector: str | None = None, value: str | None = None
    ) -> PauseRow | None:
        """End the active pause given by id or by selector and value; None if none is active."""
        with self._mapped("resume"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("pause_end"), {"actor": actor, "id": pause_id, "selector": selector, "value": value}
            ).fetchone()
        if row is None:
            return None
        return PauseRow(int(row[0]), row[1], row[2], row[3], row[4], "", row[5], row[6], actor)

    def pauses(self, *, include_resumed: bool = False, limit: int = 100) -> list[PauseRow]:
        """The active pauses (and the resumed ones, when asked), active first, newest first."""
        with self._mapped("list pauses"), self._pool.connection() as conn:
            rows = conn.execute(self.sql.query("pauses_list"), {"all": include_resumed, "limit": limit}).fetchall()
        return [PauseRow(*row) for row in rows]

    def paused_rows(self, *, count_cap: int = 1_000_000, timeout_ms: int | None = None) -> int | None:
        """Pending rows parked by a pause, counted up to ``count_cap``; None when a
        ``timeout_ms`` budget ran out first (`status` then says so rather than fail)."""
        with self._mapped("count paused rows"), self._pool.connection() as conn:
            if timeout_ms is None:
                row = conn.execute(self.sql.query("paused_rows_count"), {"count_cap": count_cap}).fetchone()
            else:
                try:
                    with conn.transaction():
                        conn.execute(self.sql.query("bound_statement"), [f"{max(1, timeout_ms)}ms"])
                        row = conn.execute(self.sql.query("paused_rows_count"), {"count_cap": count_cap}).fetchone()
                except psycopg.errors.QueryCanceled:
                    return None
        return int(row[0]) if row else 0

    def park_chunk(
        self, *, selector: str, value: str, after: tuple[dt.datetime, int] | None, chunk: int, audit_id: int | None
    ) -> ChunkStep:
        """Park the next ``chunk`` pending rows the pause matches (sql/pauses.sql park_chunk)."""
        params = _chunk_params(selector, value, after, chunk)
        rows = self._chunk("park paused rows", "park_chunk", params, audit_id, changed=len)
        if not rows:
            return ChunkStep(0, after, finished=True)
        last_id, last_at = max(rows, key=lambda r: (r[1], r[0]))
        return ChunkStep(len(rows), (last_at, int(last_id)), finished=len(rows) < chunk)

    def park_expired_chunk(
        self, *, selector: str, value: str, max_attempts: int, chunk: int, audit_id: int | None
    ) -> ChunkStep:
        """Park the next ``chunk`` rows the pause matches whose lease expired (sql/pauses.sql
        park_expired_chunk); parked rows leave the range, so each chunk starts at the front."""
        params = {"selector": selector, "value": value, "max_attempts": max_attempts, "chunk": chunk}
        rows = self._chunk("park expired leases", "park_expired_chunk", params, audit_id, changed=len)
        return ChunkStep(len(rows), None, finished=len(rows) < chunk)

    def unpark_chunk(
        self, *, selector: str, value: str, after: tuple[dt.datetime, int] | None, chunk: int, audit_id: int | None
    ) -> ChunkStep:
        """Give the next ``chunk`` parked rows the ended pause matched their original
        available_at back (sql/pauses.sql unpark_chunk)."""
        params = _chunk_params(selector, value, after, chunk)
        rows = self._chunk(
            "unpark paused rows", "unpark_chunk", params, audit_id, changed=lambda rows: int(rows[0][3]) if rows else 0
        )
        if not rows:
            return ChunkStep(0, after, finished=True)
        moved = int(rows[0][3])
        last = max(rows, key=lambda r: (r[1], r[0]))
        return ChunkStep(moved, (last[1], int(last[0])), finished=len(rows) < chunk)

    def _chunk(
        self,
        what: str,
        query: str,
        params: dict[str, Any],
        audit_id: int | None,
        *,
        changed: Callable[[list[tuple[Any, ...]]], int],
    ) -> list[tuple[Any, ...]]:
        """One chunk statement and its audit count in one transaction. The claim's planner
        settings: the pending index read in order and cut by LIMIT, never a bitmap scan
        of every pending row, whatever the statistics."""
        with self._mapped(what, commit_unknown=True), self._pool.connection() as conn:
            with conn.transaction():
                cur = conn.cursor()
                execute_with_settings(cur, self.sql.query(query), params, CLAIM_SETTINGS)
                rows: list[tuple[Any, ...]] = cur.fetchall()
                n = changed(rows)
                if n and audit_id is not None:
                    conn.execute(self.sql.query("audit_add_changed"), {"audit_id": audit_id, "n": n})
        return rows


def _chunk_params(selector: str, value: str, after: tuple[dt.datetime, int] | None, chunk: int) -> dict[str, Any]:
    """A chunk's parameters: the rows after the key ``after`` (None: from the front)."""
    return {
        "selector": selector,
        "value": value,
        "after_at": after[0] if after else None,
        "after_id": after[1] if after else None,
        "chunk": chunk,
    }
