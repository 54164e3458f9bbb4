"""Memory bounded by bytes, not rows, against a real PostgreSQL and the real broker:
a claim stops at relay.max_batch_bytes, a single larger row is claimed alone and
delivered, a row above kafka.message_max_bytes goes dead without being fetched,
workers wait for the byte budget instead of failing, and a full producer queue
is waited out."""

from __future__ import annotations

import threading
import time

import pytest

from outbox_relay.publisher import Message, SimplePublisher
from outbox_relay.publishers.kafka import KafkaPublisher
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, rows, run_sql, statuses, wait_for


def test_claim_stops_at_the_byte_budget_and_takes_one_larger_row_alone(store, pg_dsn, table):
    ids = insert_rows(pg_dsn, table, 8, payload_size=50_000)
    size = run_sql(pg_dsn, table, "SELECT octet_length(payload::text) FROM {t} WHERE id = %s", (ids[0],))[0][0]
    first = store.claim(owner="a", batch=100, lease_seconds=30, max_attempts=3, max_batch_bytes=2 * size + 10)
    assert [c.id for c in first.rows] == ids[:2]  # a third row would pass the budget
    assert all(c.size_bytes == size for c in first.rows)
    # A budget below one row: that row is claimed alone, never zero rows.
    alone = store.claim(owner="b", batch=100, lease_seconds=30, max_attempts=3, max_batch_bytes=1024)
    assert [c.id for c in alone.rows] == [ids[2]] and alone.rows[0].payload is not None
    # Sizing few candidates (the worker's adaptive limit) still claims the oldest rows.
    few = store.claim(owner="c", batch=100, lease_seconds=30, max_attempts=3, max_batch_bytes=10 * size, candidates=3)
    assert [c.id for c in few.rows] == ids[3:6]


def test_row_above_the_message_limit_is_claimed_without_its_payload(store, pg_dsn, table):
    [small, big] = insert_rows(pg_dsn, table, 1) + insert_rows(pg_dsn, table, 1, payload_size=20_000)
    claimed = store.claim(owner="a", batch=10, lease_seconds=30, max_attempts=3, max_message_bytes=10_000).rows
    by_id = {c.id: c for c in claimed}
    assert by_id[small].payload is not None and by_id[big].payload is None
    assert by_id[big].size_bytes > 20_000


def test_a_row_larger_than_the_batch_budget_is_delivered(make_settings, store, pg_dsn, table):
    big = insert_rows(pg_dsn, table, 1, payload_size=300_000)
    small = insert_rows(pg_dsn, table, 20)
    settings = make_settings(
        relay={"max_batch_bytes": 100_000, "max_in_flight_bytes": 200_000}, kafka={"message_max_bytes": 1_000_000}
    )
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 21, message="big and small rows done")
    finally:
        relay.stop()
    assert {r[0]: (r[1], r[2]) for r in rows(pg_dsn, table)} == dict.fromkeys(big + small, ("done", 1))


class SlowPublisher(SimplePublisher):
    """Takes a while per message, so batches stay in flight and the budget fills up."""

    def __init__(self) -> None:
        self.published: list[int] = []
        self._lock = threading.Lock()

    def publish(self, message: Message) -> None:
        time.sleep(0.05)
        with self._lock:
            self.published.append(message.id)


def test_workers_wait_for_the_in_flight_budget_and_nothing_fails(make_settings, store, pg_dsn, table):
    ids = insert_rows(pg_dsn, table, 40, payload_size=20_000)
    size = run_sql(pg_dsn, table, "SELECT max(octet_length(payload::text)) FROM {t}")[0][0]
    budget = 5 * size  # two batches of two rows fit; a third reservation must wait
    settings = make_settings(
        relay={"workers": 4, "batch_size": 100, "max_batch_bytes": 2 * size + 100, "max_in_flight_bytes": budget}
    )
    publisher = SlowPublisher()
    relay = Relay(settings, publisher=publisher)
    relay.start()
    highest = 0
    try:
        deadline = time.monotonic() + 90
        while statuses(pg_dsn, table).get("done", 0) < 40 and time.monotonic() < deadline:
            [(in_flight,)] = run_sql(
                pg_dsn,
                table,
                "SELECT coalesce(sum(octet_length(payload::text)), 0) FROM {t} WHERE status = 'processing'",
            )
            highest = max(highest, int(in_flight))
            time.sleep(0.02)
        waits = relay.metrics.registry.get_sample_value("outbox_relay_in_flight_budget_waits_total")
    finally:
        relay.stop()
    assert statuses(pg_dsn, table) == {"done": 40}
    assert {r[2] for r in rows(pg_dsn, table)} == {1}  # no attempt was burned by waiting
    assert sorted(publisher.published) == ids
    assert 0 < highest <= budget, (highest, budget)
    assert waits and waits > 0


def test_a_full_producer_queue_is_waited_out(make_settings, store, pg_dsn, table, broker, topic_prefix):
    if hasattr(broker, "create_topic"):
        # Created beforehand: messages waiting for an automatic topic creation in a
        # 10-message queue could time out on a busy machine (the test is about the queue).
        broker.create_topic(f"{topic_prefix}.order", partitions=4)
    ids = insert_rows(pg_dsn, table, 400)
    # A 10-message local queue: produce() keeps raising BufferError for a 400-row batch.
    settings = make_settings(relay={"workers": 2}, kafka={"extra": {"queue.buffering.max.messages": "10"}})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 400, message="all rows through a tiny queue")
    finally:
        relay.stop()
    assert {r[0]: (r[1], r[2]) for r in rows(pg_dsn, table)} == dict.fromkeys(ids, ("done", 1))
    assert isinstance(relay.publisher, KafkaPublisher) and relay.publisher.local_queue_full_waits > 0


def test_ordered_claim_keeps_to_the_byte_budget_and_a_prefix_of_each_run(store, pg_dsn, table):
    # Two aggregates of four rows each, ~30 KB per row; a budget of three rows.
    ids = {agg: [] for agg in ("x", "y")}
    for _ in range(4):
        for agg in ("x", "y"):
            [row_id] = insert_rows(pg_dsn, table, 1, aggregates=1, payload_size=30_000)
            run_sql(pg_dsn, table, "UPDATE {t} SET aggregate_id = %s WHERE id = %s", (agg, row_id))
            ids[agg].append(row_id)
    size = run_sql(pg_dsn, table, "SELECT max(octet_length(payload::text)) FROM {t}")[0][0]
    claimed = store.claim(
        owner="o",
        batch=100,
        lease_seconds=30,
        max_attempts=3,
        ordered_types=["*"],
        run_length=10,
        max_batch_bytes=3 * size,
    )
    got = sorted(c.id for c in claimed.rows)
    assert len(got) == 3 and sum(c.size_bytes for c in claimed.rows) <= 3 * size
    for agg, agg_ids in ids.items():  # whatever was taken of an aggregate is its head and what follows
        taken = [i for i in agg_ids if i in got]
        assert taken == agg_ids[: len(taken)], (agg, taken)
    # A head larger than the whole budget is still claimed alone (once the first
    # claim's rows are finished: nothing behind an unfinished head is claimable).
    store.mark_done([(c.id, c.lease_version) for c in claimed.rows])
    rest = store.claim(
        owner="p", batch=100, lease_seconds=30, max_attempts=3, ordered_types=["*"], run_length=10, max_batch_bytes=1000
    )
    assert len(rest.rows) == 1


class PipeliningPublisher(SimplePublisher):
    """A SimplePublisher that lets the worker pipeline (so batches go through the Submitter)."""

    pipelines = True

    def publish(self, message: Message) -> None:
        pass


def test_a_batch_that_fails_on_the_submitter_thread_fails_its_worker_and_gives_the_bytes_back(
    make_settings, store, pg_dsn, table, monkeypatch
):
    """A bug while building a batch on the Submitter's thread surfaces in the worker that
    handed it over (the thread ends, /healthz reports it) and the batch's bytes go back to
    the process budget, as when the worker built the batch itself."""
    from outbox_relay.core.budget import ByteBudget
    from outbox_relay.observability.metrics import RelayMetrics
    from outbox_relay.runtime import worker as worker_module
    from outbox_relay.runtime.submitter import Submitter
    from outbox_relay.runtime.worker import Worker, WorkerConfig

    insert_rows(pg_dsn, table, 5)
    settings = make_settings()
    publisher = PipeliningPublisher()
    budget = ByteBudget(settings.relay.max_in_flight_bytes)
    submitter = Submitter()

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug in build_message")

    monkeypatch.setattr(worker_module, "build_message", broken)
    worker = Worker(
        0,
        store,
        publisher,
        WorkerConfig.from_settings(settings, publisher),
        RelayMetrics(),
        budget=budget,
        submitter=submitter,
    )
    try:
        with pytest.raises(RuntimeError, match="a bug in build_message"):
            worker.run()
    finally:
        submitter.close()
    assert budget.used_bytes == 0
    assert statuses(pg_dsn, table) == {"processing": 5}  # claimed, never published: the lease recovers them
