"""The outcome decision (what a row becomes after its publish outcome) as a table: every rule, the outage and
last-attempt cases. Pure: no database, no clock."""

from __future__ import annotations

import pytest

from outbox_relay.core.decision import Decision, Kind, RetryPolicy, decide, is_outage, truncate
from outbox_relay.publisher import Defer, NotDelivered, PermanentError, RetryableError

POLICY = RetryPolicy(max_attempts=5, backoff_base_seconds=1.0, backoff_cap_seconds=300.0, max_error_chars=1000)


def upper_bound(low: float, high: float) -> float:
    """A 'random' draw that always takes the top of the window: makes delays exact."""
    return high


TRANSPORT = RetryableError("kafka: _TRANSPORT", transport=True)


@pytest.mark.parametrize(
    ("attempts", "outcome", "outage", "expected"),
    [
        # success -> done (last_error cleared by the statement)
        (1, None, False, Decision(Kind.DONE, "done")),
        (5, None, True, Decision(Kind.DONE, "done")),
        # retryable with attempts left -> pending after full-jitter backoff, attempt kept
        (1, RetryableError("timeout"), False, Decision(Kind.RETRY, "pending", 2.0, "timeout", False)),
        (3, RetryableError("timeout"), False, Decision(Kind.RETRY, "pending", 8.0, "timeout", False)),
        (4, RetryableError("timeout"), False, Decision(Kind.RETRY, "pending", 16.0, "timeout", False)),
        # Retry-After is a floor for the backoff
        (
            1,
            RetryableError("429", retry_after_seconds=60.0),
            False,
            Decision(Kind.RETRY, "pending", 60.0, "429", False),
        ),
        (4, RetryableError("503", retry_after_seconds=3.0), False, Decision(Kind.RETRY, "pending", 16.0, "503", False)),
        # retryable on the last attempt -> dead
        (
            5,
            RetryableError("timeout"),
            False,
            Decision(Kind.DEAD, "dead", 0.0, "retries exhausted after 5 attempts: timeout"),
        ),
        (
            7,
            TRANSPORT,
            False,
            Decision(Kind.DEAD, "dead", 0.0, "retries exhausted after 7 attempts: kafka: _TRANSPORT"),
        ),
        # defer -> pending after the delay, attempt refunded, whatever attempts were used
        (
            1,
            Defer(30, "customer missing"),
            False,
            Decision(Kind.DEFER, "pending", 30.0, "deferred: customer missing", True),
        ),
        (5, Defer(0.5, "not yet"), False, Decision(Kind.DEFER, "pending", 0.5, "deferred: not yet", True)),
        (5, Defer(-3, "clock skew"), False, Decision(Kind.DEFER, "pending", 0.0, "deferred: clock skew", True)),
        # permanent -> dead at once
        (1, PermanentError("too large"), False, Decision(Kind.DEAD, "dead", 0.0, "permanent: too large")),
        (1, PermanentError("too large"), True, Decision(Kind.DEAD, "dead", 0.0, "permanent: too large")),
        # released without an attempt (shutdown, stopped run): due now, refunded, last_error kept
        (1, NotDelivered("shutdown"), False, Decision(Kind.RELEASE, "pending", 0.0, None, True)),
        (5, NotDelivered("shutdown"), True, Decision(Kind.RELEASE, "pending", 0.0, None, True)),
        # outage: a retryable failure is released with its reason, even on the last attempt
        (1, TRANSPORT, True, Decision(Kind.RELEASE, "pending", 0.0, "kafka: _TRANSPORT", True)),
        (5, TRANSPORT, True, Decision(Kind.RELEASE, "pending", 0.0, "kafka: _TRANSPORT", True)),
    ],
)
def test_decision_table(attempts, outcome, outage, expected):
    assert decide(attempts, outcome, outage=outage, policy=POLICY, uniform=upper_bound) == expected


def test_backoff_is_capped_and_jittered_from_zero():
    capped = RetryPolicy(max_attempts=100, backoff_base_seconds=1.0, backoff_cap_seconds=10.0)
    assert decide(50, RetryableError("x"), outage=False, policy=capped, uniform=upper_bound).delay_seconds == 10.0
    lowest = decide(3, RetryableError("x"), outage=False, policy=POLICY, uniform=lambda low, high: low)
    assert lowest.delay_seconds == 0.0  # full jitter: the window starts at zero
    windows = []
    decide(
        3,
        RetryableError("x"),
        outage=False,
        policy=POLICY,
        uniform=lambda low, high: windows.append((low, high)) or low,
    )
    assert windows == [(0.0, 8.0)]


def test_error_text_is_truncated_to_the_limit():
    short = RetryPolicy(max_attempts=3, backoff_base_seconds=1, backoff_cap_seconds=1, max_error_chars=50)
    decision = decide(1, PermanentError("x" * 500), outage=False, policy=short)
    assert decision.error is not None and len(decision.error) == 50 and decision.error.endswith("…")
    assert truncate("abc", 3) == "abc" and truncate("abcd", 3) == "ab…"


def test_an_unknown_object_is_not_an_outcome():
    with pytest.raises(TypeError):
        decide(1, ValueError("bug"), outage=False, policy=POLICY)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ([TRANSPORT, TRANSPORT], True),
        ([TRANSPORT, NotDelivered("run stopped")], True),  # released rows do not count against it
        ([TRANSPORT, None], False),  # something was delivered: the target answers
        ([TRANSPORT, RetryableError("timeout")], False),  # a non-transport failure: not an outage
        ([TRANSPORT, PermanentError("bad")], False),
        ([NotDelivered("shutdown")], False),  # nothing failed
        ([], False),
        ([None, None], False),
    ],
)
def test_outage_detection(outcomes, expected):
    assert is_outage(outcomes) is expected


@pytest.mark.parametrize(
    ("outcome", "delay"),
    [
        (Defer(float("inf"), "forever"), 30 * 86400.0),
        (Defer(1e13, "far"), 30 * 86400.0),
        (Defer(float("nan"), "nan"), 0.0),
        (RetryableError("slow down", retry_after_seconds=float("inf")), 30 * 86400.0),
    ],
)
def test_delays_are_bounded_so_the_finalize_cannot_overflow(outcome, delay):
    decision = decide(1, outcome, outage=False, policy=POLICY, uniform=upper_bound)
    assert decision.delay_seconds == delay
