"""``outbox_relay_statements_total``: the statements a running relay sends, by kind,
against a real PostgreSQL and a real broker, scraped over HTTP.

- Delivered rows show up as ``claim`` and ``finalize`` statements.
- An idle relay that listens for inserts sends nothing but its one idle poll per
  process: one sleeping worker claims every ``relay.idle_poll_interval_seconds`` x
  U(0.75, 1.0), the others sleep until woken, and the wake-up flag does not flip
  without inserts. So at most ``window / (0.75 x idle_poll) + 1`` claims in a window,
  whatever the number of workers; polling by every worker (``workers / poll_interval``
  per second, here 40 times as many) or a busy loop would send far more.
- A steady writer of one row per transaction costs about one claim and one finalize
  per row, and the wake-up flag stays where it is.

Counts only, no timing assertion: the window's length is measured, and the bound is a
rate over it. (A cross-check against pg_stat_statements would need the extension
preloaded; the suite's embedded server does not preload it.)
"""

from __future__ import annotations

import time

import pytest

from outbox_relay.db.statement_counts import STATEMENT_KINDS
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, statuses
from tests.integration.test_metrics_http import METRICS, Samples, poll, scrape, value

pytestmark = pytest.mark.timeout(180)

WORKERS = 4
POLL_INTERVAL_SECONDS = 0.1  # each worker's poll when the relay does not listen: not this one's
IDLE_POLL_SECONDS = 1.0
IDLE_WINDOW_SECONDS = 5.0


def statements(samples: Samples) -> dict[str, float]:
    return {kind: value(samples, "outbox_relay_statements_total", statement=kind) for kind in STATEMENT_KINDS}


def test_statements_counted_and_idle_rate_bounded(make_settings, store, pg_dsn, table):
    insert_rows(pg_dsn, table, 3, aggregate_type="order")
    relay = Relay(
        make_settings(
            metrics=METRICS,
            relay={
                "workers": WORKERS,
                "poll_interval_seconds": POLL_INTERVAL_SECONDS,
                "idle_poll_interval_seconds": IDLE_POLL_SECONDS,
            },
        )
    )
    relay.start()
    try:
        port = relay.metrics_port
        assert isinstance(port, int)

        # the three rows delivered (done, or gone in delete mode): claims that took rows, and their finalizes
        def delivered_all() -> bool:
            left = statuses(pg_dsn, table)
            return left.get("pending", 0) == 0 and left.get("processing", 0) == 0

        def delivered(result: tuple[str, Samples]) -> bool:
            counts = statements(result[1])
            # On its own, or in the transaction of the worker's next claim (relay.finalize_hold_ms).
            return counts["finalize"] + counts["finalize_in_claim"] >= 1 and delivered_all()

        _text, samples = poll(lambda: scrape(port), delivered, timeout=60)
        counts = statements(samples)
        assert set(STATEMENT_KINDS) <= {k for k, v in counts.items() if v == v}, counts  # every kind exported
        assert counts["claim"] >= 1, counts
        assert 1 <= counts["finalize"] + counts["finalize_in_claim"] <= 3, counts
        assert delivered_all()

        # idle: a window of measured length with nothing to claim
        time.sleep(2 * IDLE_POLL_SECONDS)  # the last batch's follow-up claims are over
        _text, before = scrape(port)
        started = time.monotonic()
        time.sleep(IDLE_WINDOW_SECONDS)
        _text, after = scrape(port)
        seconds = time.monotonic() - started
    finally:
        relay.stop()

    sent = {kind: statements(after)[kind] - statements(before)[kind] for kind in STATEMENT_KINDS}
    assert sent["claim"] == 0, sent  # nothing to take
    assert sent["finalize"] == 0 and sent["extend_lease"] == 0, sent
    assert sent["mark_busy"] == 0 and sent["mark_idle"] == 0, sent  # no insert, no flip of the flag
    assert sent["claim_empty"] >= 1, sent  # the process does poll
    assert sent["claim_empty"] <= seconds / (0.75 * IDLE_POLL_SECONDS) + 1, (sent, seconds)


STEADY_ROWS = 120
STEADY_GAP_SECONDS = 0.025  # about 40 rows per second, one per transaction


def test_rows_written_one_at_a_time_cost_about_one_claim_and_one_finalize_each(make_settings, store, pg_dsn, table):
    """A steady writer, one row per transaction: each row wakes one worker, which
    claims it and finalizes it, and goes back to sleep: about one claim and one
    finalize per row (or fewer, when a claim takes several), a few empty claims, and
    the wake-up flag left alone. Waking every worker per row, a claim that runs again
    after every batch or a flag flipped per row would each send several times this.
    Counts only: the bound is per row written, whatever the machine's speed."""
    relay = Relay(make_settings(metrics=METRICS, relay={"workers": WORKERS, "idle_poll_interval_seconds": 5.0}))
    relay.start()
    try:
        port = relay.metrics_port
        assert isinstance(port, int)
        insert_rows(pg_dsn, table, 1)  # the flag goes idle after the first row's batch
        poll(
            lambda: scrape(port),
            lambda r: statements(r[1])["mark_idle"] >= 1 and statuses(pg_dsn, table).get("pending", 0) == 0,
            timeout=60,
        )
        time.sleep(1.0)
        _text, before = scrape(port)
        started = time.monotonic()
        for _ in range(STEADY_ROWS):
            insert_rows(pg_dsn, table, 1)
            time.sleep(STEADY_GAP_SECONDS)

        def delivered_all(result: tuple[str, Samples]) -> bool:
            left = statuses(pg_dsn, table)
            return left.get("pending", 0) == 0 and left.get("processing", 0) == 0

        _text, after = poll(lambda: scrape(port), delivered_all, timeout=60)
        seconds = time.monotonic() - started
    finally:
        relay.stop()

    sent = {kind: statements(after)[kind] - statements(before)[kind] for kind in STATEMENT_KINDS}
    idle_polls = seconds / (0.75 * 5.0) + 1
    assert sent["claim"] <= STEADY_ROWS, sent
    assert sent["finalize"] <= STEADY_ROWS, sent
    assert sent["claim"] + sent["claim_empty"] <= 1.25 * STEADY_ROWS + idle_polls, (sent, seconds)
    assert sent["mark_busy"] + sent["mark_idle"] <= 4, sent
