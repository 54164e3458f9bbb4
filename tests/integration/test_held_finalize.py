"""``relay.finalize_hold_ms``: the finalize of a small delivered batch waits briefly for
the worker's next claim and is sent in that claim's transaction.

Against a real PostgreSQL and a real broker, counted from
``outbox_relay_statements_total`` (counts only, no timing assertion):

- a steady writer: most finalizes ride in the next claim, so the relay's transactions
  per row fall from two (a claim, a finalize) towards one, and every row is done;
- a lone row: no claim comes, its finalize goes on its own when the hold ends;
- a stop: a held finalize is written before the relay stops (nothing left processing);
- 0 turns it off: every finalize in its own transaction, as before.
"""

from __future__ import annotations

import time

import pytest

from outbox_relay.db.statement_counts import STATEMENT_KINDS
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import DELETE_MODE, insert_rows, row_states, statuses
from tests.helpers.kafka_records import read_records
from tests.integration.test_metrics_http import METRICS, Samples, poll, scrape, value

pytestmark = pytest.mark.timeout(180)

STEADY_ROWS = 120
STEADY_GAP_SECONDS = 0.025  # about 40 rows per second, one per transaction


def statements(samples: Samples) -> dict[str, float]:
    return {kind: value(samples, "outbox_relay_statements_total", statement=kind) for kind in STATEMENT_KINDS}


def all_delivered(pg_dsn: str, table: str) -> bool:
    left = statuses(pg_dsn, table)
    return left.get("pending", 0) == 0 and left.get("processing", 0) == 0


def settled(relay: Relay, pg_dsn: str, table: str) -> Samples:
    """The relay's counters once the first row's batch is done and the flag is idle."""
    port = relay.metrics_port
    assert isinstance(port, int)
    insert_rows(pg_dsn, table, 1)
    poll(
        lambda: scrape(port),
        lambda r: statements(r[1])["mark_idle"] >= 1 and all_delivered(pg_dsn, table),
        timeout=60,
    )
    time.sleep(1.5)  # the first row's finalize, held or not, is written
    return scrape(port)[1]


@pytest.mark.parametrize("hold_ms", [50.0, 0.0])
def test_a_steady_writers_finalizes_ride_in_the_next_claims(make_settings, store, pg_dsn, table, hold_ms):
    relay = Relay(make_settings(metrics=METRICS, relay={"workers": 4, "finalize_hold_ms": hold_ms}))
    relay.start()
    try:
        before = settled(relay, pg_dsn, table)
        ids: list[int] = []
        for _ in range(STEADY_ROWS):
            ids += insert_rows(pg_dsn, table, 1)
            time.sleep(STEADY_GAP_SECONDS)
        port = relay.metrics_port
        assert isinstance(port, int)
        _text, after = poll(
            lambda: scrape(port),
            lambda r: (
                all_delivered(pg_dsn, table)
                and statements(r[1])["finalize"] + statements(r[1])["finalize_in_claim"]
                >= statements(r[1])["claim"]
                - statements(before)["claim"]
                + statements(before)["finalize"]
                + statements(before)["finalize_in_claim"]
            ),
            timeout=60,
        )
    finally:
        relay.stop()
    sent = {kind: statements(after)[kind] - statements(before)[kind] for kind in STATEMENT_KINDS}
    transactions = sent["claim"] + sent["claim_empty"] + sent["finalize"]
    if hold_ms > 0:
        assert sent["finalize_in_claim"] >= STEADY_ROWS / 2, sent
        assert transactions <= 1.4 * STEADY_ROWS, sent
    else:
        assert sent["finalize_in_claim"] == 0, sent
        assert transactions >= 1.8 * STEADY_ROWS, sent
    # Every row finished, by one finalize or the other: done (gone in delete mode).
    states = row_states(pg_dsn, table, ids)
    assert (states == {}) if DELETE_MODE else set(states.values()) == {("done", 1)}, states


def test_a_lone_rows_finalize_goes_on_its_own_when_no_claim_comes(make_settings, store, pg_dsn, table):
    relay = Relay(make_settings(metrics=METRICS, relay={"workers": 2, "finalize_hold_ms": 200.0}))
    relay.start()
    try:
        before = settled(relay, pg_dsn, table)
        (row_id,) = insert_rows(pg_dsn, table, 1)
        port = relay.metrics_port
        assert isinstance(port, int)
        _text, after = poll(
            lambda: scrape(port),
            lambda r: statements(r[1])["finalize"] > statements(before)["finalize"] and all_delivered(pg_dsn, table),
            timeout=60,
        )
    finally:
        relay.stop()
    sent = {kind: statements(after)[kind] - statements(before)[kind] for kind in STATEMENT_KINDS}
    assert sent["finalize"] == 1 and sent["finalize_in_claim"] == 0, sent
    assert row_states(pg_dsn, table, [row_id]) == ({} if DELETE_MODE else {row_id: ("done", 1)})


def test_a_held_finalize_is_written_before_the_relay_stops(make_settings, store, pg_dsn, table, broker, topic_prefix):
    # A hold far longer than the setting allows (model_copy skips the validation; a
    # tenth of the lease, 6 s, is the bound): the relay is stopped while the delivered
    # row's finalize waits, and writes it on its way out rather than leave it processing.
    settings = make_settings(metrics=METRICS, relay={"workers": 2, "lease_seconds": 60})
    settings = settings.model_copy(update={"relay": settings.relay.model_copy(update={"finalize_hold_ms": 30_000.0})})
    relay = Relay(settings)
    relay.start()
    try:
        settled(relay, pg_dsn, table)  # the relays sleep between batches: finalizes are held from now on
        (row_id,) = insert_rows(pg_dsn, table, 1, aggregate_type="held")
        assert len(read_records(broker.bootstrap_servers, f"{topic_prefix}.held", expected=1)) == 1
        assert row_states(pg_dsn, table, [row_id]) == {row_id: ("processing", 1)}  # delivered, finalize held
    finally:
        relay.stop()
    assert row_states(pg_dsn, table, [row_id]) == ({} if DELETE_MODE else {row_id: ("done", 1)})
