"""Shared plumbing of the bench scripts: servers, tables, backlogs, the relay subprocess.

Not a benchmark by itself. Every script imports it from its own directory
(``python bench/<name>.py`` puts ``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(1, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from outbox_relay.db.store import OutboxStore  # noqa: E402

RUN_ID = uuid.uuid4().hex[:6]


# --- output ------------------------------------------------------------------------------
def say(*parts: object) -> None:
    """Progress lines go to stderr so that ``--json`` keeps stdout machine-readable."""
    print(*parts, file=sys.stderr, flush=True)


def emit(report: dict[str, Any], text_lines: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(text_lines))


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- servers -----------------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="use this PostgreSQL instead of starting an embedded PostgreSQL 18")
    parser.add_argument("--bootstrap", help="use this Kafka cluster instead of starting a broker")
    parser.add_argument(
        "--broker",
        choices=("kafka", "tansu"),
        default=default_broker(),
        help="the broker started when --bootstrap is not given: a real Apache Kafka node "
        "(outbox_relay._embedded.kafka; the default when Java and the Kafka jars or Maven "
        "are there) or the embedded tansu broker (Python only); default: %(default)s",
    )
    parser.add_argument("--keep", action="store_true", help="keep the bench schemas (with --dsn) for inspection")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document on stdout")
    parser.add_argument(
        "--database-cpus",
        metavar="LIST",
        help="pin PostgreSQL (its postmaster and every backend) to these CPUs, e.g. 0, and this "
        "process, the broker and the relay to the others: the database on a host of its own, "
        "as in production, instead of sharing its cores with the relay and the broker",
    )


@contextlib.contextmanager
def servers(args: argparse.Namespace, *, need_broker: bool = True) -> Iterator[tuple[str, str | None]]:
    """(dsn, bootstrap): the given ones, or embedded servers started (and stopped) here."""
    from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-"))
    pg = broker = None
    database_cpus = parse_cpus(getattr(args, "database_cpus", None))
    if database_cpus:
        others = set(os.sched_getaffinity(0)) - database_cpus
        if not others:
            raise SystemExit("--database-cpus leaves no CPU for the relay and the broker")
        os.sched_setaffinity(0, others)  # inherited by the broker and relay subprocesses
    try:
        dsn = args.dsn
        if not dsn:
            say("starting embedded PostgreSQL 18 ...")
            pg = EmbeddedPostgres(base_dir=tmp).start()
            dsn = pg.dsn
        if database_cpus:
            pinned = pin_postgres(dsn, database_cpus)
            say(
                f"PostgreSQL pinned to CPU {sorted(database_cpus)} ({pinned} processes); "
                f"this process, the broker and the relay to CPU {sorted(os.sched_getaffinity(0))}"
            )
        bootstrap = getattr(args, "bootstrap", None)
        if need_broker and not bootstrap:
            if getattr(args, "broker", "tansu") == "kafka":
                from outbox_relay._embedded.kafka import KafkaBroker

                say("starting Apache Kafka (one KRaft node) ...")
                (tmp / "kafka").mkdir()
                broker = KafkaBroker(data_dir=tmp / "kafka", log_file=tmp / "broker.log").start()
            else:
                say("starting embedded Kafka-protocol broker (tansu) ...")
                broker = EmbeddedBroker(log_file=tmp / "broker.log").start()
            bootstrap = broker.bootstrap_servers
        yield dsn, bootstrap
    finally:
        if broker is not None:
            broker.stop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def default_broker() -> str:
    """``kafka`` when an Apache Kafka node can be started here (Java, and the jars or
    Maven to fetch them), else ``tansu``."""
    try:
        from outbox_relay._embedded.kafka import kafka_available
    except ImportError:
        return "tansu"
    return "kafka" if kafka_available() else "tansu"


def broker_label(args: argparse.Namespace) -> str:
    """What the figures were measured on, for every report."""
    if getattr(args, "bootstrap", None):
        return f"external ({args.bootstrap})"
    if getattr(args, "broker", "tansu") == "kafka":
        from outbox_relay._embedded.kafka import KAFKA_VERSION

        return f"Apache Kafka {KAFKA_VERSION} (one KRaft node)"
    return "embedded tansu"


def parse_cpus(text: str | None) -> set[int]:
    """ "0" / "0,2" / "0-1" -> a set of CPU numbers (empty for None)."""
    cpus: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def pin_postgres(dsn: str, cpus: set[int]) -> int:
    """Pin a local PostgreSQL's postmaster and its children to ``cpus``; backends
    started later are forked by the postmaster and inherit it. Returns how many
    processes were pinned."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        postmaster = _ppid(backend)
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == postmaster]
        for pid in (postmaster, *children):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, cpus)
    return 1 + len(children)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def server_version(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])


# --- tables ------------------------------------------------------------------------------
def new_table(prefix: str) -> str:
    """A schema-qualified outbox table in a schema of its own (fresh per variant)."""
    return f"bench_{prefix}_{RUN_ID}.outbox"


def migrate(
    dsn: str, table: str, *, notify_trigger: bool = True, ordering: bool = False, on_done: str = "keep"
) -> None:
    """``outbox-relay migrate``; ``ordering``: as with relay.ordered_event_types set;
    ``on_done``: the table's relay.on_done mode."""
    store = OutboxStore(dsn, table, pool_size=1)
    with store:
        store.migrate(notify_trigger=notify_trigger, ordering=ordering, on_done=on_done)


def drop_schema(dsn: str, table: str) -> None:
    schema = table.split(".")[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def ident(table: str) -> sql.Identifier:
    return sql.Identifier(*table.split("."))


def checkpoint(dsn: str) -> None:
    """Start each timed phase without the previous phase's dirty buffers (superuser only)."""
    with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def payload_json(seq: int, size: int) -> str:
    """JSON text of about ``size`` bytes."""
    base = {"seq": seq, "amount": seq % 9973, "currency": "EUR", "note": ""}
    text = json.dumps(base, separators=(",", ":"))
    pad = max(0, size - len(text))
    base["note"] = "x" * pad
    return json.dumps(base, separators=(",", ":"))


def copy_backlog(
    conn: psycopg.Connection[Any],
    table: str,
    n: int,
    *,
    aggregates: int,
    payload_bytes: int,
    aggregate_type: str = "order",
    event_type: str = "OrderCreated",
    start: int = 0,
) -> None:
    """COPY ``n`` rows into ``table`` inside the caller's transaction (application columns only)."""
    stmt = sql.SQL("COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN").format(ident(table))
    with conn.cursor() as cur, cur.copy(stmt) as copy:
        for i in range(start, start + n):
            copy.write_row((aggregate_type, f"agg-{i % aggregates}", event_type, payload_json(i, payload_bytes)))


DEAD_AGGREGATES_SQL = """
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, created_at, status, available_at,
                     attempts, lease_version, last_error)
SELECT 'order', 'agg-' || g || '-dead', 'OrderCreated', jsonb_build_object('seq', -g, 'note', repeat('x', %(pad)s)),
       now() - interval '30 days' + g * interval '1 ms', 'dead', now() - interval '30 days' + g * interval '1 ms',
       12, 12, 'bench: an old dead row nobody retried or skipped'
FROM generate_series(1, %(n)s) AS g
"""


def add_dead_aggregates(dsn: str, table: str, n: int, *, payload_bytes: int = 200, analyze: bool = True) -> None:
    """``n`` aggregates holding nothing but one old dead row each (ids below any later row;
    aggregate ids 'agg-<n>-dead' sort among the live 'agg-<n>' ones),
    an operator's dead backlog; then VACUUM, with ANALYZE unless the caller's
    backlog is still to come (statistics of a table holding only dead rows would tell
    the planner that no row is ever pending)."""
    if n <= 0:
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(DEAD_AGGREGATES_SQL).format(table=ident(table)), {"n": n, "pad": max(0, payload_bytes - 40)}
        )
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}" if analyze else "VACUUM {}").format(ident(table)))


def count_by_status(dsn: str, table: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(ident(table))).fetchall()
    return {s: int(n) for s, n in rows}


def wait_drained(conn: psycopg.Connection[Any], table: str, *, timeout: float, interval: float = 0.01) -> float:
    """Poll until no row is pending or processing; returns time.monotonic() when seen.

    The probe is two EXISTS on the pending and processing partial indexes: cheap enough
    to poll every 10 ms without loading the database the way a count(*) of done rows
    would. The caller checks the done count afterwards."""
    probe = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending') "
        "OR EXISTS (SELECT 1 FROM {t} WHERE status = 'processing')"
    ).format(t=ident(table))
    deadline = time.monotonic() + timeout
    while True:
        (busy,) = conn.execute(probe).fetchone()
        now = time.monotonic()
        if not busy:
            return now
        if now > deadline:
            raise TimeoutError(f"{table}: not drained within {timeout:.0f}s")
        time.sleep(interval)


# --- Kafka -------------------------------------------------------------------------------
def create_topic(bootstrap: str, topic: str, partitions: int = 4) -> None:
    """Create the topic up front so no variant pays auto-creation inside its timing."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    try:
        futures = admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=1)], operation_timeout=10, request_timeout=15
        )
        for fut in futures.values():
            with contextlib.suppress(KafkaException):
                fut.result(timeout=15)
    except Exception as exc:  # auto-creation on first produce is the fallback
        say(f"  note: could not pre-create topic {topic}: {exc}")


def unique_message_ids(bootstrap: str, topic: str, expected: int, timeout: float = 180.0) -> tuple[int, int]:
    """(unique message ids, total messages) read back from ``topic``."""
    from outbox_relay._embedded.embedded import read_messages

    messages = read_messages(bootstrap, [topic], expected=expected, timeout=timeout)
    ids = {m["headers"].get("message_id") for m in messages}  # type: ignore[union-attr]
    ids.discard(None)
    return len(ids), len(messages)


# --- the relay as a subprocess -------------------------------------------------------------
def relay_command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "outbox_relay.operator.cli"]


def relay_env(dsn: str, table: str, bootstrap: str, topic: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    env.update(
        {
            "OUTBOX_RELAY_DATABASE__DSN": dsn,
            "OUTBOX_RELAY_DATABASE__TABLE": table,
            "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE": topic,
            "OUTBOX_RELAY_METRICS__PORT": "0",
            "OUTBOX_RELAY_LOG__FORMAT": "json",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
    )
    env.update(more)
    return env


def run_cli(args: Sequence[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*relay_command(), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"outbox-relay {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result


class RelayProcess:
    """``outbox-relay run`` in a subprocess; logs go to a file (never a pipe that could fill)."""

    def __init__(self, args: Sequence[str], env: dict[str, str]) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="outbox-relay-bench-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
        self.log_path = Path(self._log.name)
        self.proc = subprocess.Popen(
            [*relay_command(), "run", *args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay exited {self.proc.returncode} at start:\n{self.log_text()[-3000:]}")
            if '"relay started"' in self.log_text():
                return
            time.sleep(0.05)
        raise TimeoutError(f"relay did not start within {timeout:.0f}s:\n{self.log_text()[-3000:]}")

    def status_kb(self, field: str) -> int | None:
        """A ``VmHWM``/``VmRSS`` line of /proc/<pid>/status, in kB."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except (OSError, ValueError):
            return None
        return None

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the relay process so far (/proc/<pid>/stat), all threads."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.returncode = self.proc.returncode
        self._log.close()
        return int(self.returncode)

    def warnings(self, limit: int = 5) -> list[str]:
        out = []
        for line in self.log_text().splitlines():
            if '"level": "warning"' in line or '"level": "error"' in line:
                out.append(line[:300])
        return out[:limit]

    def cleanup(self) -> None:
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def jitter_sleep(seconds: float) -> None:
    time.sleep(seconds * random.uniform(0.9, 1.1))
