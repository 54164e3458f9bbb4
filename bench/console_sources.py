"""The console's list of sources with many sources: a request answered from the
figures held in memory, side by side with a round that reads every source (what
every request of the list cost while it read each source itself).

One PostgreSQL (embedded PostgreSQL 18 with max_connections raised, or --dsn), N
static sources, each an outbox table of its own in one schema, seeded with a random
backlog (0-20 pending rows of random age) and 0-5 dead rows. The console runs in this
process, served by uvicorn on loopback as `outbox-relay console` serves it.

Phases, all in one run:

1. the first request (the console has read nothing: it opens every source's pool and
   waits for the first round), and the connections the console then holds;
2. ``--requests`` requests each of ``GET /static/console.css`` (the HTTP floor),
   ``GET /api/sources?limit=50`` (default sort),
   ``GET /?state=dead&sort=dead&limit=50`` (the HTML page) and
   ``GET /api/sources?q=...&page=2`` while the figures are held, with the
   scans of the outbox tables meanwhile, and the list's own work (filter,
   sort, page) timed in-process;
3. ``--rounds`` rounds that read every source (warm pools), with their scans.

No broker is needed. Run it under the timing lock on a shared machine.
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from typing import Any

import httpx
import psycopg
from _common import RUN_ID, emit, median, migrate, pct, say  # (bench/ is first on sys.path)
from psycopg import sql

from outbox_relay.config import load_settings
from outbox_relay.operator.console.app import Console
from outbox_relay.operator.console.server import make_source_console_store, uvicorn_config
from outbox_relay.operator.console.sources import ConsoleSources

TOKEN = "bench-console-token"
# A backend flushes its statistics to pg_stat_database at most this long after it went idle.
STATS_FLUSH_SECONDS = 11.5


def table_reads(dsn: str, schema: str) -> int:
    """Scans of the bench's outbox tables so far (sequential and index): the console's
    reads of the sources, and nothing else's (autovacuum's analyze is not a scan)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0) FROM pg_stat_user_tables"
            " WHERE schemaname = %s",
            (schema,),
        ).fetchone()
    return int(row[0]) if row else 0


def console_connections(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay-console'"
        ).fetchone()
    return int(row[0]) if row else 0


def seed(dsn: str, table: str, rng: random.Random) -> tuple[int, int]:
    pending, dead = rng.randint(0, 20), rng.randint(0, 5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for status, n in (("pending", pending), ("dead", dead)):
            if n:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts,"
                        "                created_at)"
                        " SELECT 'bench', 'agg-' || g, 'BenchEvent', '{{}}'::jsonb, %s, 0,"
                        "        now() - make_interval(secs => %s) FROM generate_series(1, %s) AS g"
                    ).format(sql.Identifier(*table.split("."))),
                    (status, rng.uniform(0, 86_400), n),
                )
    return pending, dead


def timed_requests(http: httpx.Client, path: str, params: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = http.get(path, params=params)
        out.append((time.perf_counter() - start) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}: {response.text[:200]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="use this PostgreSQL instead of starting an embedded PostgreSQL 18")
    parser.add_argument("--sources", type=int, default=500, help="static sources, an outbox table each (500)")
    parser.add_argument("--requests", type=int, default=50, help="requests of each kind in phase 2 (50)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds reading every source in phase 3 (3)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document on stdout")
    args = parser.parse_args()
    own_pg = None
    if not args.dsn:
        import tempfile
        from pathlib import Path

        from outbox_relay._embedded.embedded import EmbeddedPostgres

        say("starting embedded PostgreSQL 18 ...")
        own_pg = EmbeddedPostgres(base_dir=Path(tempfile.mkdtemp(prefix="outbox-relay-bcs-"))).start()
        with psycopg.connect(own_pg.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET max_connections = {args.sources * 2 + 100}")
        own_pg.stop_server()
        own_pg.start_server()
        args.dsn = own_pg.dsn
    schema = f"bench_console_{RUN_ID}"
    try:
        run(args, schema)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        if own_pg is not None:
            own_pg.stop()


def run(args: argparse.Namespace, schema: str) -> None:
    dsn = args.dsn
    rng = random.Random(7)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    say(f"creating {args.sources} outbox tables ...")
    sources: dict[str, dict[str, Any]] = {}
    for i in range(args.sources):
        table = f"{schema}.outbox_{i:04d}"
        migrate(dsn, table, notify_trigger=False)
        seed(dsn, table, rng)
        sources[f"tenant_{i:04d}"] = {"dsn": dsn, "table": table}
    settings = load_settings(
        None,
        sources=sources,
        console={"host": "127.0.0.1", "port": 0, "token": TOKEN, "sources_refresh_seconds": 3600},
        log={"level": "WARNING", "format": "json"},
    )
    console = Console(settings, ConsoleSources(settings, store_factory=make_source_console_store))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    import uvicorn

    server = uvicorn.Server(uvicorn_config(console.app()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    report: dict[str, Any] = {"sources": args.sources, "requests": args.requests, "rounds": args.rounds}
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            say("phase 1: the first request ...")
            start = time.perf_counter()
            first = http.get("/api/sources", params={"limit": 50}).json()
            report["first_request_ms"] = round((time.perf_counter() - start) * 1000, 1)
            report["first_request_sources_read"] = sum(1 for s in first["sources"] if s["read_at"])
            report["console_connections_held"] = console_connections(dsn)
            if first["figures_read_at"] is None:  # the first round outlasted the first request's wait
                while http.get("/api/sources").json()["refreshing"]:
                    time.sleep(0.1)
            report["first_round_ms"] = round((time.perf_counter() - start) * 1000, 1)

            say("phase 2: requests answered from the figures held ...")
            time.sleep(STATS_FLUSH_SECONDS)
            before = table_reads(dsn, schema)
            kinds = {
                # The HTTP floor of this machine: a static file, no handler work at all.
                "static_file": ("/static/console.css", {}),
                "api_default": ("/api/sources", {"limit": 50}),
                "page_dead_sorted": ("/", {"state": "dead", "sort": "dead", "limit": 50}),
                "api_name_filter": ("/api/sources", {"q": "tenant_01", "page": 2, "limit": 20}),
            }
            for kind, (path, params) in kinds.items():
                took = timed_requests(http, path, params, args.requests)
                report[f"{kind}_ms_p50"] = round(median(took), 2)
                report[f"{kind}_ms_p95"] = round(pct(took, 95), 2)
            # The list's own work without HTTP: filter, sort and page the held figures.
            took = []
            params = {"state": ["dead"], "sort": ["dead"], "limit": ["50"]}
            for _ in range(args.requests):
                start = time.perf_counter()
                console._source_list(params)
                took.append((time.perf_counter() - start) * 1000)
            report["list_work_ms_p50"] = round(median(took), 3)
            time.sleep(STATS_FLUSH_SECONDS)
            report["phase2_table_scans"] = table_reads(dsn, schema) - before

        say("phase 3: rounds that read every source ...")
        names = console.sources.names()
        rounds = []
        before = table_reads(dsn, schema)
        for _ in range(args.rounds):
            start = time.perf_counter()
            console.board.read_all(names)
            rounds.append((time.perf_counter() - start) * 1000)
        time.sleep(STATS_FLUSH_SECONDS)
        report["round_ms_p50"] = round(median(rounds), 1)
        report["round_ms_max"] = round(max(rounds), 1)
        report["table_scans_per_round"] = round((table_reads(dsn, schema) - before) / args.rounds, 1)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        console.close()

    lines = [
        f"console list of sources: {args.sources} sources (an outbox table each), {args.requests} requests per kind",
        f"  first request (opens every pool, waits for the first round): {report['first_request_ms']} ms, "
        f"{report['first_request_sources_read']} of the first page read; "
        f"{report['console_connections_held']} connections held then; every source read after "
        f"{report['first_round_ms']} ms",
        "  answered from the figures held (p50 / p95 ms):",
        f"    GET /static/console.css (HTTP floor)         {report['static_file_ms_p50']} / "
        f"{report['static_file_ms_p95']}",
        f"    GET /api/sources?limit=50                    {report['api_default_ms_p50']} / "
        f"{report['api_default_ms_p95']}",
        f"    GET /?state=dead&sort=dead&limit=50 (HTML)   {report['page_dead_sorted_ms_p50']} / "
        f"{report['page_dead_sorted_ms_p95']}",
        f"    GET /api/sources?q=tenant_01&page=2          {report['api_name_filter_ms_p50']} / "
        f"{report['api_name_filter_ms_p95']}",
        f"    the list's own work (filter, sort, page; no HTTP, no page rendering): {report['list_work_ms_p50']} ms",
        f"    scans of the outbox tables during those {4 * args.requests} requests: {report['phase2_table_scans']}",
        f"  a round reading every source (warm pools): p50 {report['round_ms_p50']} ms, "
        f"max {report['round_ms_max']} ms, {report['table_scans_per_round']} scans of the outbox tables per round",
    ]
    emit(report, lines, args.json)


if __name__ == "__main__":
    main()
