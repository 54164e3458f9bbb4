"""Backoff: the ceiling per attempt and the full-jitter draw."""

from __future__ import annotations

import pytest

from outbox_relay.core.backoff import backoff_ceiling, full_jitter_backoff


@pytest.mark.parametrize(
    ("attempt", "ceiling"), [(0, 1.0), (1, 2.0), (5, 32.0), (9, 300.0), (10_000, 300.0), (-1, 1.0)]
)
def test_backoff_ceiling(attempt, ceiling):
    assert backoff_ceiling(attempt, base=1.0, cap=300.0) == ceiling


def test_full_jitter_draws_from_zero_to_the_ceiling():
    draws = []
    full_jitter_backoff(3, base=0.5, cap=100, uniform=lambda low, high: draws.append((low, high)) or high)
    assert draws == [(0.0, 4.0)]
    assert all(0 <= full_jitter_backoff(4, base=1, cap=5) <= 5 for _ in range(200))
