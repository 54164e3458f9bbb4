"""Broker outage (circuit breaker) and database faults, against real servers."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from outbox_relay._embedded.embedded import read_messages
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, rows, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


def test_broker_outage_opens_breaker_refunds_attempts_and_recovers(
    make_settings, store, pg_dsn, table, durable_broker, topic_prefix
):
    own_broker = durable_broker  # killed and started again on the same storage
    settings = make_settings(
        kafka={"bootstrap_servers": own_broker.bootstrap_servers},
        relay={"lease_seconds": 5, "max_attempts": 3, "backoff_base_seconds": 0.1},
    )
    relay = Relay(settings)
    relay.start()
    try:
        before = insert_rows(pg_dsn, table, 50)
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 50, message="first rows done")
        own_broker.kill()  # all brokers down
        during = insert_rows(pg_dsn, table, 100)
        wait_for(lambda: relay.breaker.is_open, timeout=60, message="breaker open")
        assert relay.metrics.registry.get_sample_value("outbox_relay_circuit_breaker_open") == 1
        ready, why = relay.readiness()
        assert not ready and "breaker" in why
        time.sleep(3 * settings.relay.lease_seconds)  # an outage longer than max_attempts leases
        assert statuses(pg_dsn, table).get("dead", 0) == 0
        own_broker.start()
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 150, timeout=120, message="all rows done")
        wait_for(lambda: not relay.breaker.is_open, timeout=30, message="breaker closed")
    finally:
        relay.stop()
    assert relay.metrics.registry.get_sample_value("outbox_relay_circuit_breaker_open") == 0
    assert relay.metrics.registry.get_sample_value("outbox_relay_released_total") >= 1
    # The outage did not burn the attempt budget: nothing came close to max_attempts.
    assert max(r[2] for r in rows(pg_dsn, table)) < settings.relay.max_attempts
    # What the broker acknowledged before it died is still there, and so is the rest.
    every_id = set(before) | set(during)
    messages = read_messages(
        own_broker.bootstrap_servers,
        [f"{topic_prefix}.order"],
        expected=len(every_id),
        timeout=60,
        stop_when=lambda out: every_id <= {int(m["headers"]["message_id"]) for m in out},
    )
    assert every_id - {int(m["headers"]["message_id"]) for m in messages} == set()


def test_terminated_backends_make_workers_reconnect(make_settings, store, pg_dsn, table, broker):
    settings = make_settings(relay={"batch_size": 20, "workers": 4})
    relay = Relay(settings)
    relay.start()
    stop = threading.Event()
    killed = [0]

    def killer() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            while not stop.is_set():
                killed[0] += conn.execute(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'outbox-relay' AND pid <> pg_backend_pid()) t"
                ).fetchone()[0]
                time.sleep(0.3)

    thread = threading.Thread(target=killer)
    try:
        thread.start()
        for _ in range(10):
            insert_rows(pg_dsn, table, 200)
            time.sleep(0.2)
        time.sleep(2)
        stop.set()
        thread.join()
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 2000, timeout=120, message="all rows done")
        healthy, _ = relay.health()
        assert healthy  # no worker died
    finally:
        stop.set()
        relay.stop()
    assert killed[0] > 0
    assert statuses(pg_dsn, table) == {"done": 2000}


def test_finalize_whose_reply_was_lost_is_not_counted_as_lost_lease(pg_dsn, table, store):
    """The first finalize commits but its connection breaks before the reply (simulated
    by a store that raises after committing); the fenced retry matches nothing, and the
    worker must recognise its own outcome instead of reporting lost leases."""
    from outbox_relay.db.store import OutboxStore
    from outbox_relay.errors import DatabaseUnavailable
    from outbox_relay.observability.metrics import RelayMetrics
    from outbox_relay.publisher import SimplePublisher
    from outbox_relay.runtime.worker import Worker, WorkerConfig

    class ReplyLostOnce(OutboxStore):
        failed = False

        def finalize(self, items, *, strict=False, durable=True):
            result = super().finalize(items, strict=strict, durable=durable)
            if not self.failed:
                self.failed = True
                raise DatabaseUnavailable("finalize done: server closed the connection unexpectedly")
            return result

    class Ok(SimplePublisher):
        def publish(self, message):
            return None

    flaky = ReplyLostOnce(pg_dsn, table, pool_size=2)
    flaky.open()
    try:
        insert_rows(pg_dsn, table, 5)
        metrics = RelayMetrics()
        cfg = WorkerConfig(
            owner="w",
            batch_size=10,
            lease_seconds=30,
            max_attempts=3,
            ordered_types=[],
            run_length=1,
            strict_lease=False,
            topic_template="t.{aggregate_type}",
            poll_interval_seconds=1,
            backoff_base_seconds=1,
            backoff_cap_seconds=5,
            publish_timeout_seconds=5,
        )
        result = Worker(0, flaky, Ok(), cfg, metrics).run_once()
    finally:
        flaky.close()
    assert flaky.failed
    assert result.done == 5 and result.lost == []
    assert metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 0
    assert statuses(pg_dsn, table) == {"done": 5}


def test_outage_batch_on_its_last_attempt_is_released_not_dead(pg_dsn, table, store):
    from outbox_relay.core.breaker import CircuitBreaker
    from outbox_relay.observability.metrics import RelayMetrics
    from outbox_relay.publisher import RetryableError, SimplePublisher
    from outbox_relay.runtime.worker import Worker, WorkerConfig

    ids = insert_rows(pg_dsn, table, 3)
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}"."{name}" SET attempts = 2')  # the next claim is the last of 3

    class Unreachable(SimplePublisher):
        def publish(self, message):
            raise RetryableError("kafka: _ALL_BROKERS_DOWN", transport=True)

    breaker = CircuitBreaker(lambda: True, initial_backoff=0.01)
    cfg = WorkerConfig(
        owner="w",
        batch_size=10,
        lease_seconds=30,
        max_attempts=3,
        ordered_types=[],
        run_length=1,
        strict_lease=False,
        topic_template="t.{aggregate_type}",
        poll_interval_seconds=1,
        backoff_base_seconds=1,
        backoff_cap_seconds=5,
        publish_timeout_seconds=5,
    )
    result = Worker(0, store, Unreachable(), cfg, RelayMetrics(), breaker=breaker).run_once()
    assert result.released == 3 and result.dead == 0
    assert breaker.opened_count == 1
    assert {(r[0], r[1], r[2]) for r in rows(pg_dsn, table)} == {(i, "pending", 2) for i in ids}


def test_database_restart_workers_reconnect_and_drain(tmp_path, broker, topic_prefix):
    """Stop and start the database under a running relay (its own server: the session's
    is shared): workers back off while it is down, reconnect, and drain what was
    written before and after the restart."""
    from outbox_relay._embedded.embedded import EmbeddedPostgres
    from outbox_relay.config import load_settings
    from outbox_relay.db.store import OutboxStore

    pg = EmbeddedPostgres().start()  # system tmp: its server user must reach the data
    try:
        with OutboxStore(pg.dsn, "outbox", pool_size=1) as setup:
            setup.migrate()
        settings = load_settings(
            None,
            database={"dsn": pg.dsn, "table": "public.outbox"},
            kafka={"bootstrap_servers": broker.bootstrap_servers, "topic_template": topic_prefix + ".{aggregate_type}"},
            relay={"workers": 4, "lease_seconds": 10, "poll_interval_seconds": 0.2},
            metrics={"enabled": False},
            log={"level": "WARNING", "format": "json"},
        )
        relay = Relay(settings)
        relay.start()
        try:
            insert_rows(pg.dsn, "public.outbox", 100)
            wait_for(lambda: statuses(pg.dsn, "public.outbox").get("done") == 100, message="first rows")
            pg.stop_server()
            time.sleep(2)  # workers hit the dead server and back off
            pg.start_server()
            insert_rows(pg.dsn, "public.outbox", 100)
            wait_for(
                lambda: statuses(pg.dsn, "public.outbox").get("done") == 200,
                timeout=120,
                message="rows written after the restart",
            )
            healthy, why = relay.health()
            assert healthy, why
        finally:
            relay.stop()
        assert statuses(pg.dsn, "public.outbox") == {"done": 200}
    finally:
        pg.stop()
