"""MVCC pressure: a steady writer while something holds the xmin horizon back.

One run per (on_done mode, holder): a fresh table migrated by the relay under test,
``outbox-relay run`` as a subprocess, a writer inserting ``--rate`` events/s (``--per-txn``
rows per transaction), first ``--baseline-seconds`` with nothing held (the baseline),
then a holder opened and kept for ``--minutes``, then released and ``--recovery-seconds``
more. Holders: ``snapshot`` (a REPEATABLE READ transaction that took its snapshot),
``prepared`` (a prepared transaction with an xid, left open), ``none``.

Sampled every ``--sample-seconds``: rows written and delivered (the relay's
``outbox_relay_published_total{outcome="done"}``), the backlog (written - delivered),
the relay's oldest-pending gauge, the mean time of the claim and of the finalize
statements over the window (pg_stat_statements, preloaded in the embedded PostgreSQL),
heap and index size and dead tuples of the outbox, and the relay's
``outbox_relay_xmin_horizon_age_seconds`` gauge when it has one. How long after the
holder opened the relay's ``status --json`` named it is measured too (a relay
without that key reports "n/a").

Batch-job scenario (``--batch-job-rows N``): instead of the samples above, the writer
at ``--rate`` (e.g. 500), the holder opened after ``--baseline-seconds`` and kept for
``--batch-job-warmup-seconds`` (so that the relay's full claims get slow and it turns to
fast claims), then, for each value of ``--batch-job-open-seconds`` (e.g. ``20,60``), one
batch transaction that writes N rows (in ten parts spread over its life, all keyed by
its start) and stays open that long before its commit. Measured per batch job: seconds
from its commit until none of its rows is pending or processing (delivered; polled
every 0.1 s by primary key range, up to ``--batch-job-timeout-seconds``), and the full
and fast claims the relay ran meanwhile (pg_stat_statements).

Ordered scenario (``--ordered``): the relay runs with ``relay.ordered_event_types =
["*"]`` (every row ordered by its aggregate, ``--aggregates`` of them, runs of up to
``--run-length``), so every claim is the ordered claim (ordered_bounds.py). The samples
add the ordered claims' statements (full: from the front of the aggregate index; fast:
the discovery and the bounded heads), and the summary the delivered events per second
before and during the hold: compare a ``--holders none`` run with a ``--holders
snapshot`` run of the same settings (throughput held / without the hold), or read
``delivered_ratio`` (held / baseline) of one run when ``--rate`` is within what the relay
delivers.

``--relay-root DIR``: run the relay (migrate and run) from another checkout, e.g. the
code before a change: ``git worktree add --detach /tmp/mvcc-before main``, then
``--relay-root /tmp/mvcc-before``. The bench itself always comes from this checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import _common as c
import psycopg
from psycopg import sql

CLAIM_PREFIX = "WITH victims AS"  # the plain claim (reap + claim in one statement)
FINALIZE_PREFIX = "WITH decided AS"
# The CLI of the relay under test, in either package layout (--relay-root may be older).
CLI_MAIN = (
    "import sys\ntry:\n    from outbox_relay.operator.cli import main\nexcept ImportError:\n"
    "    from outbox_relay.cli import main\nsys.argv[0] = 'outbox-relay'\nmain()"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(p)
    p.add_argument("--rate", type=int, default=3000, help="events written per second")
    p.add_argument("--per-txn", type=int, default=50, help="rows per writer transaction")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the holder stays open")
    p.add_argument("--baseline-seconds", type=float, default=60.0, help="writer + relay before the holder opens")
    p.add_argument("--recovery-seconds", type=float, default=60.0, help="after the holder is released")
    p.add_argument("--sample-seconds", type=float, default=10.0)
    p.add_argument(
        "--status-every-seconds",
        type=float,
        default=60.0,
        help="while the holder is open, time `outbox-relay status --json` (a new process) this often; 0: never",
    )
    p.add_argument("--on-done", default="keep,delete", help="comma-separated modes to run")
    p.add_argument("--holders", default="snapshot", help="comma-separated: snapshot, prepared, none")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--payload-bytes", type=int, default=200)
    p.add_argument("--ordered", action="store_true", help='ordered scenario: relay.ordered_event_types = ["*"]')
    p.add_argument("--aggregates", type=int, default=100, help="distinct aggregate_ids the writer spreads rows over")
    p.add_argument("--run-length", type=int, default=0, help="--ordered: relay.max_run_length (0: the default)")
    p.add_argument("--relay-root", help="checkout whose relay (migrate + run) is measured; default: this one")
    p.add_argument(
        "--relay-setting",
        action="append",
        default=[],
        metavar="SECTION__NAME=VALUE",
        help="a setting of the relay under test, as its OUTBOX_RELAY_ variable without the prefix (repeatable)",
    )
    p.add_argument("--label", default="", help="name of this relay in the report (e.g. before/after)")
    p.add_argument(
        "--autovacuum",
        choices=("migrate", "default"),
        default="migrate",
        help="default: RESET the table's autovacuum storage parameters after migrate "
        "(PostgreSQL's defaults), to measure what the settings migrate chooses change",
    )
    p.add_argument(
        "--explain-slower-ms",
        type=int,
        help="embedded PostgreSQL only: log the plan (ANALYZE, BUFFERS) of every statement slower than this "
        "(auto_explain) into --server-log",
    )
    p.add_argument("--server-log", help="embedded PostgreSQL only: write its log (and auto_explain plans) here (a dir)")
    p.add_argument(
        "--batch-job-rows",
        type=int,
        default=0,
        help="run the batch-job scenario: rows each batch transaction writes (0: the sampled hold instead)",
    )
    p.add_argument(
        "--batch-job-open-seconds",
        default="20,60",
        help="comma-separated: how long each batch transaction stays open before its commit (one job per value)",
    )
    p.add_argument(
        "--batch-job-warmup-seconds",
        type=float,
        default=90.0,
        help="holder open this long before the first batch job (the relay turns to fast claims meanwhile)",
    )
    p.add_argument(
        "--batch-job-timeout-seconds",
        type=float,
        default=600.0,
        help="the longest wait for a batch job's rows after its commit",
    )
    args = p.parse_args()
    if args.aggregates < 1:
        p.error("--aggregates must be 1 or more")
    if args.batch_job_rows < 0:
        p.error("--batch-job-rows must be 0 or more")
    try:
        args.batch_job_open = [float(v) for v in args.batch_job_open_seconds.split(",") if v.strip()]
    except ValueError:
        p.error(f"--batch-job-open-seconds must be comma-separated seconds, not {args.batch_job_open_seconds!r}")
    if args.batch_job_rows and (not args.batch_job_open or min(args.batch_job_open) < 0):
        p.error("--batch-job-open-seconds needs at least one value, none negative")
    return args


# --- servers -------------------------------------------------------------------------------
@contextlib.contextmanager
def database(args: argparse.Namespace) -> Any:
    """The embedded PostgreSQL with pg_stat_statements preloaded and prepared
    transactions enabled (a restart), or the given --dsn as it is."""
    if args.dsn:
        yield args.dsn
        return
    from outbox_relay._embedded.embedded import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-"))
    c.say("starting embedded PostgreSQL 18 (pg_stat_statements, max_prepared_transactions=10) ...")
    pg = EmbeddedPostgres(base_dir=tmp).start()
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            preload = ["pg_stat_statements"] + (["auto_explain"] if args.explain_slower_ms is not None else [])
            libraries = sql.SQL(", ").join(sql.Literal(name) for name in preload)  # a list, not one string
            conn.execute(sql.SQL("ALTER SYSTEM SET shared_preload_libraries = {}").format(libraries))
            if args.server_log:  # the server's own log file is copied there at the end
                conn.execute("ALTER SYSTEM SET log_checkpoints = on")
                conn.execute("ALTER SYSTEM SET log_autovacuum_min_duration = 0")
            if args.explain_slower_ms is not None:
                for name, value in (
                    ("auto_explain.log_min_duration", str(args.explain_slower_ms)),
                    ("auto_explain.log_analyze", "on"),
                    ("auto_explain.log_buffers", "on"),
                    ("auto_explain.log_wal", "on"),
                    ("auto_explain.log_timing", "off"),  # per-node timing costs more than it tells here
                ):
                    conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 10")
            conn.execute("ALTER SYSTEM SET max_connections = 200")
        pg.stop_server()
        pg.start_server()
        yield pg.dsn
    finally:
        if args.server_log:  # before stop(), which removes the data directory
            Path(args.server_log).mkdir(parents=True, exist_ok=True)
            for log_file in tmp.glob("**/data/log"):
                shutil.copy(log_file, Path(args.server_log) / "postgresql.log")
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def broker(args: argparse.Namespace) -> Any:
    if args.bootstrap:
        yield args.bootstrap
        return
    from outbox_relay._embedded.embedded import EmbeddedBroker

    tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-bench-broker-"))
    c.say("starting embedded Kafka-protocol broker (tansu) ...")
    b = EmbeddedBroker(log_file=tmp / "broker.log").start()
    try:
        yield b.bootstrap_servers
    finally:
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# --- the relay under test -----------------------------------------------------------------
def relay_env(
    args: argparse.Namespace, dsn: str, table: str, bootstrap: str, topic: str, on_done: str
) -> dict[str, str]:
    env = c.relay_env(
        dsn, table, bootstrap, topic, OUTBOX_RELAY_RELAY__ON_DONE=on_done, OUTBOX_RELAY_METRICS__HOST="127.0.0.1"
    )
    if args.ordered:
        env["OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES"] = '["*"]'
        if args.run_length:
            env["OUTBOX_RELAY_RELAY__MAX_RUN_LENGTH"] = str(args.run_length)
    for setting in args.relay_setting:  # e.g. DATABASE__STATEMENT_TIMEOUT_MS=60000
        name, _, value = setting.partition("=")
        env["OUTBOX_RELAY_" + name.upper()] = value
    root = Path(args.relay_root).resolve() if args.relay_root else c.ROOT
    env["PYTHONPATH"] = str(root)
    return env


def relay_cli(env: dict[str, str], *cli_args: str, timeout: float = 120) -> str:
    import subprocess

    cmd = [sys.executable, "-c", CLI_MAIN, *cli_args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")
    if result.returncode != 0:
        raise RuntimeError(f"outbox-relay {' '.join(cli_args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


class Relay(c.RelayProcess):
    """The relay subprocess, run from --relay-root (PYTHONPATH first, cwd /)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        import subprocess

        self._log = tempfile.NamedTemporaryFile(prefix="outbox-relay-bench-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
        self.log_path = Path(self._log.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLI_MAIN, "run", *args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
        )
        self.returncode = None

    def metrics_port(self) -> int:
        for line in self.log_text().splitlines():
            if '"relay started"' in line:
                return int(json.loads(line)["metrics_port"])
        raise RuntimeError("no 'relay started' line with metrics_port")


def scrape(port: int) -> dict[str, float]:
    """name{labels} -> value of the relay's /metrics (only the series this bench reads)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


# --- load --------------------------------------------------------------------------------
class Writer(threading.Thread):
    """``rate`` events/s in transactions of ``per_txn`` rows, on an absolute schedule."""

    def __init__(
        self, dsn: str, table: str, rate: int, per_txn: int, payload_bytes: int, aggregates: int = 100
    ) -> None:
        super().__init__(name="writer", daemon=True)
        self.dsn, self.table, self.rate, self.per_txn = dsn, table, rate, per_txn
        self.aggregates = aggregates
        self.pad = max(0, payload_bytes - 40)
        self.written = 0
        self.history: list[tuple[int, float]] = []  # (rows written so far, when): the delivery lag
        self.behind_max_seconds = 0.0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        stmt = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', 'agg-' || (g %% %(aggregates)s), 'OrderCreated', "
            "jsonb_build_object('seq', g, 'note', repeat('x', %(pad)s)) "
            "FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g"
        ).format(c.ident(self.table))
        interval = self.per_txn / self.rate
        try:
            with psycopg.connect(self.dsn, autocommit=True, application_name="bench-writer") as conn:
                conn.execute("SET synchronous_commit = off")
                start = time.monotonic()
                n = 0
                while not self.stop_event.is_set():
                    due = start + n * interval
                    now = time.monotonic()
                    if due > now:
                        time.sleep(due - now)
                    else:
                        self.behind_max_seconds = max(self.behind_max_seconds, now - due)
                    conn.execute(
                        stmt,
                        {
                            "pad": self.pad,
                            "aggregates": self.aggregates,
                            "first": self.written + 1,
                            "last": self.written + self.per_txn,
                        },
                    )
                    self.written += self.per_txn
                    self.history.append((self.written, time.monotonic()))
                    n += 1
        except BaseException as exc:  # reported by the run
            self.error = exc

    def lag_seconds(self, delivered: int, now: float) -> float:
        """How long ago the first undelivered row was written (rows delivered in about
        write order): the age of the oldest pending row, measured without the database."""
        import bisect

        index = bisect.bisect_right(self.history, (delivered, float("inf")))
        if index >= len(self.history):
            return 0.0
        return now - self.history[index][1]


class Holder:
    """What holds the horizon: a REPEATABLE READ snapshot, or a prepared transaction."""

    def __init__(self, dsn: str, kind: str) -> None:
        self.kind = kind
        self.dsn = dsn
        self.conn: psycopg.Connection[Any] | None = None
        self.pid: int | None = None
        self.gid = f"bench-mvcc-{c.RUN_ID}"

    def open(self) -> None:
        if self.kind == "none":
            return
        conn = psycopg.connect(self.dsn, application_name=f"bench-holder-{self.kind}")
        self.pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        conn.rollback()
        if self.kind == "snapshot":
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT count(*) FROM pg_class").fetchone()  # takes the snapshot
            self.conn = conn
        else:
            conn.execute("SELECT pg_current_xact_id()").fetchone()  # an xid: what a prepared write holds
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(self.gid)))
            conn.close()

    def release(self) -> None:
        if self.kind == "snapshot" and self.conn is not None:
            self.conn.rollback()
            self.conn.close()
            self.conn = None
        elif self.kind == "prepared":
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(self.gid)))

    def named_by(self, doc: dict[str, Any]) -> bool:
        horizon = doc.get("xmin_horizon") or {}
        holder = horizon.get("holder") or {}
        if self.kind == "snapshot":
            return holder.get("pid") == self.pid
        return holder.get("gid") == self.gid


# --- sampling ----------------------------------------------------------------------------
KINDS = (
    "claim",
    "claim_full",
    "claim_sweep",
    "claim_fast",
    "finalize",
    "ordered_full",
    "ordered_discover",
    "ordered_bounded",
)
# A fast claim (claim_cursor.py) bounds its processing-index scan by a parameter
# ("lease_until >= $n::timestamptz"); a full claim has no such bound. Relays from before
# the bounds became index conditions wrote "($a::timestamptz IS NULL OR lease_until >=
# $b::timestamptz)", with the same parameter twice in a fast claim. A relay before the
# fast/full split has one statement only: all its claims count as "full" here.
FAST_CLAIM = re.compile(r"(?<!OR )lease_until >= \$\d+::timestamptz")
FAST_CLAIM_BEFORE = re.compile(r"\((\$\d+)::timestamptz IS NULL OR lease_until >= (\$\d+)::timestamptz\)")


# A sweep step (the full claim while fast claims are in use, claim_cursor.py Sweep)
# bounds its processing-index scan from above too: counted apart, as "claim_sweep".
SWEEP_CLAIM = re.compile(r"lease_until >= \$\d+::timestamptz AND lease_until < \$\d+::timestamptz")


def is_fast_claim(text: str) -> bool:
    before = FAST_CLAIM_BEFORE.search(text)
    if before is not None:
        return before.group(1) == before.group(2)
    return FAST_CLAIM.search(text) is not None


# The ordered claims' statements (delivery.sql), told apart by text that survives
# pg_stat_statements' normalization: the heads from the front of the aggregate index
# (full), and a fast claim's discovery and bounded heads.
ORDERED_FULL_PREFIX = "WITH RECURSIVE paused"
ORDERED_DISCOVER_MARK = "due AS MATERIALIZED"
ORDERED_BOUNDED_MARK = "WITH ORDINALITY AS v(aggregate_id, bound, ord)"


def statement_totals(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, float]]:
    """(calls, total ms) of the claim (all, full, sweep steps, fast), the ordered claim's
    (full, and a fast one's discovery and heads) and finalize statements since the last
    reset; under "<name>_rows", (rows claimed, the same total ms): a plain claim statement
    returns its claimed and reaped rows and one report row; under "<name>_max", (1, the
    longest call in ms since the last reset)."""
    names_all = KINDS
    out = dict.fromkeys(names_all, (0, 0.0)) | {f"{name}_rows": (0, 0.0) for name in names_all}
    out |= {f"{name}_max": (0, 0.0) for name in names_all}
    rows = conn.execute(
        "SELECT query, calls, total_exec_time, rows, max_exec_time FROM pg_stat_statements "
        "WHERE query LIKE %s OR query LIKE %s OR query LIKE %s OR query LIKE %s",
        (CLAIM_PREFIX + "%", FINALIZE_PREFIX + "%", ORDERED_FULL_PREFIX + "%", "%" + ORDERED_BOUNDED_MARK + "%"),
    ).fetchall()
    for text, calls, total, returned, longest in rows:
        claimed = int(returned)  # the ordered statements return their claimed rows only
        if text.startswith(FINALIZE_PREFIX):
            names = ["finalize"]
        elif text.startswith(ORDERED_FULL_PREFIX):
            names = ["ordered_full"]
        elif ORDERED_DISCOVER_MARK in text:
            names = ["ordered_discover"]
        elif ORDERED_BOUNDED_MARK in text:
            names = ["ordered_bounded"]
        else:
            kind = "claim_sweep" if SWEEP_CLAIM.search(text) else "claim_fast" if is_fast_claim(text) else "claim_full"
            names = ["claim", kind]
            claimed = int(returned) - int(calls)
        for name in names:
            out[name] = (out[name][0] + int(calls), out[name][1] + float(total))
            out[f"{name}_rows"] = (out[f"{name}_rows"][0] + claimed, out[f"{name}_rows"][1] + float(total))
            out[f"{name}_max"] = (1, max(out[f"{name}_max"][1], float(longest or 0.0)))
    return out


def table_figures(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), s.n_dead_tup, s.autovacuum_count, s.vacuum_count, "
        "(SELECT count(*) FROM pg_stat_progress_vacuum AS v WHERE v.relid = c.oid) "
        "FROM pg_class AS c LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid WHERE c.oid = %s::regclass",
        (table,),
    ).fetchone()
    assert row is not None
    schema = table.split(".", 1)[0] if "." in table else "public"
    flips = conn.execute(
        "SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables WHERE schemaname = %s AND relname LIKE %s",
        (schema, "%state%"),
    ).fetchone()
    return {
        "vacuuming": int(row[5]),  # an autovacuum of the outbox is running at the sample
        # updates of the relays' state row so far (the idle flag: set after an empty
        # claim, cleared by a notification): each leaves a dead version while vacuum is held
        "state_updates": int(flips[0]) if flips else 0,
        "heap_mb": round(row[0] / 2**20, 1),
        "index_mb": round(row[1] / 2**20, 1),
        "dead_tuples": int(row[2] or 0),
        "autovacuums": int(row[3] or 0) + int(row[4] or 0),
    }


def run_one(args: argparse.Namespace, dsn: str, bootstrap: str, on_done: str, holder_kind: str) -> dict[str, Any]:
    table = c.new_table(f"mvcc_{on_done}_{holder_kind}")
    topic = f"bench-mvcc-{c.RUN_ID}-{on_done}-{holder_kind}"
    c.create_topic(bootstrap, topic)
    env = relay_env(args, dsn, table, bootstrap, topic, on_done)
    relay_cli(env, "migrate")
    with psycopg.connect(dsn, autocommit=True) as conn:
        reloptions = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
        if args.autovacuum == "default":
            for option in reloptions[0] if reloptions and reloptions[0] else []:
                name = option.split("=", 1)[0]
                if name.startswith("autovacuum_"):
                    conn.execute(sql.SQL("ALTER TABLE {} RESET ({})").format(c.ident(table), sql.SQL(name)))
            reloptions = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
    c.say(
        f"[{args.label or 'relay'} {on_done} {holder_kind}] table {table}, "
        f"reloptions {reloptions[0] if reloptions else None}"
    )
    relay = Relay(["--workers", str(args.workers)], env)
    writer = Writer(dsn, table, args.rate, args.per_txn, args.payload_bytes, args.aggregates)
    holder = Holder(dsn, holder_kind)
    samples: list[dict[str, Any]] = []
    named_after: float | None = None
    gauge_after: float | None = None
    cli_start_s: float | None = None
    try:
        relay.wait_started()
        port = relay.metrics_port()
        asked = time.monotonic()
        relay_cli(env, "--version")  # what a new CLI process costs before any query (part of status_s)
        cli_start_s = round(time.monotonic() - asked, 2)
        mon = psycopg.connect(dsn, autocommit=True, application_name="bench-monitor")
        mon.execute("SELECT pg_stat_statements_reset()")
        writer.start()
        t0 = time.monotonic()
        hold_at = t0 + args.baseline_seconds
        release_at = hold_at + args.minutes * 60
        end_at = release_at + args.recovery_seconds
        held = released = False
        last_totals = statement_totals(mon)
        next_sample = t0 + args.sample_seconds
        next_status = hold_at + args.status_every_seconds
        status_s: float | None = None  # the last `status --json` (a new process) in the sample's window
        counted_from: Any = None
        while time.monotonic() < end_at:
            now = time.monotonic()
            if held and not released and args.status_every_seconds > 0 and now >= next_status:
                asked = time.monotonic()
                doc = json.loads(relay_cli(env, "status", "--json"))
                status_s = round(time.monotonic() - asked, 2)
                counted_from = doc.get("counted_from", "n/a")
                next_status = time.monotonic() + args.status_every_seconds
                continue
            if not held and now >= hold_at:
                holder.open()
                held = True
                opened = time.monotonic()
                if holder_kind != "none":
                    named_after, gauge_after = wait_named(env, port, holder, opened, timeout=60)
                    c.say(f"  holder named by status after {named_after} s, gauge >= 1 s after {gauge_after} s")
            if held and not released and now >= release_at:
                holder.release()
                released = True
            if now < next_sample:
                time.sleep(min(0.5, next_sample - now))
                continue
            next_sample = max(next_sample + args.sample_seconds, time.monotonic())
            now = time.monotonic()
            if writer.error is not None:
                raise RuntimeError(f"writer failed: {writer.error}")
            metrics = scrape(port)
            totals = statement_totals(mon)
            window = {k: (totals[k][0] - last_totals[k][0], totals[k][1] - last_totals[k][1]) for k in totals}
            last_totals = totals
            delivered = int(metrics.get("outbox_relay_published_total{outcome=done}", 0))
            phase = "baseline" if not held else ("held" if not released else "released")
            sample = {
                "t": round(now - t0),
                "at": time.strftime("%H:%M:%S"),  # wall clock, to match the server log
                "phase": phase,
                "written": writer.written,
                "delivered": delivered,
                "backlog": writer.written - delivered,
                "oldest_pending_s": metrics.get("outbox_relay_oldest_pending_age_seconds"),
                "lag_s": round(writer.lag_seconds(delivered, now), 2),
                "claim_ms": round(window["claim"][1] / window["claim"][0], 2) if window["claim"][0] else None,
                "claims": window["claim"][0],
                "full_claims": window["claim_full"][0],
                "full_claim_ms": (
                    round(window["claim_full"][1] / window["claim_full"][0], 2) if window["claim_full"][0] else None
                ),
                # The full claim as a sweep of bounded steps (fast claims in use): steps
                # in the window, their mean, and the longest step so far.
                "sweep_steps": window["claim_sweep"][0],
                "sweep_step_ms": (
                    round(window["claim_sweep"][1] / window["claim_sweep"][0], 2) if window["claim_sweep"][0] else None
                ),
                "sweep_step_max_ms": round(totals["claim_sweep_max"][1], 1),
                "full_claim_max_ms": round(totals["claim_full_max"][1], 1),
                "fast_claim_ms": (
                    round(window["claim_fast"][1] / window["claim_fast"][0], 2) if window["claim_fast"][0] else None
                ),
                "finalize_ms": (
                    round(window["finalize"][1] / window["finalize"][0], 2) if window["finalize"][0] else None
                ),
                **(ordered_figures(window) if args.ordered else {}),
                "xmin_gauge_s": metrics.get("outbox_relay_xmin_horizon_age_seconds"),
                # `outbox-relay status --json` in its own process (every --status-every-seconds
                # while held): seconds, and whether it counted from the relays' published start
                "status_s": status_s,
                "status_bounded": None if status_s is None else counted_from not in (None, "n/a"),
                **table_figures(mon, table),
            }
            status_s = None
            samples.append(sample)
            c.say("  " + " ".join(f"{k}={v}" for k, v in sample.items()))
        writer.stop_event.set()
        writer.join(timeout=30)
        mon.close()
    finally:
        writer.stop_event.set()
        if holder.conn is not None or (holder_kind == "prepared" and holder.pid is not None):
            with contextlib.suppress(Exception):
                holder.release()
        code = relay.stop()
        warnings = relay.warnings(limit=20)
        relay.cleanup()
    result = summarize(args, on_done, holder_kind, samples, named_after, gauge_after, writer, code, warnings)
    result["cli_start_s"] = cli_start_s
    return result


def ordered_figures(window: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """The ordered claims of one sample window: how many full and fast ones, and their
    mean time (a fast one: its discovery + its bounded heads)."""
    full_calls, full_ms = window["ordered_full"]
    fast_calls, discover_ms = window["ordered_discover"]
    bounded_ms = window["ordered_bounded"][1]
    return {
        "ordered_full_claims": full_calls,
        "ordered_full_ms": round(full_ms / full_calls, 2) if full_calls else None,
        "ordered_fast_claims": fast_calls,
        "ordered_fast_ms": round((discover_ms + bounded_ms) / fast_calls, 2) if fast_calls else None,
    }


def delivered_per_second(samples: list[dict[str, Any]], before: dict[str, Any] | None) -> float | None:
    """Events delivered per second over consecutive samples (from the sample before them)."""
    if not samples:
        return None
    first = before if before is not None else samples[0]
    seconds = samples[-1]["t"] - first["t"]
    return round((samples[-1]["delivered"] - first["delivered"]) / seconds, 1) if seconds > 0 else None


# --- batch-job scenario ---------------------------------------------------------------------
BATCH_JOB_PARTS = 10  # a batch transaction writes its rows in this many statements over its life


def batch_job(
    dsn: str, table: str, rows: int, open_seconds: float, label: str, payload_bytes: int
) -> tuple[int, int, float]:
    """One transaction that writes ``rows`` rows (aggregate_id ``label``) in parts spread
    over ``open_seconds``, then commits: (lowest id, highest id, monotonic time of the commit)."""
    stmt = sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', %(label)s, 'OrderImported', jsonb_build_object('seq', g, 'note', repeat('x', %(pad)s)) "
        "FROM generate_series(1, %(n)s) AS g RETURNING id"
    ).format(c.ident(table))
    parts = [rows // BATCH_JOB_PARTS + (1 if i < rows % BATCH_JOB_PARTS else 0) for i in range(BATCH_JOB_PARTS)]
    ids: list[int] = []
    with psycopg.connect(dsn, application_name="bench-batch-job") as conn:
        began = time.monotonic()
        for i, n in enumerate(parts):
            due = began + open_seconds * i / (BATCH_JOB_PARTS - 1)
            time.sleep(max(0.0, due - time.monotonic()))
            if n:
                ids += [r[0] for r in conn.execute(stmt, {"label": label, "pad": max(0, payload_bytes - 40), "n": n})]
        time.sleep(max(0.0, began + open_seconds - time.monotonic()))
        conn.commit()
        committed = time.monotonic()
    return min(ids), max(ids), committed


# What the relay's backends are doing (printed while a batch job's rows wait).
RELAY_BACKENDS = (
    "SELECT pid, state, wait_event_type, wait_event,"
    " round(extract(epoch FROM clock_timestamp() - query_start)::numeric, 1),"
    " left(regexp_replace(query, '\\s+', ' ', 'g'), 80) FROM pg_stat_activity"
    " WHERE application_name LIKE 'outbox-relay%%' AND state <> 'idle' ORDER BY query_start"
)


def wait_batch_delivered(
    conn: psycopg.Connection[Any], table: str, label: str, id_range: tuple[int, int], rows: int, timeout: float
) -> tuple[float | None, float | None, int]:
    """Seconds from now until the first of the batch's rows was claimed (fewer than
    ``rows`` pending) and until none is pending or processing (None: not within
    ``timeout``), and how many were left at the end."""
    query = sql.SQL(
        "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FROM {} "
        "WHERE id BETWEEN %s AND %s AND aggregate_id = %s AND status IN ('pending', 'processing')"
    ).format(c.ident(table))
    started = time.monotonic()
    first: float | None = None
    left = -1
    last_dump = started
    while time.monotonic() - started < timeout:
        pending, left = (int(v) for v in conn.execute(query, (*id_range, label)).fetchone())  # type: ignore[union-attr]
        if first is None and pending < rows:
            first = time.monotonic() - started
        if first is None and time.monotonic() - last_dump >= 5.0:  # none claimed yet: what the relay waits for
            last_dump = time.monotonic()
            for line in conn.execute(RELAY_BACKENDS).fetchall():
                c.say("    still none claimed: " + " | ".join(str(v) for v in line))
        if left == 0:
            return first, time.monotonic() - started, 0
        time.sleep(0.05)
    return first, None, left


def mean_claim_ms(
    before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]], kind: str = "claim"
) -> float | None:
    """The mean time of the claims (``kind``: claim, claim_fast, claim_full) between two
    totals; with ``kind`` + "_rows", per row claimed."""
    calls = after[kind][0] - before[kind][0]
    return round((after[kind][1] - before[kind][1]) / calls, 3) if calls else None


def run_batch_jobs(
    args: argparse.Namespace, dsn: str, bootstrap: str, on_done: str, holder_kind: str
) -> dict[str, Any]:
    table = c.new_table(f"mvcc_{on_done}_{holder_kind}")
    topic = f"bench-mvcc-{c.RUN_ID}-{on_done}-{holder_kind}"
    c.create_topic(bootstrap, topic)
    env = relay_env(args, dsn, table, bootstrap, topic, on_done)
    relay_cli(env, "migrate")
    c.say(f"[{args.label or 'relay'} {on_done} {holder_kind}] batch jobs, table {table}")
    relay = Relay(["--workers", str(args.workers)], env)
    writer = Writer(dsn, table, args.rate, args.per_txn, args.payload_bytes, args.aggregates)
    holder = Holder(dsn, holder_kind)
    jobs: list[dict[str, Any]] = []
    try:
        relay.wait_started()
        mon = psycopg.connect(dsn, autocommit=True, application_name="bench-monitor")
        writer.start()
        time.sleep(min(5.0, args.baseline_seconds / 2))  # the relay's first claims and plans
        baseline_from = statement_totals(mon)
        time.sleep(max(0.0, args.baseline_seconds - min(5.0, args.baseline_seconds / 2)))
        baseline_to = statement_totals(mon)
        baseline_claim_ms = mean_claim_ms(baseline_from, baseline_to)
        baseline_claim_ms_per_row = mean_claim_ms(baseline_from, baseline_to, "claim_rows")
        holder.open()
        c.say(f"  baseline claim {baseline_claim_ms} ms; holder open; jobs after {args.batch_job_warmup_seconds} s")
        time.sleep(args.batch_job_warmup_seconds)
        for i, open_seconds in enumerate(args.batch_job_open):
            label = f"batch-job-{i}"
            before = statement_totals(mon)
            low, high, _ = batch_job(dsn, table, args.batch_job_rows, open_seconds, label, args.payload_bytes)
            first, seconds, left = wait_batch_delivered(
                mon, table, label, (low, high), args.batch_job_rows, args.batch_job_timeout_seconds
            )
            after = statement_totals(mon)
            if writer.error is not None:
                raise RuntimeError(f"writer failed: {writer.error}")
            job = {
                "open_s": open_seconds,
                "rows": args.batch_job_rows,
                "commit_to_first_claimed_s": round(first, 2) if first is not None else None,
                "commit_to_delivered_s": round(seconds, 2) if seconds is not None else None,
                "left_at_timeout": left if seconds is None else 0,
                "full_claims": after["claim_full"][0] - before["claim_full"][0],
                "sweep_steps": after["claim_sweep"][0] - before["claim_sweep"][0],
                "fast_claims": after["claim_fast"][0] - before["claim_fast"][0],
                "claim_ms_mean": mean_claim_ms(before, after),
                "fast_claim_ms_mean": mean_claim_ms(before, after, "claim_fast"),
                "full_claim_ms_mean": mean_claim_ms(before, after, "claim_full"),
                "baseline_claim_ms": baseline_claim_ms,
                "fast_claim_ms_per_row": mean_claim_ms(before, after, "claim_fast_rows"),
                "baseline_claim_ms_per_row": baseline_claim_ms_per_row,
            }
            jobs.append(job)
            c.say("  " + " ".join(f"{k}={v}" for k, v in job.items()))
        writer.stop_event.set()
        writer.join(timeout=30)
        mon.close()
    finally:
        writer.stop_event.set()
        if holder.conn is not None or (holder_kind == "prepared" and holder.pid is not None):
            with contextlib.suppress(Exception):
                holder.release()
        code = relay.stop()
        warnings = relay.warnings(limit=20)
        relay.cleanup()
    return {
        "label": args.label,
        "on_done": on_done,
        "holder": holder_kind,
        "rate": args.rate,
        "warmup_s": args.batch_job_warmup_seconds,
        "written": writer.written,
        "batch_jobs": jobs,
        "relay_exit": code,
        "relay_warnings": warnings,
    }


def wait_named(
    env: dict[str, str], port: int, holder: Holder, opened: float, timeout: float
) -> tuple[float | None, float | None]:
    """Seconds until `status --json` names the holder, and until the relay's gauge shows
    an age of at least 1 s (short transactions of the writer and the relay itself keep
    it a few milliseconds above 0 all the time)."""
    named = gauge = None
    deadline = opened + timeout
    supported = True
    while time.monotonic() < deadline and (named is None or gauge is None):
        if gauge is None:
            value = scrape(port).get("outbox_relay_xmin_horizon_age_seconds")
            if value is None:
                gauge = float("nan")  # this relay has no such gauge
            elif value >= 1.0:
                gauge = round(time.monotonic() - opened, 1)
        if named is None and supported:
            asked = time.monotonic()
            doc = json.loads(relay_cli(env, "status", "--json"))
            c.say(f"  status --json took {time.monotonic() - asked:.1f} s (a new process, counts included)")
            if "xmin_horizon" not in doc:
                supported = False
                named = float("nan")
            elif holder.named_by(doc):
                named = round(time.monotonic() - opened, 1)
        time.sleep(0.5)
    return named, gauge


def summarize(
    args: argparse.Namespace,
    on_done: str,
    holder: str,
    samples: list[dict[str, Any]],
    named_after: float | None,
    gauge_after: float | None,
    writer: Writer,
    code: int,
    warnings: list[str],
) -> dict[str, Any]:
    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 2) if values else None

    base = [s for s in samples if s["phase"] == "baseline"]
    held = [s for s in samples if s["phase"] == "held"]
    last_minute = [s for s in held if s["t"] >= held[-1]["t"] - 60] if held else []
    claim_base = mean([s["claim_ms"] for s in base if s["claim_ms"] is not None])
    claim_last = mean([s["claim_ms"] for s in last_minute if s["claim_ms"] is not None])
    oldest = [
        s["oldest_pending_s"]
        for s in held
        if s["oldest_pending_s"] is not None and s["oldest_pending_s"] == s["oldest_pending_s"]
    ]
    lags = [s["lag_s"] for s in held]
    final = held[-1] if held else (samples[-1] if samples else {})
    # After the release: how long until a vacuum removed the dead rows (the first sample
    # with fewer dead tuples than the one before: a vacuum that started before the
    # release completes after it having removed nothing), and until the lag was back
    # under 1 s to stay.
    released = [s for s in samples if s["phase"] == "released"]
    release_t = args.baseline_seconds + args.minutes * 60
    first_vacuum = next(
        (s for prev, s in zip([final, *released], released, strict=False) if s["dead_tuples"] < prev["dead_tuples"]),
        None,
    )
    held_before = base[-1] if base else None
    rate_base = delivered_per_second(base, {"t": 0, "delivered": 0})  # the writer starts at t = 0
    rate_held = delivered_per_second(held, held_before)
    lagging = [s for s in released if s["lag_s"] >= 1.0]
    caught_up = [s for s in released if not lagging or s["t"] > lagging[-1]["t"]]
    return {
        "label": args.label,
        "on_done": on_done,
        "holder": holder,
        "minutes_held": args.minutes,
        "rate": args.rate,
        "written": writer.written,
        "writer_behind_max_s": round(writer.behind_max_seconds, 2),
        "claim_ms_baseline": claim_base,
        "claim_ms_last_minute_held": claim_last,
        "claim_ratio": round(claim_last / claim_base, 2) if claim_base and claim_last else None,
        "ordered": bool(args.ordered),
        "aggregates": args.aggregates,
        "delivered_per_s_baseline": rate_base,
        "delivered_per_s_held": rate_held,
        "delivered_ratio": round(rate_held / rate_base, 2) if rate_base and rate_held else None,
        "oldest_pending_max_s": round(max(oldest), 1) if oldest else None,
        "oldest_pending_gauge_samples": f"{len(oldest)}/{len(held)}",
        "lag_max_s": round(max(lags), 1) if lags else None,
        "lag_last_minute_max_s": max((s["lag_s"] for s in last_minute), default=None),
        "backlog_max": max((s["backlog"] for s in held), default=None),
        "backlog_end_of_hold": final.get("backlog"),
        "heap_mb_end_of_hold": final.get("heap_mb"),
        "index_mb_end_of_hold": final.get("index_mb"),
        "dead_tuples_end_of_hold": final.get("dead_tuples"),
        "after_release": samples[-1] if samples else None,
        "dead_tuples_removed_after_release_s": round(first_vacuum["t"] - release_t) if first_vacuum else None,
        "lag_under_1s_after_release_s": round(caught_up[0]["t"] - release_t) if caught_up else None,
        "heap_mb_end_of_run": released[-1]["heap_mb"] if released else None,
        "index_mb_end_of_run": released[-1]["index_mb"] if released else None,
        "dead_tuples_end_of_run": released[-1]["dead_tuples"] if released else None,
        "status_named_holder_after_s": named_after,
        # `status --json` while held: the longest and the last (seconds, a new process each)
        "status_s_max_held": max((s["status_s"] for s in held if s.get("status_s") is not None), default=None),
        "status_s_last_held": next((s["status_s"] for s in reversed(held) if s.get("status_s") is not None), None),
        # full claims while held: from the front (count, longest ms) and as sweep steps
        "full_claims_held": sum(s["full_claims"] for s in held),
        "full_claim_max_ms": final.get("full_claim_max_ms"),
        "sweep_steps_held": sum(s.get("sweep_steps", 0) for s in held),
        "sweep_step_max_ms": final.get("sweep_step_max_ms"),
        "gauge_at_least_1s_after_s": gauge_after,
        "relay_exit": code,
        "relay_warnings": warnings,
        "samples": samples,
    }


def main() -> int:
    args = parse_args()
    results = []
    with database(args) as dsn, broker(args) as bootstrap:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        version = c.server_version(dsn)
        for on_done in [m.strip() for m in args.on_done.split(",") if m.strip()]:
            for holder in [h.strip() for h in args.holders.split(",") if h.strip()]:
                table = c.new_table(f"mvcc_{on_done}_{holder}")
                run = run_batch_jobs if args.batch_job_rows else run_one
                try:
                    results.append(run(args, dsn, bootstrap, on_done, holder))
                finally:
                    if not args.keep:
                        c.drop_schema(dsn, table)
    report = {
        "bench": "mvcc_pressure",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "postgresql": version,
        "relay_root": args.relay_root or str(c.ROOT),
        "label": args.label,
        "cpus": os.cpu_count(),
        "runs": results,
    }
    title = f"mvcc_pressure {report['date']} PostgreSQL {version}, relay {args.label or report['relay_root']}"
    if args.batch_job_rows:
        lines = [
            title,
            f"{'on_done':<8}{'holder':<10}{'rate':>6}{'rows':>7}{'open s':>8}{'-> first claimed s':>19}"
            f"{'-> all delivered s':>19}{'full claims':>12}{'fast claims':>12}{'claim ms':>9}{'fast ms':>8}"
            f"{'full ms':>9}{'base ms':>8}{'fast ms/row':>12}{'base ms/row':>12}",
        ]
        for r in results:
            for job in r["batch_jobs"]:
                delivered = job["commit_to_delivered_s"]
                shown = (
                    delivered
                    if delivered is not None
                    else f">{args.batch_job_timeout_seconds:g} ({job['left_at_timeout']} left)"
                )
                lines.append(
                    f"{r['on_done']:<8}{r['holder']:<10}{r['rate']:>6}{job['rows']:>7}{job['open_s']:>8g}"
                    f"{job['commit_to_first_claimed_s']!s:>19}{shown!s:>19}{job['full_claims']:>12}"
                    f"{job['fast_claims']:>12}{job['claim_ms_mean']!s:>9}{job['fast_claim_ms_mean']!s:>8}"
                    f"{job['full_claim_ms_mean']!s:>9}{job['baseline_claim_ms']!s:>8}"
                    f"{job['fast_claim_ms_per_row']!s:>12}{job['baseline_claim_ms_per_row']!s:>12}"
                )
        c.emit(report, lines, args.json)
        return 0
    lines = [
        title,
        f"{'on_done':<8}{'holder':<10}{'claim ms base':>14}{'claim ms held':>14}{'ratio':>7}"
        f"{'oldest max s':>13}{'lag max s':>10}{'backlog max':>12}{'heap MB':>9}{'index MB':>9}"
        f"{'dead tup':>10}{'named s':>8}",
    ]
    for r in results:
        lines.append(
            f"{r['on_done']:<8}{r['holder']:<10}{r['claim_ms_baseline']!s:>14}"
            f"{r['claim_ms_last_minute_held']!s:>14}"
            f"{r['claim_ratio']!s:>7}{r['oldest_pending_max_s']!s:>13}{r['lag_max_s']!s:>10}"
            f"{r['backlog_max']!s:>12}"
            f"{r['heap_mb_end_of_hold']!s:>9}{r['index_mb_end_of_hold']!s:>9}"
            f"{r['dead_tuples_end_of_hold']!s:>10}{r['status_named_holder_after_s']!s:>8}"
        )
        if r.get("ordered"):
            lines.append(
                f"{'':<8}ordered ({r['aggregates']} aggregates): delivered/s baseline {r['delivered_per_s_baseline']}, "
                f"held {r['delivered_per_s_held']} (ratio {r['delivered_ratio']}), "
                f"lag max {r['lag_max_s']} s, last minute held {r['lag_last_minute_max_s']} s"
            )
        lines.append(
            f"{'':<8}full claims while held: {r['full_claims_held']} from the front (longest since start "
            f"{r['full_claim_max_ms']} ms), {r['sweep_steps_held']} sweep steps (longest {r['sweep_step_max_ms']} ms); "
            f"status --json took up to {r['status_s_max_held']} s (last {r['status_s_last_held']} s; "
            f"a new CLI process alone: {r.get('cli_start_s')} s)"
        )
        lines.append(
            f"{'':<8}after the release: dead tuples removed after {r['dead_tuples_removed_after_release_s']} s, "
            f"lag < 1 s after {r['lag_under_1s_after_release_s']} s; end of run: heap {r['heap_mb_end_of_run']} MB, "
            f"indexes {r['index_mb_end_of_run']} MB, dead tuples {r['dead_tuples_end_of_run']}"
        )
    c.emit(report, lines, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
