"""How many statements of each kind the store has sent: the relay's own load on its
database, counted where the statements run (an idle relay's cost is its empty claims
and wake-up flips, which no row counter shows)."""

from __future__ import annotations

import threading
from collections.abc import Callable

# The kinds counted, each one round trip to the database:
#   claim        a claim that took or reaped rows
#   claim_empty  a claim that found nothing (an idle relay's steady load)
#   finalize     one fenced finalize of a batch, in a transaction of its own
#   finalize_in_claim  one fenced finalize of a batch sent in the transaction (and the
#                round trip) of the worker's next claim (relay.finalize_hold_ms)
#   extend_lease one lease extension of a batch still being published
#   mark_idle    the relays' flag flipped to idle (inserts start to NOTIFY)
#   mark_busy    the flag flipped back on a wake-up
#   gauge_bounds where the claims start, published while vacuum is held back (every 5 s
#                at most; none otherwise: claim_cursor.py, delivery.sql publish_gauge_bounds)
# A claim's transaction-local settings ride in the same round trip (pipelined) and are
# not counted apart; a claim with ordered event types is one short transaction of
# several statements, counted once.
STATEMENT_KINDS: tuple[str, ...] = (
    "claim",
    "claim_empty",
    "finalize",
    "finalize_in_claim",
    "extend_lease",
    "mark_idle",
    "mark_busy",
    "gauge_bounds",
)


class StatementCounts:
    """Per kind, the statements sent so far; ``observe`` adds a callback called with
    the kind after each one (the metrics counter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STATEMENT_KINDS, 0)
        self._observers: tuple[Callable[[str], None], ...] = ()

    def add(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1
            observers = self._observers
        for observer in observers:
            observer(kind)

    def observe(self, callback: Callable[[str], None]) -> dict[str, int] | None:
        """Call ``callback`` after every statement from now on; returns the counts up to
        now (taken with the registration, so none is missed or counted twice), or None
        when ``callback`` already observes these counts."""
        with self._lock:
            if callback in self._observers:
                return None
            self._observers = (*self._observers, callback)
            return dict(self._counts)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
