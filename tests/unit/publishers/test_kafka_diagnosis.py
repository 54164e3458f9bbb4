"""What the Kafka publisher tells /readyz and the metrics about a cluster that takes no
writes, from librdkafka's reports, callbacks, statistics and the cluster's metadata."""

from __future__ import annotations

import json
from types import SimpleNamespace

from outbox_relay.publishers.kafka_diagnosis import (
    CAUSES,
    MIN_INSYNC_MEMORY_SECONDS,
    MIN_INSYNC_RETRY_SECONDS,
    KafkaDiagnosis,
    code_name_of,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stats(brokers: dict[int, str], leaders: dict[int, int], topic: str = "orders") -> str:
    """librdkafka's statistics JSON, with the fields the diagnosis reads."""
    return json.dumps(
        {
            "brokers": {
                "127.0.0.1:9092/bootstrap": {"name": "127.0.0.1:9092/bootstrap", "nodeid": -1, "state": "INIT"},
                **{
                    f"127.0.0.1:{9090 + node}/{node}": {
                        "name": f"127.0.0.1:{9090 + node}/{node}",
                        "nodeid": node,
                        "state": state,
                    }
                    for node, state in brokers.items()
                },
            },
            "topics": {
                topic: {
                    "partitions": {
                        **{str(p): {"partition": p, "leader": leader} for p, leader in leaders.items()},
                        "-1": {"partition": -1, "leader": -1},
                    }
                }
            },
        }
    )


def partitions(**by_number: tuple[int, list[int], list[int]]) -> dict[int, SimpleNamespace]:
    """Metadata of a topic's partitions: p<n>=(leader, replicas, in-sync replicas)."""
    return {
        int(name[1:]): SimpleNamespace(leader=leader, replicas=replicas, isrs=isrs)
        for name, (leader, replicas, isrs) in by_number.items()
    }


REFUSED = "127.0.0.1:9093/3: Connect to ipv4#127.0.0.1:9093 failed: Connection refused (after 0ms in state CONNECT)"


def test_nothing_known_says_nothing():
    diagnosis = KafkaDiagnosis()
    assert diagnosis.reason() is None
    assert diagnosis.unwritable_partitions() == dict.fromkeys(CAUSES, 0)
    assert not diagnosis.troubled


def test_two_brokers_down_without_quorum_names_unreachable_leaders_and_the_waiting_leader():
    """Two of three nodes SIGKILLed: the quorum is gone, the metadata still lists all three
    in sync. Partitions led by the dead nodes have an unreachable leader; the survivor's
    partition waits for its two dead in-sync replicas."""
    diagnosis = KafkaDiagnosis()
    diagnosis.client_error("_TRANSPORT", REFUSED)
    diagnosis.client_error(
        "_TRANSPORT",
        REFUSED.replace("9093/3", "9092/2")
        .replace("9093 failed", "9092 failed")
        .replace("CONNECT)", "CONNECT, 1 identical error(s) suppressed)"),
    )
    diagnosis.statistics(stats({1: "UP", 2: "CONNECT", 3: "INIT"}, {0: 2, 1: 3, 2: 1}))
    for partition in (0, 1, 2):
        diagnosis.delivery_failed("orders", partition, "_MSG_TIMED_OUT")
    diagnosis.metadata(
        "orders", partitions(p0=(2, [2, 3, 1], [2, 3, 1]), p1=(3, [3, 1, 2], [3, 1, 2]), p2=(1, [1, 2, 3], [1, 2, 3]))
    )
    reason = diagnosis.reason()
    assert reason is not None and reason.startswith("kafka: ")
    assert "orders[0]: its leader, broker 2, is unreachable" in reason
    assert "orders[1]: its leader, broker 3, is unreachable" in reason
    assert "orders[2]: its leader, broker 1, acknowledged nothing before the delivery timeout" in reason
    assert "its in-sync replicas [1, 2, 3] include unreachable brokers 2, 3" in reason
    assert reason.endswith(
        "brokers unreachable: 2 (127.0.0.1:9092/2), 3 (127.0.0.1:9093/3): "
        "Connect to ipv4#127.0.0.1:9092 failed: Connection refused"
    )
    assert diagnosis.unwritable_partitions() == {
        **dict.fromkeys(CAUSES, 0),
        "leader_unreachable": 2,
        "not_acknowledged": 1,
    }
    assert diagnosis.under_replicated("orders")  # live in-sync replicas: fewer than all
    diagnosis.min_insync("orders", 2)
    assert (
        "NOT_ENOUGH_REPLICAS on orders[2]: 1 of 3 replicas in sync and reachable (in-sync replicas [1, 2, 3], "
        "brokers 2, 3 unreachable), min.insync.replicas=2" in (diagnosis.reason() or "")
    )
    # the relay's own purge of a replaced producer says nothing of the partition
    diagnosis.delivery_failed("orders", 0, "_PURGE_QUEUE")
    assert "orders[0]: its leader, broker 2, is unreachable" in (diagnosis.reason() or "")


def test_fewer_in_sync_replicas_than_min_insync_is_named_not_enough_replicas():
    diagnosis = KafkaDiagnosis()
    diagnosis.statistics(stats({1: "UP", 2: "UP", 3: "INIT"}, {0: 1}, topic="strict"))
    diagnosis.delivery_failed("strict", 0, "_MSG_TIMED_OUT")
    diagnosis.metadata("strict", partitions(p0=(1, [1, 2, 3], [1, 2])))
    assert diagnosis.under_replicated("strict") and diagnosis.min_insync_wanted("strict")
    assert "strict[0]: its leader, broker 1, answers but acknowledged nothing" in (diagnosis.reason() or "")
    diagnosis.min_insync("strict", 3)
    assert not diagnosis.min_insync_wanted("strict")
    assert diagnosis.reason() == (
        "kafka: NOT_ENOUGH_REPLICAS on strict[0]: 2 of 3 replicas in sync, min.insync.replicas=3"
    )
    assert diagnosis.unwritable_partitions()["not_enough_replicas"] == 1


def test_a_failed_min_insync_lookup_is_tried_again_sooner_than_a_known_value_is_refreshed():
    now = [1000.0]
    diagnosis = KafkaDiagnosis(clock=lambda: now[0])
    diagnosis.min_insync("strict", None)  # asked, no answer (the node it asked is down)
    now[0] += MIN_INSYNC_RETRY_SECONDS - 1
    assert not diagnosis.min_insync_wanted("strict")
    now[0] += 2
    assert diagnosis.min_insync_wanted("strict")
    diagnosis.min_insync("strict", 3)
    now[0] += MIN_INSYNC_RETRY_SECONDS + 1
    assert not diagnosis.min_insync_wanted("strict")  # a value read is kept longer
    now[0] += MIN_INSYNC_MEMORY_SECONDS
    assert diagnosis.min_insync_wanted("strict")


def test_a_refusal_in_the_delivery_report_or_the_debug_log_is_named_as_it_is():
    diagnosis = KafkaDiagnosis()
    diagnosis.delivery_failed("a", 0, "NOT_ENOUGH_REPLICAS_AFTER_APPEND")
    assert diagnosis.reason() == "kafka: NOT_ENOUGH_REPLICAS_AFTER_APPEND on a[0]"
    # debug=msg: the refusal before the producer retries it; the later timeout keeps it
    diagnosis.debug_line(
        "[thrd:127.0.0.1:9091/1]: 127.0.0.1:9091/1: b [2]: MessageSet with 6 message(s) (MsgId 11, BaseSeq 10) "
        "encountered error: Broker: Not enough in-sync replicas (actions Retry,MsgNotPersisted)"
    )
    diagnosis.delivery_failed("b", 2, "_MSG_TIMED_OUT")
    assert "NOT_ENOUGH_REPLICAS on b[2]" in (diagnosis.reason() or "")
    # the client's own request timeout is no refusal of the broker's
    diagnosis.debug_line(
        "127.0.0.1:9091/1: c [0]: MessageSet with 6 message(s) (MsgId 11, BaseSeq 10) "
        "encountered error: Local: Timed out (actions Retry,MsgPossiblyPersisted)"
    )
    assert "c[0]" not in (diagnosis.reason() or "")
    assert diagnosis.unwritable_partitions()["not_enough_replicas"] == 2


def test_a_delivery_clears_its_partition_and_its_leader():
    clock = Clock()
    diagnosis = KafkaDiagnosis(clock)
    diagnosis.client_error("_TRANSPORT", REFUSED)
    diagnosis.statistics(stats({1: "UP", 3: "INIT"}, {0: 3}))
    diagnosis.delivery_failed("orders", 0, "_MSG_TIMED_OUT")
    assert diagnosis.troubled and "broker 3, is unreachable" in (diagnosis.reason() or "")
    assert diagnosis.delivered("orders", 0)
    assert diagnosis.reason() is None and not diagnosis.delivered("orders", 0)


def test_a_broker_back_up_in_the_statistics_is_no_longer_unreachable_and_old_failures_fade():
    clock = Clock()
    diagnosis = KafkaDiagnosis(clock)
    diagnosis.client_error("_TRANSPORT", REFUSED)
    diagnosis.client_error("_TRANSPORT", "127.0.0.1:9093/3: Disconnected: connection closed by peer")
    assert "brokers unreachable: 3" in (diagnosis.reason() or "")
    diagnosis.statistics(stats({3: "UP"}, {}))
    assert diagnosis.reason() is None
    diagnosis.delivery_failed("orders", 1, "_MSG_TIMED_OUT")
    assert diagnosis.reason() == "kafka: orders[1] has no leader"
    clock.now += 1000
    assert diagnosis.reason() is None


def test_all_brokers_down_comes_first_and_a_disconnection_alone_is_no_failure():
    diagnosis = KafkaDiagnosis()
    diagnosis.client_error("_TRANSPORT", "127.0.0.1:9093/3: Disconnected: connection closed by peer")
    assert diagnosis.reason() is None
    diagnosis.client_error("_ALL_BROKERS_DOWN", "3/3 brokers are down")
    assert diagnosis.reason() == "kafka: all brokers down (3/3 brokers are down)"
    diagnosis.statistics(stats({1: "UP"}, {}))
    assert diagnosis.reason() is None


def test_librdkafka_error_strings_map_back_to_their_names():
    assert code_name_of("Broker: Not enough in-sync replicas") == "NOT_ENOUGH_REPLICAS"
    assert code_name_of("Local: Timed out") == "_TIMED_OUT"
    assert code_name_of("something else") is None
