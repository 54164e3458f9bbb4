"""The finalizer: writes a batch's decisions with fencing and says what happened.

``Finalizer.write`` sends every decision of a batch in ONE fenced statement
(``OutboxStore.finalize``). Rows it does not accept are *lost leases* — a newer
claim owns them — and are reported, never forced. A finalize that fails on the
database is retried for half a lease (it is fenced, so repeating it is safe); past
that the rows are left to lease expiry. When a retried statement matches fewer rows
than expected, an earlier try may have committed before its reply was lost: rows
that already carry our decided status and our (unchanged) lease_version were ours.

``BatchResult`` (core/batch_result.py) is what the worker's metrics and logs are made
from (``RelayMetrics.record_batch`` and ``log_batch``), in one place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog

from ..core.backoff import full_jitter_backoff
from ..core.batch_result import BatchResult
from ..core.decision import Decision, Kind
from ..db.store import OutboxStore
from ..errors import DatabaseError, DatabaseUnavailable
from ..model import Claimed, FinalizeItem

log = structlog.get_logger("outbox_relay.finalizer")


class Finalizer:
    def __init__(
        self, store: OutboxStore, *, strict_lease: bool, retry_for_seconds: float, durable: bool = True
    ) -> None:
        self._store = store
        self._strict = strict_lease
        self._durable = durable
        self._retry_for = retry_for_seconds

    @staticmethod
    def items(rows: Sequence[Claimed], decisions: Sequence[Decision]) -> list[FinalizeItem]:
        """What the finalize statement writes for a batch's decisions."""
        return [
            FinalizeItem(row.id, row.lease_version, d.status, d.delay_seconds, d.error, d.refund_attempt)
            for row, d in zip(rows, decisions, strict=True)
        ]

    @staticmethod
    def accepted_result(rows: Sequence[Claimed], decisions: Sequence[Decision], accepted: set[int]) -> BatchResult:
        """The result of a finalize that ran once and accepted ``accepted`` (one sent
        in the next claim's transaction: store.claim finalize_first)."""
        result = BatchResult(rows=rows, decisions=decisions)
        result.accepted = accepted
        result.lost = [row.id for row in rows if row.id not in accepted]
        return result

    def write(
        self, rows: Sequence[Claimed], decisions: Sequence[Decision], *, owner: str, after_unknown: bool = False
    ) -> BatchResult:
        """``after_unknown``: the same finalize may already have committed (it rode in a
        claim whose commit outcome is unknown): rows it matches no longer are checked
        as after a retry (``_our_lost_replies``)."""
        items = self.items(rows, decisions)
        result = BatchResult(rows=rows, decisions=decisions)
        if not items:
            return result
        accepted, retried = self._finalize_with_retry(items, owner)
        if accepted is None:
            result.unfinalized = [row.id for row in rows]
            return result
        if (retried or after_unknown) and len(accepted) < len(items):
            accepted |= self._our_lost_replies([i for i in items if i.id not in accepted])
        result.accepted = accepted
        result.lost = [row.id for row in rows if row.id not in accepted]
        return result

    def _finalize_with_retry(self, items: list[FinalizeItem], owner: str) -> tuple[set[int] | None, bool]:
        """(accepted ids, or None if it never succeeded; whether it was retried)."""
        deadline = time.monotonic() + self._retry_for
        attempt = 0
        while True:
            try:
                return self._store.finalize(items, strict=self._strict, durable=self._durable), attempt > 0
            except DatabaseError as exc:
                attempt += 1
                if not isinstance(exc, DatabaseUnavailable):
                    # Not the connection but the statement (bad data, a missing table):
                    # repeating it cannot help; the lease expiry recovers the rows.
                    log.error(
                        "finalize refused by the database; rows will be reclaimed after their lease",
                        error=str(exc),
                        worker=owner,
                    )
                    return None, attempt > 1
                if time.monotonic() > deadline:
                    log.error("finalize failed; rows will be reclaimed after their lease", error=str(exc), worker=owner)
                    return None, True
                log.warning("finalize failed; retrying", error=str(exc), attempt=attempt, worker=owner)
                time.sleep(full_jitter_backoff(attempt, base=0.05, cap=2.0) + 0.02)

    def _our_lost_replies(self, missing: list[FinalizeItem]) -> set[int]:
        try:
            states = self._store.states([i.id for i in missing])
        except DatabaseError:
            return set()
        # A done row that no longer exists was deleted as done: by this finalize in
        # delete mode (relay.on_done = "delete"), or by a purge since; either way it was
        # delivered and is finished, which is what this finalize meant to record.
        return {
            i.id
            for i in missing
            if states.get(i.id) == (i.status, i.lease_version) or (i.status == "done" and i.id not in states)
        }


def log_batch(logger: structlog.typing.FilteringBoundLogger, result: BatchResult, *, owner: str) -> None:
    """The per-row log lines of a finalized batch: dead rows and lost leases."""
    if not result.lost and not result.counts().get(Kind.DEAD):
        return  # the common case: nothing to say per row
    for row, decision in zip(result.rows, result.decisions, strict=True):
        if row.id in result.accepted:
            if decision.kind is Kind.DEAD:
                logger.warning(
                    "row is dead",
                    outbox_id=row.id,
                    lease_version=row.lease_version,
                    lease_owner=owner,
                    reason=decision.error,
                )
        elif row.id in result.lost:
            logger.warning(
                "lost lease: finalize rejected, row belongs to a newer claim",
                outbox_id=row.id,
                lease_version=row.lease_version,
                lease_owner=owner,
                outcome=decision.kind.value,
            )
