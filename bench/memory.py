"""Peak memory of `outbox-relay run --workers 4` with default settings, by event size.

Three backlogs, each on a fresh table, drained by a fresh relay subprocess started
with the defaults (only the connection settings and a topic are given):

  a) 50 000 rows of ~200 B payloads
  b)  3 000 rows of ~190 KB payloads (a ~600 MB table)
  c)  5 000 rows of ~1 KB with 10 rows of ~900 KB spread among them

Payloads are random hex (nothing compresses). The relay starts idle, the backlog is
COPYed in one transaction, and the drain is timed from that COMMIT until no row is
pending or processing. Reported per run: events/s and the relay's peak RSS (VmHWM
of /proc/<pid>/status after the drain). Every run is verified: all rows done and
every message id read back from the topic. Target (memory bounded by bytes): peak RSS <= 300 MB in
all three with default settings.

    .venv/bin/python bench/memory.py                            # this checkout
    .venv/bin/python bench/memory.py --relay-root /tmp/old,.    # before and after, side by side

``--relay-root`` runs the relay code of one or more checkouts of the project (e.g. a
`git worktree add --detach /tmp/old <commit>` of an older commit; ``.`` is this one)
against the same servers and the same backlog shapes, in one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
import psycopg
from psycopg import sql

SCENARIOS = {
    "a": {"label": "50 000 x ~200 B", "rows": 50_000, "payload": 200, "big_every": 0, "big_payload": 0},
    "b": {"label": "3 000 x ~190 KB", "rows": 3_000, "payload": 190_000, "big_every": 0, "big_payload": 0},
    "c": {
        "label": "5 000 x ~1 KB + 10 x ~900 KB",
        "rows": 5_010,
        "payload": 1_000,
        "big_every": 501,
        "big_payload": 900_000,
    },
}


def random_payload(size: int) -> str:
    """JSON of about ``size`` bytes of random hex: nothing for TOAST or the broker to compress."""
    return '{"pad": "' + os.urandom(max(1, size // 2)).hex() + '"}'


def load_backlog(conn: psycopg.Connection[Any], table: str, spec: dict[str, Any]) -> int:
    """COPY the scenario's rows in the caller's transaction; returns the payload bytes written."""
    total = 0
    stmt = sql.SQL("COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN").format(c.ident(table))
    with conn.cursor() as cur, cur.copy(stmt) as copy:
        for i in range(spec["rows"]):
            big = spec["big_every"] and i % spec["big_every"] == spec["big_every"] // 2
            payload = random_payload(spec["big_payload"] if big else spec["payload"])
            total += len(payload)
            copy.write_row(("order", f"agg-{i % 100}", "OrderCreated", payload))
    return total


def read_ids(bootstrap: str, topic: str, expected: int, timeout: float = 300.0) -> set[str]:
    """message_id headers read back from ``topic`` (values are not kept: they can be large)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"mem-bench-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    ids: set[str] = set()
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        partitions = len(meta.partitions) if meta is not None and meta.partitions else 4
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        deadline = time.monotonic() + timeout
        while len(ids) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=500, timeout=0.5):
                if msg.error():
                    continue
                for name, value in msg.headers() or []:
                    if name == "message_id" and isinstance(value, bytes):
                        ids.add(value.decode())
    finally:
        consumer.close()
    return ids


def run_scenario(
    name: str, root: Path, index: int, dsn: str, bootstrap: str, args: argparse.Namespace
) -> dict[str, Any]:
    spec = SCENARIOS[name]
    table = c.new_table(f"mem{name}{index}")
    topic = f"bench.memory.{c.RUN_ID}.{name}.{index}"
    c.migrate(dsn, table)
    c.create_topic(bootstrap, topic)
    env = c.relay_env(dsn, table, bootstrap, topic)
    env["PYTHONPATH"] = str(root)
    command = [sys.executable, "-m", "outbox_relay.operator.cli"]
    log = Path(f"/tmp/outbox-relay-memory-{c.RUN_ID}-{name}-{index}.log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "run", "--workers", str(args.workers)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(root),
        )
    try:
        deadline = time.monotonic() + 60
        while '"relay started"' not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"relay did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        time.sleep(args.warm_seconds)
        c.say(f"[{name}] loading {spec['label']} ...")
        with psycopg.connect(dsn) as conn:
            with conn.transaction():
                payload_bytes = load_backlog(conn, table, spec)
            committed = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            drained = c.wait_drained(conn, table, timeout=args.timeout)
        seconds = drained - committed
        hwm_kb = None
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm_kb = int(line.split()[1])
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=10)
    counts = c.count_by_status(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        table_mb = (
            conn.execute(
                "SELECT pg_total_relation_size(%s::regclass)", (".".join('"' + p + '"' for p in table.split(".")),)
            ).fetchone()[0]
            / 1e6
        )
    c.say(f"[{name}] drained in {seconds:.1f} s; reading ids back ...")
    ids = read_ids(bootstrap, topic, spec["rows"])
    ok = counts == {"done": spec["rows"]} and len(ids) == spec["rows"] and code == 0
    if not args.keep:
        c.drop_schema(dsn, table)
        log.unlink(missing_ok=True)
    return {
        "relay_root": str(root),
        "scenario": name,
        "label": spec["label"],
        "rows": spec["rows"],
        "payload_mb": round(payload_bytes / 1e6, 1),
        "table_mb": round(table_mb, 1),
        "seconds": round(seconds, 2),
        "events_per_second": round(spec["rows"] / seconds),
        "peak_rss_mb": round(hwm_kb / 1024, 1) if hwm_kb else None,
        "statuses": counts,
        "unique_ids_read_back": len(ids),
        "exit_code": code,
        "verified": ok,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_server_args(parser)
    parser.add_argument("--scenarios", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warm-seconds", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--relay-root",
        default=".",
        help="comma-separated checkouts whose relay code to run ('.' = this one), side by side",
    )
    parser.add_argument("--target-rss-mb", type=float, default=300.0)
    args = parser.parse_args()
    roots = [(c.ROOT if part.strip() == "." else Path(part.strip())).resolve() for part in args.relay_root.split(",")]
    results = []
    with c.servers(args) as (dsn, bootstrap):
        assert bootstrap is not None
        for name in args.scenarios.split(","):
            for index, root in enumerate(roots):
                c.say(f"== scenario {name}, relay code {root}")
                results.append(run_scenario(name.strip(), root, index, dsn, bootstrap, args))
    report = {
        "relay_roots": [str(r) for r in roots],
        "workers": args.workers,
        "runs": results,
        "target_peak_rss_mb": args.target_rss_mb,
        "broker": c.broker_label(args),
    }
    lines = [
        f"defaults, --workers {args.workers}, broker {c.broker_label(args)}",
        f"{'relay code':<28}{'scenario':<32}{'table MB':>10}{'events/s':>10}{'peak RSS MB':>13}  verified",
    ]
    for r in results:
        lines.append(
            f"{Path(r['relay_root']).name[:27]:<28}{r['label']:<32}{r['table_mb']:>10}"
            f"{r['events_per_second']:>10}{r['peak_rss_mb']:>13}  {r['verified']}"
        )
    for root in roots:
        worst = max((r["peak_rss_mb"] or 0) for r in results if r["relay_root"] == str(root))
        lines.append(
            f"{root}: worst peak RSS {worst} MB (target <= {args.target_rss_mb:g} MB: "
            f"{'met' if worst <= args.target_rss_mb else 'NOT met'})"
        )
    c.emit(report, lines, args.json)
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
