"""BatchResult: one batch after its finalize, what the metrics, logs and traces of a
batch are made from (``RelayMetrics.record_batch``, ``log_batch``, ``BatchTrace.finalized``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..model import Claimed
from .decision import Decision, Kind


@dataclass
class BatchResult:
    """One batch after its finalize: the decisions and which of them were written."""

    rows: Sequence[Claimed] = ()
    decisions: Sequence[Decision] = ()
    accepted: set[int] = field(default_factory=set)
    lost: list[int] = field(default_factory=list)  # finalize rejected: a newer claim owns the row
    unfinalized: list[int] = field(default_factory=list)  # database down: lease expiry recovers them
    elapsed_seconds: float | None = None  # claim -> finalize, for the publish latency histogram
    _counts: Counter[Kind] | None = field(default=None, init=False, repr=False)

    @property
    def claimed(self) -> int:
        return len(self.rows)

    def count(self, kind: Kind) -> int:
        """Rows of this kind whose finalize was accepted."""
        return self.counts().get(kind, 0)

    def counts(self) -> Counter[Kind]:
        """Accepted rows per kind (computed once: metrics ask for every kind)."""
        if self._counts is None:
            accepted = self.accepted
            self._counts = Counter(
                d.kind for row, d in zip(self.rows, self.decisions, strict=True) if row.id in accepted
            )
        return self._counts

    @property
    def done(self) -> int:
        return self.count(Kind.DONE)

    @property
    def retried(self) -> int:
        return self.count(Kind.RETRY)

    @property
    def deferred(self) -> int:
        return self.count(Kind.DEFER)

    @property
    def dead(self) -> int:
        return self.count(Kind.DEAD)

    @property
    def released(self) -> int:
        return self.count(Kind.RELEASE)
