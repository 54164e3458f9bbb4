"""MonitoringOps: the reads of metrics, health and the console's overview. Depth per
status, oldest pending age and blocked aggregates in one snapshot, exact counts under
a time budget, what holds back vacuum, vacuum figures, rows published per bucket."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from psycopg import errors as pg_errors
from psycopg import sql

from ..core.ordering import OrderingRule
from ..errors import DatabaseUnavailable
from .claim_cursor import BOUNDS_STALE_SECONDS, GaugeBounds
from .store_core import Count, StoreCore
from .vacuum_health import VacuumFigures, XminHorizon, holders_from_rows

T = TypeVar("T")

STATUSES = ("pending", "processing", "done", "dead")
# Statuses with a partial index of their own: counting them reads only their entries.
INDEXED_STATUSES = ("pending", "processing", "dead")
# stats(): up to this many dead rows the blocked-aggregates query walks the dead rows
# (three index probes each); above it, the aggregates that have work.
BLOCKED_FROM_DEAD_ROWS = 1000


@dataclass(slots=True)
class Stats:
    queue_depth: dict[str, int]
    oldest_pending_age_seconds: float
    expired_leases: int
    attempts: dict[int, int]
    blocked_aggregates: list[tuple[str, int]]
    estimated_statuses: list[str] = field(default_factory=list)  # counts above the exact-count cap
    # The pending and processing figures were read from where this store's fast claims
    # start (vacuum held back: see bound_params), not from the front of their indexes.
    bounded: bool = False


def bound_params(bounds: GaugeBounds | None) -> dict[str, Any]:
    """The lower bounds of the queue gauges' index scans as query parameters (monitoring.sql
    stats_backlog says why). None: every bound NULL, the scans start at the front."""
    if bounds is None:
        return {"from_at": None, "from_id": None, "leases_from": None}
    from_at, from_id = bounds.due_from
    return {"from_at": from_at, "from_id": from_id, "leases_from": bounds.leases_from}


@dataclass(frozen=True, slots=True)
class PauseGauges:
    """The operator pause gauges' figures: the active pauses' ids, the parked rows (up to the cap)."""

    active_ids: tuple[int, ...]
    parked_rows: int


class MonitoringOps(StoreCore):
    # --- monitoring ------------------------------------------------------------------
    def stats(
        self,
        *,
        ordered_types: Sequence[str] = (),
        timeout_ms: int | None = None,
        include_depth: bool = True,
        count_cap: int = 100_000,
        blocked_limit: int = 100,
        published: GaugeBounds | None = None,
    ) -> Stats:
        """The monitoring reads (depth per status, oldest pending age, blocked aggregates), one read-only snapshot.

        While this store's claims start past dead index entries (vacuum held back), the
        pending and processing figures start there too, so their cost does not grow
        with the age of the horizon (``Stats.bounded``). ``published``: the relays' starts
        (published_gauge_bounds), for a process that does not claim itself."""
        with self._mapped("stats"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
            return self._stats_on(
                conn,
                ordered_types=ordered_types,
                include_depth=include_depth,
                count_cap=count_cap,
                blocked_limit=blocked_limit,
                published=published,
            )

    def published_gauge_bounds(self, *, fresh_seconds: float = BOUNDS_STALE_SECONDS) -> GaugeBounds | None:
        """Where the relays' fast claims start, as they published it while vacuum is held
        back (delivery.sql publish_gauge_bounds): the lowest of the entries published in
        the last ``fresh_seconds``; None when there is none (no relay under pressure:
        counts read from the front, exactly)."""
        with self._mapped("published gauge bounds"), self._pool.connection() as conn:
            rows = conn.execute(self.sql.query("published_gauge_bounds"), {"fresh_seconds": fresh_seconds}).fetchall()
        bounds: GaugeBounds | None = None
        for due_at, due_id, leases_from, _process in rows:
            due_from = (dt.datetime.fromisoformat(due_at), int(due_id))
            leases = dt.datetime.fromisoformat(leases_from) if leases_from is not None else None
            if bounds is None:
                bounds = GaugeBounds(due_from=due_from, leases_from=leases)
                continue
            # The lowest of them (a process that reads its processing index from the front: the front).
            lowest_leases = None if leases is None or bounds.leases_from is None else min(leases, bounds.leases_from)
            bounds = GaugeBounds(due_from=min(due_from, bounds.due_from), leases_from=lowest_leases)
        return bounds

    def _stats_on(
        self,
        conn: Any,
        *,
        ordered_types: Sequence[str],
        include_depth: bool,
        count_cap: int,
        blocked_limit: int,
        published: GaugeBounds | None = None,
    ) -> Stats:
        ordering = OrderingRule.of(ordered_types)
        bounds = published or self.due_cursor.gauge_bounds()
        bound = bound_params(bounds)
        # These walk the front of the claim's partial indexes up to count_cap, like the
        # claim: without statistics a bitmap scan read the whole backlog instead
        # (stats_backlog 101 -> 37 ms at a 200 000-row backlog; 37 -> 29 ms analyzed).
        conn.execute("SET LOCAL enable_bitmapscan = off")
        depth = dict.fromkeys(STATUSES, 0)
        estimated: list[str] = []
        if include_depth:
            unknown: list[str] = []  # done rows in a table above the cap (no index counts them)
            for status, n in conn.execute(
                self.sql.query("stats_depth"), {"cap": count_cap, "table": self.sql.regclass_text, **bound}
            ).fetchall():
                if n is None:
                    unknown.append(status)
                else:
                    depth[status] = int(n)
            capped = [status for status, n in depth.items() if n >= count_cap]
            if capped or unknown:
                rows = conn.execute(
                    self.sql.query("stats_status_estimate"),
                    {"table": self.sql.regclass_text, "schema": self.sql.schema_name, "name": self.sql.table_name},
                ).fetchall()
                estimates = {status: int(n) for status, n in rows}
                for status in capped:
                    depth[status] = max(count_cap, estimates.get(status, count_cap))
                    estimated.append(status)
                for status in unknown:
                    depth[status] = estimates.get(status, 0)
                    estimated.append(status)
        attempts: dict[int, int] = {}
        oldest_age = 0.0
        for a, n, age in conn.execute(self.sql.query("stats_backlog"), {"cap": count_cap, **bound}).fetchall():
            attempts[int(a)] = int(n)
            oldest_age = max(oldest_age, float(age))
        expired = conn.execute(self.sql.query("stats_expired"), bound).fetchone()
        blocked: list[tuple[str, int]] = []
        dead_rows = depth["dead"] if include_depth else None
        if ordering.enabled and dead_rows != 0:  # no dead row, no blocked aggregate
            # Walk whichever is smaller: few dead rows, or the aggregates with work
            # (at most count_cap of them), so the cost never follows the operator's
            # backlog of dead rows.
            few_dead = dead_rows is not None and dead_rows <= BLOCKED_FROM_DEAD_ROWS
            blocked = [
                (r[0], int(r[1]))
                for r in conn.execute(
                    self.sql.query("stats_blocked_from_dead" if few_dead else "stats_blocked"),
                    {
                        "ordered_types": ordering.explicit_types,
                        "all_ordered": ordering.all_types,
                        "limit": blocked_limit,
                        "scan_cap": count_cap,
                    },
                ).fetchall()
            ]
        return Stats(
            queue_depth=depth,
            estimated_statuses=estimated,
            oldest_pending_age_seconds=oldest_age,
            expired_leases=int(expired[0]) if expired else 0,
            attempts=attempts,
            blocked_aggregates=blocked,
            bounded=bounds is not None,
        )

    def xmin_horizon(self, *, limit: int = 5, timeout_ms: int | None = None) -> XminHorizon:
        """What holds back vacuum of this table, oldest first (vacuum_health.py)."""
        with self._mapped("xmin horizon"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_ms))))
            return self._xmin_horizon_on(conn, limit)

    def _xmin_horizon_on(self, conn: Any, limit: int) -> XminHorizon:
        cur = conn.execute(self.sql.query("xmin_horizon_holders"), {"limit": limit}, prepare=False)
        names = [d.name for d in cur.description or ()]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return XminHorizon(holders_from_rows(rows))

    def vacuum_figures(self, *, timeout_ms: int | None = None) -> VacuumFigures:
        """Dead tuples, heap and index size, last vacuum of the table (statistics views only)."""
        with self._mapped("vacuum figures"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_ms))))
            return self._vacuum_figures_on(conn)

    def monitoring_reads(
        self,
        *,
        ordered_types: Sequence[str] = (),
        timeout_ms: int | None = None,
        count_cap: int = 100_000,
        horizon_limit: int = 5,
    ) -> tuple[XminHorizon | Exception, VacuumFigures | Exception, Stats | Exception, PauseGauges | Exception]:
        """What the metrics refresher reads, in one transaction (one commit per refresh
        instead of three: an idle relay's cost on the database is mostly its
        transactions). Each part runs in a savepoint of its own and comes back as its
        result or the exception that ended it, so a failure of one (a statement
        timeout, a view the role may not read) leaves the others standing. The
        connection failing raises, as the separate reads do."""
        with self._mapped("stats"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_ms))))
            horizon = self._in_savepoint(conn, "xmin horizon", lambda: self._xmin_horizon_on(conn, horizon_limit))
            figures = self._in_savepoint(conn, "vacuum figures", lambda: self._vacuum_figures_on(conn))
            stats = self._in_savepoint(
                conn,
                "stats",
                lambda: self._stats_on(
                    conn, ordered_types=ordered_types, include_depth=True, count_cap=count_cap, blocked_limit=100
                ),
            )
            pauses = self._in_savepoint(conn, "pause gauges", lambda: self._pause_gauges_on(conn, count_cap))
        return horizon, figures, stats, pauses

    def _pause_gauges_on(self, conn: Any, count_cap: int) -> PauseGauges:
        row = conn.execute(self.sql.query("pause_gauges"), {"count_cap": count_cap}).fetchone()
        assert row is not None
        return PauseGauges(tuple(int(i) for i in row[0]), int(row[1]))

    def _in_savepoint(self, conn: Any, what: str, read: Callable[[], T]) -> T | Exception:
        try:
            with self._mapped(what), conn.transaction():
                return read()
        except DatabaseUnavailable as exc:
            if conn.closed or conn.broken:
                raise
            return exc

    def _vacuum_figures_on(self, conn: Any) -> VacuumFigures:
        row = conn.execute(self.sql.query("vacuum_figures"), {"table": self.sql.regclass_text}).fetchone()
        assert row is not None
        return VacuumFigures(
            dead_tuples=int(row[0]),
            live_tuples=int(row[1]),
            heap_bytes=int(row[2]),
            index_bytes=int(row[3]),
            since_vacuum_seconds=float(row[4]) if row[4] is not None else None,
            vacuums=int(row[5]),
        )

    def exact_depth(
        self,
        *,
        budget_ms: int,
        statuses: Sequence[str] = STATUSES,
        first_upto: int = 100_000,
        published: GaugeBounds | None = None,
    ) -> dict[str, Count]:
        """Rows per status, counted exactly from each status's partial index while the
        shared budget lasts; a status whose count runs out is a lower bound. Counted
        in the order dead, pending, processing, done (done has no index and is usually
        the largest: it gets what is left of the budget). Pending and processing start
        where this store's fast claims start while it uses them, or at ``published`` (see ``stats``)."""
        bound = bound_params(published or self.due_cursor.gauge_bounds())
        order = [s for s in ("dead", "pending", "processing", "done") if s in statuses]
        deadline = time.monotonic() + budget_ms / 1000.0
        out: dict[str, Count] = {}
        with self._mapped("count rows"):
            for status in order:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                out[status] = self._bounded_count(
                    self.sql.query("status_count_upto", status=sql.Literal(status)),
                    bound,
                    first_upto=first_upto,
                    budget_ms=left_ms,
                    indexed=status in INDEXED_STATUSES,
                )
        return {s: out[s] for s in statuses}

    def published_per_bucket(
        self, *, window_seconds: int = 3600, bucket_seconds: int = 300, timeout_ms: int = 2000
    ) -> list[int] | None:
        """Rows finalized done per bucket over the window, oldest bucket first; None if
        counting did not finish within ``timeout_ms``."""
        buckets = [0] * (window_seconds // bucket_seconds)
        try:
            with self._mapped("published rate"), self._pool.connection() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, timeout_ms))))
                for bucket, n in conn.execute(
                    self.sql.query("published_per_bucket"),
                    {"window_seconds": window_seconds, "bucket_seconds": bucket_seconds},
                ).fetchall():
                    if 0 <= bucket < len(buckets):
                        buckets[len(buckets) - 1 - bucket] = int(n)
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.QueryCanceled):
                return None
            raise
        return buckets
