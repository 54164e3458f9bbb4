#!/usr/bin/env python3
"""Soak: a steady writer, two relays, a fault every minute; is anything lost, stuck or leaking?

A writer commits events at a steady rate (default 1 000 events/s, in 10 transactions
a second) for ``--minutes`` (default 10). Two ``outbox-relay run`` processes drain
them into the embedded tansu broker, which stores on S3 (a local object store), so a
broker restart keeps every message it acknowledged. Every ``--fault-every`` seconds
(default 60) one fault strikes, in turn:

  relay-kill       SIGKILL relay B and start it again at once (an orchestrator restart)
  broker-restart   SIGKILL the broker, 3 s down, start it again on the same storage
  db-terminate     pg_terminate_backend() of every relay backend

Relay A is never killed: its RSS and open sockets are sampled every ``--sample-every``
seconds (default 10) with the oldest pending age and the backlog. At the end: every id
must have reached the broker (topic read back), none is pending/processing/dead, and
relay A's RSS and sockets must be flat over the second half (least-squares slope:
the change it projects over the second half within max(3 x residual stddev, 5 %)).
Delivery is checked by a consumer that reads the topic from offset 0 all along (every
id must arrive, through the broker restarts), and after the last fault the oldest
messages are read again from offset 0 (still there after every restart).
A PNG plot (matplotlib, the ``bench`` extra) of RSS, backlog age and faults over time
goes to ``docs/images/soak.png`` (``--plot``), shown on the benchmark results page.

    .venv/bin/python bench/soak.py                   # 10 minutes (~12 with the drain and read-back)
    .venv/bin/python bench/soak.py --short           # 1 minute, a fault every 15 s, sampled every 5 s
    .venv/bin/python bench/soak.py --dsn postgresql://postgres@127.0.0.1:5432/test --json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedObjectStore, EmbeddedPostgres

FAULTS = ("relay-kill", "broker-restart", "db-terminate")
PARTITIONS = 4
OLDEST_CHECKED = 2000
BROKER_DOWN_SECONDS = 3.0


# --- the writer ------------------------------------------------------------------------
class SteadyWriter(threading.Thread):
    """``rate`` events/s as ``ticks_per_second`` transactions a second, through enqueue().
    A failed transaction is retried on a new connection (nothing it held was committed)."""

    def __init__(self, dsn: str, table: str, rate: float, seconds: float, ticks_per_second: int = 10) -> None:
        super().__init__(name="writer", daemon=True)
        self.dsn, self.table, self.rate, self.seconds = dsn, table, rate, seconds
        self.ticks_per_second = ticks_per_second
        self.written = 0
        self.failed_transactions = 0
        self.behind_ticks = 0  # ticks that started late (the writer could not keep up)
        self.stop = threading.Event()
        self.elapsed_seconds = 0.0

    def run(self) -> None:
        per_tick = self.rate / self.ticks_per_second
        interval = 1.0 / self.ticks_per_second
        conn: psycopg.Connection[Any] | None = None
        begin = time.monotonic()
        owed = 0.0
        tick = 0
        while not self.stop.is_set():
            due = begin + tick * interval
            if due - begin >= self.seconds:
                break
            delay = due - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            elif delay < -interval:
                self.behind_ticks += 1
            owed += per_tick
            count = int(owed)
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, application_name="soak-writer")
                with conn.transaction():
                    for i in range(count):
                        seq = self.written + i
                        enqueue(
                            conn,
                            aggregate_type="order",
                            aggregate_id=f"agg-{seq % 500}",
                            event_type="OrderCreated",
                            payload={"seq": seq, "note": "x" * 100},
                            table=self.table,
                        )
                self.written += count
                owed -= count
            except psycopg.Error:
                self.failed_transactions += 1
                if conn is not None:
                    conn.close()
                conn = None
            tick += 1
        self.elapsed_seconds = time.monotonic() - begin
        if conn is not None:
            conn.close()


# --- sampling --------------------------------------------------------------------------
@dataclass
class Sample:
    t: float
    rss_a_mb: float | None
    rss_b_mb: float | None
    sockets_a: int | None
    db_connections: int
    oldest_pending_age_seconds: float
    backlog: int
    written: int


@dataclass
class Fault:
    t: float
    kind: str
    detail: str = ""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def open_sockets(pid: int) -> int | None:
    """Sockets the process holds (database pool + listener, broker connections)."""
    try:
        return sum(
            1 for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        )
    except OSError:
        return None


def sample(
    monitor: psycopg.Connection[Any],
    table: str,
    t: float,
    relay_a: c.RelayProcess,
    relay_b: c.RelayProcess,
    writer: SteadyWriter,
) -> Sample:
    ident = c.ident(table)
    age, backlog = monitor.execute(
        sql.SQL(
            "SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8, count(*) "
            "FROM {} WHERE status IN ('pending', 'processing')"
        ).format(ident)
    ).fetchone()
    (connections,) = monitor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay'"
    ).fetchone()
    return Sample(
        t=t,
        rss_a_mb=rss_mb(relay_a.pid),
        rss_b_mb=rss_mb(relay_b.pid),
        sockets_a=open_sockets(relay_a.pid),
        db_connections=int(connections),
        oldest_pending_age_seconds=float(age),
        backlog=int(backlog),
        written=writer.written,
    )


def flat(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Least-squares slope of (t, value); flat if the change it projects over the span is
    within max(3 x residual stddev, 5 % of the mean)."""
    if len(points) < 3:
        return {"flat": None, "reason": "fewer than 3 samples"}
    ts, vs = [p[0] for p in points], [p[1] for p in points]
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(vs)
    var_t = sum((t - mean_t) ** 2 for t in ts)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t if var_t else 0.0
    residuals = [v - (mean_v + slope * (t - mean_t)) for t, v in points]
    noise = statistics.pstdev(residuals)
    span = ts[-1] - ts[0]
    projected = slope * span
    allowed = max(3 * noise, 0.05 * abs(mean_v))
    return {
        "flat": abs(projected) <= allowed,
        "slope_per_minute": round(slope * 60, 3),
        "projected_change": round(projected, 2),
        "allowed_change": round(allowed, 2),
        "mean": round(mean_v, 2),
        "first": round(vs[0], 2),
        "last": round(vs[-1], 2),
    }


# --- read-back -------------------------------------------------------------------------
def _consumer(bootstrap: str, **more: object) -> Any:
    from confluent_kafka import Consumer

    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"soak-{c.RUN_ID}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 0,
            **more,
        }
    )


def _message_id(msg: Any) -> int | None:
    for key, value in msg.headers() or []:
        if key == "message_id" and value is not None:
            return int(value)
    return None


class LiveReader(threading.Thread):
    """Reads the topic from offset 0 for the whole soak (``assign``, no group), keeping
    only message ids, through broker restarts. Reading afterwards from offset 0 is not
    practical on the test broker: its S3 engine lists every object of a partition on
    each fetch and reads one object per batch, so a cold read of 600 000 messages
    runs at tens of messages per second; at the head of the log it keeps up."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        super().__init__(name="live-reader", daemon=True)
        self.bootstrap, self.topic, self.partitions = bootstrap, topic, partitions
        self.seen: set[int] = set()
        self.at: dict[tuple[int, int], int] = {}  # (partition, offset) -> message id read there
        self.messages = 0
        self.stop = threading.Event()

    def run(self) -> None:
        from confluent_kafka import TopicPartition

        consumer = _consumer(self.bootstrap)
        consumer.assign([TopicPartition(self.topic, p, 0) for p in range(self.partitions)])
        try:
            while not self.stop.is_set():
                for msg in consumer.consume(num_messages=5000, timeout=0.5):
                    if msg.error():
                        continue
                    self.messages += 1
                    message_id = _message_id(msg)
                    if message_id is not None:
                        self.seen.add(message_id)
                        self.at[(msg.partition(), msg.offset())] = message_id
        finally:
            consumer.close()


def oldest_readable(bootstrap: str, topic: str, partitions: int, *, want: int, timeout: float) -> list[int]:
    """After every fault: the first ``want`` messages from offset 0 (written before the
    broker was ever restarted) are still readable. Returns their ids."""
    from confluent_kafka import TopicPartition

    consumer = _consumer(bootstrap, **{"max.partition.fetch.bytes": 65536})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    found: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        while len(found) < want and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=1000, timeout=0.5):
                message_id = None if msg.error() else _message_id(msg)
                if message_id is not None:
                    found.append(message_id)
    finally:
        consumer.close()
    return found


# --- diagnosis of undelivered rows ------------------------------------------------------
@dataclass
class Report:
    """One delivery report a relay acted on (``OUTBOX_RELAY_DELIVERY_LOG``)."""

    t: float
    pid: int
    source: str  # main<generation> | isolation
    message_id: int
    partition: int | None
    offset: int | None  # None: the report carried no offset
    error: str  # "-" = success


def read_delivery_log(path: Path) -> list[Report]:
    reports: list[Report] = []
    if not path.exists():
        return reports
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 7:
            continue  # a line cut by SIGKILL
        t, pid, source, message_id, partition, offset, error = parts
        reports.append(
            Report(
                float(t),
                int(pid),
                source,
                int(message_id),
                None if partition == "None" else int(partition),
                None if offset == "None" else int(offset),
                error,
            )
        )
    return reports


def duplicate_sequence_acks(reports: list[Report]) -> set[int]:
    """Indexes of the success reports that came from a DUPLICATE_SEQUENCE_NUMBER answer.

    librdkafka takes that answer ("this producer's batch is already stored") as a
    success and numbers the batch's messages from the base offset of the error
    response, -1: the first message's report has no offset, the next ones 0, 1, 2, ...
    (offsets that belong to other messages). The reports of one record batch are
    served one after another, so such a run is: a success without an offset, then
    successes of the same producer and partition at 0, 1, 2, ..."""
    runs: dict[tuple[int, str, int | None], int] = {}  # producer + partition -> next offset of the run
    found: set[int] = set()
    for index, r in enumerate(reports):
        if r.error != "-":
            continue
        key = (r.pid, r.source, r.partition)
        if r.offset is None:
            runs[key] = 0
            found.add(index)
        elif runs.get(key) == r.offset:
            runs[key] = r.offset + 1
            found.add(index)
        else:
            runs.pop(key, None)
    return found


def diagnose(
    missing: set[int],
    reports: list[Report],
    read_at: dict[tuple[int, int], int],
    faults: list[Fault],
    start_epoch: float,
) -> dict[str, Any]:
    """Why ids finalized ``done`` never reached the reader, from the delivery reports
    the relays acted on and the (partition, offset) at which the reader saw each id.

    - ``no_success_report``: finalized done without a successful delivery report: a
      relay bug.
    - ``acked_by_duplicate_sequence``: the only successes were DUPLICATE_SEQUENCE_NUMBER
      answers (see ``duplicate_sequence_acks``): the broker said it had stored the batch
      and had not.
    - ``offset_reused``: the broker acknowledged an offset at which the reader found
      another message: the broker overwrote or rewound.
    - ``offset_never_read``: an acknowledged offset the reader never saw."""
    dupseq = duplicate_sequence_acks(reports)
    success: dict[int, list[tuple[int, Report]]] = {}
    errors: dict[str, int] = {}
    for index, r in enumerate(reports):
        if r.error == "-":
            success.setdefault(r.message_id, []).append((index, r))
        else:
            errors[r.error] = errors.get(r.error, 0) + 1
    kinds: dict[str, list[int]] = {
        "no_success_report": [],
        "acked_by_duplicate_sequence": [],
        "offset_reused": [],
        "offset_never_read": [],
    }
    for message_id in sorted(missing):
        acks = success.get(message_id, [])
        real = [r for index, r in acks if index not in dupseq]
        if not acks:
            kinds["no_success_report"].append(message_id)
        elif not real:
            kinds["acked_by_duplicate_sequence"].append(message_id)
        elif any(r.partition is not None and r.offset is not None and (r.partition, r.offset) in read_at for r in real):
            kinds["offset_reused"].append(message_id)
        else:
            kinds["offset_never_read"].append(message_id)
    seen_ids = set(read_at.values())
    only_dupseq = {m for m, acks in success.items() if all(index in dupseq for index, _r in acks)}
    # When the DUPLICATE_SEQUENCE_NUMBER answers came: seconds after the last broker restart.
    restarts = [f.t for f in faults if f.kind == "broker-restart"]
    answers = sorted(
        {(round(reports[i].t, 1), reports[i].pid, reports[i].partition) for i in dupseq if reports[i].offset is None}
    )
    after_restart = []
    for t, pid, partition in answers:
        rel = t - start_epoch
        before = [x for x in restarts if x <= rel]
        after_restart.append(
            {
                "at_seconds": round(rel, 1),
                "relay_pid": pid,
                "partition": partition,
                "seconds_after_broker_restart": round(rel - before[-1], 1) if before else None,
            }
        )
    return {
        "counts": {k: len(v) for k, v in kinds.items()},
        "success_reports": sum(len(v) for v in success.values()),
        "duplicate_sequence_answers": len(answers),
        "duplicate_sequence_acked_messages": len(dupseq),
        "ids_acked_only_by_duplicate_sequence": len(only_dupseq),
        "of_which_reader_saw": len(only_dupseq & seen_ids),
        "error_reports": errors,
        "duplicate_sequence_answers_detail": after_restart[:50],
        "missing_ids_sample": {k: v[:20] for k, v in kinds.items() if v},
    }


# --- the plot --------------------------------------------------------------------------
def plot(run: Run, path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    minutes = [s.t / 60 for s in run.samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].plot(minutes, [s.rss_a_mb for s in run.samples], marker="o", label="relay A (never killed)")
    axes[0].plot(
        minutes,
        [s.rss_b_mb for s in run.samples],
        marker=".",
        linestyle="--",
        label="relay B (SIGKILLed and restarted)",
    )
    axes[0].set_ylabel("RSS (MB)")
    axes[0].set_ylim(bottom=0)
    axes[1].plot(minutes, [s.oldest_pending_age_seconds for s in run.samples], marker="o", color="tab:red")
    axes[1].set_ylabel("oldest pending age (s)")
    axes[1].set_ylim(bottom=0)
    axes[2].plot(minutes, [s.sockets_a for s in run.samples], marker="o", label="relay A open sockets")
    axes[2].plot(
        minutes, [s.db_connections for s in run.samples], marker=".", linestyle="--", label="relay backends (A + B)"
    )
    axes[2].set_ylabel("connections")
    axes[2].set_xlabel("minutes")
    axes[2].set_ylim(bottom=0)
    colours = {"relay-kill": "tab:purple", "broker-restart": "tab:orange", "db-terminate": "tab:green"}
    for ax in axes:
        for fault in run.faults:
            ax.axvline(fault.t / 60, color=colours.get(fault.kind, "grey"), alpha=0.5, linewidth=1)
        ax.grid(alpha=0.3)
    for kind, colour in colours.items():
        axes[0].plot([], [], color=colour, alpha=0.5, label=f"fault: {kind}")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[2].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


# --- main ------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the writer writes (default 10)")
    parser.add_argument("--rate", type=float, default=1000.0, help="events per second (default 1000)")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--short", action="store_true", help="1 minute, a fault every 15 s, a sample every 5 s")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"the faults to strike in turn, comma-separated (default {','.join(FAULTS)})",
    )
    parser.add_argument("--workers", type=int, default=4, help="worker threads per relay (default 4)")
    parser.add_argument("--dsn", help="use this PostgreSQL instead of starting an embedded PostgreSQL 18")
    parser.add_argument("--plot", default=str(c.ROOT / "docs" / "images" / "soak.png"), help="PNG path ('' = no plot)")
    parser.add_argument(
        "--readback-timeout",
        type=float,
        default=300.0,
        help="seconds allowed, after the drain, until the reader has seen every id (default 300)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document on stdout")
    args = parser.parse_args()
    # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so every server started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.short:
        args.minutes, args.fault_every, args.sample_every = 1.0, 15.0, 5.0
    seconds = args.minutes * 60
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if not faults or set(faults) - set(FAULTS):
        parser.error(f"--faults: choose from {', '.join(FAULTS)}")

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-soak-"))
    pg = None
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        if args.dsn:
            dsn = args.dsn
        else:
            c.say("starting embedded PostgreSQL 18 ...")
            pg = EmbeddedPostgres(base_dir=tmp).start()
            stack.callback(pg.stop)
            dsn = pg.dsn
        c.say("starting the object store and the broker on it (durable across broker restarts) ...")
        storage = stack.enter_context(EmbeddedObjectStore(log_file=tmp / "object-store.log"))
        broker = EmbeddedBroker(log_file=tmp / "broker.log", storage=storage).start()
        stack.callback(broker.stop)
        delivery_log = tmp / "deliveries.tsv"
        table = c.new_table("soak")
        topic = f"soak-{c.RUN_ID}"
        c.migrate(dsn, table)
        stack.callback(c.drop_schema, dsn, table)
        c.create_topic(broker.bootstrap_servers, topic, partitions=PARTITIONS)
        reader = LiveReader(broker.bootstrap_servers, topic, PARTITIONS)
        reader.start()
        stack.callback(reader.stop.set)
        env = c.relay_env(
            dsn,
            table,
            broker.bootstrap_servers,
            topic,
            OUTBOX_RELAY_RELAY__WORKERS=str(args.workers),
            OUTBOX_RELAY_RELAY__LEASE_SECONDS="10",
            OUTBOX_RELAY_RELAY__MAX_ATTEMPTS="100",
            OUTBOX_RELAY_RELAY__BACKOFF_CAP_SECONDS="5",
            OUTBOX_RELAY_METRICS__ENABLED="false",
            OUTBOX_RELAY_LOG__LEVEL="INFO",
            # Diagnostics: every delivery report (id, partition, offset) to a file.
            OUTBOX_RELAY_DELIVERY_LOG=str(delivery_log),
        )
        relays = {"A": c.RelayProcess([], env), "B": c.RelayProcess([], env)}
        every_relay = list(relays.values())
        stack.callback(lambda: [r.stop(timeout=30) for r in every_relay])
        for relay in relays.values():
            relay.wait_started()
        monitor = stack.enter_context(psycopg.connect(dsn, autocommit=True, application_name="soak-monitor"))

        c.say(f"soak: {args.rate:.0f} events/s for {args.minutes:g} min, a fault every {args.fault_every:g} s")
        writer = SteadyWriter(dsn, table, args.rate, seconds)
        run = Run()
        start = time.monotonic()
        start_epoch = time.time()
        writer.start()
        next_sample, next_fault, fault_index = 0.0, args.fault_every, 0
        while writer.is_alive():
            now = time.monotonic() - start
            if now >= next_sample:
                run.samples.append(sample(monitor, table, now, relays["A"], relays["B"], writer))
                s = run.samples[-1]
                c.say(
                    f"  {now:6.0f}s written {s.written:>8}  backlog {s.backlog:>7}  oldest "
                    f"{s.oldest_pending_age_seconds:6.1f}s  RSS A {s.rss_a_mb or 0:6.1f} MB  "
                    f"sockets A {s.sockets_a}  backends {s.db_connections}"
                )
                next_sample += args.sample_every
            if now >= next_fault and now < seconds - 1:
                kind = faults[fault_index % len(faults)]
                fault_index += 1
                detail = ""
                if kind == "relay-kill":
                    victim = relays["B"]
                    victim.proc.kill()
                    victim.proc.wait(timeout=10)
                    relays["B"] = c.RelayProcess([], env)
                    every_relay.append(relays["B"])
                    detail = f"pid {victim.pid} -> {relays['B'].pid}"
                elif kind == "broker-restart":
                    broker.kill()
                    time.sleep(BROKER_DOWN_SECONDS)
                    broker.start()
                    detail = f"{BROKER_DOWN_SECONDS:g} s down"
                else:
                    (terminated,) = monitor.execute(
                        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = 'outbox-relay') AS t"
                    ).fetchone()
                    detail = f"{terminated} backends"
                run.faults.append(Fault(now, kind, detail))
                c.say(f"  {now:6.0f}s FAULT {kind} ({detail})")
                next_fault += args.fault_every
            time.sleep(0.2)
        written_seconds = writer.elapsed_seconds

        # --- drain, then check -----------------------------------------------------------
        drain_started = time.monotonic()
        drained_at = c.wait_drained(monitor, table, timeout=300, interval=0.2)
        drain_seconds = drained_at - drain_started
        run.samples.append(sample(monitor, table, time.monotonic() - start, relays["A"], relays["B"], writer))
        counts = c.count_by_status(dsn, table)
        ids = {r[0] for r in monitor.execute(sql.SQL("SELECT id FROM {}").format(c.ident(table))).fetchall()}
        alive = {name: r.proc.poll() is None for name, r in relays.items()}
        c.say(
            f"drained {drain_seconds:.1f}s after the writer stopped; waiting for the reader to see all "
            f"{len(ids)} ids ..."
        )
        read_started = time.monotonic()
        while not ids <= reader.seen and time.monotonic() - read_started < args.readback_timeout:
            time.sleep(0.5)
        time.sleep(2.0)  # late duplicates
        reader.stop.set()
        reader.join(timeout=30)
        seen, messages = set(reader.seen), reader.messages
        diagnosis = diagnose(ids - seen, read_delivery_log(delivery_log), reader.at, run.faults, start_epoch)
        read_seconds = time.monotonic() - read_started
        c.say("reading the oldest messages again from offset 0 (written before any broker restart) ...")
        oldest = oldest_readable(broker.bootstrap_servers, topic, PARTITIONS, want=OLDEST_CHECKED, timeout=120)
        missing_rows = []
        if ids - seen:
            # Where the undelivered rows sit in time, next to the faults (diagnosis).
            missing_rows = monitor.execute(
                sql.SQL(
                    "SELECT id, extract(epoch FROM created_at)::float8, extract(epoch FROM done_at)::float8, attempts "
                    "FROM {} WHERE id = ANY(%s) ORDER BY id"
                ).format(c.ident(table)),
                (sorted(ids - seen),),
            ).fetchall()
        exit_codes = {name: r.stop(timeout=60) for name, r in relays.items()}
        crashes = sum(r.log_text().count('"worker crashed"') for r in every_relay)
        warnings: dict[str, int] = {}
        for relay in every_relay:
            for line in relay.log_text().splitlines():
                if '"level": "warning"' in line or '"level": "error"' in line:
                    event = line.split('"event": "', 1)[-1].split('"', 1)[0]
                    warnings[event] = warnings.get(event, 0) + 1

    half = written_seconds / 2
    second_half = [s for s in run.samples if half <= s.t <= written_seconds]
    rss = flat([(s.t, s.rss_a_mb) for s in second_half if s.rss_a_mb is not None])
    sockets = flat([(s.t, float(s.sockets_a)) for s in second_half if s.sockets_a is not None])
    ages = [s.oldest_pending_age_seconds for s in run.samples]
    missing = ids - seen
    first_restart = next((f.t for f in run.faults if f.kind == "broker-restart"), None)
    oldest_ok = len(oldest) >= min(OLDEST_CHECKED, len(ids)) and set(oldest) <= ids
    ok = (
        not missing
        and oldest_ok
        and counts == {"done": len(ids)}
        and all(alive.values())
        and crashes == 0
        and rss["flat"] is not False
        and sockets["flat"] is not False
        and all(code == 0 for code in exit_codes.values())
    )
    report = {
        "ok": ok,
        "postgres": c.server_version(dsn) if args.dsn else "18 (embedded)",
        "minutes": args.minutes,
        "target_rate": args.rate,
        "achieved_rate": round(writer.written / written_seconds, 1) if written_seconds else 0,
        "events": writer.written,
        "writer_failed_transactions": writer.failed_transactions,
        "writer_late_ticks": writer.behind_ticks,
        "faults": [{"at_seconds": round(f.t, 1), "kind": f.kind, "detail": f.detail} for f in run.faults],
        "delivered_unique": len(seen & ids),
        "messages_read": messages,
        "duplicates": messages - len(seen),
        "missing": len(missing),
        "oldest_readable_after_restarts": {
            "read": len(oldest),
            "all_known_ids": set(oldest) <= ids,
            "first_broker_restart_at_seconds": first_restart,
        },
        "final_status": counts,
        "missing_diagnosis": diagnosis,
        "missing_rows": [
            {
                "id": r[0],
                "created_at_seconds": round(r[1] - start_epoch, 1),
                "done_at_seconds": round(r[2] - start_epoch, 1) if r[2] else None,
                "attempts": r[3],
            }
            for r in missing_rows[:200]
        ],
        "relay_warnings": warnings,
        "relays_alive_at_end": alive,
        "graceful_exit_codes": exit_codes,
        "worker_crashes": crashes,
        "drain_seconds_after_writer_stopped": round(drain_seconds, 1),
        "readback_seconds": round(read_seconds, 1),
        "oldest_pending_age_seconds": {"max": round(max(ages), 1), "median": round(statistics.median(ages), 1)},
        "relay_a_rss_mb_second_half": rss,
        "relay_a_sockets_second_half": sockets,
        "samples": [vars(s) for s in run.samples],
    }
    plot_note = None
    if args.plot:
        title = (
            f"outbox-relay soak: {writer.written} events at {report['achieved_rate']:.0f}/s, "
            f"{len(run.faults)} faults, {len(missing)} missing, {report['duplicates']} duplicates"
        )
        plot_note = plot(run, Path(args.plot), title)
        report["plot"] = plot_note or args.plot
    lines = [
        f"soak {'OK' if ok else 'FAILED'}: {writer.written} events in {written_seconds / 60:.1f} min "
        f"({report['achieved_rate']} /s, target {args.rate:g}); {len(run.faults)} faults "
        f"({', '.join(f'{k} x{sum(1 for f in run.faults if f.kind == k)}' for k in FAULTS)})",
        f"  delivered {len(seen & ids)}/{len(ids)} unique ids, missing {len(missing)}, "
        f"duplicates {report['duplicates']}; final status {counts}",
        f"  delivery reports: {diagnosis['success_reports']} successes; "
        f"{diagnosis['duplicate_sequence_answers']} DUPLICATE_SEQUENCE_NUMBER answers taken as success for "
        f"{diagnosis['duplicate_sequence_acked_messages']} messages "
        f"({diagnosis['ids_acked_only_by_duplicate_sequence']} ids acked only so, "
        f"{diagnosis['of_which_reader_saw']} of them stored all the same); "
        f"errors {diagnosis['error_reports']}",
        f"  missing ids by cause: {diagnosis['counts']}",
        f"  after every fault, the first {len(oldest)} messages from offset 0 are still readable: {oldest_ok}",
        f"  oldest pending age: max {report['oldest_pending_age_seconds']['max']} s, "
        f"median {report['oldest_pending_age_seconds']['median']} s; "
        f"drained {drain_seconds:.1f} s after the writer stopped",
        f"  relay A RSS over the second half: {rss.get('first')} -> {rss.get('last')} MB, slope "
        f"{rss.get('slope_per_minute')} MB/min, flat={rss.get('flat')} "
        f"(projected {rss.get('projected_change')} vs allowed {rss.get('allowed_change')})",
        f"  relay A sockets over the second half: {sockets.get('first')} -> {sockets.get('last')}, "
        f"flat={sockets.get('flat')}",
        f"  relays alive at the end {alive}, graceful exit codes {exit_codes}, worker crashes {crashes}",
        f"  plot: {report.get('plot')}",
    ]
    c.emit(report, lines, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
