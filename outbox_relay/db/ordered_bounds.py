"""Where the ordered claim's fast claims look for each aggregate's head, so that an
ordered relay's cost stays flat while vacuum is held back.

The ordered claim (delivery.sql "claim_ordered_heads") walks the distinct aggregates of
the per-aggregate index of pending and processing rows and takes each one's first such
row: both read every entry of an aggregate from its front. While vacuum is held back
each delivered row leaves two dead entries there (its pending and its processing
version), which nothing removes nor marks dead, so the claim's cost grows with every
row delivered since the horizon was taken. Its "fast" form
("claim_ordered_heads_bounded") reads each aggregate's index from a key per aggregate
instead, and finds the aggregates to look at without the skip scan.

The rule it relies on. A bound B of aggregate X is proven when a statement saw, at its
snapshot, that no ordered row of X below B was pending, processing or dead (the first
unfinished row found from an earlier proven bound, and no dead row below it).
Once proven it stays true: a finished row never becomes unfinished again. Only a
finalize moves a row out of processing (and only its claim's rows, which were at or
above B when claimed), dead_retry moves only dead rows back to pending, dead_skip
makes a dead row done, and a replay sends done rows without changing them. A writer
may add a row below B only by committing out of id order within the aggregate, which
ordering forbids (enqueue(ordered=True) or the aggregate lock: docs/explanation/
ordering.md); such a row is taken, as it would have been before, by the next full
claim. So a row of X found first at or above B, with no ordered dead row of X below it
(one probe of the dead-rows index, which holds only rows that went dead, as in the
full claim), has no earlier unfinished row: it is X's head, and claiming it keeps the
order. A bound is never moved past a dead row (a retry would make it pending again
below it).

Bounds come from what this process saw: a full claim's claimed heads (proven from the
front), then every fast look, which moves the bound to the first unfinished row it
found, unless a dead row lies below that row. The walk from a bound therefore reads only
the entries of the rows delivered since the last look at that aggregate. An aggregate
never seen yet starts at bound 0 (its history read once).

Which aggregates a fast claim looks at: those "visited", i.e. found with a pending row
by the discovery scan of the due index ("claim_ordered_discover", from where the fast
claims start: a DueCursor of its own, fed with what the scan read up to and with the
open writers it saw) or found unfinished by an earlier look (a head in flight, rows
behind a dead or paused head, a head not due yet). An aggregate leaves the visited
set when a look finds no unfinished row in it; its bound is kept (up to
MAX_KNOWN_AGGREGATES, least recently used first out), so that its next row costs a walk
from there. What fast claims cannot see comes to the full claims, which still come
round (claim_cursor.py): rows below where the discovery starts in an aggregate this
process does not visit (those of another relay process, a writer the look for open
writers missed, an expired lease of an aggregate nobody here was visiting).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable

# How many aggregates' bounds are remembered, least recently used first out. Full
# claims record theirs too, also without MVCC pressure (the aggregates in flight when
# the fast claims take over must be known then): some 15 MB at most.
MAX_KNOWN_AGGREGATES = 100_000
# How many aggregates the visited set holds; beyond it the oldest are left to full claims.
MAX_VISITED_AGGREGATES = 50_000


class AggregateBounds:
    """Shared by the workers of one process (thread-safe)."""

    def __init__(self, *, max_known: int = MAX_KNOWN_AGGREGATES, max_visited: int = MAX_VISITED_AGGREGATES) -> None:
        self._lock = threading.Lock()
        self._bounds: OrderedDict[str, int] = OrderedDict()  # proven bounds, least recently used first
        # Aggregates to look at, in round-robin order, each with the ticket of when it
        # was last found pending: a look that started before that may not drop it.
        self._visited: OrderedDict[str, int] = OrderedDict()
        self._ticket = 0
        self._max_known = max_known
        self._max_visited = max_visited

    def bound(self, aggregate_id: str) -> int:
        with self._lock:
            return self._bounds.get(aggregate_id, 0)

    def visited_count(self) -> int:
        with self._lock:
            return len(self._visited)

    def discovered(self, aggregate_ids: Iterable[str]) -> None:
        """Aggregates with a pending row (the discovery scan, or a full claim's heads)."""
        with self._lock:
            self._ticket += 1
            for aggregate_id in aggregate_ids:
                self._visited[aggregate_id] = self._ticket
            while len(self._visited) > self._max_visited:
                self._visited.popitem(last=False)

    def heads_claimed(self, heads: Iterable[tuple[str, int]]) -> int:
        """A full claim's claimed heads, (aggregate, id): each is the first unfinished row
        of its aggregate read from the front, with no dead row before it (a proven
        bound), and its aggregate is visited from now on. Returns how many of them were
        not visited before (rows the fast claims had not been looking at)."""
        with self._lock:
            self._ticket += 1
            new = 0
            for aggregate_id, head_id in heads:
                if aggregate_id not in self._visited:
                    new += 1
                self._visited[aggregate_id] = self._ticket
                self._prove(aggregate_id, head_id)
            while len(self._visited) > self._max_visited:
                self._visited.popitem(last=False)
            return new

    def proven(self, aggregate_id: str, bound: int) -> None:
        """No ordered row of the aggregate below ``bound`` is unfinished (module docstring)."""
        with self._lock:
            self._prove(aggregate_id, bound)

    def to_visit(self, limit: int) -> tuple[int, list[tuple[str, int]]]:
        """Up to ``limit`` visited aggregates with their bounds, taken round-robin (moved
        to the end, so concurrent claims take different ones), and the ticket of this
        look (for ``looked``)."""
        with self._lock:
            self._ticket += 1
            taken: list[tuple[str, int]] = []
            for aggregate_id in list(itertools.islice(self._visited, limit)):
                self._visited.move_to_end(aggregate_id)
                taken.append((aggregate_id, self._bounds.get(aggregate_id, 0)))
            return self._ticket, taken

    def looked(self, ticket: int, aggregate_id: str, first_unfinished: int | None, blocked: bool) -> None:
        """What a look from the bound found: the aggregate's first pending or processing
        ordered row at or above it (None: none), and whether an ordered dead row lies
        below that one (then the bound stays: a retry would make that row pending again)."""
        with self._lock:
            if first_unfinished is None:
                # Nothing to wait for: leave the visited set, unless a discovery found a
                # pending row after this look's statement began (its ticket is newer).
                seen = self._visited.get(aggregate_id)
                if seen is not None and seen < ticket:
                    del self._visited[aggregate_id]
                return
            if not blocked:
                self._prove(aggregate_id, first_unfinished)

    def _prove(self, aggregate_id: str, bound: int) -> None:
        if bound > self._bounds.get(aggregate_id, 0):
            self._bounds[aggregate_id] = bound
        if aggregate_id in self._bounds:
            self._bounds.move_to_end(aggregate_id)
        while len(self._bounds) > self._max_known:
            self._bounds.popitem(last=False)
