"""Many outboxes: one relay process for N databases versus one relay process per database.

    .venv/bin/python bench/many_sources.py                       # 200 databases, 10 single relays sampled
    .venv/bin/python bench/many_sources.py --sources 50 --backlog 100000 --per-process-sample 5

One PostgreSQL (embedded PostgreSQL 18, max_connections raised; or --dsn), one broker
(embedded tansu, or --bootstrap), N databases ``msb_<run>_<i>`` each with its outbox.
Phases, each printed as it ends:

1. **idle, one process** — ``outbox-relay run`` with ``[discovery]`` over the N
   databases; once every source is ready, a ``--idle-seconds`` window: the relay's RSS,
   its connections (pg_stat_activity), the transactions per second it makes the N
   databases run (pg_stat_database.xact_commit), and PostgreSQL's CPU (all its
   processes, /proc) per second.
2. **idle, one process per database** — ``--per-process-sample`` K single-source relays
   (what a deployment of N relays runs, K of them, as N would not fit this shared
   machine): the same figures for K, and scaled by N/K.
3. **idle source cost, LISTEN vs probing** — K' LISTEN sessions held by one process
   (what waking idle sources by LISTEN/NOTIFY needs: a session per database, on top of
   the pool's connection) against the relay's probing: connections, transactions/s and
   PostgreSQL backend memory (Pss of the backends) per idle source.
4. **throughput, all busy** — ``--rows-per-source`` rows in every database, then one
   multi-source relay drains them all; against one single-source relay draining the
   same total in one database. rows/s of each and the ratio.
5. **quiet source while another drains** — one database gets ``--backlog`` rows, a
   quiet one gets a row every ``--quiet-interval`` s while the backlog drains;
   insert -> finalize latency of the quiet rows (done_at - created_at, the database's
   clock: at least the insert -> acknowledgement time), p50/p99/max, and how much of the
   backlog was left when the measurement ended.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import (
    RUN_ID,
    RelayProcess,
    add_server_args,
    emit,
    median,
    pct,
    relay_env,
    say,
    servers,
)

import psycopg  # isort: skip

from outbox_relay.db.store import OutboxStore  # isort: skip


def db_dsn(dsn: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)


def create_databases(dsn: str, names: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
    for name in names:
        with OutboxStore(db_dsn(dsn, name), "outbox", pool_size=1) as store:
            store.migrate()


def drop_databases(dsn: str, names: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def raise_max_connections(dsn: str, wanted: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
        current = int(row[0]) if row else 0
    if current >= wanted:
        return
    raise SystemExit(
        f"max_connections is {current}; this run needs about {wanted} "
        "(ALTER SYSTEM SET max_connections and restart, or fewer --sources)"
    )


def relay_connections(dsn: str, prefix: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname LIKE %s AND application_name LIKE 'outbox-relay%%'",
            (prefix + "%",),
        ).fetchone()
        return int(row[0]) if row else 0


def xact_commits(dsn: str, prefix: str) -> int:
    return database_counters(dsn, prefix)[0]


def database_counters(dsn: str, prefix: str) -> tuple[int, int]:
    """(transactions committed or rolled back, sessions established) in the databases
    named ``prefix%`` so far (pg_stat_database)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT coalesce(sum(xact_commit + xact_rollback), 0), coalesce(sum(sessions), 0) "
            "FROM pg_stat_database WHERE datname LIKE %s",
            (prefix + "%",),
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)


def postgres_pids(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time(), pg_backend_pid()").fetchone()
        assert row is not None
        backend = int(row[1])
        # The postmaster is the backend's parent (read while the backend lives: it
        # exits with this connection); every server process is one of its children.
        ppid = int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
    pids = [ppid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def backend_pss_kb(dsn: str, prefix: str, application: str) -> tuple[int, int]:
    """(backends, summed Pss in kB) of the sessions of ``application`` in the bench databases."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname LIKE %s AND application_name = %s",
                (prefix + "%", application),
            ).fetchall()
        ]
    return len(pids), sum(pss_kb(pid) for pid in pids)


def wait_sources_ready(port: int, n: int, timeout: float) -> float:
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            up = sum(
                1 for line in text.splitlines() if line.startswith("outbox_relay_source_up{") and line.endswith(" 1.0")
            )
            if up >= n:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not all {n} sources ready within {timeout:.0f}s")


def metrics_port(relay: RelayProcess, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in relay.log_text().splitlines():
            if '"relay started"' in line:
                port = json.loads(line).get("metrics_port")
                if port:
                    return int(port)
        time.sleep(0.1)
    raise TimeoutError("no metrics port in the relay's log")


def idle_window(dsn: str, prefix: str, relays: list[RelayProcess], seconds: float) -> dict[str, float]:
    pids = postgres_pids(dsn)
    commits0, cpu0, t0 = xact_commits(dsn, prefix), cpu_seconds(pids), time.monotonic()
    relay_cpu0 = sum(r.cpu_seconds() or 0.0 for r in relays)
    time.sleep(seconds)
    time.sleep(1.1)  # the statistics collector flushes at most once a second
    commits1, cpu1, t1 = xact_commits(dsn, prefix), cpu_seconds(pids), time.monotonic()
    relay_cpu1 = sum(r.cpu_seconds() or 0.0 for r in relays)
    elapsed = t1 - t0
    return {
        "rss_mb": sum((r.status_kb("VmRSS") or 0) for r in relays) / 1024,
        "connections": relay_connections(dsn, prefix),
        "xacts_per_second": (commits1 - commits0) / elapsed,
        "postgres_cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
        "relay_cpu_percent": 100 * (relay_cpu1 - relay_cpu0) / elapsed,
    }


def multi_env(dsn: str, prefix: str, bootstrap: str, topic: str, workers: int, **more: str) -> dict[str, str]:
    env = relay_env(dsn, "outbox", bootstrap, topic, **more)
    env.pop("OUTBOX_RELAY_DATABASE__TABLE", None)
    env.pop("OUTBOX_RELAY_DATABASE__DSN", None)
    env.update(
        {
            "OUTBOX_RELAY_DISCOVERY__DSN": dsn,
            "OUTBOX_RELAY_DISCOVERY__DATABASE_PATTERN": prefix.replace("_", r"\_") + "%",
            "OUTBOX_RELAY_DISCOVERY__REFRESH_INTERVAL_SECONDS": "5",
            "OUTBOX_RELAY_RELAY__WORKERS": str(workers),
        }
    )
    return env


def fill(dsn: str, name: str, rows: int, aggregate_type: str = "bench", *, not_before_year: int | None = None) -> None:
    """``rows`` pending rows of ~200 bytes; with ``not_before_year`` not due until then
    (``release_and_drain`` makes them all due at one moment)."""
    available = f"make_timestamptz({not_before_year}, 1, 1, 0, 0, 0)" if not_before_year else "now()"
    with psycopg.connect(db_dsn(dsn, name), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, available_at) "
            "SELECT %s, 'agg-' || (g %% 100), 'BenchEvent', "
            f"jsonb_build_object('seq', g, 'note', repeat('x', 150)), {available} "
            "FROM generate_series(1, %s) g",
            (aggregate_type, rows),
        )
        conn.execute("ANALYZE outbox")


def release_and_drain(
    dsn: str,
    names: list[str],
    relay: RelayProcess,
    rows_held: int,
    timeout: float = 3600,
    *,
    profile: Path | None = None,
    profile_gil: bool = False,
    statements: bool = False,
) -> dict[str, Any]:
    """Make the held-back rows due at one instant in every database, then measure the
    steady rate: rows finalized per second from that instant until 90 % of all rows
    are done (what the relay sustains with every source busy, not the time the script
    takes to reach 200 databases). Every database's rows are made due by an UPDATE in
    a transaction of its own, left open; once every UPDATE has run, the transactions
    are committed one after the other (a COMMIT takes milliseconds, an UPDATE of
    200 000 rows seconds on a loaded machine), and the window starts at the first
    COMMIT, so no source starts early and the single-source relay does not wait inside
    the window for its one big UPDATE. Returns the figures of that window:
    ``rows_per_second``; ``xacts_per_1000_rows``, the transactions the relay made the
    databases run (claims, finalizes, lease extensions, probes and gauge queries
    together); ``sessions_opened`` (each a backend forked, authenticated and warming its
    catalog caches); ``postgres_cpu_ms_per_1000_rows`` and ``relay_cpu_ms_per_1000_rows``
    (/proc: every PostgreSQL process, the relay's threads); with ``statements``, the
    statements' calls, execution and planning time per kind (pg_stat_statements).

    ``profile``: a py-spy profile of the relay process over the window (``py-spy
    record --nonblocking``, raw collapsed stacks) written there.

    The relay's counter is read every 0.5 s, not more often: rendering /metrics for
    many sources is work for the relay process, and the rate is computed from the
    counter's value at the moment it was read, so a coarser poll does not bias it."""
    port = metrics_port(relay)
    prefix = names[0][: names[0].rindex("_") + 1] if len(names) > 1 else names[0]
    d1 = published_done(port)
    c1 = claimed_rows(port)
    held: list[psycopg.Connection[Any]] = []
    try:
        for name in names:
            conn = psycopg.connect(db_dsn(dsn, name))  # not autocommit: due at its COMMIT
            held.append(conn)
            conn.execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'")
        x1, s1 = database_counters(dsn, prefix)
        if statements:
            reset_statements(dsn)
        pg_pids = postgres_pids(dsn)
        pg_cpu1, relay_cpu1 = cpu_seconds(pg_pids), relay.cpu_seconds() or 0.0
        threads1 = thread_cpu(relay.pid)
        t1 = time.monotonic()
        for conn in held:
            conn.commit()
        committing = time.monotonic() - t1
    finally:
        for conn in held:
            conn.close()
    say(f"  {len(names)} releases committed in {committing:.3f}s")
    spy = start_profile(relay.pid, profile, gil=profile_gil) if profile is not None else None
    target = 0.9 * rows_held
    first_claim = first_done = None
    busy_from: tuple[float, float] | None = None  # (seconds, done) at the first reading past 10 %
    try:
        while (done := published_done(port)) < target:
            now = time.monotonic() - t1
            if now > timeout:
                raise TimeoutError(f"not drained within {timeout:.0f}s")
            if relay.proc.poll() is not None:
                raise RuntimeError(f"relay exited:\n{relay.log_text()[-3000:]}")
            if first_claim is None and claimed_rows(port) > c1:
                first_claim = now
            if first_done is None and done > d1:
                first_done = now
            if busy_from is None and done - d1 >= 0.1 * rows_held:
                busy_from = (now, done)
            # Until the first batch is done the counter is read every 20 ms (the start is
            # timed), then every 0.5 s.
            time.sleep(0.5 if first_done is not None else 0.02)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            spy.wait(timeout=60)
    elapsed = time.monotonic() - t1
    relay_cpu2 = relay.cpu_seconds() or 0.0
    threads2 = thread_cpu(relay.pid)
    names_by_tid = python_thread_names(relay.pid)
    pg_pids2 = postgres_pids(dsn)
    pg_cpu2 = cpu_seconds(pg_pids) + cpu_seconds([pid for pid in pg_pids2 if pid not in set(pg_pids)])
    window = statement_figures(dsn) if statements else None
    rows = max(1.0, done - d1)
    time.sleep(1.1)  # the statistics are flushed at most once a second
    x2, s2 = database_counters(dsn, prefix)
    relay_xacts = x2 - x1 - len(names)  # less the script's own COMMITs
    figures: dict[str, Any] = {
        "rows_per_second": (done - d1) / elapsed,
        # From the first reading past 10 % of the rows to the last one (past 90 %):
        # the rate with every source busy, without the start (the release found by a
        # probe or a poll, the first claims on cold connections).
        "busy_rows_per_second": (
            (done - busy_from[1]) / (elapsed - busy_from[0]) if busy_from and elapsed > busy_from[0] else None
        ),
        "seconds_to_first_claim": first_claim,
        "seconds_to_first_done": first_done,
        "xacts_per_1000_rows": 1000 * relay_xacts / max(1.0, published_done(port) - d1),
        "sessions_opened": s2 - s1,
        "postgres_cpu_ms_per_1000_rows": 1e6 * (pg_cpu2 - pg_cpu1) / rows,
        "relay_cpu_ms_per_1000_rows": 1e6 * (relay_cpu2 - relay_cpu1) / rows,
    }
    if window is not None:
        figures["statements"] = window
    figures["relay_threads_per_1000_rows"] = thread_figures(threads1, threads2, names_by_tid, rows)
    return figures


def reset_statements(dsn: str) -> None:
    """Forget the statements so far (pg_stat_statements must be preloaded: --statements)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")


def statement_figures(dsn: str) -> list[dict[str, Any]]:
    """The statements run since the last reset (every database), most total time first:
    calls, execution and planning milliseconds, the first 70 characters of the text."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70) AS head, sum(calls), "
            "sum(total_exec_time), sum(total_plan_time) FROM pg_stat_statements "
            "GROUP BY head ORDER BY sum(total_exec_time) + sum(total_plan_time) DESC LIMIT 25"
        ).fetchall()
    return [
        {"statement": head, "calls": int(calls), "exec_ms": round(float(ex), 1), "plan_ms": round(float(plan), 1)}
        for head, calls, ex, plan in rows
    ]


ThreadTimes = dict[int, tuple[str, float, float, int]]


def thread_cpu(pid: int) -> ThreadTimes:
    """Per thread of ``pid`` (/proc/PID/task): its OS name, user and system CPU
    seconds, and context switches (voluntary + involuntary)."""
    out: ThreadTimes = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        out[int(task.name)] = (name, int(fields[11]) / tick, int(fields[12]) / tick, switches)
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """The Python names of ``pid``'s threads by OS thread id (``py-spy dump``, when
    py-spy is installed: Python does not give its threads OS names, librdkafka does)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    dump = subprocess.run([spy, "dump", "--json", "--nonblocking", "-p", str(pid)], capture_output=True, text=True)
    try:
        threads = json.loads(dump.stdout or "[]")
    except ValueError:
        return {}
    return {int(t["os_thread_id"]): t.get("thread_name") or "?" for t in threads if t.get("os_thread_id")}


def thread_figures(before: ThreadTimes, after: ThreadTimes, names: dict[int, str], rows: float) -> dict[str, Any]:
    """CPU ms and context switches per 1 000 rows, per group of threads (the name
    without its digits: worker-0..3 are one group, the 50 lease keepers another)."""
    groups: dict[str, list[float]] = {}
    for tid, (os_name, user, system, switches) in after.items():
        name = names.get(tid, os_name)
        group = "".join(ch for ch in name if not ch.isdigit()).rstrip("/:#-_") or "?"
        _, user0, system0, switches0 = before.get(tid, (name, 0.0, 0.0, 0))
        total = groups.setdefault(group, [0.0, 0.0, 0.0])
        total[0] += 1e6 * (user - user0) / rows
        total[1] += 1e6 * (system - system0) / rows
        total[2] += 1000 * (switches - switches0) / rows
    return {
        group: {"user_ms": round(v[0], 1), "system_ms": round(v[1], 1), "context_switches": round(v[2], 1)}
        for group, v in sorted(groups.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    }


def profile_path(directory: Path | None, name: str) -> Path | None:
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"many-sources-{RUN_ID}-{name}.txt"


def start_profile(pid: int, out: Path, *, gil: bool = False) -> subprocess.Popen[bytes]:
    """py-spy (``pip install py-spy``) sampling every thread of ``pid`` until SIGINT:
    every thread, waiting or not (``--idle``), or with ``gil`` only the thread holding
    the GIL (what the relay's Python spends its one interpreter on)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    say(f"  profiling the relay (pid {pid}) into {out}")
    return subprocess.Popen(
        [
            *(spy, "record", "--nonblocking", "--gil" if gil else "--idle", "--threads", "-r", "50"),
            *("-p", str(pid), "-o", str(out), "--format", "raw"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


#: The scrape that reads the done counter: only its samples (``name[]``). A full
#: /metrics of 50 sources is ~3 000 series, 60-80 ms of the relay's Python time (the
#: GIL its workers need), which read twice a second slowed the relay it measured
#: (``--scrape-all`` reads the whole page, as the script did before).
DONE_SCRAPE = "/metrics?name[]=outbox_relay_published_total"


def claimed_rows(port: int) -> float:
    """Rows claimed so far, over every source (the claim batch size histogram's sum)."""
    url = f"http://127.0.0.1:{port}/metrics?name[]=outbox_relay_claim_batch_size_sum"
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("outbox_relay_claim_batch_size_sum")
    )


def published_done(port: int) -> float:
    """Rows finalized as done so far, over every source (the relay's own counter)."""
    for attempt in range(5):  # a relay busy with 200 sources on a loaded machine can be slow to answer
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{DONE_SCRAPE}", timeout=30) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if attempt == 4:
                raise
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("outbox_relay_published_total{") and 'outcome="done"' in line
    )


def left(dsn: str, names: list[str]) -> int:
    total = 0
    for name in names:
        with psycopg.connect(db_dsn(dsn, name), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'processing')").fetchone()
            total += int(row[0]) if row else 0
    return total


def reset(dsn: str, names: list[str]) -> None:
    for name in names:
        with psycopg.connect(db_dsn(dsn, name), autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(parser)
    parser.add_argument("--sources", type=int, default=200, help="databases, each with its outbox (200)")
    parser.add_argument("--workers", type=int, default=4, help="relay.workers of every relay (4)")
    parser.add_argument(
        "--per-process-sample",
        type=int,
        default=10,
        help="single-source relays started for the one-process-per-database figures (10)",
    )
    parser.add_argument("--listen-sample", type=int, default=50, help="LISTEN sessions for phase 3 (50)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="length of each idle window (20)")
    parser.add_argument("--rows-per-source", type=int, default=1000, help="rows per database, phase 4 (1000)")
    parser.add_argument("--backlog", type=int, default=1_000_000, help="rows of the busy source, phase 5 (1e6)")
    parser.add_argument("--quiet-interval", type=float, default=0.2, help="s between the quiet source's rows")
    parser.add_argument(
        "--quiet-seconds",
        type=float,
        default=60.0,
        help="how long the quiet source writes while the backlog drains (60)",
    )
    parser.add_argument("--skip", default="", help="comma-separated phases to skip (1-5)")
    parser.add_argument(
        "--scrape-all",
        action="store_true",
        help="read the relays' whole /metrics page for the done counter (default: only that counter's samples)",
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="phase 4: preload pg_stat_statements (planning tracked) in the embedded PostgreSQL and report "
        "each relay's statements: calls, execution and planning time",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="phase 4: py-spy profiles of both relays over their windows, written here (needs py-spy)",
    )
    parser.add_argument(
        "--profile-gil",
        action="store_true",
        help="with --profile-dir: sample only the thread holding the GIL (default: every thread, idle or not)",
    )
    args = parser.parse_args()
    skip = {int(p) for p in args.skip.split(",") if p.strip()}
    report: dict[str, Any] = {"sources": args.sources, "workers": args.workers}
    lines: list[str] = []
    prefix = f"msb_{RUN_ID}_"
    names = [f"{prefix}{i:04d}" for i in range(args.sources)]
    own_pg = None
    if not args.dsn:  # our own PostgreSQL, with room for N databases' connections
        import tempfile

        from outbox_relay._embedded.embedded import EmbeddedPostgres

        say("starting embedded PostgreSQL 18 ...")
        own_pg = EmbeddedPostgres(base_dir=Path(tempfile.mkdtemp(prefix="outbox-relay-msb-"))).start()
        with psycopg.connect(own_pg.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_connections = 1500")
            if args.statements:
                conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
                conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        own_pg.stop_server()
        own_pg.start_server()
        args.dsn = own_pg.dsn
    try:
        run(args, skip, report, lines, prefix, names)
    finally:
        if own_pg is not None:
            own_pg.stop()
    emit(report, lines, args.json)


def run(
    args: argparse.Namespace, skip: set[int], report: dict[str, Any], lines: list[str], prefix: str, names: list[str]
) -> None:
    global DONE_SCRAPE
    if args.scrape_all:
        DONE_SCRAPE = "/metrics"
    with servers(args) as (dsn, bootstrap):
        assert bootstrap is not None
        raise_max_connections(dsn, args.sources * 2 + args.per_process_sample * (args.workers + 5) + 50)
        say(f"creating {args.sources} databases with their outbox ...")
        started = time.monotonic()
        create_databases(dsn, names)
        say(f"  {time.monotonic() - started:.1f}s")
        topic = f"msb{RUN_ID}" + ".{aggregate_type}"
        try:
            if 1 not in skip:
                say("phase 1: one process, every source idle ...")
                relay = RelayProcess([], multi_env(dsn, prefix, bootstrap, topic, args.workers))
                try:
                    relay.wait_started(120)
                    port = metrics_port(relay)
                    ready_s = wait_sources_ready(port, args.sources, timeout=300)
                    time.sleep(3)
                    one = idle_window(dsn, prefix, [relay], args.idle_seconds)
                    one["seconds_to_all_ready"] = ready_s
                    one["warnings"] = relay.warnings(3)  # type: ignore[assignment]
                finally:
                    relay.stop()
                    relay.cleanup()
                report["one_process_idle"] = one
                lines.append(
                    f"one process, {args.sources} idle sources: RSS {one['rss_mb']:.0f} MB, "
                    f"{one['connections']} connections ({one['connections'] / args.sources:.2f}/source), "
                    f"{one['xacts_per_second']:.0f} transactions/s "
                    f"({one['xacts_per_second'] / args.sources:.2f}/source), PostgreSQL CPU "
                    f"{one['postgres_cpu_percent']:.1f}%, relay CPU {one['relay_cpu_percent']:.1f}% "
                    f"(all sources ready {ready_s:.1f}s after start)"
                )
                say("  " + lines[-1])
            if 2 not in skip:
                k = min(args.per_process_sample, args.sources)
                say(f"phase 2: {k} single-source relays (one per database), idle ...")
                relays = []
                try:
                    for name in names[:k]:
                        env = relay_env(
                            db_dsn(dsn, name), "outbox", bootstrap, topic, OUTBOX_RELAY_RELAY__WORKERS=str(args.workers)
                        )
                        relays.append(RelayProcess([], env))
                    for r in relays:
                        r.wait_started(120)
                    time.sleep(3)
                    sample = idle_window(dsn, prefix, relays, args.idle_seconds)
                finally:
                    for r in relays:
                        r.stop()
                        r.cleanup()
                scale = args.sources / k
                per = {
                    key: sample[key] * scale
                    for key in (
                        "rss_mb",
                        "connections",
                        "xacts_per_second",
                        "postgres_cpu_percent",
                        "relay_cpu_percent",
                    )
                }
                report["per_process_idle_sample"] = dict(sample, processes=k)
                report["per_process_idle_scaled"] = per
                lines.append(
                    f"{k} single-source relays, idle: RSS {sample['rss_mb']:.0f} MB, "
                    f"{sample['connections']} connections, {sample['xacts_per_second']:.0f} transactions/s, "
                    f"PostgreSQL CPU {sample['postgres_cpu_percent']:.1f}%; scaled to {args.sources}: "
                    f"RSS {per['rss_mb']:.0f} MB, {per['connections']:.0f} connections, "
                    f"{per['xacts_per_second']:.0f} transactions/s, "
                    f"PostgreSQL CPU {per['postgres_cpu_percent']:.0f}%"
                )
                say("  " + lines[-1])
            if 3 not in skip:
                k = min(args.listen_sample, args.sources)
                say(f"phase 3: idle-source cost, {k} LISTEN sessions vs the relay's probing ...")
                held = []
                try:
                    for name in names[:k]:
                        conn = psycopg.connect(db_dsn(dsn, name), autocommit=True, application_name="msb-listen")
                        conn.execute("LISTEN msb_wake")
                        held.append(conn)
                    time.sleep(1)
                    n_listen, listen_pss = backend_pss_kb(dsn, prefix, "msb-listen")
                finally:
                    for conn in held:
                        conn.close()
                relay = RelayProcess([], multi_env(dsn, prefix, bootstrap, topic, args.workers))
                try:
                    relay.wait_started(120)
                    wait_sources_ready(metrics_port(relay), args.sources, timeout=300)
                    time.sleep(3)
                    n_relay, relay_pss = backend_pss_kb(dsn, prefix, "outbox-relay")
                finally:
                    relay.stop()
                    relay.cleanup()
                report["idle_source_cost"] = {
                    "listen_backend_pss_kb": listen_pss / max(1, n_listen),
                    "relay_backend_pss_kb": relay_pss / max(1, n_relay),
                    "relay_connections_per_source": n_relay / args.sources,
                }
                lines.append(
                    f"idle source: a LISTEN session costs a backend of {listen_pss / max(1, n_listen):.0f} "
                    f"kB Pss (and 0 queries/s) in addition to the pool's connection; probing costs "
                    f"the pool's one connection ({relay_pss / max(1, n_relay):.0f} kB Pss per backend, "
                    f"{n_relay / args.sources:.2f} connections/source) and the queries of phase 1"
                )
                say("  " + lines[-1])
            if 4 not in skip:
                total = args.rows_per_source * args.sources
                say(
                    f"phase 4: throughput, {args.rows_per_source} rows in each of {args.sources} databases "
                    f"({total} rows) vs {total} rows in one database ..."
                )
                for name in names:
                    fill(dsn, name, args.rows_per_source, not_before_year=2100)
                relay = RelayProcess([], multi_env(dsn, prefix, bootstrap, topic, args.workers))
                try:
                    relay.wait_started(120)
                    wait_sources_ready(metrics_port(relay), args.sources, timeout=300)
                    multi = release_and_drain(
                        dsn,
                        names,
                        relay,
                        total,
                        profile=profile_path(args.profile_dir, "multi"),
                        profile_gil=args.profile_gil,
                        statements=args.statements,
                    )
                finally:
                    relay.stop()
                    relay.cleanup()
                reset(dsn, names)
                fill(dsn, names[0], total, not_before_year=2100)
                env = relay_env(
                    db_dsn(dsn, names[0]), "outbox", bootstrap, topic, OUTBOX_RELAY_RELAY__WORKERS=str(args.workers)
                )
                single = RelayProcess([], env)
                try:
                    single.wait_started(120)
                    time.sleep(2)
                    single_figures = release_and_drain(
                        dsn,
                        names[:1],
                        single,
                        total,
                        profile=profile_path(args.profile_dir, "single"),
                        profile_gil=args.profile_gil,
                        statements=args.statements,
                    )
                finally:
                    single.stop()
                    single.cleanup()
                reset(dsn, names[:1])
                multi_rate, single_rate = multi["rows_per_second"], single_figures["rows_per_second"]
                multi_busy, single_busy = multi["busy_rows_per_second"], single_figures["busy_rows_per_second"]
                busy_ratio = multi_busy / single_busy if multi_busy and single_busy else None
                report["throughput"] = {
                    "rows": total,
                    "multi_rows_per_second": multi_rate,
                    "single_rows_per_second": single_rate,
                    "ratio": multi_rate / single_rate,
                    "multi_busy_rows_per_second": multi_busy,
                    "single_busy_rows_per_second": single_busy,
                    "busy_ratio": busy_ratio,
                    "multi_xacts_per_1000_rows": multi["xacts_per_1000_rows"],
                    "single_xacts_per_1000_rows": single_figures["xacts_per_1000_rows"],
                    "multi": multi,
                    "single": single_figures,
                }
                lines.append(
                    f"throughput, {total} rows, every source busy (10 % to 90 % of the rows): one process "
                    f"over {args.sources} sources {multi_busy or 0:,.0f} rows/s, one single-source relay over "
                    f"one database {single_busy or 0:,.0f} rows/s: ratio {busy_ratio or 0:.2f}; from the "
                    f"release to 90 %: {multi_rate:,.0f} vs {single_rate:,.0f} rows/s, ratio "
                    f"{multi_rate / single_rate:.2f} (first rows claimed after "
                    f"{multi['seconds_to_first_claim'] or 0:.2f} vs "
                    f"{single_figures['seconds_to_first_claim'] or 0:.2f} s); per 1 000 rows, "
                    f"multi vs single: database transactions {multi['xacts_per_1000_rows']:.1f} vs "
                    f"{single_figures['xacts_per_1000_rows']:.1f}, PostgreSQL CPU "
                    f"{multi['postgres_cpu_ms_per_1000_rows']:.0f} vs "
                    f"{single_figures['postgres_cpu_ms_per_1000_rows']:.0f} ms, relay CPU "
                    f"{multi['relay_cpu_ms_per_1000_rows']:.0f} vs "
                    f"{single_figures['relay_cpu_ms_per_1000_rows']:.0f} ms; "
                    f"sessions opened while draining {multi['sessions_opened']} vs {single_figures['sessions_opened']}"
                )
                say("  " + lines[-1])
            if 5 not in skip:
                busy, quiet = names[0], names[1]
                say(f"phase 5: {args.backlog} rows in {busy}, a row every {args.quiet_interval}s in {quiet} ...")
                started = time.monotonic()
                fill(dsn, busy, args.backlog)
                say(f"  backlog written in {time.monotonic() - started:.1f}s")
                relay = RelayProcess([], multi_env(dsn, prefix, bootstrap, topic, args.workers))
                stop = threading.Event()
                try:
                    relay.wait_started(120)
                    wait_sources_ready(metrics_port(relay), args.sources, timeout=300)
                    with psycopg.connect(db_dsn(dsn, quiet), autocommit=True) as qconn:
                        deadline = time.monotonic() + args.quiet_seconds
                        written = 0
                        while time.monotonic() < deadline and not stop.is_set():
                            qconn.execute(
                                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                "VALUES ('quiet', 'q', 'QuietEvent', '{}')"
                            )
                            written += 1
                            time.sleep(args.quiet_interval)
                        backlog_left = left(dsn, [busy])
                        deadline = time.monotonic() + 60
                        while left(dsn, [quiet]) and time.monotonic() < deadline:
                            time.sleep(0.2)
                        latencies = [
                            float(r[0])
                            for r in qconn.execute(
                                "SELECT extract(epoch FROM done_at - created_at) FROM outbox WHERE done_at IS NOT NULL"
                            ).fetchall()
                        ]
                finally:
                    relay.stop()
                    relay.cleanup()
                reset(dsn, [busy, quiet])
                report["quiet_latency"] = {
                    "rows": written,
                    "finalized": len(latencies),
                    "p50_seconds": median(latencies),
                    "p99_seconds": pct(latencies, 99),
                    "max_seconds": max(latencies) if latencies else None,
                    "backlog": args.backlog,
                    "backlog_left_at_end": backlog_left,
                }
                lines.append(
                    f"quiet source while another drains {args.backlog} rows: insert->finalize "
                    f"p50 {median(latencies):.3f}s, p99 {pct(latencies, 99):.3f}s, max "
                    f"{max(latencies):.3f}s over {len(latencies)} rows; backlog left at the end "
                    f"{backlog_left} (it was still draining throughout)"
                    if backlog_left
                    else f"quiet p99 {pct(latencies, 99):.3f}s, but the backlog was drained before the end"
                )
                say("  " + lines[-1])
        finally:
            if not args.keep:
                drop_databases(dsn, names)


if __name__ == "__main__":
    main()
