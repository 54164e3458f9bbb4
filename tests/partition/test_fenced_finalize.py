"""A relay cut off from the database between its publish and its finalize.

Relay A (in its own network namespace) publishes a batch; the moment the broker has
it (its Produce request went out; the broker's answer is held back by the broker
link's proxy for the few milliseconds the cut takes), A's database link is cut
(packets dropped, no RST). A's finalize goes into the partition. Its lease expires,
relay B (on the host) reclaims the rows and delivers them again. Then:

- the link heals while A's connection is still alive: A's finalize reaches the
  database and the fencing token refuses every row (counted as lost leases);
- or A's connection timed out first (its ``database.tcp_user_timeout_ms``): A says it
  gave the batch up and leaves the rows to lease expiry.

Either way: nothing B wrote is overwritten, every row is delivered, and the only
duplicates on the topic are exactly the rows A had in flight.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from outbox_relay._embedded.embedded import read_messages
from tests.helpers.db import assert_delivered, delivered, insert_rows
from tests.helpers.net_proxy import KAFKA_PRODUCE_API_KEY, KafkaRequestWatcher
from tests.partition.conftest import Partition, events, report, wait_until

pytestmark = [pytest.mark.partition, pytest.mark.first_pass_only]

LEASE_SECONDS = 5
# A waits this long for the broker's acks: far longer than the cut takes to put in
# place (tc in the router namespace, slow on a loaded machine), so A's publish is not
# failed by its own delivery timeout while the acks are held back.
A_DELIVERY_TIMEOUT_SECONDS = 4
GAVE_UP = "finalize failed; rows will be reclaimed after their lease"
LOST_LEASE = "lost lease: finalize rejected, row belongs to a newer claim"


def _arm_hold_on_produce(net: Partition) -> threading.Event:
    """From now on, the first Produce request through the broker link holds the
    broker's answers (the messages reach the broker; the acks wait)."""
    produced = threading.Event()

    def on_request(api_key: int) -> None:
        if api_key == KAFKA_PRODUCE_API_KEY and not produced.is_set():
            net.broker_proxy.hold_downstream.set()
            produced.set()

    net.broker_proxy.watch_upstream = lambda: KafkaRequestWatcher(on_request).feed
    net.broker_proxy.kill_connections()  # reconnections get a watcher from their first byte
    return produced


def _run_cut_before_finalize(net: Partition, *, heal_while_connected: bool) -> dict[str, object]:
    a_settings = {
        "OUTBOX_RELAY_RELAY__WORKERS": "1",
        "OUTBOX_RELAY_RELAY__BATCH_SIZE": "100",
        "OUTBOX_RELAY_RELAY__LEASE_SECONDS": str(LEASE_SECONDS),
        "OUTBOX_RELAY_KAFKA__DELIVERY_TIMEOUT_SECONDS": str(A_DELIVERY_TIMEOUT_SECONDS),
    }
    if heal_while_connected:
        # Long enough that the connection outlives the partition: the finalize arrives late.
        a_settings.update(
            {
                "OUTBOX_RELAY_DATABASE__TCP_USER_TIMEOUT_MS": "60000",
                "OUTBOX_RELAY_DATABASE__TCP_KEEPALIVES_IDLE_SECONDS": "0",
            }
        )
    else:
        a_settings["OUTBOX_RELAY_DATABASE__TCP_USER_TIMEOUT_MS"] = "1500"
    relay_a = net.start_relay("relay-a", **a_settings)
    relay_a.wait_started()

    before = insert_rows(net.pg_dsn, net.table, 5)
    wait_until(lambda: delivered(net.pg_dsn, net.table, before) == set(before), 30, "A's first rows")

    produced = _arm_hold_on_produce(net)
    in_flight = insert_rows(net.pg_dsn, net.table, 20)
    wait_until(produced.is_set, 30, "A's Produce request")
    net.database.cut()
    cut_at = time.monotonic()
    net.broker_proxy.hold_downstream.clear()
    net.broker_proxy.watch_upstream = None

    relay_b = net.start_relay(
        "relay-b", inside=False, OUTBOX_RELAY_RELAY__WORKERS="1", OUTBOX_RELAY_RELAY__LEASE_SECONDS=str(LEASE_SECONDS)
    )
    figures: dict[str, object] = {"lease_seconds": LEASE_SECONDS}
    if not heal_while_connected:
        figures["cut_to_a_gave_up_seconds"] = round(
            wait_until(lambda: events(relay_a, GAVE_UP), 60, "A giving its batch up"), 2
        )
        figures["a_gave_up_error"] = events(relay_a, GAVE_UP)[0].get("error")

    after = insert_rows(net.pg_dsn, net.table, 5)
    relay_b.wait_started()
    everything = before + in_flight + after
    wait_until(lambda: delivered(net.pg_dsn, net.table, everything) == set(everything), 60, "B delivering every row")
    b_delivered_after = time.monotonic() - cut_at

    figures["cut_to_b_delivered_seconds"] = round(b_delivered_after, 2)
    if heal_while_connected:
        assert events(relay_a, GAVE_UP) == []
        net.database.heal()
        healed_at = time.monotonic()
        wait_until(
            lambda: len(events(relay_a, LOST_LEASE)) >= len(in_flight), 60, "A's late finalize refused row by row"
        )
        figures["heal_to_a_refused_seconds"] = round(time.monotonic() - healed_at, 2)
        lost = {e["outbox_id"] for e in events(relay_a, LOST_LEASE)}
        assert lost == set(in_flight)
    else:
        net.database.heal()
        assert events(relay_a, LOST_LEASE) == []

    # Nothing B wrote was overwritten by A's late finalize.
    assert_delivered(net.pg_dsn, net.table, everything)
    # A is back to work after the heal: a new row goes through one of the two.
    extra = insert_rows(net.pg_dsn, net.table, 1)
    wait_until(lambda: delivered(net.pg_dsn, net.table, extra) == set(extra), 60, "a row after the heal")
    assert relay_a.alive() and relay_b.alive()

    every_id = set(everything + extra)
    messages = read_messages(
        net.broker.bootstrap_servers, [net.topic()], expected=len(every_id) + len(in_flight), timeout=30
    )
    copies = Counter(int(m["headers"]["message_id"]) for m in messages)
    assert set(copies) == every_id
    assert {i for i, n in copies.items() if n > 1} == set(in_flight), relay_a.output()[-3000:]
    assert all(copies[i] == 2 for i in in_flight)
    relay_a.terminate()
    relay_b.terminate()
    return figures


def test_late_finalize_after_takeover_is_refused_by_the_fencing_token(partition: Partition) -> None:
    figures = _run_cut_before_finalize(partition, heal_while_connected=True)
    report("fenced late finalize", **figures)


def test_finalize_timed_out_in_the_partition_gives_the_batch_up(partition: Partition) -> None:
    figures = _run_cut_before_finalize(partition, heal_while_connected=False)
    report("finalize given up", **figures)
