"""The database 1, 5 and 20 ms away, and a lossy link: throughput and insert->ack latency.

    .venv/bin/python bench/network_latency.py                       # about 10 minutes
    .venv/bin/python bench/network_latency.py --rtts-ms 0,5 --settings 4x1000,16x1000 --events 5000

Production databases are not on loopback. Between the relay and PostgreSQL this puts a
TCP proxy of the test suite's own (``tests/helpers/net_proxy.py``; this kernel has no
netem) that forwards every chunk half the round-trip time later in each direction, and
with ``--loss`` stalls a fraction of the chunks for a retransmission timeout (200 ms,
Linux's minimum RTO), which is what an application sees of a lost TCP segment. The
writers and the read-back reach the database and the broker directly; only the relay's
own database link is slowed. Conditions, each with a fresh table and relay:

- loopback (no proxy) and the proxy with no delay (what the proxy itself costs);
- ``--rtts-ms`` (1, 5, 20) round trips;
- ``--loss`` (1 %) on a ``--loss-rtt-ms`` (1 ms) link.

Per condition and per ``--settings`` (workers x batch size): a backlog of ``--events``
rows committed at once, drained by the relay: rows per second. With the first setting
(the defaults, 4 x 1000) the same relay then takes ``--rate`` single-row inserts per
second for ``--paced-seconds``: insert->ack latency is ``done_at - created_at`` of those
rows (the database's clock, both ends: a row is done only after the broker acknowledged
it), p50 / p90 / p99.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay import enqueue
from tests.helpers.net_proxy import TcpProxy


def parse_settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        workers, _, batch = item.strip().partition("x")
        out.append((int(workers), int(batch)))
    return out


def relay_dsn(dsn: str, proxy: TcpProxy | None) -> str:
    if proxy is None:
        return dsn
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(proxy.port))
    params.pop("hostaddr", None)
    return psycopg.conninfo.make_conninfo("", **params)


def proxy_target(dsn: str) -> tuple[str, int]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
    return ("127.0.0.1" if host == "localhost" else host), int(params.get("port") or 5432)


def paced_inserts(dsn: str, table: str, rate: float, seconds: float) -> list[int]:
    ids: list[int] = []
    with psycopg.connect(dsn) as conn:
        next_at = time.monotonic()
        end = next_at + seconds
        seq = 0
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
                            aggregate_id=f"agg-{seq % 50}",
                            event_type="OrderCreated",
                            payload=c.payload_json(seq, 200),
                            table=table,
                        )
                    )
                )
            seq += 1
            next_at += 1.0 / rate
    return ids


def insert_to_ack_ms(dsn: str, table: str, ids: list[int], timeout: float) -> list[float]:
    query = sql.SQL(
        "SELECT extract(epoch FROM done_at - created_at) * 1000 FROM {} WHERE id = ANY(%s) AND status = 'done'"
    ).format(c.ident(table))
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            found = [float(r[0]) for r in conn.execute(query, (ids,)).fetchall()]
            if len(found) >= len(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def run_one(
    dsn: str,
    bootstrap: str,
    proxy: TcpProxy | None,
    label: str,
    workers: int,
    batch: int,
    args: argparse.Namespace,
    *,
    paced: bool,
) -> dict[str, Any]:
    table = c.new_table(f"{label}_{workers}x{batch}")
    topic = f"bench.{c.RUN_ID}.{label}.{workers}x{batch}"
    c.migrate(dsn, table)
    c.create_topic(bootstrap, topic)
    env = c.relay_env(relay_dsn(dsn, proxy), table, bootstrap, topic, OUTBOX_RELAY_RELAY__BATCH_SIZE=str(batch))
    relay = c.RelayProcess(["--workers", str(workers)], env)
    result: dict[str, Any] = {"workers": workers, "batch_size": batch}
    try:
        relay.wait_started(timeout=120)
        time.sleep(1.0)
        with psycopg.connect(dsn) as conn:
            with conn.transaction():
                c.copy_backlog(conn, table, args.events, aggregates=100, payload_bytes=200)
                started = time.monotonic()
            with psycopg.connect(dsn, autocommit=True) as poll:
                finished = c.wait_drained(poll, table, timeout=args.timeout)
        result["rows_per_second"] = round(args.events / (finished - started))
        if paced:
            ids = paced_inserts(dsn, table, args.rate, args.paced_seconds)
            latencies = insert_to_ack_ms(dsn, table, ids, timeout=60)
            result.update(
                {
                    "paced_rows": len(ids),
                    "acked": len(latencies),
                    "p50_ms": round(c.pct(latencies, 50), 1),
                    "p90_ms": round(c.pct(latencies, 90), 1),
                    "p99_ms": round(c.pct(latencies, 99), 1),
                }
            )
    finally:
        result["exit_code"] = relay.stop()
        result["warnings"] = relay.warnings(3)
        relay.cleanup()
        if not args.keep:
            c.drop_schema(dsn, table)
    counts = result.get("rows_per_second")
    c.say(
        f"  {label:<14} {workers:>2} x {batch:<5} {counts} rows/s"
        + (f"  p50 {result['p50_ms']} ms  p99 {result['p99_ms']} ms" if paced else "")
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument("--rtts-ms", default="1,5,20", help="round-trip times to put on the relay's database link")
    parser.add_argument("--loss", type=float, default=0.01, help="fraction of chunks stalled like a lost segment")
    parser.add_argument("--loss-rtt-ms", type=float, default=1.0, help="round trip of the lossy condition")
    parser.add_argument(
        "--settings",
        default="4x1000,8x1000,16x1000",
        help="workers x batch size, comma-separated; the first also measures latency",
    )
    parser.add_argument("--events", type=int, default=20_000, help="backlog rows per throughput run")
    parser.add_argument("--rate", type=float, default=50.0, help="single-row inserts per second (latency)")
    parser.add_argument("--paced-seconds", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    settings = parse_settings(args.settings)
    conditions: list[tuple[str, float | None, float]] = [("loopback", None, 0.0), ("proxy-0ms", 0.0, 0.0)]
    conditions += [(f"rtt-{r:g}ms", float(r), 0.0) for r in (float(x) for x in args.rtts_ms.split(",") if x)]
    if args.loss > 0:
        conditions.append((f"loss-{args.loss * 100:g}pct", args.loss_rtt_ms, args.loss))
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "events": args.events,
        "rate_per_second": args.rate,
        "conditions": {},
    }
    with c.servers(args) as (dsn, bootstrap):
        assert bootstrap is not None
        report["postgres"] = c.server_version(dsn)
        for label, rtt_ms, loss in conditions:
            proxy = None
            if rtt_ms is not None:
                host, port = proxy_target(dsn)
                proxy = TcpProxy(host, port).start()
                proxy.delay_seconds = rtt_ms / 2000.0
                proxy.loss = loss
            try:
                runs = [
                    run_one(dsn, bootstrap, proxy, label.replace("-", "").replace(".", ""), w, b, args, paced=(i == 0))
                    for i, (w, b) in enumerate(settings)
                ]
            finally:
                if proxy is not None:
                    proxy.stop()
            report["conditions"][label] = {"rtt_ms": rtt_ms if rtt_ms is not None else 0.0, "loss": loss, "runs": runs}
    lines = [
        f"network latency bench, {report['date']}, {args.events} rows per drain, PostgreSQL {report['postgres']}",
        "",
        "| condition | "
        + " | ".join(f"{w} x {b} rows/s" for w, b in settings)
        + " | insert->ack p50 / p90 / p99 ms (first setting) |",
        "|---|" + "---|" * len(settings) + "---|",
    ]
    for label, cond in report["conditions"].items():
        runs = cond["runs"]
        first = runs[0]
        lines.append(
            f"| {label} | "
            + " | ".join(str(r.get("rows_per_second")) for r in runs)
            + f" | {first.get('p50_ms')} / {first.get('p90_ms')} / {first.get('p99_ms')} |"
        )
    c.emit(report, lines, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
