"""ReplayOps: what a replay of delivered rows reads (operator/replay.py sends them).

A replay never changes an outbox row: it reads delivered rows (status ``done``, no
``last_error``) and adds them to an audit entry. No index covers done rows (the queue's
partial indexes hold unfinished rows only), so the rows are found by walking the table
in id order (its primary key) in bounded windows, one short read each, like purge:
no statement reads more than ``window`` rows, however many match.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from psycopg import errors as pg_errors
from psycopg import sql

from ..core.filters import DeadFilter
from ..errors import DatabaseUnavailable, SchemaMissing
from ..model import Claimed
from .store_core import Count, StoreCore


@dataclass(slots=True)
class ReplayStep:
    """One step of a replay's walk: the matching rows (in id order) and where to go on."""

    rows: list[Claimed]
    after_id: int  # the next step starts after this id
    finished: bool  # the walk reached its end


class ReplayOps(StoreCore):
    def replay_count(self, selector: DeadFilter, *, budget_ms: int, first_upto: int = 100_000) -> Count:
        """Delivered rows matching ``selector`` (its limit applied), exactly while the budget lasts."""
        with self._mapped("count delivered rows"):
            count = self._bounded_count(
                self.sql.query("replay_count_upto"),
                selector.sql_params(),
                first_upto=first_upto,
                budget_ms=budget_ms,
                indexed=False,
            )
        if selector.limit is not None and count.n >= selector.limit:
            return Count(selector.limit, exact=True)
        return count

    def replay_sample(self, selector: DeadFilter, *, limit: int, timeout_ms: int) -> list[dict[str, Any]] | None:
        """The first ``limit`` matching delivered rows in id order; None if finding them
        took longer than ``timeout_ms``."""
        params = dict(selector.sql_params(), limit=limit)
        try:
            with self._mapped("replay sample"), self._pool.connection() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, timeout_ms))))
                cur = conn.execute(self.sql.query("replay_sample"), params, prepare=False)
                names = [d.name for d in cur.description or ()]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.QueryCanceled):
                return None
            raise

    def replay_upto_id(self) -> int:
        """The highest id now: where a replay starting now stops."""
        with self._mapped("replay bounds"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("replay_bounds")).fetchone()
            return int(row[0]) if row else 0

    def replay_step(self, selector: DeadFilter, *, after_id: int, upto_id: int, chunk: int, window: int) -> ReplayStep:
        """At most ``chunk`` matching delivered rows after ``after_id`` (up to ``upto_id``),
        found among at most ``window`` rows looked at, as ``Claimed`` rows to build messages of."""
        params = dict(selector.sql_params(), after_id=after_id, upto_id=upto_id, chunk=chunk, window=window)
        with self._mapped("replay read"), self._pool.connection() as conn:
            fetched = conn.execute(self.sql.query("replay_walk"), params, prepare=False).fetchall()
        last_scanned = fetched[0][0] if fetched else None
        if last_scanned is None:
            return ReplayStep([], after_id, finished=True)
        rows = [
            Claimed(
                id=int(r[1]),
                lease_version=0,
                attempts=0,
                aggregate_type=r[2],
                aggregate_id=r[3],
                event_type=r[4],
                payload=r[5],
                topic=r[6],
                headers=r[7],
                created_at=r[8] if isinstance(r[8], dt.datetime) else dt.datetime.fromisoformat(str(r[8])),
                tombstone=bool(r[9]),
                partition=r[10],
                payload_bytes=r[11],
            )
            for r in fetched
            if r[1] is not None
        ]
        if len(rows) >= chunk:  # the window may hold more matches after the chunk's last
            return ReplayStep(rows, rows[-1].id, finished=False)
        return ReplayStep(rows, int(last_scanned), finished=int(last_scanned) >= upto_id)

    def require_replay_audit(self) -> None:
        """The audit table exists and may record replays (migrate step add_audit_replay)."""
        with self._mapped("check audit table"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("audit_allows_replay"), {"audit_table": self.sql.audit_regclass_text}
            ).fetchone()
        if not (row and row[0]):
            raise SchemaMissing(
                f"the audit table of {self.table!r} cannot record replays yet: run `outbox-relay migrate` "
                "(this version records every replay there); nothing was sent"
            )

    def audit_add_changed(self, audit_id: int, n: int) -> None:
        with self._mapped("audit"), self._pool.connection() as conn:
            conn.execute(self.sql.query("audit_add_changed"), {"audit_id": audit_id, "n": n})

    def audit_finish_replay(self, audit_id: int, *, failed: int) -> None:
        with self._mapped("audit"), self._pool.connection() as conn:
            conn.execute(self.sql.query("audit_finish_replay"), {"audit_id": audit_id, "failed": failed})
