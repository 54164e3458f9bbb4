"""Many outboxes from one relay process (MultiRelay) against a real PostgreSQL and a real
broker: every source in a database of its own.

- two static sources: the rows of each reach their own topics, with per-source metrics;
- discovery: a database created while the relay runs is served once its table exists,
  a dropped one is let go;
- a source whose database is down (nothing listens at its address; another one whose
  database stops accepting connections mid-run) while the others drain, /readyz staying
  ready and naming it;
- fairness: a quiet source's lone row is claimed after at most ``workers`` claims of a
  source with a large backlog once it is known to be due, and long before that backlog
  is drained (ordering and claim counts, no wall-clock threshold).
"""

from __future__ import annotations

import gc
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from outbox_relay.config import Settings, load_settings
from outbox_relay.db.store import OutboxStore
from outbox_relay.runtime.multi import MultiRelay
from tests.helpers import sources as source_helpers
from tests.helpers.db import ON_DONE, insert_rows, rows, statuses, wait_for
from tests.helpers.sources import drop_database

databases = source_helpers.databases  # the fixture

pytestmark = pytest.mark.timeout(240)


def sources_settings(broker: Any, topic_prefix: str, sources: dict[str, dict[str, Any]], **sections: Any) -> Settings:
    merged: dict[str, Any] = {
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "topic_template": topic_prefix + ".{aggregate_type}"},
        "relay": {
            "workers": 2,
            "lease_seconds": 10,
            "poll_interval_seconds": 0.2,
            "on_done": ON_DONE,
            "shutdown_timeout_seconds": 5,
        },
        "metrics": {"enabled": True, "host": "127.0.0.1", "port": 0, "refresh_interval_seconds": 0.3},
        "log": {"level": "WARNING", "format": "json"},
        "sources": sources,
    }
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return load_settings(None, **merged)


def pending_count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'processing')").fetchone()
        return int(row[0]) if row else 0


def fetch(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list[Any]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"sources-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                got.append(msg)
        return got
    finally:
        consumer.close()


@pytest.fixture
def running() -> Iterator[Callable[[Settings], MultiRelay]]:
    relays: list[MultiRelay] = []

    def start(settings: Settings) -> MultiRelay:
        relay = MultiRelay(settings)
        relays.append(relay)
        relay.start()
        return relay

    try:
        yield start
    finally:
        for relay in relays:
            relay.stop(timeout_seconds=5)


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def test_two_static_sources_deliver_to_their_own_topics(databases, broker, topic_prefix, running):
    dsn_a, dsn_b = databases("a"), databases("b")
    settings = sources_settings(
        broker,
        topic_prefix,
        {
            "a": {"dsn": dsn_a, "topic_template": topic_prefix + ".a.{aggregate_type}"},
            "b": {"dsn": dsn_b, "topic_template": topic_prefix + ".b.{aggregate_type}"},
        },
    )
    ids_a = insert_rows(dsn_a, "outbox", 7, aggregate_type="order")
    ids_b = insert_rows(dsn_b, "outbox", 5, aggregate_type="order")
    relay = running(settings)
    wait_for(lambda: pending_count(dsn_a) == 0 and pending_count(dsn_b) == 0, timeout=60)

    got_a = read_topic(broker.bootstrap_servers, topic_prefix + ".a.order", len(ids_a))
    got_b = read_topic(broker.bootstrap_servers, topic_prefix + ".b.order", len(ids_b))
    assert sorted(int(dict(m.headers())["message_id"]) for m in got_a) == ids_a
    assert sorted(int(dict(m.headers())["message_id"]) for m in got_b) == ids_b

    port = relay.metrics_port
    assert port is not None

    def published(source: str) -> float | None:
        return metric(fetch(port, "/metrics")[1], "outbox_relay_published_total", outcome="done", source=source)

    wait_for(lambda: published("a") == 7 and published("b") == 5, timeout=20)
    # every per-outbox series carries its source; process-wide ones do not. The queue
    # gauges are NaN until the source's first refresh after start-up has answered.
    wait_for(
        lambda: metric(fetch(port, "/metrics")[1], "outbox_relay_queue_depth", status="pending", source="a") == 0,
        timeout=30,
        message="source a's queue_depth gauge refreshed to 0",
    )
    # The vacuum-health gauges of each source's table, labelled like the queue gauges.
    wait_for(
        lambda: (metric(fetch(port, "/metrics")[1], "outbox_relay_table_size_bytes", part="heap", source="b") or 0) > 0,
        timeout=30,
        message="source b's table size gauge refreshed",
    )
    text = fetch(port, "/metrics")[1]
    for source in ("a", "b"):
        assert metric(text, "outbox_relay_dead_tuples", source=source) is not None
        assert metric(text, "outbox_relay_xmin_horizon_age_seconds", source=source) is not None
        assert metric(text, "outbox_relay_table_size_bytes", part="indexes", source=source) > 0
        # each source's own statements, counted by its store
        assert metric(text, "outbox_relay_statements_total", statement="finalize", source=source) >= 1
    for unlabelled in (
        "outbox_relay_dead_tuples ",
        "outbox_relay_xmin_horizon_age_seconds ",
        "outbox_relay_last_vacuum_age_seconds ",
    ):
        assert "\n" + unlabelled not in text
    assert metric(text, "outbox_relay_source_up", source="b") == 1
    assert 'outbox_relay_queue_depth{status="pending"}' not in text
    assert "outbox_relay_in_flight_bytes " in text
    # name[] narrows a scrape to those samples, every source's and the process's alike
    narrow = fetch(port, "/metrics?name[]=outbox_relay_published_total&name[]=outbox_relay_source_up")[1]
    assert metric(narrow, "outbox_relay_published_total", outcome="done", source="a") == 7
    assert metric(narrow, "outbox_relay_published_total", outcome="done", source="b") == 5
    assert metric(narrow, "outbox_relay_source_up", source="a") == 1
    series = {line.split("{")[0].split(" ")[0] for line in narrow.splitlines() if not line.startswith("#")}
    assert series == {"outbox_relay_published_total", "outbox_relay_source_up"}, narrow
    code, body = fetch(port, "/readyz")
    assert code == 200 and "2/2 sources ready" in body


def test_discovery_serves_a_new_database_and_lets_a_dropped_one_go(databases, pg_dsn, broker, topic_prefix, running):
    first = databases("one")
    prefix = databases.prefix
    settings = sources_settings(
        broker,
        topic_prefix,
        {},
        discovery={"dsn": pg_dsn, "database_pattern": prefix + r"\_%", "refresh_interval_seconds": 0.3},
    )
    relay = running(settings)
    # As `run` does: what start-up made, and what each source makes as it opens, is
    # kept out of the cyclic collector's reach; a source let go is collected.
    relay.freeze_long_lived()
    first_name = f"{prefix}_one"
    wait_for(lambda: first_name in relay.runtimes and relay.runtimes[first_name].opened, timeout=30)
    try:
        discovery_serves_and_lets_go(relay, databases, prefix, first, pg_dsn, broker, topic_prefix)
    finally:
        gc.unfreeze()


def collected_generations_hold(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def discovery_serves_and_lets_go(relay, databases, prefix, first, pg_dsn, broker, topic_prefix):
    # A database created while the relay runs, its table made afterwards: served then.
    second = databases("two", migrate=False)
    second_name = f"{prefix}_two"
    wait_for(lambda: "does not exist" in str(relay.source_readiness().get(second_name)), timeout=30)
    with OutboxStore(second, "outbox", pool_size=1) as store:
        store.migrate(on_done=ON_DONE)
    ids = insert_rows(second, "outbox", 4, aggregate_type="tenant")
    wait_for(lambda: pending_count(second) == 0, timeout=60)
    got = read_topic(broker.bootstrap_servers, topic_prefix + ".tenant", len(ids))
    assert sorted(int(dict(m.headers())["message_id"]) for m in got) == ids
    # The source opened after start-up: its runtime, pool and workers were frozen.
    runtime = relay.runtimes[second_name]
    assert runtime.workers
    for obj in (runtime, runtime.store, *runtime.workers.values()):
        assert not collected_generations_hold(obj)

    # A database dropped while served: its source goes, the others stay, and nothing
    # of it stays in memory (collected at its removal, or a lease later).
    first_name = f"{prefix}_one"
    insert_rows(first, "outbox", 3, aggregate_type="tenant")
    wait_for(lambda: pending_count(first) == 0, timeout=60)
    # (Its pool may outlive it for a moment: psycopg_pool's threads end on their own.)
    gone = [weakref.ref(relay.runtimes[first_name]), weakref.ref(relay.runtimes[first_name].store)]
    drop_database(pg_dsn, first_name)
    wait_for(lambda: first_name not in relay.runtimes, timeout=30)
    wait_for(lambda: all(ref() is None for ref in gone), timeout=30)
    assert first_name not in relay.scheduler.names()
    port = relay.metrics_port
    assert port is not None
    text = fetch(port, "/metrics")[1]
    assert f'source="{first_name}"' not in text
    assert f'source="{second_name}"' in text
    more = insert_rows(second, "outbox", 2, aggregate_type="tenant")
    wait_for(lambda: pending_count(second) == 0, timeout=60)
    assert len(more) == 2
    assert fetch(port, "/readyz")[0] == 200


def test_a_source_whose_database_is_down_does_not_hold_up_the_others(databases, pg_dsn, broker, topic_prefix, running):
    dsn_ok, dsn_flaky = databases("ok"), databases("flaky")
    flaky_name = f"{databases.prefix}_flaky"
    settings = sources_settings(
        broker,
        topic_prefix,
        {
            "ok": {"dsn": dsn_ok},
            "flaky": {"dsn": dsn_flaky},
            # A server that is not there at all (nothing listens on port 1).
            "gone": {"dsn": "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=2"},
        },
    )
    relay = running(settings)
    insert_rows(dsn_ok, "outbox", 20)
    insert_rows(dsn_flaky, "outbox", 5)
    wait_for(lambda: pending_count(dsn_ok) == 0 and pending_count(dsn_flaky) == 0, timeout=60)
    port = relay.metrics_port
    assert port is not None
    code, body = fetch(port, "/readyz")
    assert code == 200 and "gone:" in body and "2/3 sources ready" in body

    # The flaky source's database stops accepting connections mid-run.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{flaky_name}" ALLOW_CONNECTIONS false')
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (flaky_name,))
    try:
        wait_for(lambda: relay.source_readiness().get("flaky") is not None, timeout=30)
        ids = insert_rows(dsn_ok, "outbox", 30)
        wait_for(lambda: pending_count(dsn_ok) == 0, timeout=60)
        code, body = fetch(port, "/readyz")
        assert code == 200 and "flaky:" in body and "gone:" in body and "1/3 sources ready" in body
        assert metric(fetch(port, "/metrics")[1], "outbox_relay_source_up", source="flaky") == 0
        assert len(ids) == 30
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{flaky_name}" ALLOW_CONNECTIONS true')
    # Back: the flaky source recovers by itself.
    with psycopg.connect(dsn_flaky, autocommit=True):
        pass
    insert_rows(dsn_flaky, "outbox", 3)
    wait_for(lambda: pending_count(dsn_flaky) == 0, timeout=90)
    wait_for(lambda: relay.source_readiness().get("flaky") is None, timeout=30)


def test_a_quiet_source_is_not_held_up_by_another_sources_backlog(databases, broker, topic_prefix, running):
    dsn_busy, dsn_quiet = databases("busy"), databases("quiet")
    backlog = 20_000
    with psycopg.connect(dsn_busy, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'busy', 'agg-' || (g %% 50), 'E', '{}'::jsonb FROM generate_series(1, %s) g",
            (backlog,),
        )
    workers = 2
    settings = sources_settings(
        broker,
        topic_prefix,
        {"busy": {"dsn": dsn_busy}, "quiet": {"dsn": dsn_quiet}},
        relay={"workers": workers, "batch_size": 100},
    )
    relay = MultiRelay(settings)
    # Record the scheduler's decisions (the real scheduler, observed): every claim it
    # hands out, and when the quiet source became due.
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    next_due, next_fresh, probed = relay.scheduler.next_due, relay.scheduler.next_fresh, relay.scheduler.probed

    def recording_next_due(timeout: float) -> tuple[str, int] | None:
        pick = next_due(timeout)
        if pick is not None:
            with lock:
                events.append(("claim", pick[0]))
        return pick

    def recording_next_fresh(timeout: float) -> tuple[str, int] | None:  # the lane for just-due sources
        pick = next_fresh(timeout)
        if pick is not None:
            with lock:
                events.append(("claim", pick[0]))
        return pick

    def recording_probed(name: str, *, has_work: bool, error: str | None = None) -> None:
        if has_work:
            with lock:
                events.append(("due", name))
        probed(name, has_work=has_work, error=error)

    relay.scheduler.next_due = recording_next_due  # type: ignore[method-assign]
    relay.scheduler.next_fresh = recording_next_fresh  # type: ignore[method-assign]
    relay.scheduler.probed = recording_probed  # type: ignore[method-assign]
    try:
        relay.start()
        wait_for(lambda: pending_count(dsn_busy) < backlog - 1000, timeout=60)  # the drain is under way
        [quiet_id] = insert_rows(dsn_quiet, "outbox", 1, aggregate_type="quiet")
        wait_for(lambda: pending_count(dsn_quiet) == 0, timeout=60)
        left_when_quiet_done = pending_count(dsn_busy)
    finally:
        relay.stop(timeout_seconds=5)
    # The lone row did not wait for the backlog: most of it was still there.
    assert left_when_quiet_done > 1000, left_when_quiet_done
    with lock:
        seen = list(events)
    due_at = next(i for i, e in enumerate(seen) if e == ("due", "quiet"))
    claimed_at = next(i for i, e in enumerate(seen) if e == ("claim", "quiet") and i > due_at)
    busy_claims_between = sum(1 for e in seen[due_at:claimed_at] if e == ("claim", "busy"))
    # The stated bound: at most one claim per worker of the other due source(s).
    assert busy_claims_between <= workers, seen[due_at : claimed_at + 1]
    assert quiet_id > 0


def test_startup_timeout_gives_up_when_no_source_becomes_ready(databases, broker, topic_prefix, running):
    """relay.startup_timeout_seconds with sources: the process must become ready (one
    source ready) within it, else it stops and says why; one ready source is enough."""
    from outbox_relay.errors import DatabaseUnavailable

    down = {"gone": {"dsn": "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=1"}}
    settings = sources_settings(broker, topic_prefix, down, relay={"startup_timeout_seconds": 1.5})
    relay = MultiRelay(settings)
    started = time.monotonic()
    with pytest.raises(
        DatabaseUnavailable,
        match=r"not ready within relay.startup_timeout_seconds .*database still down: "
        r"database: no source became ready .gone: cannot connect",
    ):
        relay.start()
    assert time.monotonic() - started < 30
    assert relay.wait(timeout=0)  # stopped, nothing left running

    dsn_ok = databases("ok")
    settings = sources_settings(
        broker, topic_prefix, {"ok": {"dsn": dsn_ok}, **down}, relay={"startup_timeout_seconds": 30}
    )
    relay = running(settings)
    ready, text = relay.readiness()
    assert ready and "1/2 sources ready" in text


@pytest.mark.first_pass_only
def test_one_lease_thread_extends_every_sources_slow_batches(databases, own_broker, topic_prefix, running):
    # The topic exists before the broker hangs, and the delivery timeout leaves a
    # resumed JVM broker seconds to answer: the test is about the leases.
    if hasattr(own_broker, "create_topic"):
        own_broker.create_topic(f"{topic_prefix}.order", partitions=2)
    dsns = {"a": databases("a"), "b": databases("b")}
    settings = sources_settings(
        own_broker,
        topic_prefix,
        {name: {"dsn": dsn} for name, dsn in dsns.items()},
        kafka={"delivery_timeout_seconds": 16},
        relay={"lease_seconds": 20},
    )
    relay = running(settings)
    wait_for(lambda: all(name in relay.runtimes and relay.runtimes[name].opened for name in dsns), timeout=30)
    # The sources' keepers have no thread of their own: the process's one lease thread runs them.
    assert all(runtime.keeper is not None and runtime.keeper._thread is None for runtime in relay.runtimes.values())
    assert relay._leases is not None and relay._leases._thread is not None and relay._leases._thread.is_alive()
    try:
        own_broker.pause()
        ids = {name: insert_rows(dsn, "outbox", 3) for name, dsn in dsns.items()}
        for dsn in dsns.values():
            wait_for(lambda dsn=dsn: statuses(dsn, "outbox").get("processing") == 3, message="claimed")
        first = {name: dict(rows(dsn, "outbox", "id, lease_until")) for name, dsn in dsns.items()}

        def extended(name: str) -> bool:
            now = dict(rows(dsns[name], "outbox", "id, lease_until"))
            return all(now[i] > first[name][i] for i in ids[name])

        wait_for(lambda: extended("a") and extended("b"), timeout=30, message="both sources' leases extended")
        own_broker.resume()
        for dsn in dsns.values():
            wait_for(lambda dsn=dsn: statuses(dsn, "outbox").get("done") == 3, timeout=60, message="done")
    finally:
        own_broker.resume_quietly()
    # Extended, never reclaimed: one claim each.
    for dsn in dsns.values():
        assert {r[0] for r in rows(dsn, "outbox", "lease_version")} == {1}
