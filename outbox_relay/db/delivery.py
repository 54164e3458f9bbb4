"""DeliveryOps: the relay's hot path. Claim rows (reap + lease, plain or ordered),
write a batch's decisions in one fenced finalize, and extend the leases of rows
still being published."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import errors as pg_errors
from psycopg import pq

from ..core.ordering import OrderingRule
from ..errors import DatabaseUnavailable
from ..model import Claimed, FinalizeItem
from .claim_cursor import BOUNDS_STALE_SECONDS, ClaimOutcome, ClaimPlan, GaugeBounds, LongWriter, WritersLook
from .pooler import execute_with_settings
from .store_core import StoreCore


@dataclass(slots=True)
class ClaimResult:
    rows: list[Claimed]
    reaped: list[tuple[int, int, str | None]] = field(default_factory=list)  # (id, version, owner)
    # Where the next ordered claim should start (round-robin); None: from the first
    # aggregate (an empty string is a valid aggregate_id, so it cannot mean "start").
    ordered_after: str | None = None
    # Rows the claim picked that another claim took first (only a lockless claim sees
    # them): what was due was not all taken, so the claim counts as cut.
    taken_by_others: int = 0
    # With finalize_first: the ids that finalize accepted (written in the claim's
    # transaction); None when there was none.
    finalized: set[int] | None = None


@dataclass(slots=True)
class Reschedule:
    id: int
    lease_version: int
    delay_seconds: float
    error: str | None
    refund_attempt: bool


def finalize_params(items: Sequence[FinalizeItem]) -> dict[str, Any]:
    """The parameters of delivery.sql "finalize" for a batch's decisions: delivered
    rows as two arrays of their own (the common case, usually the whole batch), every
    other outcome in six parallel arrays (usually empty)."""
    done_ids: list[int] = []
    done_versions: list[int] = []
    others: list[FinalizeItem] = []
    for item in items:
        if item.status == "done":
            done_ids.append(item.id)
            done_versions.append(item.lease_version)
        else:
            others.append(item)
    return {
        # As array literals: one join in C instead of binary-dumping each integer in
        # Python (~1 us per row of a batch, measured with py-spy on a drain).
        "done_ids": _bigint_array(done_ids),
        "done_versions": _bigint_array(done_versions),
        "ids": [i.id for i in others],
        "versions": [i.lease_version for i in others],
        "statuses": [i.status for i in others],
        "delays": [max(0.0, float(i.delay_seconds)) for i in others],
        "errors": [i.error for i in others],
        "refunds": [1 if i.refund_attempt else 0 for i in others],
    }


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# A fast claim's bound when its cursor has none: below every row, and a timestamp like
# the others (not NULL, not '-infinity' text), so the prepared statement and its plan
# are the same whatever the cursor holds (delivery.sql "claim").
INDEX_FRONT = dt.datetime(1, 1, 2, tzinfo=dt.UTC)


def _from_epoch_us(text: str | int) -> dt.datetime:
    """A time sent as microseconds since the Unix epoch (exact: no float on the way)."""
    return _EPOCH + dt.timedelta(microseconds=int(text))


def parse_long_writers(text: str) -> frozenset[LongWriter]:
    """delivery.sql "outbox_writers" long_writers: 'pid:start_us' pairs, comma-separated."""
    writers: set[LongWriter] = set()
    for pair in filter(None, text.split(",")):
        pid, started_us = pair.split(":")
        writers.add((int(pid), _from_epoch_us(started_us)))
    return frozenset(writers)


# A fast ordered claim's discovery reads at most this many due rows (ordered_bounds.py):
# more than arrive between two claims at thousands of events/s.
ORDERED_DISCOVER_ROWS = 2000
# ... and looks at up to this many visited aggregates (at least; per row of room:
# ORDERED_VISIT_PER_ROW), round-robin: most hold a head in flight.
ORDERED_VISIT_MIN = 256
ORDERED_VISIT_PER_ROW = 4


@dataclass(slots=True)
class _OrderedPart:
    """The ordered part of one claim, for the ordered claims' cursor: its statements'
    time, rows claimed, what they saw."""

    outcomes: list[ClaimOutcome] = field(default_factory=list)
    claimed: int = 0
    found_below: bool | None = None
    elapsed: float = 0.0
    started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        if self.started is not None:
            self.elapsed += time.monotonic() - self.started
            self.started = None

    def seconds(self) -> float:
        running = time.monotonic() - self.started if self.started is not None else 0.0
        return self.elapsed + running


def _bigint_array(values: Sequence[int]) -> str:
    """``bigint[]`` input text (the values are ints: nothing to quote)."""
    return "{" + ",".join(map(str, values)) + "}"


# Planner settings of the claim and the finalize (delivery.sql "statement_settings"
# says why): plans that touch only the rows of the batch, whatever the statistics say.
# jit = off: before PostgreSQL 18 a disabled plan node still costs 1e10, which crosses
# jit_above_cost, and compiling the statement then took 1.5 s on every call.
CLAIM_SETTINGS = {"enable_bitmapscan": "off", "enable_seqscan": "off", "jit": "off"}
# The plain claim (no ordered types) of a relay that is not busy, with its generic plan:
# planning it cost 20x running it when it finds a row or two (0.6 ms against 0.03 ms),
# and every condition that bounds its index scans is an index condition in the generic
# plan too (delivery.sql "claim"). A busy relay's claims keep custom plans: at 2 000
# events/s (keep mode) the generic plan's full claims took ~28 ms instead of ~0.4 ms,
# which made the claim cursor switch to fast claims and left rows below their start
# waiting for the next full claim (p99 ~20 s instead of ~40 ms; bench/primary_cost.py).
# The ordered claims keep custom plans too (their round-robin start may be NULL, which
# only a custom plan folds).
PLAIN_CLAIM_SETTINGS = dict(CLAIM_SETTINGS, plan_cache_mode="force_generic_plan", enable_nestloop="off")
# The plain claim on its own statement (not inside an ordered claim's transaction) of a
# busy relay. enable_nestloop = off, in PLAIN_CLAIM_SETTINGS too: its UPDATEs find the
# picked rows by "id = ANY(ARRAY(SELECT id FROM picked))" (delivery.sql "reap"); in a
# nested loop with the picked rows outside, every lookup inside took that condition as
# an index key and sorted the whole array again (a 1 000-row claim 2-3x slower); a hash
# join reads the array once. The ordered claim's transaction keeps CLAIM_SETTINGS, which
# its own statements are planned for.
BUSY_PLAIN_CLAIM_SETTINGS = dict(CLAIM_SETTINGS, enable_nestloop="off")
# The plain claim with its generic plan runs without the row lock (delivery.sql
# "claim"): it is a claim of a few rows while one worker claims at a time, so another
# claim rarely holds one of its rows, and locking each row before updating it wrote a
# WAL record per row (~54 B per event) that the UPDATE's own record makes redundant.
# Waiting for a row another transaction holds is bounded by lock_timeout; past it the
# claim runs again with the lock (SKIP LOCKED passes such rows by).
LOCKLESS_CLAIM_LOCK_TIMEOUT_MS = 100
LOCKLESS_CLAIM_SETTINGS = dict(PLAIN_CLAIM_SETTINGS, lock_timeout=f"{LOCKLESS_CLAIM_LOCK_TIMEOUT_MS}ms")
# Also the lease keeper's extend_lease (the same join). enable_nestloop = off: with
# statistics that see almost no live row (an ANALYZE while vacuum is held back) the
# planner expected one outbox row and joined the batch's arrays to it in a nested loop,
# unnesting the 1 000-element arrays again for every one of the 1 000 rows (2 s per
# finalize); a hash join of the batch's arrays and its rows' primary-key lookups costs
# the same whatever the statistics say.
FINALIZE_SETTINGS = {"enable_bitmapscan": "off", "enable_nestloop": "off", "enable_seqscan": "off", "jit": "off"}
# A finalize of at most this many rows uses its generic plan: planned once per
# connection instead of on every call (0.4 ms, more than the small finalize runs). A
# larger one keeps a custom plan: the generic plan is estimated for arrays of a few
# elements, and took 3-10x longer on a 1 000-row batch (bench/pooler.py).
GENERIC_FINALIZE_MAX_ROWS = 64
SMALL_FINALIZE_SETTINGS = dict(FINALIZE_SETTINGS, plan_cache_mode="force_generic_plan")


# This process among the relays of a table (publish_gauge_bounds: one entry each).
PROCESS_KEY = f"{socket.gethostname()}:{os.getpid()}"


class DeliveryOps(StoreCore):
    # --- claim -----------------------------------------------------------------------
    def claim(
        self,
        *,
        owner: str,
        batch: int,
        lease_seconds: float,
        max_attempts: int,
        ordered_types: Sequence[str] = (),
        run_length: int = 1,
        ordered_after: str | None = None,
        max_batch_bytes: int = 2**62,
        candidates: int | None = None,
        max_message_bytes: int | None = None,
        generic_plan: bool = False,
        lock_rows: bool = True,
        finalize_first: Sequence[FinalizeItem] = (),
        finalize_strict: bool = False,
    ) -> ClaimResult:
        """Reap poison rows, then claim up to ``batch`` rows, in one short transaction
        committed before this returns (so before any publish). ``generic_plan``: the
        plain claim may use its generic plan (a relay that is not busy: see
        PLAIN_CLAIM_SETTINGS). ``lock_rows=False``: that generic claim may leave the row
        lock out (LOCKLESS_CLAIM_SETTINGS), for a worker that claims alone.
        ``finalize_first``: the decisions of the worker's previous batch (a few rows),
        written by the finalize statement in the claim's transaction and round trip
        (``ClaimResult.finalized``: what it accepted); only without ordered types. If
        the claim raises, nothing of it committed unless the error is an unknown commit
        outcome: the caller finalizes on its own (a fenced finalize may be repeated)."""
        if finalize_first and ordered_types:
            raise ValueError("finalize_first is for the plain claim only")
        ordering = OrderingRule.of(ordered_types)
        all_ordered = ordering.all_types
        types = ordering.explicit_types
        params: dict[str, Any] = {
            "owner": owner,
            "batch": batch,
            "lease_seconds": float(lease_seconds),
            "max_attempts": max_attempts,
            "ordered_types": types,
            "all_ordered": all_ordered,
            "max_batch_bytes": max_batch_bytes,
            "candidates": max(1, min(batch, candidates if candidates is not None else batch)),
            "max_message_bytes": max_message_bytes,
            "generic_plan": generic_plan,
            "lock_rows": lock_rows,
        }
        # The connection breaking during COMMIT leaves the claim's outcome unknown:
        # CommitOutcomeUnknown propagates and nothing is published; if it did commit,
        # the rows' lease expires and a later claim takes them (never publish what may not be ours).
        result, sweep = self._claim_once(
            ordering,
            params,
            run_length=run_length,
            ordered_after=ordered_after,
            finalize_first=(finalize_first, finalize_strict),
        )
        finalized = result.finalized
        # An empty claim whose look saw a long writer transaction end: its rows are
        # committed below where fast claims start, and the catch-up claim that takes
        # them is the next claim. Sent at once rather than after the worker's idle wait.
        # So is the worker's own claim after a sweep step that found nothing (a step
        # reads only its range, below the rows waiting above the fast start).
        if not result.rows and (
            sweep or self.due_cursor.catch_up_pending() or (ordering.enabled and self.ordered_cursor.catch_up_pending())
        ):
            result, _ = self._claim_once(ordering, params, run_length=run_length, ordered_after=ordered_after)
            result.finalized = finalized
        publish, bounds = self.due_cursor.bounds_to_publish()
        if publish and not self._gauge_bounds_unsupported:
            self._publish_gauge_bounds(bounds)
        return result

    def _publish_gauge_bounds(self, bounds: GaugeBounds | None) -> None:
        """Where this process's fast claims start, for `status` in another process
        (delivery.sql publish_gauge_bounds); None withdraws it. Best effort: the claim's
        rows are this worker's whatever happens here; a table migrated before the column
        existed stops the publications of this store."""
        doc = None
        if bounds is not None:
            due_at, due_id = bounds.due_from
            leases = bounds.leases_from.isoformat() if bounds.leases_from is not None else None
            doc = json.dumps({"due_at": due_at.isoformat(), "due_id": due_id, "leases_from": leases})
        params = {"process": PROCESS_KEY, "bounds": doc, "stale_seconds": BOUNDS_STALE_SECONDS}
        try:
            with self._pool.connection() as conn:
                conn.execute(self.sql.query("publish_gauge_bounds"), params)
            self.statement_counts.add("gauge_bounds")
        except pg_errors.UndefinedColumn:
            self._gauge_bounds_unsupported = True
        except Exception:  # the database unreachable, a timeout: the next publication tries again
            self.gauge_bounds_publish_failures += 1

    def _claim_once(
        self,
        ordering: OrderingRule,
        params: dict[str, Any],
        *,
        run_length: int,
        ordered_after: str | None,
        finalize_first: tuple[Sequence[FinalizeItem], bool] = ((), False),
    ) -> tuple[ClaimResult, bool]:
        """One claim; and whether it was a sweep step. ``finalize_first``: the items and
        strictness of a finalize sent in the claim's transaction (``claim``)."""
        rows: list[Claimed] = []
        plan = self.due_cursor.begin()
        outcomes: list[ClaimOutcome] = []  # what each claim statement saw, for the cursor
        started = time.monotonic()
        try:
            result = self._claim(
                ordering,
                params,
                rows,
                plan,
                outcomes,
                run_length=run_length,
                ordered_after=ordered_after,
                finalize_first=finalize_first,
            )
        except DatabaseUnavailable as exc:
            elapsed = time.monotonic() - started
            if plan.sweep and isinstance(exc.__cause__, pg_errors.QueryCanceled):
                # A sweep step ran out of its own statement timeout (its range far denser
                # than the last): nothing was claimed; narrower next time, and this
                # worker claims again at once from the fast start.
                self.due_cursor.failed(plan, elapsed, timed_out=True)
                return ClaimResult(rows=[], reaped=[]), True
            self.due_cursor.failed(plan, elapsed)
            raise
        except BaseException:
            self.due_cursor.failed(plan, time.monotonic() - started)
            raise
        self.due_cursor.end(plan, outcomes, time.monotonic() - started, claimed_rows=len(result.rows))
        self.statement_counts.add("claim" if result.rows or result.reaped else "claim_empty")
        return result, plan.sweep

    def _claim(
        self,
        ordering: OrderingRule,
        params: dict[str, Any],
        rows: list[Claimed],
        plan: ClaimPlan,
        lowest: list[ClaimOutcome],
        *,
        run_length: int,
        ordered_after: str | None,
        finalize_first: tuple[Sequence[FinalizeItem], bool] = ((), False),
    ) -> ClaimResult:
        start_at, start_id = plan.start if plan.start is not None else (INDEX_FRONT, 0)
        params = dict(
            params,
            from_at=start_at,
            from_id=start_id,
            leases_from=plan.leases_from if plan.leases_from is not None else INDEX_FRONT,
            lease_scan=plan.lease_scan,
            writers_check=plan.writers_check,
            writers_within_seconds=float(plan.writers_within_seconds),
            full_claim=plan.full,
            sweep_claim=plan.sweep,
            sweep_timeout_ms=plan.statement_timeout_ms,
        )
        if plan.sweep:  # its range's upper ends (exclusive): see claim_cursor.Sweep
            assert plan.until is not None
            params.update(
                to_at=plan.until[0],
                to_id=plan.until[1],
                leases_to=plan.leases_until if plan.leases_until is not None else INDEX_FRONT,
            )
        if not ordering.enabled:
            # One statement, autocommit: reap + claim in a single round trip.
            picked: list[int] = []
            finalize_items, finalize_strict = finalize_first
            finalized: set[int] | None = None
            with self._mapped("claim", commit_unknown=True), self._pool.connection() as conn:
                settings = PLAIN_CLAIM_SETTINGS if params.get("generic_plan") else BUSY_PLAIN_CLAIM_SETTINGS
                if settings is PLAIN_CLAIM_SETTINGS and not params.get("lock_rows", True):
                    settings = LOCKLESS_CLAIM_SETTINGS
                # Not in a sweep step: its statement timeout (a range denser than the
                # last) would take the finalize with it; the worker writes it on its own.
                finalize_cursor = conn.cursor() if finalize_items and not plan.sweep else None
                reaped = self._plain_claim(
                    conn.cursor(),
                    dict(params, excluded_types=[]),
                    rows,
                    lowest,
                    settings=settings,
                    picked=picked,
                    before=(
                        [
                            (
                                finalize_cursor,
                                self.sql.query("finalize", strict=finalize_strict),
                                finalize_params(finalize_items),
                            )
                        ]
                        if finalize_cursor is not None
                        else []
                    ),
                )
                if finalize_cursor is not None:
                    finalized = {r[0] for r in finalize_cursor.fetchall()}
            if finalized is not None:
                self.statement_counts.add("finalize_in_claim")
            rows.sort(key=lambda c: c.id)  # RETURNING order is unspecified
            return ClaimResult(
                rows=rows, reaped=reaped, taken_by_others=max(0, sum(picked) - len(rows)), finalized=finalized
            )
        # Ordered: several statements in one short transaction (heads, runs, the rest).
        # The ordered part has a cursor of its own (ordered_bounds.py): full (from the
        # front of the aggregate index, the statements as they always were) or fast.
        oplan = self.ordered_cursor.begin()
        ordered = _OrderedPart()
        try:
            result = self._claim_with_ordered(
                ordering, params, rows, lowest, oplan, ordered, run_length=run_length, ordered_after=ordered_after
            )
        except BaseException:
            self.ordered_cursor.failed(oplan, ordered.seconds())
            raise
        self.ordered_cursor.end(
            oplan, ordered.outcomes, ordered.seconds(), claimed_rows=ordered.claimed, found_below=ordered.found_below
        )
        return result

    def _claim_with_ordered(
        self,
        ordering: OrderingRule,
        params: dict[str, Any],
        rows: list[Claimed],
        lowest: list[ClaimOutcome],
        oplan: ClaimPlan,
        ordered: _OrderedPart,
        *,
        run_length: int,
        ordered_after: str | None,
    ) -> ClaimResult:
        all_ordered = ordering.all_types
        types = ordering.explicit_types
        batch = int(params["batch"])
        max_batch_bytes = int(params["max_batch_bytes"])
        next_after: str | None = None
        with self._mapped("claim", commit_unknown=True), self._pool.connection() as conn:
            with conn.transaction():
                cur = conn.cursor()
                unordered = dict(params, excluded_types=types)
                # The first statement sets the claim's planner settings for the whole
                # transaction (_plain_claim does it in the else branch; a fast ordered
                # claim of an all-ordered relay reaps in its discovery statement).
                reaped: list[tuple[int, int, str | None]] = []
                if all_ordered:
                    if oplan.full:
                        ordered.start()
                        execute_with_settings(cur, self.sql.query("reap"), params, CLAIM_SETTINGS)
                        reaped = [(r[0], r[1], r[2]) for r in cur.fetchall()]
                        ordered.stop()
                else:
                    # Unordered rows get up to half of every batch first, so a large
                    # ordered backlog can never starve them (and vice versa).
                    reaped = self._plain_claim(
                        cur,
                        dict(unordered, batch=max(1, batch // 2), max_batch_bytes=max(1, max_batch_bytes // 2)),
                        rows,
                        lowest,
                    )
                head_room = batch - len(rows)
                params = dict(params, batch=head_room)

                def bytes_left() -> int:
                    return max_batch_bytes - sum(r.size_bytes for r in rows)

                heads: list[Claimed] = []
                ordered.start()
                if oplan.full:
                    heads, next_after = self._ordered_heads_full(
                        cur, params, rows, ordered, head_room, bytes_left, ordered_after
                    )
                else:
                    next_after = ordered_after  # the full claims' round-robin resumes there
                    reaped += self._ordered_discover(cur, params, oplan, ordered, all_ordered=all_ordered)
                    if head_room > 0 and (bytes_left() > 0 or not rows):
                        heads = self._ordered_heads_bounded(cur, params, rows, head_room, bytes_left())
                        rows.extend(heads)
                if heads and run_length > 1 and batch > len(rows) and bytes_left() > 0:
                    run_params = dict(
                        params,
                        run_length=run_length - 1,
                        room=batch - len(rows),
                        aggregate_ids=[h.aggregate_id for h in heads],
                        head_ids=[h.id for h in heads],
                        max_batch_bytes=bytes_left(),
                    )
                    runs = [Claimed(*r) for r in cur.execute(self.sql.query("claim_ordered_runs"), run_params)]
                    rows.extend(runs)
                    ordered.claimed += len(runs)
                ordered.claimed += len(heads)
                ordered.stop()
                room = batch - len(rows)
                if not all_ordered and room > 0 and bytes_left() > 0:
                    reaped += self._plain_claim(
                        cur, dict(unordered, batch=room, max_batch_bytes=bytes_left()), rows, lowest
                    )
        rows.sort(key=lambda c: c.id)  # RETURNING order is unspecified
        return ClaimResult(rows=rows, reaped=reaped, ordered_after=next_after)

    def _ordered_heads_full(
        self,
        cur: Any,
        params: dict[str, Any],
        rows: list[Claimed],
        ordered: _OrderedPart,
        head_room: int,
        bytes_left: Callable[[], int],
        ordered_after: str | None,
    ) -> tuple[list[Claimed], str | None]:
        """The ordered claim from the front of the aggregate index (delivery.sql
        "claim_ordered_heads"), round-robin from ``ordered_after``. Its heads are proven
        bounds for the fast claims (ordered_bounds.py)."""
        last_aggregate: list[str | None] = [None]
        database_now: list[dt.datetime | None] = [None]

        def claim_heads(after: str | None, limit: int) -> list[Claimed]:
            head_params = dict(params, after=after, batch=limit, max_batch_bytes=bytes_left(), first_always=not rows)
            found = cur.execute(self.sql.query("claim_ordered_heads"), head_params).fetchall()
            if found:  # the last aggregate in the column's collation order (see delivery.sql)
                last_aggregate[0], database_now[0] = found[0][-2], found[0][-1]
            return [Claimed(*r[:-2]) for r in found]

        # Round-robin over aggregates: start after where the last claim ended,
        # wrap around to the beginning if that end of the range had too few.
        heads: list[Claimed] = []
        if head_room > 0 and (bytes_left() > 0 or not rows):
            heads = claim_heads(ordered_after, head_room)
            rows.extend(heads)
            if len(heads) < head_room and ordered_after is not None and bytes_left() > 0:
                seen = {h.id for h in heads}
                more = [h for h in claim_heads(None, head_room - len(heads)) if h.id not in seen]
                heads.extend(more)
                rows.extend(more)
        new = self.ordered_bounds.heads_claimed([(h.aggregate_id, h.id) for h in heads])
        ordered.found_below = new > 0
        if database_now[0] is not None:
            # Where the discovery of the fast claims starts: every aggregate with a due
            # row below it was either claimed here (now visited) or is left to the next
            # full claim.
            ordered.outcomes.append(ClaimOutcome(lowest=(database_now[0], 0), database_now=database_now[0]))
        return heads, (last_aggregate[0] if heads else None)

    def _ordered_discover(
        self, cur: Any, params: dict[str, Any], plan: ClaimPlan, ordered: _OrderedPart, *, all_ordered: bool
    ) -> list[tuple[int, int, str | None]]:
        """A fast ordered claim's discovery (delivery.sql "claim_ordered_discover"): the
        aggregates with a due row since where the ordered cursor starts enter the
        visited set; with ``all_ordered`` it also reaps (no plain claim does)."""
        start_at, start_id = plan.start if plan.start is not None else (INDEX_FRONT, 0)
        discover_params = dict(
            params,
            from_at=start_at,
            from_id=start_id,
            leases_from=plan.leases_from if plan.leases_from is not None else INDEX_FRONT,
            lease_scan=plan.lease_scan,
            reap=all_ordered,
            writers_check=plan.writers_check,
            writers_within_seconds=float(plan.writers_within_seconds),
            scan_rows=ORDERED_DISCOVER_ROWS,
        )
        execute_with_settings(cur, self._ordered_discover_statement, discover_params, CLAIM_SETTINGS)
        reaped: list[tuple[int, int, str | None]] = []
        aggregates: list[str] = []
        keys: list[tuple[dt.datetime, int]] = []
        outcome = ClaimOutcome()
        for kind, aggregate_id, row_id, version, owner, at, long_writers, looked_at_us, since, now in cur.fetchall():
            if kind == "due":
                aggregates.append(aggregate_id)
            elif kind == "reaped":
                reaped.append((row_id, version, owner))
            else:  # the report
                keys.append((at, int(row_id)))
                if since is not None:  # rows an open writer will commit start at or after this key
                    keys.append((since, 0))
                look = None
                if looked_at_us is not None:
                    look = WritersLook(_from_epoch_us(looked_at_us), parse_long_writers(long_writers or ""))
                outcome = ClaimOutcome(
                    lowest=min(keys),
                    database_now=now,
                    leases_exhausted=all_ordered and plan.lease_scan,
                    server_seconds=int(version) / 1_000_000,
                    writers_look=look,
                )
        ordered.outcomes.append(outcome)
        self.ordered_bounds.discovered(aggregates)
        return reaped

    def _ordered_heads_bounded(
        self, cur: Any, params: dict[str, Any], rows: list[Claimed], head_room: int, bytes_left: int
    ) -> list[Claimed]:
        """A fast ordered claim's heads (delivery.sql "claim_ordered_heads_bounded"):
        each visited aggregate read from its proven bound; what each look found moves
        the bounds (ordered_bounds.py)."""
        ticket, visit = self.ordered_bounds.to_visit(max(ORDERED_VISIT_MIN, ORDERED_VISIT_PER_ROW * head_room))
        if not visit:
            return []
        head_params = dict(
            params,
            batch=head_room,
            max_batch_bytes=bytes_left,
            first_always=not rows,
            aggregate_ids=[aggregate_id for aggregate_id, _ in visit],
            bounds=[bound for _, bound in visit],
        )
        heads: list[Claimed] = []
        for record in cur.execute(self.sql.query("claim_ordered_heads_bounded"), head_params).fetchall():
            if record[0] == "claimed":
                heads.append(Claimed(*record[1:15]))
            else:
                self.ordered_bounds.looked(ticket, record[5], record[1], bool(record[15]))
        return heads

    def _plain_claim(
        self,
        cur: Any,
        params: dict[str, Any],
        rows: list[Claimed],
        outcomes: list[ClaimOutcome],
        *,
        settings: dict[str, str] = CLAIM_SETTINGS,
        picked: list[int] | None = None,
        before: Sequence[tuple[Any, Any, Any]] = (),
    ) -> list[tuple[int, int, str | None]]:
        """Run the reap + claim statement; append claimed rows (and what the statement
        saw to ``outcomes``, for the claim cursor), return reaped ones. ``picked``: gets
        how many rows the statement picked (more than it claimed when another claim
        took some first). ``before``: statements sent first in the same transaction
        (execute_with_settings), e.g. the previous batch's finalize."""
        reaped: list[tuple[int, int, str | None]] = []
        params = dict(params, candidates=min(params["candidates"], params["batch"]))
        full = params.pop("full_claim", True)
        sweep = params.pop("sweep_claim", False)
        sweep_timeout_ms = params.pop("sweep_timeout_ms", None)
        statement = self._full_claim_statement if full else self._claim_statement
        lockless = settings is LOCKLESS_CLAIM_SETTINGS
        generic = lockless or settings is PLAIN_CLAIM_SETTINGS
        if lockless and (sweep or cur.connection.info.transaction_status != pq.TransactionStatus.IDLE):
            lockless, settings = False, PLAIN_CLAIM_SETTINGS  # a sweep step, or inside a transaction: with the lock
        if lockless:
            statement = self._lockless_full_claim_statement if full else self._lockless_claim_statement
        if sweep:
            statement = self._sweep_claim_statement
            if sweep_timeout_ms is not None and cur.connection.info.transaction_status == pq.TransactionStatus.IDLE:
                # Its own statement timeout, for this statement only (in an ordered
                # claim's transaction it would outlast it: the step goes without).
                settings = dict(settings, statement_timeout=str(sweep_timeout_ms))
        claimed_before = len(rows)
        # A generic plan is worth keeping from the first call: an idle relay's claims,
        # seconds apart, may each land on a connection that has not run it 5 times.
        prepare = True if generic and not self.transaction_pooler else None
        if before:
            # The finalize's planner settings under the claim's (they agree; a generic
            # claim's plan_cache_mode gives the small finalize its generic plan too).
            settings = dict(FINALIZE_SETTINGS, **settings)
        try:
            execute_with_settings(cur, statement, params, settings, prepare=prepare, before=before)
        except pg_errors.LockNotAvailable:
            if not lockless:
                raise
            # Another transaction held one of the rows past the lock_timeout: the claim
            # with the lock passes such rows by (nothing was claimed, nothing finalized:
            # autocommit, one implicit transaction).
            statement = self._full_claim_statement if full else self._claim_statement
            settings = dict(FINALIZE_SETTINGS, **PLAIN_CLAIM_SETTINGS) if before else PLAIN_CLAIM_SETTINGS
            execute_with_settings(cur, statement, params, settings, prepare=prepare, before=before)
        keys: list[tuple[dt.datetime, int]] = []
        database_now: dt.datetime | None = None
        server_seconds: float | None = None
        expired_seen = 0
        writers_look: WritersLook | None = None
        for record in cur.fetchall():
            if record[0] is None:  # the statement's clock, expired leases looked at, open writers
                expired_seen, database_now = int(record[1]), record[13]
                if picked is not None and record[3] is not None:
                    picked.append(int(record[3]))
                if record[2] is not None:
                    server_seconds = int(record[2]) / 1_000_000
                if record[10] is not None:  # rows an open writer will commit start at or after this key
                    keys.append((record[10], 0))
                if record[7] is not None:  # the look ran: its clock, the long writers it saw
                    writers_look = WritersLook(_from_epoch_us(record[7]), parse_long_writers(record[6] or ""))
            elif record[0]:
                reaped.append((record[1], record[2], record[12]))
            else:
                row = Claimed(*record[1:12])
                row.tombstone, row.partition, row.payload_bytes = record[14], record[15], record[16]
                rows.append(row)
                if record[13] is not None:
                    keys.append((record[13], record[1]))
        outcomes.append(
            ClaimOutcome(
                lowest=min(keys) if keys else None,
                database_now=database_now,
                leases_exhausted=bool(params.get("lease_scan", True)) and expired_seen < int(params["candidates"]),
                server_seconds=server_seconds,
                writers_look=writers_look,
                claimed=len(rows) - claimed_before,
            )
        )
        return reaped

    # --- fenced finalize -------------------------------------------------------------
    def finalize(self, items: Sequence[FinalizeItem], *, strict: bool = False, durable: bool = True) -> set[int]:
        """Write every decision of a batch in one fenced statement; return the ids it
        accepted (the others lost their lease to a newer claim). ``durable`` = False:
        the commit does not wait for its WAL flush (relay.finalize_synchronous_commit):
        a finalize lost in a server crash leaves its rows processing under the claim's
        token, so they are claimed again with a new one when the lease expires."""
        if not items:
            return set()
        params = finalize_params(items)
        with self._mapped("finalize"), self._pool.connection() as conn:
            cur = conn.cursor()
            settings = SMALL_FINALIZE_SETTINGS if len(items) <= GENERIC_FINALIZE_MAX_ROWS else FINALIZE_SETTINGS
            if not durable:
                settings = dict(settings, synchronous_commit="off")
            execute_with_settings(cur, self.sql.query("finalize", strict=strict), params, settings)
            accepted = {r[0] for r in cur.fetchall()}
        self.statement_counts.add("finalize")
        return accepted

    # Conveniences over finalize() for scripts, benchmarks and tests.
    def mark_done(self, claims: Sequence[tuple[int, int]], *, strict: bool = False) -> set[int]:
        """(id, lease_version) pairs -> ids actually finalized (the rest lost their lease)."""
        return self.finalize([FinalizeItem(i, v, "done") for i, v in claims], strict=strict)

    def reschedule(self, items: Sequence[Reschedule], *, strict: bool = False) -> set[int]:
        return self.finalize(
            [FinalizeItem(i.id, i.lease_version, "pending", i.delay_seconds, i.error, i.refund_attempt) for i in items],
            strict=strict,
        )

    def mark_dead(self, items: Sequence[tuple[int, int, str]], *, strict: bool = False) -> set[int]:
        return self.finalize([FinalizeItem(i, v, "dead", 0.0, e) for i, v, e in items], strict=strict)

    def has_due_rows(self) -> bool:
        """Is a row claimable now (a due pending row or an expired lease)? One statement,
        two index probes (bounded by database.statement_timeout_ms)."""
        with self.connection() as conn:
            row = conn.execute(self.sql.query("has_due_rows")).fetchone()
        return bool(row and row[0])

    def extend_lease(
        self, claims: Sequence[tuple[int, int]], lease_seconds: float, *, strict: bool = False
    ) -> set[int]:
        if not claims:
            return set()
        ids = [row_id for row_id, _ in claims]
        versions = [version for _, version in claims]
        with self._mapped("extend lease"), self._pool.connection() as conn:
            cur = conn.cursor()  # the finalize's join, so the finalize's planner settings
            execute_with_settings(
                cur,
                self.sql.query("extend_lease", strict=strict),
                {"ids": list(ids), "versions": list(versions), "lease_seconds": float(lease_seconds)},
                FINALIZE_SETTINGS,
            )
            extended = {r[0] for r in cur.fetchall()}
        self.statement_counts.add("extend_lease")
        return extended
