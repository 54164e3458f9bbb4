"""Why the Kafka cluster does not take the relay's messages, in the producer's own words.

With ``acks=all`` and an idempotent producer, librdkafka retries a broker's refusal
(NOT_ENOUGH_REPLICAS, NOT_ENOUGH_REPLICAS_AFTER_APPEND, REQUEST_TIMED_OUT, a leader it
cannot reach) inside the producer until ``message.timeout.ms``: the delivery report then
says only ``_MSG_TIMED_OUT``, and the refusal itself is written to librdkafka's debug log
at most. So the reason is put together from everything the producer does tell:

- delivery reports: the error code and the partition of every failed message (a refusal
  that reaches the report, e.g. NOT_ENOUGH_REPLICAS with ``retries`` limited, is named
  as it is);
- ``error_cb``: brokers whose connection failed (``_TRANSPORT``), ``_ALL_BROKERS_DOWN``;
- the statistics callback: every broker's connection state and every partition's leader;
- the cluster's metadata, read after delivery timeouts: the in-sync replicas of each
  partition, and the topic's ``min.insync.replicas`` when fewer replicas than all are in
  sync. A partition with fewer in-sync replicas than that refuses every ``acks=all``
  write with NOT_ENOUGH_REPLICAS: the broker's rule, stated as such;
- opt-in, librdkafka's ``debug=msg`` lines (``kafka.extra = {debug = "msg"}``), which
  carry the refusal of each produce request before it is retried.

``reason()`` is the one-line summary ``/readyz`` shows; ``unwritable_partitions()`` counts
the partitions whose messages fail, by cause, for the metrics.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError

E = KafkaError

#: How long a failed partition stays in the diagnosis without a new failure. Long enough
#: to span several delivery timeouts of one outage; a delivery to the partition clears it.
PARTITION_MEMORY_SECONDS = 120.0
#: How long a topic's ``min.insync.replicas`` is kept.
MIN_INSYNC_MEMORY_SECONDS = 60.0
#: How soon a lookup that failed (or is still running) may be tried again. Short: the
#: failure is usually the outage itself (the admin request went to a node that is down),
#: and the cluster's view of its live nodes changes within seconds.
MIN_INSYNC_RETRY_SECONDS = 10.0
#: At most this many partitions and brokers are named in one reason.
NAMED_AT_MOST = 5

#: Connection states of a broker in librdkafka's statistics in which it takes requests.
BROKER_UP_STATES = frozenset({"UP", "UPDATE"})

#: The causes ``unwritable_partitions()`` counts (the metric's ``reason`` label).
CAUSES = ("no_leader", "leader_unreachable", "not_enough_replicas", "not_acknowledged", "refused")

# librdkafka names a broker "host:port/<node id>" (or ".../bootstrap" before it knows the id).
_BROKER = re.compile(r"^(?:\[thrd:[^\]]*\]: )?(?P<name>[^\s/]+/(?P<node>\d+|bootstrap)): (?P<text>.*)$", re.S)
# librdkafka's suffix of a connection error: how long, in which state, how many suppressed.
_ERROR_SUFFIX = re.compile(r" \(after \d+ms in state .*\)$")
#: Delivery errors of the client's own making (a purge when the producer is replaced or
#: closed): they say nothing of the cluster, and keep what was known of the partition.
LIFECYCLE_CODES = frozenset({"_PURGE_QUEUE", "_PURGE_INFLIGHT", "_DESTROY"})
# The debug=msg line of a produce request that failed:
# "<broker>: <topic> [<partition>]: MessageSet with N message(s) (...) encountered error: <err2str> (actions ...)"
_MSGSET_ERROR = re.compile(
    r"(?P<topic>\S+) \[(?P<partition>-?\d+)\]: MessageSet with .*encountered error: (?P<error>.+?) \(actions"
)

_CODES_BY_TEXT: dict[str, str] = {}


def code_name_of(text: str) -> str | None:
    """The error name (``NOT_ENOUGH_REPLICAS``) of librdkafka's error string
    (``Broker: Not enough in-sync replicas``), for the codes a produce request can get."""
    if not _CODES_BY_TEXT:
        for code in (
            E.NOT_ENOUGH_REPLICAS,
            E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
            E.REQUEST_TIMED_OUT,
            E.NOT_LEADER_FOR_PARTITION,
            E.LEADER_NOT_AVAILABLE,
            E.KAFKA_STORAGE_ERROR,
            E.UNKNOWN_TOPIC_OR_PART,
            E.TOPIC_AUTHORIZATION_FAILED,
            E._TIMED_OUT,
            E._TIMED_OUT_QUEUE,
            E._TRANSPORT,
            E._MSG_TIMED_OUT,
        ):
            err = KafkaError(code)
            _CODES_BY_TEXT[err.str()] = err.name()
    return _CODES_BY_TEXT.get(text.strip())


@dataclass
class _Partition:
    code: str  # the last error name reported for it
    when: float  # monotonic
    refusal: str | None = None  # a broker's refusal seen in the debug log, if any


@dataclass
class _TopicMetadata:
    leaders: dict[int, int]
    replicas: dict[int, int]  # how many
    in_sync: dict[int, list[int]]  # node ids
    when: float


class KafkaDiagnosis:
    """Thread-safe memory of the producer's errors and of the cluster's state as the
    producer sees it. Fed from the poll thread (reports, callbacks) and the workers
    (metadata after timeouts); read by ``/readyz`` and the metrics."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._broker_failed: dict[int, tuple[float, str]] = {}  # node id -> (when, text)
        self._broker_names: dict[int, str] = {}
        self._broker_up: dict[int, bool] = {}  # from the statistics
        self._leaders: dict[tuple[str, int], int] = {}  # from the statistics
        self._all_down: str | None = None
        self._metadata: dict[str, _TopicMetadata] = {}
        self._min_insync: dict[str, tuple[float, int | None]] = {}

    # --- what the producer reports ---------------------------------------------------------
    def delivery_failed(self, topic: str, partition: int, code: str) -> None:
        if partition < 0 or code in LIFECYCLE_CODES:
            return  # never assigned to a partition, or purged by the relay itself
        with self._lock:
            known = self._partitions.get((topic, partition))
            refusal = known.refusal if known is not None else None
            self._partitions[(topic, partition)] = _Partition(code, self._clock(), refusal)

    def delivered(self, topic: str, partition: int) -> bool:
        """A message reached the partition: it takes writes again, and so does its
        leader. True if that changed what is known."""
        with self._lock:
            changed = self._partitions.pop((topic, partition), None) is not None or self._all_down is not None
            self._all_down = None
            leader = self._leaders.get((topic, partition))
            if leader is not None and self._broker_failed.pop(leader, None) is not None:
                changed = True
            return changed

    def client_error(self, code: str, text: str) -> None:
        """An ``error_cb`` error: a broker connection that failed, or all of them."""
        with self._lock:
            if code == "_ALL_BROKERS_DOWN":
                self._all_down = text
                return
            if code not in ("_TRANSPORT", "_TIMED_OUT", "_RESOLVE", "_SSL", "_AUTHENTICATION"):
                return
            match = _BROKER.match(text)
            if match is None or match["node"] == "bootstrap":
                return
            node = int(match["node"])
            self._broker_names[node] = match["name"]
            # A connection that the broker closed is not yet a broker down: librdkafka
            # reconnects at once, and reports the reconnection's failure if there is one.
            if "Disconnected" in match["text"] and code == "_TRANSPORT":
                return
            self._broker_failed[node] = (self._clock(), _ERROR_SUFFIX.sub("", match["text"].strip()))

    def debug_line(self, text: str) -> None:
        """A librdkafka ``MSGSET`` debug line (``debug=msg``): the refusal of a produce
        request the producer is about to retry."""
        match = _MSGSET_ERROR.search(text)
        if match is None:
            return
        name = code_name_of(match["error"]) or match["error"]
        if name.startswith("_") or name.startswith("Local:"):
            return  # the client's own timeout or connection loss: not the broker's refusal
        key = (match["topic"], int(match["partition"]))
        with self._lock:
            known = self._partitions.get(key)
            if known is None:
                self._partitions[key] = _Partition(name, self._clock(), name)
            else:
                known.refusal = name
                known.when = self._clock()

    def statistics(self, stats_json: str) -> None:
        """librdkafka's statistics: brokers' connection states and partitions' leaders."""
        try:
            stats = json.loads(stats_json)
        except ValueError:
            return
        brokers = stats.get("brokers") or {}
        topics = stats.get("topics") or {}
        with self._lock:
            any_up = False
            for broker in brokers.values():
                node = broker.get("nodeid", -1)
                if not isinstance(node, int) or node < 0:
                    continue
                up = broker.get("state") in BROKER_UP_STATES
                any_up = any_up or up
                self._broker_up[node] = up
                if isinstance(broker.get("name"), str):
                    self._broker_names[node] = broker["name"]
                if up:
                    self._broker_failed.pop(node, None)
            if any_up:
                self._all_down = None
            for topic, info in topics.items():
                for number, partition in (info.get("partitions") or {}).items():
                    try:
                        index = int(number)
                    except ValueError:
                        continue
                    if index >= 0 and isinstance(partition.get("leader"), int):
                        self._leaders[(topic, index)] = partition["leader"]

    def metadata(self, topic: str, partitions: Mapping[int, Any]) -> None:
        """A topic's partitions as the cluster's metadata describes them (``leader``,
        ``replicas``, ``isrs`` of confluent-kafka's PartitionMetadata)."""
        leaders = {n: int(p.leader) for n, p in partitions.items()}
        replicas = {n: len(p.replicas) for n, p in partitions.items()}
        in_sync = {n: [int(node) for node in p.isrs] for n, p in partitions.items()}
        with self._lock:
            self._metadata[topic] = _TopicMetadata(leaders, replicas, in_sync, self._clock())
            for n, leader in leaders.items():
                self._leaders.setdefault((topic, n), leader)

    @property
    def troubled(self) -> bool:
        """Anything to clear when a message is delivered (read without the lock: a hint)."""
        return bool(self._partitions or self._broker_failed or self._all_down is not None)

    def under_replicated(self, topic: str) -> bool:
        """True if a partition of ``topic`` has fewer live in-sync replicas than replicas
        (by the metadata last read, less the brokers found unreachable): only then can
        its min.insync.replicas refuse writes."""
        with self._lock:
            meta = self._metadata.get(topic)
            unreachable = self._unreachable()
            return meta is not None and any(
                len([node for node in meta.in_sync[n] if node not in unreachable]) < meta.replicas[n]
                for n in meta.in_sync
            )

    def min_insync_wanted(self, topic: str) -> bool:
        """True if ``topic``'s min.insync.replicas is unknown or due to be read again."""
        with self._lock:
            known = self._min_insync.get(topic)
        if known is None:
            return True
        kept = MIN_INSYNC_MEMORY_SECONDS if known[1] is not None else MIN_INSYNC_RETRY_SECONDS
        return self._clock() - known[0] > kept

    def min_insync(self, topic: str, value: int | None) -> None:
        """The topic's ``min.insync.replicas`` (None: it could not be read)."""
        with self._lock:
            self._min_insync[topic] = (self._clock(), value)

    # --- what it comes to ------------------------------------------------------------------
    def _forget_old(self, now: float) -> None:
        for key, known in list(self._partitions.items()):
            if now - known.when > PARTITION_MEMORY_SECONDS:
                del self._partitions[key]

    def _unreachable(self) -> dict[int, str]:
        return {node: text for node, (_, text) in self._broker_failed.items() if not self._broker_up.get(node, False)}

    def _cause(self, key: tuple[str, int], known: _Partition, unreachable: Iterable[int]) -> tuple[str, str]:
        """(cause, the partition's description) of one failed partition. The lock is held."""
        topic, number = key
        where = f"{topic}[{number}]"
        if known.refusal is not None and known.refusal != "_MSG_TIMED_OUT":
            cause = "not_enough_replicas" if known.refusal.startswith("NOT_ENOUGH_REPLICAS") else "refused"
            return cause, f"{known.refusal} on {where}"
        if known.code != "_MSG_TIMED_OUT":
            cause = "not_enough_replicas" if known.code.startswith("NOT_ENOUGH_REPLICAS") else "refused"
            return cause, f"{known.code} on {where}"
        leader = self._leaders.get(key)
        meta = self._metadata.get(topic)
        if meta is not None and number in meta.leaders:
            leader = meta.leaders[number] if leader is None else leader
        if leader is None or leader < 0:
            return "no_leader", f"{where} has no leader"
        if leader in unreachable:
            return "leader_unreachable", f"{where}: its leader, broker {leader}, is unreachable"
        min_insync = self._min_insync.get(topic, (0.0, None))[1]
        in_sync = meta.in_sync.get(number) if meta is not None else None
        if meta is not None and in_sync is not None:
            replicas = meta.replicas[number]
            live = [node for node in in_sync if node not in unreachable]
            gone = sorted(set(in_sync) - set(live))
            listed = ", ".join(str(node) for node in gone)
            if min_insync is not None and len(in_sync) < min_insync:
                # The broker's own rule: it refuses acks=all writes with NOT_ENOUGH_REPLICAS.
                return "not_enough_replicas", (
                    f"NOT_ENOUGH_REPLICAS on {where}: {len(in_sync)} of {replicas} replicas in sync, "
                    f"min.insync.replicas={min_insync}"
                )
            if min_insync is not None and len(live) < min_insync:
                # The in-sync replicas the metadata lists include brokers the producer cannot
                # reach: the leader waits for them (or, once they leave the ISR, refuses).
                return "not_enough_replicas", (
                    f"NOT_ENOUGH_REPLICAS on {where}: {len(live)} of {replicas} replicas in sync and reachable "
                    f"(in-sync replicas {sorted(in_sync)}, broker{'s' if len(gone) > 1 else ''} {listed} "
                    f"unreachable), min.insync.replicas={min_insync}"
                )
            if gone:
                return "not_acknowledged", (
                    f"{where}: its leader, broker {leader}, acknowledged nothing before the delivery timeout: "
                    f"acks=all waits for every in-sync replica, and its in-sync replicas {sorted(in_sync)} "
                    f"include unreachable broker{'s' if len(gone) > 1 else ''} {listed}"
                )
        detail = f"; {len(in_sync)} of {meta.replicas[number]} replicas in sync" if meta and in_sync else ""
        return "not_acknowledged", (
            f"{where}: its leader, broker {leader}, answers but acknowledged nothing before the delivery "
            f"timeout (acks=all waits for every in-sync replica{detail})"
        )

    def _causes(self) -> list[tuple[str, str]]:
        now = self._clock()
        self._forget_old(now)
        unreachable = self._unreachable()
        return [self._cause(key, known, unreachable) for key, known in sorted(self._partitions.items())]

    def unwritable_partitions(self) -> dict[str, int]:
        """Partitions whose last messages failed, by cause (every cause of CAUSES present)."""
        counts = dict.fromkeys(CAUSES, 0)
        with self._lock:
            for cause, _ in self._causes():
                counts[cause] += 1
        return counts

    def reason(self) -> str | None:
        """One line: why messages fail, most telling first; None when nothing is known."""
        with self._lock:
            causes = self._causes()
            unreachable = self._unreachable()
            all_down = self._all_down
            names = dict(self._broker_names)
        parts: list[str] = []
        if all_down is not None:
            parts.append(f"all brokers down ({all_down})")
        order = {cause: rank for rank, cause in enumerate(("not_enough_replicas", "refused", "no_leader"))}
        ranked = sorted(causes, key=lambda c: order.get(c[0], len(order)))
        if ranked:
            named = "; ".join(text for _, text in ranked[:NAMED_AT_MOST])
            if len(ranked) > NAMED_AT_MOST:
                named += f"; and {len(ranked) - NAMED_AT_MOST} more partitions"
            parts.append(named)
        if unreachable and all_down is None:
            nodes = sorted(unreachable)
            listed = ", ".join(f"{node} ({names.get(node, '?')})" for node in nodes[:NAMED_AT_MOST])
            parts.append(f"brokers unreachable: {listed}: {unreachable[nodes[0]]}")
        if not parts:
            return None
        return "kafka: " + "; ".join(parts)
