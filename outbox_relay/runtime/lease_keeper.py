"""LeaseKeeper: extends the leases of batches whose delivery takes longer than expected.

One thread per relay process (a relay serving many sources runs every source's keeper
from one thread of its own instead: ``source_services.LeaseRounds``). A worker registers its batch before
publishing and unregisters it before finalizing. Once a batch has been in flight for
``extend_after_fraction`` of its lease, the keeper extends the lease of the rows the
batch still owns with a fenced update (``status = 'processing' AND lease_version =
<claimed>``). Rows the update no longer finds were taken over by a newer claim: the
keeper records them, and when the whole batch is lost it sets the batch's ``cancel``
event so the worker stops waiting for deliveries that no longer matter to it (its
finalize will be rejected and counted as lost leases).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from ..config import Settings
from ..core.service import PeriodicService
from ..db.store import OutboxStore
from ..errors import DatabaseError
from ..model import Claimed

log = structlog.get_logger("outbox_relay.lease_keeper")


@dataclass(eq=False)
class LeasedBatch:
    rows: Sequence[Claimed]
    owner: str
    extended_at: float = field(default_factory=time.monotonic)
    lost: set[int] = field(default_factory=set)
    cancel: threading.Event = field(default_factory=threading.Event)
    extensions: int = 0
    # Never extend past this (monotonic): a batch whose worker died or hangs must not
    # keep its rows leased forever; after it, lease expiry recovers them.
    extend_until: float = float("inf")

    @property
    def claims(self) -> list[tuple[int, int]]:
        """(id, lease_version) of every row; built only when an extension is due."""
        return [(r.id, r.lease_version) for r in self.rows]


class LeaseKeeper(PeriodicService):
    thread_name = "lease-keeper"

    def __init__(
        self, store: OutboxStore, *, lease_seconds: float, extend_after_fraction: float = 0.5, strict: bool = False
    ) -> None:
        super().__init__(max(0.05, min(1.0, lease_seconds / 10)))
        self._store = store
        self._strict = strict
        self._lease = lease_seconds
        self._after = lease_seconds * extend_after_fraction
        self._lock = threading.Lock()
        self._batches: set[LeasedBatch] = set()

    @classmethod
    def from_settings(cls, store: OutboxStore, settings: Settings) -> LeaseKeeper:
        """The keeper of one source's leases, as its ``relay.*`` settings configure it."""
        r = settings.relay
        return cls(
            store,
            lease_seconds=r.lease_seconds,
            extend_after_fraction=r.lease_extend_after_fraction,
            strict=r.strict_lease,
        )

    def track(self, rows: Sequence[Claimed], owner: str, *, max_seconds: float | None = None) -> LeasedBatch:
        batch = LeasedBatch(rows=rows, owner=owner)
        if max_seconds is not None:
            batch.extend_until = time.monotonic() + max_seconds
        with self._lock:
            self._batches.add(batch)
        return batch

    def untrack(self, batch: LeasedBatch) -> None:
        with self._lock:
            self._batches.discard(batch)

    def _due(self, batch: LeasedBatch, now: float) -> bool:
        return now - batch.extended_at >= self._after and not batch.cancel.is_set() and now < batch.extend_until

    def has_due(self, now: float | None = None) -> bool:
        """Does a tracked batch need its lease extended now? (What ``step`` would do;
        cheap: a relay serving many sources asks every source's keeper each round.)"""
        now = time.monotonic() if now is None else now
        with self._lock:
            return any(self._due(b, now) for b in self._batches)

    def step(self) -> None:
        """Extend every batch that is due; called by the thread, callable from tests."""
        now = time.monotonic()
        with self._lock:
            due = [b for b in self._batches if self._due(b, now)]
        for batch in due:
            owned = [c for c in batch.claims if c[0] not in batch.lost]
            try:
                kept = self._store.extend_lease(owned, self._lease, strict=self._strict)
            except DatabaseError as exc:
                log.warning("lease extension failed", error=str(exc), lease_owner=batch.owner)
                continue
            batch.extended_at = time.monotonic()
            batch.extensions += 1
            with self._lock:
                finalizing = batch not in self._batches
            if finalizing:
                # The worker untracked the batch while this extension ran: it is
                # finalizing (or releasing) the rows itself, so rows the update did not
                # find were most likely just finalized by their own claim, not taken
                # over. Judging them lost would log false warnings and cancel a batch
                # that is already done; a real takeover is still caught by the fenced
                # finalize, which counts it as a lost lease.
                continue
            for row_id, version in owned:
                if row_id not in kept:
                    batch.lost.add(row_id)
                    log.warning(
                        "lease lost while publishing: a newer claim owns the row",
                        outbox_id=row_id,
                        lease_version=version,
                        lease_owner=batch.owner,
                    )
            if kept:
                log.info("lease extended", rows=len(kept), lease_owner=batch.owner, lease_seconds=self._lease)
            if len(batch.lost) == len(batch.rows):
                batch.cancel.set()
