#!/usr/bin/env python3
"""What does database.transaction_pooler cost, and do prepared statements help a direct connection?

Starts an embedded PostgreSQL 18 (or --dsn) and a private pgbouncer (Debian package
``pgbouncer``, pool_mode = transaction, stock configuration otherwise) in front of
it, fills one outbox table with --rows pending rows, and times the relay's two hot
statements, one claim (``claim``, --batch-sizes rows) then the fenced ``finalize``
of what it claimed (back to pending, attempt refunded, so the backlog keeps its
size), on one connection per variant, the variants interleaved cycle by cycle:

  direct, prepared, custom plans   the relay's direct connection: statement_timeout as a
                            startup option, psycopg's automatic prepared statements (after
                            5 runs), plan_cache_mode=force_custom_plan
  direct, prepared, generic plans allowed   the same with PostgreSQL's default plan_cache_mode
                            (auto: after 5 custom plans it may keep a generic one)
  direct, not prepared      prepare_threshold=None
  proxy, no timeout         through pgbouncer, unbounded: what the statements cost there
                            (a reference, not a mode: an ALTER ROLE/DATABASE ... SET
                            statement_timeout costs the same but any client of the proxy
                            can change a shared server session with a plain SET)
  proxy, set_config         the relay's pooler mode (outbox_relay.db.pooler.PoolerConnection):
                            set_config('statement_timeout', ms, true) pipelined in front of
                            the statement, one Sync: one implicit transaction, one round trip
  proxy, BEGIN/SET LOCAL/.../COMMIT pipelined   four statements, one round trip
  proxy, SET LOCAL own round trip               BEGIN, SET LOCAL, statement, COMMIT, each waited for

and the ordered claim (several statements in one transaction, OutboxStore.claim with
ordered_types=["*"]) direct, in pooler mode (the set_config travels with the
transaction's first statement) and with SET LOCAL in its own round trip.

Round trips per statement are measured in a short separate pass behind a TCP
forwarder that delays every chunk by half of --probe-rtt-ms (10 ms) each way: how
much slower the median is there, divided by the added round-trip time (pipelined
messages overlap in flight as on a real network, so a pipeline counts once). --rtt-ms D puts every
timed connection behind such a link with D ms round trip (a network between relay
and proxy); the default times on loopback.
Every variant is also checked for the one property that matters: a statement
running longer than the timeout is cancelled ("bounded").

    .venv/bin/python bench/pooler.py                    # loopback, about a minute
    .venv/bin/python bench/pooler.py --rtt-ms 1         # with a 1 ms network round trip
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _common as c
import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.transaction import Transaction

from outbox_relay._embedded.embedded import EmbeddedPgBouncer
from outbox_relay.db import store as store_module
from outbox_relay.db import store_core
from outbox_relay.db.pooler import PoolerConnection
from outbox_relay.db.store import OutboxStore

TIMEOUT_MS = 10_000
# Executions before timing: psycopg prepares at the 6th, PostgreSQL plans the next 5
# with the actual values and may then settle on its generic plan (from the 11th).
WARM_UP = 12
DIRECT_CUSTOM = "direct, prepared, custom plans (relay)"
DIRECT_GENERIC = "direct, prepared, generic plans allowed"
DIRECT_UNPREPARED = "direct, not prepared"
CHECK_TIMEOUT_MS = 200  # the "bounded" check: pg_sleep(1) must be cancelled at this timeout


# --- a TCP forwarder that adds network delay ------------------------------------------------
class Forwarder:
    """127.0.0.1:<port> -> the server (TCP or unix socket), every chunk delivered
    ``delay_ms / 2`` after it was read, in each direction: a link with that round-trip
    time (chunks overlap in flight, as on a network; no bandwidth limit)."""

    def __init__(self, target: tuple[str, int] | str, *, delay_ms: float = 0.0) -> None:
        self._target = target
        self._one_way_s = delay_ms / 2000.0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _connect_target(self) -> socket.socket:
        if isinstance(self._target, str):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(self._target)
        else:
            sock = socket.create_connection(self._target)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = self._connect_target()
            for source, sink in ((client, server), (server, client)):
                in_flight: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(source, in_flight), daemon=True).start()
                threading.Thread(target=self._deliver, args=(in_flight, sink), daemon=True).start()

    def _read(self, source: socket.socket, in_flight: queue.Queue[tuple[float, bytes]]) -> None:
        try:
            while data := source.recv(65536):
                in_flight.put((time.monotonic() + self._one_way_s, data))
        except OSError:
            pass
        in_flight.put((0.0, b""))

    @staticmethod
    def _deliver(in_flight: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        try:
            while True:
                due, data = in_flight.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def dsn(self, dsn: str) -> str:
        return make_conninfo(dsn, host="127.0.0.1", port=str(self.port))

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def target_of(dsn: str) -> tuple[str, int] | str:
    info = conninfo_to_dict(dsn)
    host, port = str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)


# --- the ways of running one statement ---------------------------------------------------
Runner = Callable[[psycopg.Connection[Any], Any, dict[str, Any]], list[Any]]
# The timeout each timed connection bounds its statements with (the runners that set
# it themselves read it here; PoolerConnection carries its own).
_TIMEOUT_OF: weakref.WeakKeyDictionary[psycopg.Connection[Any], int] = weakref.WeakKeyDictionary()


def run_plain(conn: psycopg.Connection[Any], query: Any, params: dict[str, Any]) -> list[Any]:
    return conn.execute(query, params).fetchall()  # PoolerConnection: bounded by its cursor


def run_begin_set_local_commit_pipelined(
    conn: psycopg.Connection[Any], query: Any, params: dict[str, Any]
) -> list[Any]:
    with conn.pipeline():  # leaving it sends the one Sync
        conn.execute("BEGIN")
        conn.execute(f"SET LOCAL statement_timeout = {_TIMEOUT_OF[conn]}")
        cursor = conn.execute(query, params)
        conn.execute("COMMIT")
    return cursor.fetchall()


def run_set_local_own_round_trip(conn: psycopg.Connection[Any], query: Any, params: dict[str, Any]) -> list[Any]:
    with conn.transaction():
        conn.execute(f"SET LOCAL statement_timeout = {_TIMEOUT_OF[conn]}")
        return conn.execute(query, params).fetchall()


class SetLocalOwnRoundTrip(PoolerConnection):
    """Pooler mode with the alternative for transactions: SET LOCAL right after BEGIN,
    waited for, instead of riding along with the transaction's first statement."""

    @contextmanager
    def transaction(self, savepoint_name: str | None = None, force_rollback: bool = False) -> Iterator[Transaction]:
        outermost = self.info.transaction_status == pq.TransactionStatus.IDLE
        with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost and self.statement_timeout_ms > 0:
                psycopg.Cursor(self).execute(f"SET LOCAL statement_timeout = {int(self.statement_timeout_ms)}")
                self._transaction_bounded = True
            yield tx


class Variant:
    def __init__(
        self,
        name: str,
        dsn: str,
        runner: Runner,
        *,
        prepared: bool = False,
        pooler: bool = False,
        startup_timeout: bool = False,
        custom_plans: bool = False,
    ) -> None:
        self.name, self.dsn, self.runner = name, dsn, runner
        self.prepared, self.pooler, self.startup_timeout = prepared, pooler, startup_timeout
        self.custom_plans = custom_plans

    def connect(self, dsn: str | None = None, timeout_ms: int = TIMEOUT_MS) -> psycopg.Connection[Any]:
        kwargs: dict[str, Any] = {"autocommit": True}
        if not self.prepared:
            kwargs["prepare_threshold"] = None
        if self.startup_timeout:
            kwargs["options"] = f"-c statement_timeout={timeout_ms}"
            if self.custom_plans:
                kwargs["options"] += " -c plan_cache_mode=force_custom_plan"
        if self.pooler:
            pooled = PoolerConnection.connect(dsn or self.dsn, **kwargs)
            pooled.statement_timeout_ms = timeout_ms
            return pooled
        conn = psycopg.Connection.connect(dsn or self.dsn, **kwargs)
        _TIMEOUT_OF[conn] = timeout_ms
        return conn

    def bounded(self) -> bool:
        """Is a statement over the timeout cancelled? (pg_sleep(1) at a 200 ms timeout)"""
        with self.connect(timeout_ms=CHECK_TIMEOUT_MS) as conn:
            try:
                self.runner(conn, "SELECT pg_sleep(%(seconds)s)", {"seconds": 1.0})
            except psycopg.errors.QueryCanceled:
                return True
        return False


# --- the timed loop ----------------------------------------------------------------------
def claim_params(batch: int) -> dict[str, Any]:
    return {
        "owner": "bench",
        "batch": batch,
        "lease_seconds": 60.0,
        "max_attempts": 2_000_000_000,
        "ordered_types": [],
        "all_ordered": False,
        "excluded_types": [],
        "max_batch_bytes": 2**62,
        "candidates": batch,
        "max_message_bytes": None,
    }


def finalize_params(rows: list[Any]) -> dict[str, Any]:
    """Back to pending, due now, attempt refunded: the backlog keeps its size."""
    n = len(rows)
    return {
        "ids": [r[1] for r in rows],
        "versions": [r[2] for r in rows],
        "statuses": ["pending"] * n,
        "delays": [0.0] * n,
        "errors": [None] * n,
        "refunds": [1] * n,
    }


def rotated(items: list[Any], shift: int) -> list[Any]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def cycle(conn: psycopg.Connection[Any], runner: Runner, sql_of: Any, batch: int) -> tuple[float, float]:
    started = time.perf_counter()
    rows = [r for r in runner(conn, sql_of.query("claim"), claim_params(batch)) if not r[0]]
    claimed = time.perf_counter()
    runner(conn, sql_of.query("finalize"), finalize_params(rows))
    return claimed - started, time.perf_counter() - claimed


def ordered_cycle(store: OutboxStore, batch: int) -> float:
    started = time.perf_counter()
    result = store.claim(
        owner="bench", batch=batch, lease_seconds=60.0, max_attempts=2_000_000_000, ordered_types=["*"], run_length=1
    )
    elapsed = time.perf_counter() - started
    store.reschedule([store_module.Reschedule(r.id, r.lease_version, 0.0, None, True) for r in result.rows])
    return elapsed


@contextmanager
def pooler_store(dsn: str, table: str, connection_class: type[PoolerConnection]) -> Iterator[OutboxStore]:
    """An OutboxStore in pooler mode whose pool uses ``connection_class``."""
    original = store_core.PoolerConnection  # the store's __init__ picks the pool's connection class
    store_core.PoolerConnection = connection_class  # type: ignore[misc]
    try:
        store = OutboxStore(dsn, table, pool_size=1, transaction_pooler=True, statement_timeout_ms=TIMEOUT_MS)
    finally:
        store_core.PoolerConnection = original  # type: ignore[misc]
    with store:
        yield store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument("--rows", type=int, default=5000, help="pending rows in the table")
    parser.add_argument("--batch-sizes", default="1,100,1000", help="claim batch sizes, comma-separated")
    parser.add_argument(
        "--ops",
        type=int,
        default=400,
        help="claim+finalize cycles per variant at batch <= 10 (fewer for larger batches: "
        "ops*10/batch, at least 20), variants interleaved cycle by cycle",
    )
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="added network round trip (forwarder), ms")
    parser.add_argument(
        "--probe-rtt-ms",
        type=float,
        default=10.0,
        help="round trip of the link that counts round trips (latency / this)",
    )
    parser.add_argument("--probe-ops", type=int, default=10, help="operations timed behind that link")
    args = parser.parse_args()
    if args.probe_rtt_ms <= args.rtt_ms:
        parser.error("--probe-rtt-ms must be larger than --rtt-ms")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if EmbeddedPgBouncer.binary() is None:
        c.say("pgbouncer is not installed (Debian package 'pgbouncer'): nothing to measure")
        return 1

    with c.servers(args, need_broker=False) as (dsn, _), EmbeddedPgBouncer(dsn) as bouncer:
        table = c.new_table("pooler")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{table.split(".")[0]}"')
        c.migrate(dsn, table, notify_trigger=False, ordering=True)  # the ordered claim needs its indexes
        with psycopg.connect(dsn) as conn, conn.transaction():
            c.copy_backlog(conn, table, args.rows, aggregates=max(1, args.rows // 10), payload_bytes=200)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Statistics as ANALYZE takes them (again before each batch size) and no
            # autovacuum in between: a plan cannot change in the middle of a run.
            name = c.ident(table).as_string(conn)
            conn.execute(f"ALTER TABLE {name} SET (autovacuum_enabled = false)")
            conn.execute(f"VACUUM ANALYZE {name}")
        sql_of = OutboxStore(dsn, table).sql
        probe_direct = Forwarder(target_of(dsn), delay_ms=args.probe_rtt_ms)
        probe_proxy = Forwarder(("127.0.0.1", bouncer.port), delay_ms=args.probe_rtt_ms)
        delayed: list[Forwarder] = []
        direct_dsn, proxy_dsn = dsn, bouncer.dsn
        if args.rtt_ms > 0:
            delayed = [
                Forwarder(target_of(dsn), delay_ms=args.rtt_ms),
                Forwarder(("127.0.0.1", bouncer.port), delay_ms=args.rtt_ms),
            ]
            direct_dsn, proxy_dsn = delayed[0].dsn(dsn), delayed[1].dsn(bouncer.dsn)
        try:
            report = measure(
                args,
                batch_sizes,
                table,
                sql_of,
                direct_dsn,
                proxy_dsn,
                probes={"direct": probe_direct.dsn(dsn), "proxy": probe_proxy.dsn(bouncer.dsn)},
            )
        finally:
            for forwarder in (probe_direct, probe_proxy, *delayed):
                forwarder.close()
            if not args.keep:
                c.drop_schema(dsn, table)
        report["server_version"] = c.server_version(dsn)
    c.emit(report, render(report, args), args.json)
    return 0


def measure(
    args: argparse.Namespace,
    batch_sizes: list[int],
    table: str,
    sql_of: Any,
    direct_dsn: str,
    proxy_dsn: str,
    *,
    probes: dict[str, str],
) -> dict[str, Any]:
    variants = [
        Variant(DIRECT_CUSTOM, direct_dsn, run_plain, prepared=True, startup_timeout=True, custom_plans=True),
        Variant(DIRECT_GENERIC, direct_dsn, run_plain, prepared=True, startup_timeout=True),
        Variant(DIRECT_UNPREPARED, direct_dsn, run_plain, startup_timeout=True),
        Variant("proxy, no timeout (reference)", proxy_dsn, run_plain),
        Variant("proxy, set_config pipelined (pooler mode)", proxy_dsn, run_plain, pooler=True),
        Variant("proxy, BEGIN/SET LOCAL/stmt/COMMIT pipelined", proxy_dsn, run_begin_set_local_commit_pipelined),
        Variant("proxy, SET LOCAL own round trip", proxy_dsn, run_set_local_own_round_trip),
    ]
    report: dict[str, Any] = {"rows": args.rows, "rtt_ms": args.rtt_ms, "ops": args.ops, "single": {}, "ordered": {}}
    c.say("checking which variants bound a statement ...")
    bounded = {v.name: v.bounded() for v in variants}

    # Round trips: the same operation timed behind the probe link and on the timed
    # connection; the difference over the difference in round-trip time leaves the
    # execution time out (a pipelined statement and its set_config count once).
    extra_rtt_s = (args.probe_rtt_ms - args.rtt_ms) / 1000.0

    def trips(probed_s: float, timed_s: float) -> float:
        return round(max(0.0, probed_s - timed_s) / extra_rtt_s, 1)

    for batch in batch_sizes:
        c.say(f"single statements, batch {batch} ...")
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute(f"ANALYZE {c.ident(table).as_string(conn)}")  # no row is processing now
        cycles = max(20, args.ops * 10 // max(10, batch))
        timings: dict[str, tuple[list[float], list[float]]] = {v.name: ([], []) for v in variants}
        probed: dict[str, list[tuple[float, float]]] = {}
        # Round trips do not depend on the batch size: measured at the smallest, where
        # execution time varies least.
        for v in variants if batch == min(batch_sizes) else []:
            with v.connect(probes["direct" if v.dsn == direct_dsn else "proxy"]) as conn:
                for _ in range(WARM_UP):
                    cycle(conn, v.runner, sql_of, batch)
                probed[v.name] = [cycle(conn, v.runner, sql_of, batch) for _ in range(args.probe_ops)]
        conns = {v.name: v.connect() for v in variants}
        try:
            for conn_v in variants:
                for _ in range(WARM_UP):
                    cycle(conns[conn_v.name], conn_v.runner, sql_of, batch)
            # Cycle by cycle, in a rotating order: every variant sees the same load
            # from whatever else runs on the machine.
            for op in range(cycles):
                for v in rotated(variants, op):
                    claim_s, final_s = cycle(conns[v.name], v.runner, sql_of, batch)
                    timings[v.name][0].append(claim_s)
                    timings[v.name][1].append(final_s)
        finally:
            for conn in conns.values():
                conn.close()
        report["single"][str(batch)] = {
            v.name: {
                "cycles": cycles,
                "claim_ms_p50": 1000 * c.median(timings[v.name][0]),
                "claim_ms_p90": 1000 * c.pct(timings[v.name][0], 90),
                "finalize_ms_p50": 1000 * c.median(timings[v.name][1]),
                "finalize_ms_p90": 1000 * c.pct(timings[v.name][1], 90),
                "claim_round_trips": trips(c.median([t[0] for t in probed[v.name]]), c.median(timings[v.name][0]))
                if probed
                else None,
                "finalize_round_trips": trips(c.median([t[1] for t in probed[v.name]]), c.median(timings[v.name][1]))
                if probed
                else None,
                "bounded": bounded[v.name],
            }
            for v in variants
        }

    for batch in batch_sizes:
        c.say(f"ordered claim (one transaction), batch {batch} ...")
        times: dict[str, list[float]] = {}
        probed_times: dict[str, float] = {}
        with contextlib.ExitStack() as stack:
            stores = {
                "direct": stack.enter_context(OutboxStore(direct_dsn, table, pool_size=1)),
                "pooler mode (set_config with the first statement)": stack.enter_context(
                    pooler_store(proxy_dsn, table, PoolerConnection)
                ),
                "pooler, SET LOCAL own round trip": stack.enter_context(
                    pooler_store(proxy_dsn, table, SetLocalOwnRoundTrip)
                ),
            }
            probed_stores = {
                "direct": stack.enter_context(OutboxStore(probes["direct"], table, pool_size=1)),
                "pooler mode (set_config with the first statement)": stack.enter_context(
                    pooler_store(probes["proxy"], table, PoolerConnection)
                ),
                "pooler, SET LOCAL own round trip": stack.enter_context(
                    pooler_store(probes["proxy"], table, SetLocalOwnRoundTrip)
                ),
            }
            for name, probed_store in (probed_stores if batch == min(batch_sizes) else {}).items():
                ordered_cycle(probed_store, batch)
                probed_times[name] = c.median([ordered_cycle(probed_store, batch) for _ in range(args.probe_ops)])
            for name, st in stores.items():
                for _ in range(5):
                    ordered_cycle(st, batch)
                times[name] = []
            for op in range(max(10, args.ops // 3)):
                for name in rotated(list(stores), op):
                    times[name].append(ordered_cycle(stores[name], batch))
        report["ordered"][str(batch)] = {
            name: {
                "claim_ms_p50": 1000 * c.median(t),
                "claim_ms_p90": 1000 * c.pct(t, 90),
                "round_trips": trips(probed_times[name], c.median(t)) if probed_times else None,
            }
            for name, t in times.items()
        }
    return report


def _trips(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rtt = f"{report['rtt_ms']:g} ms added round trip" if report["rtt_ms"] else "loopback, no added delay"
    lines = [
        f"PostgreSQL {report['server_version']}, pgbouncer pool_mode=transaction; {report['rows']} pending rows; "
        f"{rtt}; variants interleaved cycle by cycle",
        "",
    ]
    for batch, table in report["single"].items():
        cycles = next(iter(table.values()))["cycles"]
        lines.append(
            f"claim + finalize, batch {batch}, {cycles} cycles: median (p90) ms per statement, "
            "round trips per statement"
        )
        lines.append(f"  {'variant':<46}{'claim':>16}{'finalize':>16}{'trips':>8}  bounded")
        for name, r in table.items():
            lines.append(
                f"  {name:<46}{r['claim_ms_p50']:>7.3f} ({r['claim_ms_p90']:>6.3f})"
                f"{r['finalize_ms_p50']:>7.3f} ({r['finalize_ms_p90']:>6.3f})"
                f"{_trips(r['claim_round_trips']):>5}/{_trips(r['finalize_round_trips']):<4}  "
                f"{'yes' if r['bounded'] else 'NO'}"
            )
        unprepared = table[DIRECT_UNPREPARED]
        reference, chosen = table["proxy, no timeout (reference)"], table["proxy, set_config pipelined (pooler mode)"]
        for name in (DIRECT_CUSTOM, DIRECT_GENERIC):
            prepared = table[name]
            claim_gain = unprepared["claim_ms_p50"] / prepared["claim_ms_p50"]
            finalize_gain = unprepared["finalize_ms_p50"] / prepared["finalize_ms_p50"]
            helps = (
                prepared["claim_ms_p50"] + prepared["finalize_ms_p50"]
                < unprepared["claim_ms_p50"] + unprepared["finalize_ms_p50"]
            )
            lines.append(
                f"  {name} vs not prepared: claim x{claim_gain:.2f}, finalize x{finalize_gain:.2f} "
                f"({'faster' if helps else 'no faster'} in sum)"
            )
        lines.append(
            f"  the bound in pooler mode: claim {chosen['claim_ms_p50'] - reference['claim_ms_p50']:+.3f} ms, "
            f"finalize {chosen['finalize_ms_p50'] - reference['finalize_ms_p50']:+.3f} ms vs the unbounded "
            "statement through the proxy"
        )
        lines.append("")
    for batch, table in report["ordered"].items():
        lines.append(
            f"ordered claim (several statements, one transaction), batch {batch}: median (p90) ms, round trips"
        )
        for name, r in table.items():
            lines.append(
                f"  {name:<52}{r['claim_ms_p50']:>7.3f} ({r['claim_ms_p90']:>6.3f}){_trips(r['round_trips']):>6}"
            )
        lines.append("")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
