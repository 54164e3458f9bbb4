#!/usr/bin/env python3
"""Insert -> broker latency at a light steady load, with and without wake-ups, and
what the wake-up trigger costs the application's inserts.

Part 1, latency. For each mode a fresh table and a warm ``outbox-relay run``
subprocess; a paced writer commits single-row transactions through ``enqueue()``
(default ~200 events/s for 15 s) while a consumer (``assign`` from offset 0, no
consumer group) reads the topic. Per message:

  visible   consumer receive time - row created_at  (the message was acked by the
            broker before the consumer could fetch it: an upper bound of insert->ack)
  produced  producer CreateTime timestamp - row created_at (the relay handed it to
            the producer: a lower bound of insert->ack)

created_at is the database's now() of the inserting transaction; both clocks are
this host's. Modes:

  wake-ups on   ``outbox-relay migrate`` (installs the NOTIFY trigger), relay.listen_notify=true
  wake-ups off  ``outbox-relay migrate --no-notify-trigger``, OUTBOX_RELAY_RELAY__LISTEN_NOTIFY=false
                (workers poll: relay.poll_interval_seconds, default 1 s, jittered)

Part 2, insert cost of the trigger. Several writer threads (default 4) commit
single-row ``enqueue()`` transactions as fast as they can into a table with the
trigger and into one without it (alternating rounds, a LISTEN session attached as a
relay would be), and the throughput difference is reported in %.

    .venv/bin/python bench/latency.py
    .venv/bin/python bench/latency.py --seconds 5 --insert-seconds 4 --json
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay import enqueue
from outbox_relay.config import load_settings

DEFAULTS = load_settings(None)


# --- part 1: latency ----------------------------------------------------------------------
class TopicWatcher:
    """Consumes a topic from offset 0 in a thread; records (receive time, CreateTime) per message id."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, probe_topic: str | None = None) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-latency-{c.RUN_ID}-{topic}",  # required by librdkafka; never joined (assign)
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 5,
                "fetch.min.bytes": 1,
                "log_level": 3,
            }
        )
        assignment = [TopicPartition(topic, p, 0) for p in range(partitions)]
        if probe_topic:
            assignment.append(TopicPartition(probe_topic, 0, 0))
        self._consumer.assign(assignment)
        self.seen: dict[int, tuple[float, float | None]] = {}
        self.probes_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

        while not self._stop.is_set():
            for msg in self._consumer.consume(num_messages=500, timeout=0.05):
                now = time.time()
                if msg.error():
                    continue
                headers = dict(msg.headers() or [])
                probe = headers.get("probe")
                if probe is not None:
                    with self._lock:
                        self.probes_seen.setdefault(int(probe), now)
                    continue
                raw = headers.get("message_id")
                if raw is None:
                    continue
                kind, ts_ms = msg.timestamp()
                ts = ts_ms / 1000.0 if kind != TIMESTAMP_NOT_AVAILABLE else None
                with self._lock:
                    self.seen.setdefault(int(raw), (now, ts))

    def count(self, ids: set[int]) -> int:
        with self._lock:
            return sum(1 for i in ids if i in self.seen)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._consumer.close()


class ConsumerPathProbe:
    """Measures this broker's produce-ack -> consumer-receive delay in the same consumer.

    A producer in this process (acks=all, linger.ms=0) sends a probe message every
    ``interval`` s to a calibration topic; ack = its delivery report time. The
    watcher's receive time minus that ack is the consumer path's own delay, which
    the "visible" figure includes (tansu serves fetches of new data late and with a
    varying delay, tens of ms): reported to explain "visible", never subtracted."""

    def __init__(self, bootstrap: str, topic: str, interval: float = 0.05) -> None:
        from confluent_kafka import Producer

        self._producer = Producer(
            {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 0, "log_level": 3}
        )
        self._topic = topic
        self._interval = interval
        self.acked: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self._interval):
            n += 1
            seq = n
            self._producer.produce(
                self._topic,
                value=b"probe",
                headers=[("probe", str(seq))],
                partition=0,
                on_delivery=lambda err, _m, seq=seq: err is None and self.acked.setdefault(seq, time.time()),
            )
            self._producer.flush(5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._producer.flush(5)


def scrape_histogram(port: int, name: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of one Prometheus histogram of the relay."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    buckets: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if line.startswith(prefix):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return buckets


def histogram_quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Upper bucket bound (seconds) holding the q-quantile of the observations made between two scrapes."""
    diff = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = diff.get(float("inf"), 0.0)
    if total <= 0:
        return None
    for le in sorted(diff):
        if diff[le] >= q * total:
            return le
    return None


def _partitions(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3}).list_topics(topic, timeout=10)
    t = meta.topics.get(topic)
    return len(t.partitions) if t is not None and t.partitions else 4


def paced_writer(
    dsn: str, table: str, rate: float, seconds: float, *, payload_bytes: int, aggregates: int, start_seq: int = 0
) -> tuple[list[int], float]:
    """Single-row transactions via enqueue(), evenly paced. Returns (ids, achieved rate)."""
    ids: list[int] = []
    interval = 1.0 / rate
    with psycopg.connect(dsn) as conn:
        begin = time.monotonic()
        next_at = begin
        end = begin + seconds
        seq = start_seq
        while next_at < end:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with conn.transaction():
                ids.append(
                    int(
                        enqueue(
                            conn,
                            aggregate_type="order",
                            aggregate_id=f"agg-{seq % aggregates}",
                            event_type="OrderCreated",
                            payload=c.payload_json(seq, payload_bytes),
                            table=table,
                        )
                    )
                )
            seq += 1
            next_at += interval
        achieved = len(ids) / (time.monotonic() - begin)
    return ids, achieved


def wait_seen(watcher: TopicWatcher, ids: set[int], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = watcher.count(ids)
        if n >= len(ids):
            return n
        time.sleep(0.05)
    return watcher.count(ids)


def measure_mode(dsn: str, bootstrap: str, args: argparse.Namespace, *, wakeups: bool) -> dict[str, Any]:
    label = "on" if wakeups else "off"
    table = c.new_table(f"lat_{label}")
    topic = f"bench.{c.RUN_ID}.latency-{label}"
    probe_topic = f"bench.{c.RUN_ID}.latency-{label}-probe"
    from outbox_relay._embedded.embedded import free_port

    metrics_port = free_port()
    extra = {"OUTBOX_RELAY_METRICS__PORT": str(metrics_port), "OUTBOX_RELAY_METRICS__HOST": "127.0.0.1"}
    if not wakeups:
        extra["OUTBOX_RELAY_RELAY__LISTEN_NOTIFY"] = "false"
    env = c.relay_env(dsn, table, bootstrap, topic, **extra)
    c.run_cli(["migrate"] + ([] if wakeups else ["--no-notify-trigger"]), env)
    c.create_topic(bootstrap, topic)
    c.create_topic(bootstrap, probe_topic, partitions=1)
    relay = c.RelayProcess(["--workers", str(args.workers)], env)
    watcher = None
    probe = ConsumerPathProbe(bootstrap, probe_topic)
    hist_name = "outbox_relay_end_to_end_latency_seconds"
    hist_before: dict[float, float] = {}
    hist_after: dict[float, float] = {}
    try:
        relay.wait_started()
        c.say(f"latency, wake-ups {label}: warming up ...")
        warm_ids, _ = paced_writer(
            dsn, table, 20, 1.0, payload_bytes=args.payload_bytes, aggregates=args.aggregates, start_seq=10_000_000
        )
        with psycopg.connect(dsn, autocommit=True) as poll:
            c.wait_drained(poll, table, timeout=60, interval=0.05)
        watcher = TopicWatcher(bootstrap, topic, _partitions(bootstrap, topic), probe_topic)
        if wait_seen(watcher, set(warm_ids), 30) < len(warm_ids):
            raise RuntimeError("warm-up messages did not arrive on the topic")
        probe.start()
        with contextlib.suppress(OSError):
            hist_before = scrape_histogram(metrics_port, hist_name)
        c.say(f"latency, wake-ups {label}: {args.rate:g} events/s for {args.seconds:g}s ...")
        ids, achieved = paced_writer(
            dsn, table, args.rate, args.seconds, payload_bytes=args.payload_bytes, aggregates=args.aggregates
        )
        seen = wait_seen(watcher, set(ids), 60)
        with contextlib.suppress(OSError):
            hist_after = scrape_histogram(metrics_port, hist_name)
    finally:
        probe.stop()
        time.sleep(0.3)
        if watcher is not None:
            watcher.close()
        code = relay.stop()
    with psycopg.connect(dsn, autocommit=True) as conn:
        times = conn.execute(
            sql.SQL(
                "SELECT id, extract(epoch FROM created_at)::float8,"
                " extract(epoch FROM done_at - created_at)::float8 * 1000 FROM {} WHERE id = ANY(%s)"
            ).format(c.ident(table)),
            (ids,),
        ).fetchall()
    created = {i: t for i, t, _ in times}
    finalized_ms = [d for _, _, d in times if d is not None]
    visible_ms = [(watcher.seen[i][0] - created[i]) * 1000 for i in ids if i in watcher.seen]
    produced_ms = [
        (watcher.seen[i][1] - created[i]) * 1000 for i in ids if i in watcher.seen and watcher.seen[i][1] is not None
    ]
    consumer_path_ms = [(watcher.probes_seen[k] - t) * 1000 for k, t in probe.acked.items() if k in watcher.probes_seen]
    hist_p50 = histogram_quantile_bound(hist_before, hist_after, 0.5) if hist_after else None
    hist_p99 = histogram_quantile_bound(hist_before, hist_after, 0.99) if hist_after else None
    depth = c.count_by_status(dsn, table)
    problems = []
    if seen != len(ids):
        problems.append(f"only {seen}/{len(ids)} messages arrived")
    if code != 0:
        problems.append(f"relay exited {code}")
    if not args.keep:
        c.drop_schema(dsn, table)
    relay.cleanup()

    def summary(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
        return {
            "p50_ms": round(c.pct(values, 50), 2),
            "p90_ms": round(c.pct(values, 90), 2),
            "p99_ms": round(c.pct(values, 99), 2),
            "max_ms": round(max(values), 2),
        }

    result = {
        "wakeups": wakeups,
        "events": len(ids),
        "rate_per_second": round(achieved, 1),
        "received": seen,
        "rows": depth,
        "visible": summary(visible_ms),
        "produced": summary(produced_ms),
        # done_at - created_at: the relay finalizes a row only after its delivery report,
        # so this bounds insert->ack from above, on the database clock alone
        "finalized": summary(finalized_ms),
        "consumer_path_delay": summary(consumer_path_ms),
        # the relay's own created_at -> delivery report histogram: bucket bounds holding p50/p99
        "relay_histogram_p50_le_ms": None if hist_p50 is None else hist_p50 * 1000,
        "relay_histogram_p99_le_ms": None if hist_p99 is None else hist_p99 * 1000,
        "ok": not problems,
        "problems": problems,
    }
    c.say(
        f"    wake-ups {label}: visible p50 {result['visible']['p50_ms']} ms, p99 {result['visible']['p99_ms']} ms; "
        f"finalized p50 {result['finalized']['p50_ms']} ms"
    )
    return result


# --- part 2: insert cost of the NOTIFY trigger ----------------------------------------------
def insert_round(dsn: str, table: str, writers: int, seconds: float, payload_bytes: int, aggregates: int) -> int:
    conns = [psycopg.connect(dsn) for _ in range(writers)]
    counts = [0] * writers
    start = threading.Barrier(writers + 1)
    stop_at = [0.0]

    def write(i: int) -> None:
        conn = conns[i]
        payload = c.payload_json(i, payload_bytes)
        start.wait()
        n = 0
        while time.monotonic() < stop_at[0]:
            with conn.transaction():
                enqueue(
                    conn,
                    aggregate_type="order",
                    aggregate_id=f"agg-{(i * 7919 + n) % aggregates}",
                    event_type="OrderCreated",
                    payload=payload,
                    table=table,
                )
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    stop_at[0] = time.monotonic() + seconds
    start.wait()
    for t in threads:
        t.join()
    for conn in conns:
        conn.close()
    return sum(counts)


class RelayFlagEmulator:
    """What a running relay does to the idle flag, without the relay's CPU load (which
    on this 2-core machine would compete with the writers): its listener clears the
    flag when a notification arrives, and a worker that finds nothing to claim sets it
    again — here every ``idle_every`` seconds, i.e. a relay that drains each burst at
    once and goes idle again."""

    def __init__(self, dsn: str, table: str, idle_every: float) -> None:
        from outbox_relay.db.schema import TableSql

        self._sql = TableSql(table)
        self._listen = psycopg.connect(dsn, autocommit=True)
        self._listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._sql.channel)))
        self._marker = psycopg.connect(dsn, autocommit=True)
        self._idle_every = idle_every
        self.received = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._listen_loop, daemon=True),
            threading.Thread(target=self._idle_loop, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _listen_loop(self) -> None:
        while not self._stop.is_set():
            got = list(self._listen.notifies(timeout=0.2, stop_after=1))
            if got:
                self.received += len(got)
                self._listen.execute(self._sql.query("mark_busy"))

    def _idle_loop(self) -> None:
        while not self._stop.wait(self._idle_every):
            self._marker.execute(self._sql.query("mark_idle"))

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._listen.close()
        self._marker.close()


class Listener:
    """A LISTEN session draining notifications, as a running relay's listener would."""

    def __init__(self, dsn: str, channel: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in self._conn.notifies(timeout=0.2):
                self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._conn.close()


def measure_insert_cost(dsn: str, bootstrap: str, args: argparse.Namespace) -> dict[str, Any]:
    """The application's insert throughput with and without the NOTIFY trigger,
    alternating rounds, nothing else running (on this 2-core machine a relay draining
    the table would compete with the writers for CPU and blur what the trigger costs):

    - no_trigger: ``migrate --no-notify-trigger``;
    - trigger_relays_busy: the trigger, relays busy (idle flag false): the trigger
      only reads the flag — the normal case under load;
    - trigger_relay_running: the trigger with the flag driven as a running relay drives
      it (RelayFlagEmulator: cleared on each notification, set again every
      --idle-every-ms by a worker that found nothing) — the steady state in production;
    - trigger_relays_idle: the trigger with the idle flag set and a LISTEN session
      attached, so every insert NOTIFYs — the worst case, and what a plain
      per-statement NOTIFY trigger would cost.
    """
    from outbox_relay.db.schema import TableSql

    del bootstrap
    tables = {
        "no_trigger": c.new_table("ins_notrg"),
        "trigger_relays_busy": c.new_table("ins_busy"),
        "trigger_relay_running": c.new_table("ins_run"),
        "trigger_relays_idle": c.new_table("ins_idle"),
    }
    c.migrate(dsn, tables["no_trigger"], notify_trigger=False)
    c.migrate(dsn, tables["trigger_relays_busy"], notify_trigger=True)
    c.migrate(dsn, tables["trigger_relay_running"], notify_trigger=True)
    c.migrate(dsn, tables["trigger_relays_idle"], notify_trigger=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TableSql(tables["trigger_relays_busy"]).query("mark_busy"))
        conn.execute(TableSql(tables["trigger_relays_idle"]).query("mark_idle"))
    listener = Listener(dsn, TableSql(tables["trigger_relays_idle"]).channel)
    emulator = RelayFlagEmulator(dsn, tables["trigger_relay_running"], args.idle_every_ms / 1000)
    totals = dict.fromkeys(tables, 0)
    per_round = args.insert_seconds / args.insert_rounds
    try:
        keys = list(tables)
        for r in range(args.insert_rounds):
            order = keys if r % 2 == 0 else list(reversed(keys))
            for key in order:
                c.checkpoint(dsn)
                c.say(
                    f"insert cost: round {r + 1}/{args.insert_rounds}, {key}, {args.writers} writers, "
                    f"{per_round:g}s ..."
                )
                totals[key] += insert_round(
                    dsn, tables[key], args.writers, per_round, args.payload_bytes, args.aggregates
                )
    finally:
        listener.close()
        emulator.close()
    seconds = per_round * args.insert_rounds
    rates = {k: v / seconds for k, v in totals.items()}

    def cost(key: str) -> float:
        base = rates["no_trigger"]
        return round((1 - rates[key] / base) * 100, 1) if base else float("nan")

    if not args.keep:
        for table in tables.values():
            c.drop_schema(dsn, table)
    return {
        "writers": args.writers,
        "seconds_each": seconds,
        "rounds": args.insert_rounds,
        "inserts_per_second_without_trigger": round(rates["no_trigger"], 1),
        "inserts_per_second_with_trigger": round(rates["trigger_relays_busy"], 1),
        "inserts_per_second_trigger_relays_idle": round(rates["trigger_relays_idle"], 1),
        "inserts_per_second_trigger_relay_running": round(rates["trigger_relay_running"], 1),
        "notifications_received_relay_running": emulator.received,
        "cost_percent_relay_running": cost("trigger_relay_running"),
        "notifications_received_relays_idle": listener.received,
        "cost_percent": cost("trigger_relays_busy"),
        "cost_percent_relays_idle": cost("trigger_relays_idle"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    c.add_server_args(parser)
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the paced writer (default 200)")
    parser.add_argument("--seconds", type=float, default=15.0, help="duration of each latency run (default 15)")
    parser.add_argument("--workers", type=int, default=4, help="relay --workers (default 4)")
    parser.add_argument("--aggregates", type=int, default=100)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--writers", type=int, default=4, help="concurrent writers for the insert cost (default 4)")
    parser.add_argument(
        "--insert-seconds", type=float, default=10.0, help="total insert time per configuration (default 10)"
    )
    parser.add_argument(
        "--insert-rounds", type=int, default=2, help="alternating rounds the insert time is split into (default 2)"
    )
    parser.add_argument(
        "--idle-every-ms",
        type=float,
        default=100.0,
        help="insert cost: how often the emulated relay marks itself idle (default 100)",
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-insert-cost", action="store_true")
    parser.add_argument("--target-p50-ms", type=float, default=20.0)
    parser.add_argument("--target-cost-percent", type=float, default=10.0)
    args = parser.parse_args()

    report: dict[str, Any] = {
        "benchmark": "latency",
        "rate": args.rate,
        "seconds": args.seconds,
        "relay_workers": args.workers,
        "poll_interval_seconds": DEFAULTS.relay.poll_interval_seconds,
        "broker": c.broker_label(args),
    }
    with c.servers(args) as (dsn, bootstrap):
        report["postgresql"] = c.server_version(dsn)
        if not args.skip_latency:
            assert bootstrap is not None
            report["wakeups_on"] = measure_mode(dsn, bootstrap, args, wakeups=True)
            report["wakeups_off"] = measure_mode(dsn, bootstrap, args, wakeups=False)
        if not args.skip_insert_cost:
            assert bootstrap is not None
            report["insert_cost"] = measure_insert_cost(dsn, bootstrap, args)

    targets = {}
    lines = [
        f"latency: insert -> broker, {args.rate:g} events/s single-row enqueue() transactions for "
        f"{args.seconds:g}s, relay --workers {args.workers}, PostgreSQL {report['postgresql']}, "
        f"broker {report['broker']}"
    ]
    ok = True
    if not args.skip_latency:
        lines.append(f"  {'':<17}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}   (ms after the row's created_at)")
        for key in ("wakeups_on", "wakeups_off"):
            m = report[key]
            ok &= m["ok"]
            check = f"{m['received']}/{m['events']} received" if m["ok"] else "FAILED: " + "; ".join(m["problems"])
            lines.append(
                f"  wake-ups {('on' if m['wakeups'] else 'off')}: {m['rate_per_second']:.0f} events/s, "
                f"{check}; relay's own histogram: p50 <= {m['relay_histogram_p50_le_ms']} ms, "
                f"p99 <= {m['relay_histogram_p99_le_ms']} ms"
            )
            for name in ("produced", "finalized", "visible"):
                v = m[name]
                lines.append(f"    {name:<15}{v['p50_ms']!s:>9}{v['p90_ms']!s:>9}{v['p99_ms']!s:>9}{v['max_ms']!s:>9}")
            d = m["consumer_path_delay"]
            lines.append(
                f"    (this broker's ack -> consumer receive delay, probe messages: p50 {d['p50_ms']} ms, "
                f"p99 {d['p99_ms']} ms)"
            )
        lines.append("  produced  = producer CreateTime - created_at: handed to the producer (lower bound of ack)")
        lines.append("  finalized = done_at - created_at: row finalized after its delivery report (upper bound of ack)")
        lines.append("  visible   = consumer receive - created_at: includes the broker's fetch delay (see probes)")
        p50 = report["wakeups_on"]["finalized"]["p50_ms"]
        targets["p50_with_wakeups"] = {
            "target": f"<= {args.target_p50_ms:g} ms",
            "value": p50,
            "met": p50 is not None and p50 <= args.target_p50_ms,
        }
    if not args.skip_insert_cost:
        ic = report["insert_cost"]
        lines.append(
            f"  insert throughput, {ic['writers']} writers, single-row transactions, "
            f"{ic['seconds_each']:g}s each: without trigger {ic['inserts_per_second_without_trigger']:,.0f}/s; "
            f"with trigger, relays busy {ic['inserts_per_second_with_trigger']:,.0f}/s "
            f"(cost {ic['cost_percent']}%); relay running (flag re-armed every {args.idle_every_ms:g} ms) "
            f"{ic['inserts_per_second_trigger_relay_running']:,.0f}/s (cost {ic['cost_percent_relay_running']}%, "
            f"{ic['notifications_received_relay_running']} notifications); relays idle, every insert notifies "
            f"{ic['inserts_per_second_trigger_relays_idle']:,.0f}/s (cost {ic['cost_percent_relays_idle']}%)"
        )
        # The target applies to the state a relay is in while writers insert at full
        # speed (busy: its claims keep finding rows, so it never marks itself idle);
        # the re-armed and always-notify cases are reported beside it.
        steady = ic["cost_percent"]
        targets["trigger_insert_cost"] = {
            "target": f"<= {args.target_cost_percent:g}%",
            "value": steady,
            "met": steady <= args.target_cost_percent,
        }
    for key, t in targets.items():
        lines.append(f"  {key:<22} {t['value']!s:>8}   target {t['target']:<9} {'met' if t['met'] else 'NOT MET'}")
    report["targets"] = targets
    report["correct"] = ok
    c.emit(report, lines, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
