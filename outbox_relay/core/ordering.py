"""Per-aggregate ordering, in one place.

``relay.ordered_event_types`` names the event types delivered in per-aggregate order
(``["*"]`` = all). For those, the claim hands out only an aggregate's head and the
rows right behind it (a *run*), in id order. Within one batch the rule the worker
and every publisher follow is: **a run stops at its first failure** — nothing after
a failed row of the same aggregate may be published or finalized as done in that
batch; those rows are released (back to pending, attempt refunded) and follow the
failed row later.

- ``OrderingRule``: which event types are ordered (``is_ordered``), built once from
  the settings; messages of ordered types carry ``Message.order_key``.
- ``RunGuard``: tracks, while a batch is being produced or sent, which aggregates'
  runs have stopped.
- ``release_after_failures``: the same rule applied to a finished batch's outcomes.
- ``chains``: groups a batch into independent units for concurrent senders (each
  ordered aggregate is one chain sent in sequence; each unordered message is its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import NotDelivered

if TYPE_CHECKING:
    from ..model import Message, Outcome

ALL_TYPES = "*"
#: The reason recorded (in logs only: a release keeps the row's last_error) for a row
#: not published because an earlier row of its aggregate did not succeed.
RELEASED_AFTER_FAILURE = "released: an earlier row of this aggregate did not succeed"


@dataclass(frozen=True, slots=True)
class OrderingRule:
    """Which event types are delivered in per-aggregate order."""

    all_types: bool
    types: frozenset[str]

    @classmethod
    def of(cls, ordered_event_types: Iterable[str]) -> OrderingRule:
        names = list(ordered_event_types)
        return cls(all_types=ALL_TYPES in names, types=frozenset(n for n in names if n != ALL_TYPES))

    @property
    def enabled(self) -> bool:
        return self.all_types or bool(self.types)

    @property
    def explicit_types(self) -> list[str]:
        """The named types (without ``*``), sorted: what the SQL statements take."""
        return sorted(self.types)

    def is_ordered(self, event_type: str) -> bool:
        return self.all_types or event_type in self.types

    def order_key(self, event_type: str, aggregate_id: str) -> str | None:
        """The aggregate id for an ordered type, else None (the row is independent)."""
        return aggregate_id if self.is_ordered(event_type) else None


class RunGuard:
    """Remembers which ordered aggregates' runs stopped in the current batch."""

    __slots__ = ("_stopped",)

    def __init__(self) -> None:
        self._stopped: set[str] = set()

    def stopped(self, order_key: str | None) -> bool:
        """True if an earlier row of this aggregate failed: do not publish this one."""
        return order_key is not None and order_key in self._stopped

    def record(self, order_key: str | None, failed: bool) -> None:
        if failed and order_key is not None:
            self._stopped.add(order_key)


def release_after_failures(order_keys: Sequence[str | None], outcomes: list[Outcome]) -> None:
    """In place, for rows in id order: every row after a failed row of the same
    ordered aggregate becomes ``NotDelivered`` (released), whatever its own outcome."""
    guard = RunGuard()
    for index, key in enumerate(order_keys):
        if guard.stopped(key):
            outcomes[index] = NotDelivered(RELEASED_AFTER_FAILURE)
        else:
            guard.record(key, outcomes[index] is not None)


def chains(messages: Sequence[Message]) -> list[list[int]]:
    """Indexes grouped for concurrent sending: one chain per ordered aggregate (sent in
    sequence, stopping at a failure), one single-message chain per unordered message.
    Chains keep the batch's order of first appearance."""
    result: list[list[int]] = []
    by_key: dict[str, list[int]] = {}
    for index, message in enumerate(messages):
        key = message.order_key
        if key is None:
            result.append([index])
            continue
        chain = by_key.get(key)
        if chain is None:
            chain = by_key[key] = []
            result.append(chain)
        chain.append(index)
    return result
