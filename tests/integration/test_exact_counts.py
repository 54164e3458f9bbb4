"""Counts an operator can trust. The depth gauge above
metrics.exact_count_limit comes from a slower exact count, not the planner's
estimate (which is stale right after a bulk failure); counts that run out of time
are lower bounds, never guesses."""

from __future__ import annotations

import pytest

from outbox_relay.core.filters import DeadFilter
from outbox_relay.observability.metrics import RelayMetrics, StatsRefresher
from tests.helpers.console import seed_dead
from tests.helpers.db import wait_for

pytestmark = pytest.mark.timeout(120)


def gauge(metrics: RelayMetrics, status: str) -> float:
    return metrics.queue_depth.labels(status=status)._value.get()


def test_depth_gauge_above_the_cap_is_an_exact_count(store, pg_dsn, table):
    seed_dead(pg_dsn, table, 1_000)
    seed_dead(pg_dsn, table, 30, status="pending")
    metrics = RelayMetrics()
    refresher = StatsRefresher(
        store,
        metrics,
        interval_seconds=60,
        timeout_ms=2000,
        ordered_types=[],
        count_cap=100,
        exact_count_interval_seconds=0.05,
        exact_count_timeout_ms=5000,
    )
    assert refresher.refresh_once()
    # Below the cap: exact at every refresh. Above it: the cap or the planner's
    # estimate (no ANALYZE yet: at most a stale guess) until the slow exact count lands.
    assert gauge(metrics, "pending") == 30

    def exact() -> bool:
        refresher.refresh_once()
        return gauge(metrics, "dead") == 1_000

    wait_for(exact, timeout=20, interval=0.05, message="the exact dead count in the gauge")
    # The slow count follows the table (at most one count per interval).
    seed_dead(pg_dsn, table, 500)

    def recounted() -> bool:
        refresher.refresh_once()
        return gauge(metrics, "dead") == 1_500

    wait_for(recounted, timeout=20, interval=0.05, message="the recount")


def test_counts_are_exact_or_proven_lower_bounds(store, pg_dsn, table):
    seed_dead(pg_dsn, table, 3_000, aggregates=100)
    seed_dead(pg_dsn, table, 700, event_type="OrderCreated", last_error="permanent: too large")
    depth = store.exact_depth(budget_ms=10_000, first_upto=10)  # several 4x steps, all in time
    assert {s: (c.n, c.exact) for s, c in depth.items()} == {
        "pending": (0, True),
        "processing": (0, True),
        "done": (0, True),
        "dead": (3_700, True),
    }
    assert store.dead_count(DeadFilter(error_contains="TOO LARGE"), budget_ms=10_000, first_upto=10).n == 700
    limited = store.dead_count(DeadFilter(event_type="OrderCreated", limit=50), budget_ms=10_000)
    assert (limited.n, limited.exact) == (50, True)
    # No time at all beyond the first step: the first step's limit is what is proven.
    bound = store.exact_depth(budget_ms=0, statuses=["dead"], first_upto=100)["dead"]
    assert (bound.n, bound.exact) == (100, False)
    assert str(bound) == "\u2265 100"
