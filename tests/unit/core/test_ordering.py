"""Ordering: which event types are ordered, runs stopped at their first failure, chains per key."""

from __future__ import annotations

from outbox_relay.core.ordering import RELEASED_AFTER_FAILURE, OrderingRule, RunGuard, chains, release_after_failures
from outbox_relay.publisher import (
    NotDelivered,
    PermanentError,
    RetryableError,
)
from tests.helpers.messages import message


def test_ordering_rule():
    assert not OrderingRule.of([]).enabled
    star = OrderingRule.of(["*"])
    assert star.enabled and star.all_types and star.is_ordered("Anything") and star.explicit_types == []
    named = OrderingRule.of(["B", "A"])
    assert named.is_ordered("A") and not named.is_ordered("C") and named.explicit_types == ["A", "B"]
    assert named.order_key("A", "agg-1") == "agg-1" and named.order_key("C", "agg-1") is None


def test_release_after_failures_stops_each_run_at_its_first_failure():
    keys = ["x", "x", "y", "x", None, "y", None]
    outcomes = [None, RetryableError("t"), None, None, PermanentError("p"), PermanentError("q"), None]
    release_after_failures(keys, outcomes)
    assert outcomes[0] is None and isinstance(outcomes[1], RetryableError)
    assert isinstance(outcomes[3], NotDelivered) and outcomes[3].reason == RELEASED_AFTER_FAILURE
    assert outcomes[2] is None and isinstance(outcomes[5], PermanentError)  # y's failure is its own
    assert isinstance(outcomes[4], PermanentError) and outcomes[6] is None  # unordered rows are independent


def test_run_guard_and_chains():
    guard = RunGuard()
    guard.record("x", failed=False)
    assert not guard.stopped("x")
    guard.record("x", failed=True)
    guard.record(None, failed=True)
    assert guard.stopped("x") and not guard.stopped("y") and not guard.stopped(None)
    msgs = [message(1, key="a"), message(2), message(3, key="a"), message(4, key="b"), message(5)]
    assert chains(msgs) == [[0, 2], [1], [3], [4]]
