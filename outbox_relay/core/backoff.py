"""Backoff: how long to wait before trying again.

One formula for every retry in the project (rows that failed to publish, claims and
finalizes that hit a database error, the circuit breaker's probes): AWS's "full
jitter", ``uniform(0, min(cap, base * 2**attempt))``. Full jitter spreads many
workers that failed at the same moment over the whole window, so they do not come
back in lockstep.
"""

from __future__ import annotations

import random
from collections.abc import Callable

#: Draws a number in [low, high]; ``random.uniform`` unless a test passes its own.
Uniform = Callable[[float, float], float]


def full_jitter_backoff(attempt: int, *, base: float, cap: float, uniform: Uniform = random.uniform) -> float:
    """``uniform(0, min(cap, base * 2**attempt))`` seconds (the exponent is clamped so
    a huge attempt count cannot overflow)."""
    return float(uniform(0.0, backoff_ceiling(attempt, base=base, cap=cap)))


def backoff_ceiling(attempt: int, *, base: float, cap: float) -> float:
    """The upper end of the full-jitter window after ``attempt`` attempts."""
    return min(cap, base * float(2 ** min(max(attempt, 0), 62)))
