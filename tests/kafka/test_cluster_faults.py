"""What only a replicated Apache Kafka cluster shows: leader failover and lost quorum.

Three nodes (replication factor 3, ``min.insync.replicas=2``), started once for the
module. The relay runs in process with its defaults (idempotent producer, acks=all).

- The partition leader is killed (SIGKILL) mid-drain, or shut down in a controlled way
  (SIGTERM): a follower takes over, every row is delivered, none goes dead; the
  duplicates the failover caused are counted (printed, and kept as test properties).
- A topic with ``min.insync.replicas=3`` and one node down, and two of three nodes
  down: no write can reach enough in-sync replicas. Rows wait (released
  with their attempt refunded, never ``dead``), ``/readyz`` (over HTTP) says why the
  cluster cannot take them, ``/metrics`` counts the producer's errors by code and the
  partitions it cannot write by cause, and the circuit-breaker gauge is 1; once the nodes
  return, everything is delivered.
"""

from __future__ import annotations

import collections
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox_relay._embedded.embedded import read_messages
from outbox_relay._embedded.kafka import KafkaCluster
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, statuses, wait_for
from tests.kafka.conftest import heal, sample, wait_in_sync

pytestmark = [pytest.mark.first_pass_only, pytest.mark.kafka_cluster, pytest.mark.timeout(600)]

ROWS = 3000
PARTITIONS = 3
METRICS = {"enabled": True, "host": "127.0.0.1", "port": 0}


def _relay_on(
    cluster: KafkaCluster,
    make_settings: Callable[..., Any],
    topic: str,
    kafka: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    **relay: Any,
) -> Relay:
    settings = make_settings(
        kafka={"bootstrap_servers": cluster.bootstrap_servers, "topic_template": topic, **(kafka or {})},
        relay={"workers": 4, "batch_size": 100, "max_attempts": 5, **relay},
        metrics=metrics or {"enabled": False},
    )
    return Relay(settings)


def _http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=15) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class OutageWatch:
    """What ``/readyz`` and ``/metrics`` said over HTTP while the cluster could not take writes."""

    def __init__(self, relay: Relay) -> None:
        port = relay.metrics_port
        assert port is not None, "the relay serves no /readyz"
        self._port = port
        self.reasons: set[str] = set()
        self.breaker_seen = False
        self.unwritable: collections.Counter[str] = collections.Counter()  # cause -> most partitions seen at once
        self.errors: dict[tuple[str, str], float] = {}  # (source, code) -> count

    def look(self) -> None:
        status, body = _http_get(self._port, "/readyz")
        if status == 503:
            self.reasons.add(body.strip())
        status, text = _http_get(self._port, "/metrics")
        assert status == 200, text
        for family in text_string_to_metric_families(text):
            for one in family.samples:
                self._note(one.name, one.labels, one.value)

    def _note(self, name: str, named: dict[str, str], value: float) -> None:
        if name == "outbox_relay_circuit_breaker_open" and value == 1:
            self.breaker_seen = True
        elif name == "outbox_relay_unwritable_partitions":
            cause = named["cause"]
            self.unwritable[cause] = max(self.unwritable[cause], int(value))
        elif name == "outbox_relay_producer_errors_total":
            self.errors[(named["reported_by"], named["code"])] = value

    def said(self, pattern: str) -> list[str]:
        return [reason for reason in self.reasons if re.search(pattern, reason)]


def _read_back(cluster: KafkaCluster, topic: str, ids: list[int]) -> collections.Counter[int]:
    wanted = set(ids)
    # ``expected`` counts messages, duplicates included: stop on the ids instead.
    messages = read_messages(
        cluster.bootstrap_servers,
        [topic],
        expected=10 * len(ids),
        timeout=120,
        partitions=PARTITIONS,
        stop_when=lambda out: wanted <= {int(m["headers"]["message_id"]) for m in out},
    )
    return collections.Counter(int(m["headers"]["message_id"]) for m in messages)


def _drain_through(
    cluster: KafkaCluster,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic: str,
    fault: Callable[[], None],
    record_property: Callable[[str, object], None],
) -> None:
    """Start a drain of ROWS rows, apply ``fault`` once a tenth is delivered, then check
    that everything arrived, nothing died, and count the duplicates."""
    cluster.create_topic(topic, partitions=PARTITIONS)
    ids = insert_rows(pg_dsn, table, ROWS, aggregates=50)
    relay = _relay_on(cluster, make_settings, topic)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done", 0) >= ROWS // 10, timeout=120, message="a tenth delivered")
        fault_at = time.monotonic()
        fault()
        wait_for(
            lambda: statuses(pg_dsn, table).get("done", 0) == ROWS,
            timeout=240,
            interval=0.2,
            message="every row delivered after the fault",
        )
        recovery_seconds = time.monotonic() - fault_at
    finally:
        relay.stop()
    assert statuses(pg_dsn, table) == {"done": ROWS}
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    heal(cluster, topic)  # read with every replica back in sync
    seen = _read_back(cluster, topic, ids)
    missing = sorted(set(ids) - set(seen))
    assert missing == [], f"{len(missing)} rows acknowledged by the cluster are missing, e.g. {missing[:20]}"
    duplicates = sum(count - 1 for count in seen.values())
    record_property("duplicates", duplicates)
    record_property("seconds_from_fault_to_all_delivered", round(recovery_seconds, 1))
    print(
        f"\n[kafka] {ROWS} rows: {duplicates} duplicates; all delivered {recovery_seconds:.1f}s after the fault; "
        f"retries {sample(relay, 'outbox_relay_published_total', {'outcome': 'retry'}):.0f}, "
        f"released {sample(relay, 'outbox_relay_released_total'):.0f}"
    )


def test_partition_leader_killed_mid_drain(cluster, make_settings, store, pg_dsn, table, topic_prefix, record_property):
    topic = f"{topic_prefix}.killed-leader"

    def kill_leader() -> None:
        cluster.leader_of(topic, 0).kill()

    try:
        _drain_through(cluster, make_settings, pg_dsn, table, topic, kill_leader, record_property)
    finally:
        heal(cluster, topic)


def test_partition_leader_shut_down_mid_drain(
    cluster, make_settings, store, pg_dsn, table, topic_prefix, record_property
):
    topic = f"{topic_prefix}.stopped-leader"

    def stop_leader() -> None:
        cluster.leader_of(topic, 0).stop()  # SIGTERM: controlled shutdown moves leadership first

    try:
        _drain_through(cluster, make_settings, pg_dsn, table, topic, stop_leader, record_property)
    finally:
        heal(cluster, topic)


def test_two_of_three_nodes_down_rows_wait_then_all_delivered(
    cluster, make_settings, store, pg_dsn, table, topic_prefix, record_property
):
    topic = f"{topic_prefix}.no-quorum"
    cluster.create_topic(topic, partitions=PARTITIONS)
    # A short delivery timeout so the outage shows within seconds (until then the
    # producer retries NOT_ENOUGH_REPLICAS and unreachable leaders itself).
    relay = _relay_on(
        cluster,
        make_settings,
        topic,
        kafka={"delivery_timeout_seconds": 8},
        metrics=METRICS,
        backoff_base_seconds=0.2,
        backoff_cap_seconds=2,
    )
    relay.start()
    watch = OutageWatch(relay)
    down = cluster.nodes[1:]
    down_ids = {node.node_id for node in down}
    try:
        first = insert_rows(pg_dsn, table, 200)
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 200, timeout=120, message="first rows delivered")
        for node in down:
            node.kill()
        down_at = time.monotonic()
        second = insert_rows(pg_dsn, table, 300)
        # Long enough for several delivery timeouts: rows must keep waiting, not die.
        while time.monotonic() - down_at < 45:
            watch.look()
            assert statuses(pg_dsn, table).get("dead", 0) == 0
            time.sleep(0.5)
        waiting = statuses(pg_dsn, table)
        assert waiting.get("done", 0) < 500 and waiting.get("dead", 0) == 0, waiting
        assert watch.reasons, "readiness never reported the outage"
        assert watch.breaker_seen, "the circuit breaker gauge never showed the outage"
        # Why: the controller quorum is gone with the two nodes, so no ISR shrinks and no
        # leader moves. The partitions they led have an unreachable leader; the one the
        # survivor leads takes the write and waits for the two dead in-sync replicas.
        leaders_down = "|".join(str(node) for node in sorted(down_ids))
        assert watch.said(rf"kafka: .*{re.escape(topic)}\[\d\]: its leader, broker ({leaders_down}), is unreachable"), (
            watch.reasons
        )
        assert watch.said(r"brokers unreachable: "), watch.reasons
        # The survivor's partition: its ISR still lists the dead nodes (no controller to
        # shrink it); named NOT_ENOUGH_REPLICAS once the topic's min.insync.replicas was
        # read (the survivor answers DescribeConfigs, or not without the controller).
        survivor = cluster.nodes[0].node_id
        assert watch.said(
            rf"NOT_ENOUGH_REPLICAS on {re.escape(topic)}\[\d\]: 1 of 3 replicas in sync and reachable"
            rf"|{re.escape(topic)}\[\d\]: its leader, broker {survivor}, acknowledged nothing"
        ), watch.reasons
        assert watch.unwritable["refused"] == 0, watch.unwritable
        assert watch.unwritable["leader_unreachable"] >= 1, watch.unwritable
        assert watch.errors.get(("delivery", "_MSG_TIMED_OUT"), 0) > 0, watch.errors
        assert watch.errors.get(("client", "_TRANSPORT"), 0) > 0, watch.errors
        restarted_at = time.monotonic()
        heal(cluster)
        wait_for(
            lambda: statuses(pg_dsn, table).get("done") == 500,
            timeout=240,
            interval=0.2,
            message="every row delivered after the nodes returned",
        )
        catch_up_seconds = time.monotonic() - restarted_at
    finally:
        relay.stop()
        heal(cluster)
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    seen = _read_back(cluster, topic, first + second)
    assert set(first + second) - set(seen) == set()
    assert sample(relay, "outbox_relay_unwritable_partitions", {"cause": "leader_unreachable"}) == 0
    record_property("readiness_reasons", sorted(watch.reasons))
    record_property("producer_errors", sorted(watch.errors.items()))
    record_property("seconds_from_restart_to_all_delivered", round(catch_up_seconds, 1))
    print(
        f"\n[kafka] two nodes down: /readyz said {sorted(watch.reasons)}; "
        f"producer errors {sorted(watch.errors.items())}; "
        f"unwritable partitions (most at once) {dict(watch.unwritable)}; released "
        f"{sample(relay, 'outbox_relay_released_total'):.0f}; all delivered {catch_up_seconds:.1f}s after the "
        f"nodes were started again"
    )
    wait_in_sync(cluster, topic)


def test_topic_requiring_more_in_sync_replicas_than_are_live_holds_rows_until_one_returns(
    cluster, make_settings, store, pg_dsn, table, topic_prefix, record_property
):
    """``min.insync.replicas=3`` on a topic of three replicas, one node down: every
    write is refused with NOT_ENOUGH_REPLICAS (the producer retries it until its
    delivery timeout). Rows wait, none dead; all delivered when the node returns."""
    topic = f"{topic_prefix}.strict-isr"
    cluster.create_topic(topic, partitions=1, config={"min.insync.replicas": 3})
    relay = _relay_on(
        cluster,
        make_settings,
        topic,
        kafka={"delivery_timeout_seconds": 8},
        metrics=METRICS,
        backoff_base_seconds=0.2,
        backoff_cap_seconds=2,
    )
    down = cluster.nodes[2]
    relay.start()
    watch = OutageWatch(relay)
    try:
        down.kill()
        ids = insert_rows(pg_dsn, table, 100)
        down_at = time.monotonic()
        # Until the controller fences the node (its session times out) the ISR still has
        # it and writes wait for it; then the ISR shrinks to 2 and the leader refuses them.
        while time.monotonic() - down_at < 30 or (
            not watch.said("NOT_ENOUGH_REPLICAS") and time.monotonic() - down_at < 90
        ):
            watch.look()
            assert statuses(pg_dsn, table).get("dead", 0) == 0
            time.sleep(0.5)
        assert statuses(pg_dsn, table).get("done", 0) == 0, "a write was acknowledged without 3 in-sync replicas"
        assert watch.reasons, "readiness never reported the refused writes"
        assert watch.said(
            rf"kafka: NOT_ENOUGH_REPLICAS on {re.escape(topic)}\[0\]: 2 of 3 replicas in sync, min.insync.replicas=3"
        ), watch.reasons
        assert watch.unwritable["not_enough_replicas"] == 1, watch.unwritable
        assert watch.errors.get(("delivery", "_MSG_TIMED_OUT"), 0) > 0, watch.errors
        healed_at = time.monotonic()
        heal(cluster)
        wait_for(
            lambda: statuses(pg_dsn, table).get("done") == 100,
            timeout=240,
            interval=0.2,
            message="every row delivered once three replicas are in sync",
        )
        catch_up_seconds = time.monotonic() - healed_at
    finally:
        relay.stop()
        heal(cluster)
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    assert set(ids) - set(_read_back(cluster, topic, ids)) == set()
    record_property("readiness_reasons", sorted(watch.reasons))
    record_property("producer_errors", sorted(watch.errors.items()))
    record_property("seconds_from_restart_to_all_delivered", round(catch_up_seconds, 1))
    print(
        f"\n[kafka] min.insync.replicas=3 with a node down: /readyz said {sorted(watch.reasons)}; producer errors "
        f"{sorted(watch.errors.items())}; all delivered "
        f"{catch_up_seconds:.1f}s after the node was started again"
    )
