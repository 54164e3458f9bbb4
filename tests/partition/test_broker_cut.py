"""A relay cut off from the broker (packets dropped, no RST) with batches in flight.

What the failure-mode table promises for a broker unreachable as a whole: the batch
fails on transport within the delivery timeout (``kafka.delivery_timeout_seconds``,
below the lease, so the lease keeper, due at half the lease, has nothing to extend),
its rows are released with the attempt refunded, the circuit breaker opens, ``/readyz``
is 503, nothing goes ``dead``; when the link heals, delivery resumes by itself.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from outbox_relay._embedded.embedded import free_port, read_messages
from tests.helpers.db import assert_delivered, delivered, insert_rows, run_sql
from tests.partition.conftest import Partition, events, report, wait_until

pytestmark = [pytest.mark.partition, pytest.mark.first_pass_only]

LEASE_SECONDS = 4
CUT_SECONDS = 6  # several delivery timeouts (1.6 s) and breaker probes


def test_broker_cut_releases_rows_without_burning_attempts_and_resumes(partition: Partition) -> None:
    net = partition
    port = free_port()
    relay = net.start_relay(
        "relay",
        OUTBOX_RELAY_RELAY__LEASE_SECONDS=str(LEASE_SECONDS),
        OUTBOX_RELAY_RELAY__MAX_ATTEMPTS="3",
        OUTBOX_RELAY_METRICS__ENABLED="true",
        OUTBOX_RELAY_METRICS__HOST="127.0.0.1",
        OUTBOX_RELAY_METRICS__PORT=str(port),
    )
    relay.wait_started()
    readyz = f"http://127.0.0.1:{port}/readyz"
    warm = insert_rows(net.pg_dsn, net.table, 5)
    wait_until(lambda: delivered(net.pg_dsn, net.table, warm) == set(warm), 30, "rows before the cut")
    assert net.host.http_status(readyz) == 200

    net.broker_link.cut()
    cut_at = time.monotonic()
    in_cut = insert_rows(net.pg_dsn, net.table, 30)
    wait_until(
        lambda: run_sql(
            net.pg_dsn, net.table, "SELECT 1 FROM {t} WHERE status = 'processing' AND id = ANY(%s)", (in_cut,)
        ),
        30,
        "the rows claimed and in flight",
    )
    claimed_after = time.monotonic() - cut_at
    wait_until(lambda: net.host.http_status(readyz) == 503, 30, "/readyz 503 while cut", interval=0.3)
    not_ready_after = time.monotonic() - cut_at
    wait_until(
        lambda: events(relay, "broker unreachable: circuit breaker open, claiming paused"),
        30,
        "the circuit breaker opening",
    )
    breaker_after = time.monotonic() - cut_at
    time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
    during = run_sql(
        net.pg_dsn,
        net.table,
        "SELECT status, max(attempts), count(*) FROM {t} WHERE id = ANY(%s) GROUP BY status",
        (in_cut,),
    )
    assert net.host.http_status(readyz) == 503
    extensions = events(relay, "lease extended")

    net.broker_link.heal()
    healed_at = time.monotonic()
    wait_until(lambda: delivered(net.pg_dsn, net.table, in_cut) == set(in_cut), 90, "delivery after the heal")
    resumed_after = time.monotonic() - healed_at
    ready_again = wait_until(
        lambda: net.host.http_status(readyz) == 200, 30, "/readyz 200 after the heal", interval=0.3
    )

    assert_delivered(net.pg_dsn, net.table, in_cut)
    # No row went dead and no attempt was burned by the outage.
    assert not [s for s in during if s[0] == "dead"], during
    dead = run_sql(net.pg_dsn, net.table, "SELECT count(*) FROM {t} WHERE status = 'dead'")[0][0]
    assert dead == 0
    copies = Counter(
        int(m["headers"]["message_id"])
        for m in read_messages(net.broker.bootstrap_servers, [net.topic()], expected=35, timeout=30)
    )
    assert set(in_cut) <= set(copies)
    assert relay.alive()
    relay.terminate()
    report(
        "broker cut",
        lease_seconds=LEASE_SECONDS,
        cut_seconds=CUT_SECONDS,
        claimed_after_seconds=round(claimed_after, 2),
        readyz_503_after_seconds=round(not_ready_after, 2),
        breaker_open_after_seconds=round(breaker_after, 2),
        rows_during_cut=during,
        lease_extensions_during_cut=len(extensions),
        heal_to_all_delivered_seconds=round(resumed_after, 2),
        heal_to_readyz_200_seconds=round(ready_again, 2),
        duplicates=sum(1 for n in copies.values() if n > 1),
    )
