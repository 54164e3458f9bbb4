"""outbox-relay beside Debezium's outbox event router, one after the other in one run.

Both read the same kind of outbox on the same PostgreSQL (wal_level=logical) and write
to the same Apache Kafka, fed by the same writer (one event per transaction), and both
emit the same messages: the relay with ``kafka.message_format = debezium``, Kafka Connect
standalone with ``debezium-connector-postgres`` (pgoutput, snapshot.mode=no_data) and
the ``EventRouter`` transform mapped to the table's columns (key = aggregate_id, value =
payload as JSON text, header ``id``, topic ``<prefix>.<system>.<aggregate_type>``).

Per system (``--systems``: relay, debezium with the connector's defaults, debezium-tuned
with ``max.batch.size=8192``, ``max.queue.size=32768``, ``poll.interval.ms=50`` and the
worker's producer at ``batch.size=262144``, ``compression.type=lz4``,
``enable.idempotence=true``), in this order, against a fresh table, topic and (Debezium)
replication slot:

1. start the process; write a probe event every 0.2 s until one reaches Kafka
   (``ready``: start-up until the first delivery);
2. **latency**: the writer commits ``--rate`` events/s, ``--warm-seconds`` first, then
   for ``--latency-seconds``;
   insert->Kafka per event = the broker's LogAppendTime - the moment the writer's
   COMMIT returned (one clock, this machine's); over that window also the process's
   CPU, PostgreSQL's CPU (the whole server: every backend, the writer's included), the
   CPU of the reader's own backends (below) and the WAL written (``pg_current_wal_insert_lsn()``
   before and after; the cluster is this run's own);
3. **outage**: the process is stopped (SIGTERM) while the writer goes on for
   ``--stop-seconds``; just before the restart: WAL retained by the connector's
   replication slot (current LSN - the slot's ``restart_lsn``) and rows waiting in
   the relay's outbox; after the restart: the time until every event committed before
   it is in Kafka (catch-up, start-up included), then the writer stops;
4. **flat out**: nothing may read the backlog before the drain, so that all of its
   reading is in the measured drain: the connector is *stopped* through Connect's REST
   API (``PUT /connectors/<name>/stop``: its task shuts down and closes the replication
   connection; the JVM stays up and warm) and the script waits until the slot is no
   longer active; the relay is stopped (``--cold-drain``: the Connect worker is stopped
   too, and both start cold). (Connect's *pause* is not enough: a paused task's WAL
   reader goes on filling its queue from the slot, and most of the backlog was read
   before the resume.) ``--events`` events are then committed one per transaction
   (``--writer-threads`` writers), the reader resumes and the backlog is drained:
   events/s from the first to the last backlog event in Kafka (and over its second
   half, and from the resume), CPU of the process and of the whole PostgreSQL from the
   first to the last event, CPU of the reader's backends from the resume to the last
   event, WAL written by the reader during the drain, and the share of the backlog's
   WAL the slot had already confirmed when the drain started (0 % expected);
5. every event written after ``ready`` must be in the topic (unique ``id`` headers);
   duplicates are counted. Exit status 1 if one is missing.

The reader's backends are every client backend and walsender except the bench's own
connections (application_name ``bench-*``): the relay's pooled connections, or
Debezium's walsender and JDBC connections. Their pids are listed from pg_stat_activity
every 0.25 s while a window runs and their CPU read from /proc while they live (a
backend that closes between two samples loses at most 0.25 s). A CPU figure that cannot
be read (a server on another host) is reported as missing (``n/a``, ``null`` in JSON).

Peak RSS is the largest ``VmHWM`` of the process's three lives. Without ``--dsn`` the
script starts a PostgreSQL of its own on a loopback TCP port (Debezium connects over
JDBC) with the embedded PostgreSQL 18 binaries and ``wal_level=logical``, so that the
WAL and CPU figures hold nothing but this run. The Debezium jars come from Maven
(``java/debezium/pom.xml``; runtime classpath cached in
``$XDG_CACHE_HOME/outbox-relay/debezium-<version>.classpath``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common as c
import _local_pg as lp
import psycopg
from psycopg import sql

DEBEZIUM_VERSION = "3.6.1.Final"
POM = c.ROOT / "java" / "debezium" / "pom.xml"
LOG4J2 = c.ROOT / "java" / "debezium" / "log4j2.xml"
CONNECT_MAIN = "org.apache.kafka.connect.cli.ConnectStandalone"
AGGREGATE_TYPE = "order"

# The table a Debezium user keeps: the application's columns, nothing for a relay.
PLAIN_TABLE_SQL = """
CREATE TABLE {table} (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NULL,
    headers         jsonb       NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
)
"""


# --- the Debezium jars -------------------------------------------------------------------
def classpath_cache_file() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "outbox-relay" / f"debezium-{DEBEZIUM_VERSION}.classpath"


def _usable(text: str) -> bool:
    entries = [e for e in text.strip().split(os.pathsep) if e]
    return bool(entries) and all(os.path.exists(e) for e in entries)


def debezium_classpath() -> str:
    """The runtime classpath of java/debezium/pom.xml: from the cache file when it is
    newer than the pom and every jar is still there, else from Maven (which keeps the
    jars in the local repository, so a second fetch is quick)."""
    cache = classpath_cache_file()
    if cache.is_file() and cache.stat().st_mtime >= POM.stat().st_mtime and _usable(cache.read_text()):
        return cache.read_text().strip()
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SystemExit("the Debezium bench needs Maven ('mvn' on the PATH, Debian package maven)")
    c.say(f"fetching Kafka Connect + Debezium {DEBEZIUM_VERSION} with Maven ...")
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    done = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:build-classpath",
            f"-Dmdep.outputFile={partial}",
            "-Dmdep.includeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not partial.is_file():
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise SystemExit(f"Maven could not fetch Debezium: {tail}")
    os.replace(partial, cache)
    return cache.read_text().strip()


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    found = shutil.which("java")
    if found is None:
        raise SystemExit("the Debezium bench needs Java 17 or later ('java' on the PATH or JAVA_HOME)")
    return found


# --- /proc figures -------------------------------------------------------------------------
def proc_status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# The bench's own connections (the writer, the monitoring one) carry an application_name
# starting with this; every other client backend or walsender is the reader's.
BENCH_APP = "bench-"
WRITER_APP = BENCH_APP + "writer"
MONITOR_APP = BENCH_APP + "monitor"


def reader_backends(conn: psycopg.Connection[Any]) -> list[int]:
    """The pids of the reader's PostgreSQL backends: the relay's pooled connections, or
    Debezium's walsender and its JDBC connections (all but the bench's own)."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE backend_type IN ('client backend', 'walsender') "
        "AND pid <> pg_backend_pid() AND NOT starts_with(coalesce(application_name, ''), %s)",
        (BENCH_APP,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def per_1000(before: float | None, after: float | None, events: int) -> float | None:
    """CPU seconds per 1 000 events, None (a missing figure, shown as n/a) when either
    reading is missing (a server on another host, a process gone)."""
    if before is None or after is None or events <= 0:
        return None
    return round((after - before) / events * 1000, 3)


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    """The insert position: WAL already inserted counts even while it waits in the WAL
    buffers (pg_current_wal_lsn(), the write position, lags by whatever asynchronous
    commits left there: a backlog of a few hundred events did not move it at all)."""
    return str(conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0])  # type: ignore[index]


def wal_bytes(conn: psycopg.Connection[Any], start: str, end: str) -> int:
    return int(
        conn.execute(
            "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)",  # type: ignore[index]
            (end, start),
        ).fetchone()[0]
    )


# --- the Kafka side --------------------------------------------------------------------------
def create_log_append_topic(bootstrap: str, topic: str, partitions: int) -> bool:
    """The topic with ``message.timestamp.type=LogAppendTime``: every message then
    carries the broker's own append time. False when the broker refused the config."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    new = NewTopic(
        topic, num_partitions=partitions, replication_factor=1, config={"message.timestamp.type": "LogAppendTime"}
    )
    try:
        admin.create_topics([new], operation_timeout=15, request_timeout=20)[topic].result(timeout=30)
        return True
    except Exception as exc:  # fall back to a plain topic, receive time
        c.say(f"  note: topic {topic} with LogAppendTime refused ({exc}); using the consumer's receive time")
        c.create_topic(bootstrap, topic, partitions)
        return False


class TopicWatcher:
    """Reads the topic from offset 0 in a thread; per ``id`` header the first
    (broker append time, receive time), and how many messages arrived in all."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-dbz-{c.RUN_ID}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
                "log_level": 3,
            }
        )
        self._consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self.seen: dict[int, tuple[float, float]] = {}
        self.messages = 0
        self.log_append = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="topic-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

        while not self._stop.is_set():
            for msg in self._consumer.consume(num_messages=1000, timeout=0.05):
                now = time.time()
                if msg.error():
                    continue
                kind, ts_ms = msg.timestamp()
                event_id = None
                for key, value in msg.headers() or []:
                    if key == "id" and value is not None:
                        event_id = int(value.decode() if isinstance(value, bytes) else value)
                if event_id is None:
                    continue
                appended = ts_ms / 1000.0 if kind == TIMESTAMP_LOG_APPEND_TIME else now
                with self._lock:
                    self.messages += 1
                    self.log_append = self.log_append or kind == TIMESTAMP_LOG_APPEND_TIME
                    self.seen.setdefault(event_id, (appended, now))

    def count(self) -> int:
        with self._lock:
            return len(self.seen)

    def has_all(self, ids: set[int]) -> bool:
        with self._lock:
            return ids.issubset(self.seen.keys())

    def wait_for(self, ids: set[int], timeout: float) -> float:
        """Block until every id arrived; returns time.time() when seen."""
        deadline = time.monotonic() + timeout
        while not self.has_all(ids):
            if time.monotonic() > deadline:
                with self._lock:
                    missing = len(ids - self.seen.keys())
                raise TimeoutError(f"{missing} of {len(ids)} events not in Kafka within {timeout:.0f}s")
            time.sleep(0.01)
        return time.time()

    def wait_any(self, ids: set[int], timeout: float) -> float:
        """Block until the first of ``ids`` arrived; returns time.time() when seen."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not ids.isdisjoint(self.seen.keys()):
                    return time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"none of {len(ids)} events in Kafka within {timeout:.0f}s")
            time.sleep(0.005)

    def times(self, ids: set[int]) -> dict[int, tuple[float, float]]:
        with self._lock:
            return {i: self.seen[i] for i in ids if i in self.seen}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._consumer.close()


# --- the writer -----------------------------------------------------------------------------
class Writer:
    """One event per transaction (autocommit INSERT ... RETURNING id): the application's
    columns, as every outbox writer inserts them. Records when each COMMIT returned."""

    def __init__(self, dsn: str, table: str, args: argparse.Namespace) -> None:
        self.dsn = dsn
        self.insert = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s) RETURNING id"
        ).format(c.ident(table))
        self.args = args
        self.committed: dict[int, float] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._paced: threading.Thread | None = None
        self._stop = threading.Event()

    def _one(self, conn: psycopg.Connection[Any]) -> int:
        with self._lock:
            self._seq += 1
            seq = self._seq
        row = conn.execute(
            self.insert,
            (
                AGGREGATE_TYPE,
                f"agg-{seq % self.args.aggregates}",
                "OrderCreated",
                c.payload_json(seq, self.args.payload_bytes),
            ),
        ).fetchone()
        now = time.time()
        event_id = int(row[0])  # type: ignore[index]
        with self._lock:
            self.committed[event_id] = now
        return event_id

    def write(self, n: int) -> list[int]:
        with psycopg.connect(self.dsn, autocommit=True, application_name=WRITER_APP) as conn:
            return [self._one(conn) for _ in range(n)]

    def start_paced(self, rate: float) -> None:
        """Commit ``rate`` events/s in a thread until ``stop_paced``."""
        self._stop.clear()

        def run() -> None:
            with psycopg.connect(self.dsn, autocommit=True, application_name=WRITER_APP) as conn:
                interval = 1.0 / rate
                next_at = time.monotonic()
                while not self._stop.is_set():
                    self._one(conn)
                    next_at += interval
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        self._stop.wait(delay)
                    elif delay < -1.0:  # fell behind by a second: do not burst to catch up
                        next_at = time.monotonic()

        self._paced = threading.Thread(target=run, name="paced-writer", daemon=True)
        self._paced.start()

    def stop_paced(self) -> None:
        self._stop.set()
        if self._paced is not None:
            self._paced.join(timeout=30)

    def flat_out(self, n: int, threads: int) -> list[int]:
        """``n`` events as fast as ``threads`` connections commit them."""
        ids: list[int] = []
        lock = threading.Lock()

        def run(count: int) -> None:
            with psycopg.connect(self.dsn, autocommit=True, application_name=WRITER_APP) as conn:
                conn.execute("SET synchronous_commit = off")  # the same WAL records, no fsync wait
                mine = [self._one(conn) for _ in range(count)]
            with lock:
                ids.extend(mine)

        workers = [
            threading.Thread(target=run, args=(n // threads + (1 if i < n % threads else 0),)) for i in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return ids

    def ids_between(self, start: float, end: float) -> set[int]:
        with self._lock:
            return {i for i, t in self.committed.items() if start <= t < end}

    def ids_since(self, start: float) -> set[int]:
        with self._lock:
            return {i for i, t in self.committed.items() if t >= start}


# --- the two systems ---------------------------------------------------------------------------
class Reader:
    """One of the two systems: ``start()`` a process, ``stop()`` it, its pid."""

    name = ""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss_kb = 0
        self._log: Any = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu(self) -> float | None:
        return lp.proc_cpu_seconds(self.pid) if self.proc is not None else None

    def _popen(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> int:
        if self.proc is None:
            return 0
        hwm = proc_status_kb(self.proc.pid, "VmHWM")
        self.peak_rss_kb = max(self.peak_rss_kb, hwm or 0)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        code = int(self.proc.returncode)
        self.proc = None
        if self._log is not None:
            self._log.close()
        return code

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}; log: {self.log_path}")

    log_path = Path()

    def backlog(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def pause(self) -> int:
        """Stop reading with the process kept (warm): Debezium only. Returns the exit
        code when the process had to be stopped instead."""
        return self.stop()

    def resume(self) -> None:
        self.start()

    def read_before_drain(self, conn: psycopg.Connection[Any], start: str, end: str) -> dict[str, Any]:
        """How much of the backlog's WAL [start, end) the reader had read before the
        drain starts: a replication slot's figure, none for the relay."""
        return {"backlog_wal_read_before_drain_pct": None, "slot_active_before_drain": None}

    def cleanup(self, conn: psycopg.Connection[Any]) -> None:
        pass


class RelayReader(Reader):
    name = "outbox-relay"

    def __init__(
        self, dsn: str, table: str, bootstrap: str, topic_prefix: str, work: Path, args: argparse.Namespace
    ) -> None:
        super().__init__()
        self.table = table
        c.migrate(dsn, table)
        self.env = c.relay_env(
            dsn, table, bootstrap, f"{topic_prefix}.{{aggregate_type}}", OUTBOX_RELAY_KAFKA__MESSAGE_FORMAT="debezium"
        )
        self.argv = [*c.relay_command(), "run", "--workers", str(args.workers)]
        self.log_path = work / "relay.log"

    def start(self) -> None:
        self._popen(self.argv, self.env, self.log_path)

    def backlog(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        rows, size = conn.execute(
            sql.SQL(
                "SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0) FROM {} AS t "
                "WHERE status IN ('pending', 'processing')"
            ).format(c.ident(self.table))
        ).fetchone()  # type: ignore[misc]
        return {"rows_waiting": int(rows), "bytes_waiting_in_rows": int(size), "slot_retained_bytes": None}


# Debezium's knobs for throughput, beside its defaults (``debezium-tuned``): bigger
# batches and queue between the WAL reader and the task, a shorter idle poll, and the
# worker's producer batching and compressing as the relay's producer can.
TUNED_CONNECTOR = {"max.batch.size": "8192", "max.queue.size": "32768", "poll.interval.ms": "50"}
TUNED_WORKER = {
    "producer.batch.size": "262144",
    "producer.compression.type": "lz4",
    "producer.enable.idempotence": "true",
}


class DebeziumReader(Reader):
    name = "Debezium"

    def __init__(
        self,
        dsn: str,
        table: str,
        bootstrap: str,
        topic_prefix: str,
        work: Path,
        args: argparse.Namespace,
        *,
        tuned: bool = False,
    ) -> None:
        super().__init__()
        self.tuned = tuned
        if tuned:
            self.name = "Debezium tuned"
        self.table = table
        schema = table.split(".")[0]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            if args.debezium_table == "relay":
                c.migrate(dsn, table)
            else:
                conn.execute(sql.SQL(PLAIN_TABLE_SQL).format(table=c.ident(table)))
        self.dsn = dsn
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        suffix = "tuned" if tuned else "default"  # two connectors in one run: a slot each
        self.slot = f"bench_dbz_{c.RUN_ID}_{suffix}"
        self.rest_port = lp.free_port()
        self.connector_name = f"outbox-bench-{c.RUN_ID}-{suffix}"
        self.publication = f"bench_dbz_{c.RUN_ID}_{suffix}"
        connector = {
            "name": self.connector_name,
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "tasks.max": "1",
            "database.hostname": str(info.get("host") or "127.0.0.1"),
            "database.port": str(info.get("port") or 5432),
            "database.user": str(info.get("user") or "postgres"),
            "database.password": str(info.get("password") or ""),
            "database.dbname": str(info.get("dbname") or "postgres"),
            "topic.prefix": f"bench_dbz_{c.RUN_ID}",
            "plugin.name": "pgoutput",
            "slot.name": self.slot,
            "publication.name": self.publication,
            "publication.autocreate.mode": "filtered",
            "table.include.list": table,
            "snapshot.mode": "no_data",
            "tombstones.on.delete": "false",
            "transforms": "outbox",
            "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
            "transforms.outbox.table.field.event.id": "id",
            "transforms.outbox.table.field.event.key": "aggregate_id",
            "transforms.outbox.table.field.event.payload": "payload",
            "transforms.outbox.route.by.field": "aggregate_type",
            "transforms.outbox.route.topic.replacement": f"{topic_prefix}.${{routedByValue}}",
            "key.converter": "org.apache.kafka.connect.storage.StringConverter",
            "value.converter": "org.apache.kafka.connect.storage.StringConverter",
        }
        worker = {
            "bootstrap.servers": bootstrap,
            "key.converter": "org.apache.kafka.connect.storage.StringConverter",
            "value.converter": "org.apache.kafka.connect.storage.StringConverter",
            "offset.storage.file.filename": str(work / "connect.offsets"),
            # the value of Kafka's own config/connect-standalone.properties
            "offset.flush.interval.ms": "10000",
            "listeners": f"http://127.0.0.1:{self.rest_port}",
            # every jar on the classpath has ServiceLoader manifests: what the worker's own
            # start-up warning recommends, and a start without a reflective scan
            "plugin.discovery": "service_load",
        }
        if tuned:
            connector.update(TUNED_CONNECTOR)
            worker.update(TUNED_WORKER)
        for item in args.connector_prop or []:
            key, _, value = item.partition("=")
            connector[key] = value
        for item in args.worker_prop or []:
            key, _, value = item.partition("=")
            worker[key] = value
        self.worker_file = work / "worker.properties"
        self.connector_file = work / "connector.properties"
        self.worker_file.write_text("".join(f"{k}={v}\n" for k, v in worker.items()))
        self.connector_file.write_text("".join(f"{k}={v}\n" for k, v in connector.items()))
        self.argv = [
            java_binary(),
            f"-Xmx{args.connect_heap_mb}m",
            f"-Dlog4j2.configurationFile={LOG4J2}",
            "-cp",
            debezium_classpath(),
            CONNECT_MAIN,
            str(self.worker_file),
            str(self.connector_file),
        ]
        self.env = dict(os.environ)
        self.log_path = work / "connect.log"

    def start(self) -> None:
        self._popen(self.argv, self.env, self.log_path)

    def backlog(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        row = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (self.slot,),
        ).fetchone()
        retained = int(row[0]) if row and row[0] is not None else None
        unconfirmed = int(row[1]) if row and row[1] is not None else None
        return {
            "rows_waiting": None,
            "bytes_waiting_in_rows": None,
            "slot_retained_bytes": retained,
            "slot_unconfirmed_bytes": unconfirmed,
        }

    def _rest(self, verb: str) -> None:
        """PUT /connectors/<name>/<verb> on the worker's REST API, then wait until the
        connector reports the new state: ``stop`` (STOPPED, no task left) or ``resume``
        (every task RUNNING)."""
        import json
        import urllib.request

        base = f"http://127.0.0.1:{self.rest_port}/connectors/{self.connector_name}"
        urllib.request.urlopen(urllib.request.Request(f"{base}/{verb}", method="PUT"), timeout=30).close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{base}/status", timeout=30) as resp:
                status = json.load(resp)
            tasks = status.get("tasks", [])
            if verb == "stop" and status.get("connector", {}).get("state") == "STOPPED" and not tasks:
                return
            if verb == "resume" and tasks and all(t.get("state") == "RUNNING" for t in tasks):
                return
            time.sleep(0.2)
        raise TimeoutError(f"connector not {verb}ped/resumed within 120s")

    def pause(self) -> int:
        """Connect's stop (not its pause): the task is shut down and closes its
        replication connection, so the slot is not read until ``resume``; the worker's
        JVM stays up and warm. A paused task would go on reading the slot into its
        queue, and the drain would then find most of the backlog already read."""
        self._rest("stop")
        self.wait_slot_inactive()
        return 0

    def resume(self) -> None:
        self._rest("resume")

    def wait_slot_inactive(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, autocommit=True, application_name=MONITOR_APP) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
                ).fetchone()
                if row is None or not row[0]:
                    return
                time.sleep(0.1)
        raise TimeoutError(f"replication slot {self.slot} still read {timeout:.0f}s after the connector stopped")

    def read_before_drain(self, conn: psycopg.Connection[Any], start: str, end: str) -> dict[str, Any]:
        """The share of the backlog's WAL the slot had confirmed before the drain (0 when
        the connector was stopped, as it should be), and whether a walsender held it."""
        row = conn.execute(
            "SELECT active, greatest(0, least(pg_wal_lsn_diff(confirmed_flush_lsn, %s::pg_lsn), "
            "pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn))) / greatest(1, pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)) * 100 "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (start, end, start, end, start, self.slot),
        ).fetchone()
        if row is None:
            return {"backlog_wal_read_before_drain_pct": None, "slot_active_before_drain": None}
        return {"backlog_wal_read_before_drain_pct": round(float(row[1]), 1), "slot_active_before_drain": bool(row[0])}

    def cleanup(self, conn: psycopg.Connection[Any]) -> None:
        """A slot left behind would keep every later WAL segment on the server."""
        with contextlib.suppress(psycopg.Error):
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s AND NOT active",
                (self.slot,),
            )
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(self.publication)))


# --- one system, every phase ----------------------------------------------------------------------
def wait_ready(reader: Reader, writer: Writer, watcher: TopicWatcher, timeout: float) -> tuple[float, float]:
    """Probe events every 0.2 s until one reaches Kafka. Returns (process start, first
    delivery). Probes written before a fresh slot exists are never captured
    (snapshot.mode=no_data), so the checks only count events written after this."""
    started = time.time()
    deadline = time.monotonic() + timeout
    before = watcher.count()
    while watcher.count() == before:
        reader.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{reader.name}: nothing reached Kafka within {timeout:.0f}s; log {reader.log_path}")
        writer.write(1)
        time.sleep(0.2)
    return started, time.time()


def measure(kind: str, dsn: str, bootstrap: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    table = c.new_table(kind.replace("-", "_"))
    topic_prefix = f"bench-dbz-{c.RUN_ID}.{kind}"
    topic = f"{topic_prefix}.{AGGREGATE_TYPE}"
    partitions = args.partitions
    log_append = create_log_append_topic(bootstrap, topic, partitions)
    work.mkdir(parents=True, exist_ok=True)
    reader: Reader
    if kind == "relay":
        reader = RelayReader(dsn, table, bootstrap, topic_prefix, work, args)
    else:
        reader = DebeziumReader(dsn, table, bootstrap, topic_prefix, work, args, tuned=kind == "debezium-tuned")
    pg_cpu = lp.ServerCpu(dsn)
    writer = Writer(dsn, table, args)
    watcher = TopicWatcher(bootstrap, topic, partitions)
    conn = psycopg.connect(dsn, autocommit=True, application_name=MONITOR_APP)
    report: dict[str, Any] = {
        "system": reader.name,
        "table": table,
        "topic": topic,
        "latency_clock": "broker LogAppendTime" if log_append else "consumer receive",
    }
    try:
        # 1. start-up
        c.say(f"[{kind}] start")
        reader.start()
        started, first = wait_ready(reader, writer, watcher, args.timeout)
        report["ready_seconds"] = round(first - started, 2)
        checked_from = time.time()

        # 2. latency at a fixed rate, after --warm-seconds at that rate (a JVM just
        # started compiles its hot paths during the first seconds of load)
        c.say(
            f"[{kind}] latency: {args.rate:g} events/s, {args.warm_seconds:g}s warm-up, "
            f"{args.latency_seconds:g}s measured"
        )
        writer.start_paced(args.rate)
        time.sleep(args.warm_seconds)
        backends = lp.BackendCpu(dsn, reader_backends)
        backends.start()
        lsn0, cpu0, pg0, t0 = wal_lsn(conn), reader.cpu(), pg_cpu.seconds(), time.time()
        time.sleep(args.latency_seconds)
        t1 = time.time()
        lsn1, cpu1, pg1 = wal_lsn(conn), reader.cpu(), pg_cpu.seconds()
        reader_pg = backends.stop()
        window = writer.ids_between(t0, t1)
        watcher.wait_for(window, args.timeout)
        reader.check_alive()
        arrived = watcher.times(window)
        lat = [(appended - writer.committed[i]) * 1000.0 for i, (appended, _) in arrived.items()]
        rcv = [(received - writer.committed[i]) * 1000.0 for i, (_, received) in arrived.items()]
        n = len(window)
        report["latency"] = {
            "events": n,
            "p50_ms": round(c.pct(lat, 50), 1),
            "p99_ms": round(c.pct(lat, 99), 1),
            "max_ms": round(max(lat), 1),
            "received_p50_ms": round(c.pct(rcv, 50), 1),
            "received_p99_ms": round(c.pct(rcv, 99), 1),
            "process_cpu_s_per_1000": per_1000(cpu0, cpu1, n),
            "postgres_cpu_s_per_1000": per_1000(pg0, pg1, n),
            "reader_backends_cpu_s_per_1000": per_1000(0.0, reader_pg, n),
            "reader_backends": backends.backends,
            "wal_bytes_per_event": round(wal_bytes(conn, lsn0, lsn1) / n),
        }

        # 3. outage with the writer going on
        c.say(f"[{kind}] outage: stopped for {args.stop_seconds:g}s while the writer goes on")
        exit_stop = reader.stop()
        stop_lsn = wal_lsn(conn)
        time.sleep(args.stop_seconds)
        held = reader.backlog(conn)
        wal_meanwhile = wal_bytes(conn, stop_lsn, wal_lsn(conn))
        restart_at = time.time()
        waiting = writer.ids_between(checked_from, restart_at)
        behind = len(waiting) - len(watcher.times(waiting))
        reader.start()
        caught_up = watcher.wait_for(waiting, args.timeout)
        writer.stop_paced()
        report["outage"] = {
            "stopped_seconds": args.stop_seconds,
            "events_written_meanwhile": None,
            "events_behind_at_restart": behind,
            "wal_written_while_stopped_bytes": wal_meanwhile,
            **held,
            "catch_up_seconds": round(caught_up - restart_at, 2),
            "exit_code_at_stop": exit_stop,
        }
        report["outage"]["events_written_meanwhile"] = len(
            writer.ids_between(restart_at - args.stop_seconds, restart_at)
        )

        # 4. flat out: a backlog drained
        c.say(f"[{kind}] flat out: {args.events} events, one per transaction, then drained")
        watcher.wait_for(writer.ids_since(checked_from), args.timeout)
        exit_stop2 = reader.pause() if args.drain_warm else reader.stop()
        backlog_lsn0 = wal_lsn(conn)
        backlog = set(writer.flat_out(args.events, args.writer_threads))
        backlog_lsn1 = wal_lsn(conn)
        time.sleep(0.5)
        read_before = reader.read_before_drain(conn, backlog_lsn0, backlog_lsn1)
        backends = lp.BackendCpu(dsn, reader_backends)
        backends.start()
        start_at = time.time()
        if args.drain_warm:
            reader.resume()
        else:
            reader.start()
        drain_lsn0 = wal_lsn(conn)
        # CPU over the drain only (not the start-up): read when the first and the last
        # backlog event have arrived (polled every 5 ms by this thread)
        watcher.wait_any(backlog, args.timeout)
        cpu_a, pg_a = reader.cpu(), pg_cpu.seconds()
        last = watcher.wait_for(backlog, args.timeout)
        cpu_b, pg_b = reader.cpu(), pg_cpu.seconds()
        reader_pg = backends.stop()
        drain_lsn1 = wal_lsn(conn)
        arrivals = sorted(appended for appended, _ in watcher.times(backlog).values())
        first_at, last_at = arrivals[0], arrivals[-1]
        half_at = arrivals[len(arrivals) // 2]
        report["flat_out"] = {
            "events": len(backlog),
            "events_per_s": round(len(backlog) / max(last_at - first_at, 1e-3)),
            "events_per_s_from_start": round(len(backlog) / max(last - start_at, 1e-3)),
            "events_per_s_second_half": round((len(arrivals) - len(arrivals) // 2) / max(last_at - half_at, 1e-3)),
            "seconds_to_first": round(first_at - start_at, 2),
            "process_cpu_s_per_1000": per_1000(cpu_a, cpu_b, len(backlog)),
            "postgres_cpu_s_per_1000": per_1000(pg_a, pg_b, len(backlog)),
            "reader_backends_cpu_s_per_1000": per_1000(0.0, reader_pg, len(backlog)),
            **read_before,
            "writer_wal_bytes_per_event": round(wal_bytes(conn, backlog_lsn0, backlog_lsn1) / len(backlog)),
            "reader_wal_bytes_per_event": round(wal_bytes(conn, drain_lsn0, drain_lsn1) / len(backlog)),
        }
        exit_final = reader.stop()
        report["exit_codes"] = [exit_stop, exit_stop2, exit_final]
        report["peak_rss_mb"] = round(reader.peak_rss_kb / 1024, 1)

        # 5. nothing lost
        expected = writer.ids_since(checked_from)
        time.sleep(1.0)
        with watcher._lock:
            delivered = expected & watcher.seen.keys()
            total = watcher.messages
        report["check"] = {
            "expected": len(expected),
            "delivered": len(delivered),
            "missing": len(expected) - len(delivered),
            "messages": total,
            "duplicates": total - len(watcher.seen),
        }
        return report
    except Exception:
        report["failed"] = True
        with contextlib.suppress(OSError):
            tail = reader.log_path.read_text(errors="replace").splitlines()[-40:]
            c.say(f"--- last lines of {reader.log_path}:\n" + "\n".join(tail))
        raise
    finally:
        writer.stop_paced()
        with contextlib.suppress(Exception):
            reader.stop()
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copy(reader.log_path, Path(args.logs) / f"{kind}.log")
        watcher.close()
        reader.cleanup(conn)
        if not args.keep:
            c.drop_schema(dsn, table)
        conn.close()


@contextlib.contextmanager
def postgres(args: argparse.Namespace, tmp: Path) -> Iterator[str]:
    if args.dsn:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            level = conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
        if level != "logical":
            raise SystemExit(f"--dsn: wal_level is {level}; Debezium needs wal_level=logical")
        yield args.dsn
        return
    c.say("starting PostgreSQL (embedded binaries, TCP on loopback, wal_level=logical) ...")
    pg = lp.LocalPostgres(
        tmp,
        Path(args.pg_bin) if args.pg_bin else None,
        {"wal_level": "logical", "max_connections": "100", "max_wal_size": "4GB"},
    ).start()
    try:
        yield pg.dsn
    finally:
        pg.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument(
        "--systems",
        default="relay,debezium,debezium-tuned",
        help="which to run, in this order: relay, debezium (the connector's defaults), debezium-tuned "
        "(max.batch.size=8192, max.queue.size=32768, poll.interval.ms=50; the worker's producer "
        "batch.size=262144, compression.type=lz4, enable.idempotence=true); default: %(default)s",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the paced writer")
    parser.add_argument(
        "--warm-seconds", type=float, default=10.0, help="seconds at --rate before the latency window opens"
    )
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument(
        "--cold-drain",
        dest="drain_warm",
        action="store_false",
        help="drain the flat-out backlog with a freshly started process; by default the "
        "connector is stopped and resumed through Connect's REST API (its JVM stays warm, "
        "its replication connection is closed: the slot is read only in the drain) "
        "and the relay, which has no JIT to warm, is restarted",
    )
    parser.add_argument("--logs", metavar="DIR", help="copy the relay's and the Connect worker's logs here")
    parser.add_argument(
        "--stop-seconds",
        type=float,
        default=15.0,
        help="how long the relay / the connector is stopped while the writer goes on",
    )
    parser.add_argument("--events", type=int, default=20000, help="backlog of the flat-out drain")
    parser.add_argument("--writer-threads", type=int, default=4, help="writers of the flat-out backlog")
    parser.add_argument("--aggregates", type=int, default=100)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4, help="outbox-relay run --workers")
    parser.add_argument("--connect-heap-mb", type=int, default=512, help="-Xmx of the Kafka Connect JVM")
    parser.add_argument(
        "--debezium-table",
        choices=("plain", "relay"),
        default="plain",
        help="the connector's outbox: the application's columns only (what a Debezium user "
        "keeps; default) or the relay's own table with its indexes",
    )
    parser.add_argument(
        "--connector-prop",
        action="append",
        metavar="KEY=VALUE",
        help="override a connector property (repeatable), e.g. poll.interval.ms=100",
    )
    parser.add_argument(
        "--worker-prop", action="append", metavar="KEY=VALUE", help="override a Connect worker property (repeatable)"
    )
    parser.add_argument(
        "--pg-bin", help="PostgreSQL bin directory for the run's own server (default: the embedded PostgreSQL 18's)"
    )
    parser.add_argument("--fetch-only", action="store_true", help="fetch the Debezium jars with Maven and exit")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds any one wait (start-up, a drain) may take before the run fails",
    )
    args = parser.parse_args()

    if args.fetch_only:
        print(debezium_classpath().count(os.pathsep) + 1, "jars on the Kafka Connect + Debezium classpath")
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"relay", "debezium", "debezium-tuned"}
    if unknown or not systems:
        parser.error(f"--systems: relay, debezium and/or debezium-tuned (not {', '.join(sorted(unknown))})")
    if {"debezium", "debezium-tuned"} & set(systems):
        java_binary()
        debezium_classpath()

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-dbz-"))
    results: list[dict[str, Any]] = []
    try:
        with postgres(args, tmp) as dsn, c.servers(argparse.Namespace(**{**vars(args), "dsn": dsn})) as (_, bootstrap):
            assert bootstrap is not None
            version = c.server_version(dsn)
            for kind in systems:
                results.append(measure(kind, dsn, bootstrap, tmp / kind, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    report = {
        "benchmark": "debezium",
        "postgresql": version,
        "broker": c.broker_label(args),
        "settings": {
            k: getattr(args, k)
            for k in (
                "rate",
                "warm_seconds",
                "latency_seconds",
                "stop_seconds",
                "events",
                "writer_threads",
                "workers",
                "payload_bytes",
                "partitions",
                "debezium_table",
                "connect_heap_mb",
                "drain_warm",
            )
        },
        "systems": results,
    }
    c.emit(report, text_report(report), args.json)
    ok = all(r["check"]["missing"] == 0 for r in results)
    return 0 if ok else 1


def text_report(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    rows: list[tuple[str, ...]] = [
        (
            "events/s flat out (first -> last in Kafka)",
            *(str(r["flat_out"]["events_per_s"]) for r in report["systems"]),
        ),
        (
            "events/s flat out, second half of the drain",
            *(str(r["flat_out"]["events_per_s_second_half"]) for r in report["systems"]),
        ),
        (
            "events/s flat out, from start or resume",
            *(str(r["flat_out"]["events_per_s_from_start"]) for r in report["systems"]),
        ),
        (f"insert->Kafka p50 at {s['rate']:g}/s (ms)", *(str(r["latency"]["p50_ms"]) for r in report["systems"])),
        (f"insert->Kafka p99 at {s['rate']:g}/s (ms)", *(str(r["latency"]["p99_ms"]) for r in report["systems"])),
        (
            "process CPU s / 1000 events, flat out",
            *(_or_na(r["flat_out"]["process_cpu_s_per_1000"]) for r in report["systems"]),
        ),
        (
            f"process CPU s / 1000 events at {s['rate']:g}/s",
            *(_or_na(r["latency"]["process_cpu_s_per_1000"]) for r in report["systems"]),
        ),
        (
            "reader's PostgreSQL backends CPU s / 1000 events, drain from the resume",
            *(_or_na(r["flat_out"].get("reader_backends_cpu_s_per_1000")) for r in report["systems"]),
        ),
        (
            "backlog WAL already read when the drain starts (%)",
            *(_or_dash(r["flat_out"].get("backlog_wal_read_before_drain_pct")) for r in report["systems"]),
        ),
        (
            "PostgreSQL CPU s / 1000 events, flat out",
            *(_or_na(r["flat_out"]["postgres_cpu_s_per_1000"]) for r in report["systems"]),
        ),
        (
            f"PostgreSQL CPU s / 1000 events at {s['rate']:g}/s",
            *(_or_na(r["latency"]["postgres_cpu_s_per_1000"]) for r in report["systems"]),
        ),
        (
            f"reader's PostgreSQL backends CPU s / 1000 events at {s['rate']:g}/s",
            *(_or_na(r["latency"].get("reader_backends_cpu_s_per_1000")) for r in report["systems"]),
        ),
        ("peak RSS (MB)", *(str(r["peak_rss_mb"]) for r in report["systems"])),
        (
            f"WAL bytes / event at {s['rate']:g}/s (writer + reader)",
            *(str(r["latency"]["wal_bytes_per_event"]) for r in report["systems"]),
        ),
        (
            "WAL bytes / event, writer alone (backlog)",
            *(str(r["flat_out"]["writer_wal_bytes_per_event"]) for r in report["systems"]),
        ),
        (
            "WAL bytes / event, reader alone (drain)",
            *(str(r["flat_out"]["reader_wal_bytes_per_event"]) for r in report["systems"]),
        ),
        (
            f"stopped {s['stop_seconds']:g}s: events written meanwhile",
            *(str(r["outage"]["events_written_meanwhile"]) for r in report["systems"]),
        ),
        (
            "  WAL retained by the replication slot (MB)",
            *(_mb(r["outage"]["slot_retained_bytes"]) for r in report["systems"]),
        ),
        ("  rows waiting in the outbox", *(_or_dash(r["outage"]["rows_waiting"]) for r in report["systems"])),
        (
            "  catch-up after restart, start-up included (s)",
            *(str(r["outage"]["catch_up_seconds"]) for r in report["systems"]),
        ),
        ("start-up to first delivery (s)", *(str(r["ready_seconds"]) for r in report["systems"])),
        (
            "checked: missing / duplicates",
            *(f"{r['check']['missing']} / {r['check']['duplicates']}" for r in report["systems"]),
        ),
    ]
    head = ("", *(r["system"] for r in report["systems"]))
    width = max(len(r[0]) for r in rows) + 2
    lines = [
        f"debezium: PostgreSQL {report['postgresql']}, broker {report['broker']}, "
        f"{s['payload_bytes']}-byte payloads, one event per transaction; latency clock: "
        f"{report['systems'][0]['latency_clock'] if report['systems'] else '-'}",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    del width
    return lines


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _or_na(value: float | None) -> str:
    """A CPU figure, or "n/a" when it could not be measured (a server on another host)."""
    return "n/a" if value is None else str(value)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())
