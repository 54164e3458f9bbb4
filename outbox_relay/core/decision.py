"""What a row becomes after its publish outcome: a pure decision, the same for every publisher.

``decide`` maps (claimed row, outcome, outage?, policy) to a frozen ``Decision``:
the status the fenced finalize writes, the delay before the row is due again, the
error text kept in ``last_error``, and whether the claim's attempt is refunded. It
reads no clock and no database, so every rule is covered by a table of unit tests
(tests/unit/core/test_decision.py); the store then writes a whole batch of decisions in
one fenced statement (``OutboxStore.finalize``).

| outcome                                   | decision                                      |
|-------------------------------------------|-----------------------------------------------|
| success (None)                            | done                                          |
| ``NotDelivered`` (shutdown, run stopped)  | release: pending, due now, attempt refunded, last_error kept |
| ``RetryableError`` during an outage       | release, with the reason as last_error        |
| ``Defer(delay)``                          | defer: pending after delay, attempt refunded  |
| ``RetryableError``, attempts left         | retry: pending after full-jitter backoff (``Retry-After`` is a floor) |
| ``RetryableError``, attempts used up      | dead: "retries exhausted after N attempts: …" |
| ``PermanentError``                        | dead: "permanent: …"                          |

An *outage* is a batch in which nothing was delivered and every failure was a
transport failure (the target is unreachable as a whole): burning attempts then
would send a healthy backlog to ``dead`` during a broker restart, so the rows are
released instead and the circuit breaker opens (``is_outage``).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..model import Defer, NotDelivered, Outcome, PermanentError, RetryableError
from .backoff import Uniform, full_jitter_backoff


class Kind(enum.Enum):
    """How a row's outcome is counted (``outbox_relay_published_total{outcome}`` except release)."""

    DONE = "done"
    RETRY = "retry"
    DEFER = "defer"
    DEAD = "dead"
    RELEASE = "release"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the fenced finalize writes for one row."""

    kind: Kind
    status: str  # "done" | "pending" | "dead"
    delay_seconds: float = 0.0  # pending only: due after now() + delay
    error: str | None = None  # last_error; None keeps the previous one (pending) or clears it (done)
    refund_attempt: bool = False  # give back the attempt the claim took


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    backoff_base_seconds: float
    backoff_cap_seconds: float
    max_error_chars: int = 1000


#: The longest delay a decision writes (a plug-in's Defer(inf), a huge Retry-After):
#: now() + a larger interval overflows the timestamp and would fail the batch's finalize.
MAX_DELAY_SECONDS = 30 * 86400.0


def bounded_delay(seconds: float) -> float:
    """A delay PostgreSQL can add to now(): NaN and negative -> 0, at most 30 days."""
    if not math.isfinite(seconds):
        return MAX_DELAY_SECONDS if seconds > 0 else 0.0
    return min(MAX_DELAY_SECONDS, max(0.0, seconds))


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_outage(outcomes: Sequence[Outcome]) -> bool:
    """True if nothing in the batch was delivered and every real failure (ignoring rows
    released without an attempt) was a transport failure."""
    failures = [o for o in outcomes if o is not None and not isinstance(o, NotDelivered)]
    return (
        bool(failures)
        and all(o is not None for o in outcomes)
        and all(isinstance(o, RetryableError) and o.transport for o in failures)
    )


DONE = Decision(Kind.DONE, "done")


def decide(
    attempts: int, outcome: Outcome, *, outage: bool, policy: RetryPolicy, uniform: Uniform = random.uniform
) -> Decision:
    """The decision for a row claimed with ``attempts`` attempts used (the claim's
    included). ``uniform`` draws the backoff's jitter (tests pass their own)."""
    limit = policy.max_error_chars
    if outcome is None:
        return DONE
    if isinstance(outcome, NotDelivered):
        return Decision(Kind.RELEASE, "pending", 0.0, None, True)
    if isinstance(outcome, RetryableError) and outage:
        return Decision(Kind.RELEASE, "pending", 0.0, truncate(outcome.reason, limit), True)
    if isinstance(outcome, Defer):
        return Decision(
            Kind.DEFER, "pending", bounded_delay(outcome.delay), truncate(f"deferred: {outcome.reason}", limit), True
        )
    if isinstance(outcome, RetryableError):
        if attempts >= policy.max_attempts:
            return Decision(
                Kind.DEAD,
                "dead",
                0.0,
                truncate(f"retries exhausted after {attempts} attempts: {outcome.reason}", limit),
            )
        delay = full_jitter_backoff(
            attempts, base=policy.backoff_base_seconds, cap=policy.backoff_cap_seconds, uniform=uniform
        )
        if outcome.retry_after_seconds is not None:
            delay = max(delay, bounded_delay(outcome.retry_after_seconds))
        return Decision(Kind.RETRY, "pending", bounded_delay(delay), truncate(outcome.reason, limit), False)
    if isinstance(outcome, PermanentError):
        return Decision(Kind.DEAD, "dead", 0.0, truncate(f"permanent: {outcome.reason}", limit))
    raise TypeError(f"publisher returned {outcome!r}, not an outcome")
