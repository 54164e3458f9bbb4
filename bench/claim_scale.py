#!/usr/bin/env python3
"""Does the claim's cost depend on the table's size? Large vs small table, one run.

  large  --rows done rows (default 1M) + --rows pending rows (default 1M), many aggregates
  small  --small pending rows (default 10k)

Both tables are built with generate_series INSERTs (explicit status/done_at; the
CHECK wants lease_until set iff processing), then VACUUM (ANALYZE). On each:

  claim          OutboxStore.claim(batch = relay default), timed; then the rows go
                 back to pending through the fenced OutboxStore.reschedule (attempt
                 refunded, due now), so the backlog keeps its size. --reps times; median.
  ordered claim  the same with ordered_types=["*"] (claim_ordered_heads), run_length 1.
  stats_*        the metrics refresh queries (stats_backlog, stats_expired,
                 stats_depth), timed --stats-reps times; median.

and prints EXPLAIN (ANALYZE, BUFFERS) of each statement on the large table (run in a
transaction that is rolled back), and the large/small ratio. Target: claim within 2x.

Dead-only aggregates (--parts dead; a dead backlog must not slow the claim): one table per count in
--dead-aggregates (default 0, 20 000, 100 000) of aggregates holding nothing but one
old dead row each, plus --dead-pending pending rows (20 000) over --dead-live
aggregates (2 000), VACUUM (ANALYZE). On each: the ordered claim (as above), the
blocked-aggregates query (stats_blocked, the walk over aggregates with work), all of
what `status` and the gauge refresher run (OutboxStore.stats with ordered types), and
EXPLAIN (ANALYZE, BUFFERS) of claim_ordered_heads and stats_blocked. Target: ordered claim with the most dead
aggregates within 1.5x of none.

    .venv/bin/python bench/claim_scale.py                   # 1M + 1M vs 10k (a few minutes)
    .venv/bin/python bench/claim_scale.py --rows 100000     # quicker
    .venv/bin/python bench/claim_scale.py --parts dead      # only the dead-only-aggregates table
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import _common as c
import psycopg
from psycopg import ClientCursor, sql

from outbox_relay.config import load_settings
from outbox_relay.db import store as store_module
from outbox_relay.db.store import OutboxStore, Reschedule

DEFAULTS = load_settings(None)
STATS = ("stats_backlog", "stats_expired", "stats_depth")
# The refresher's bound on exact counts (metrics.exact_count_limit).
STATS_PARAMS = {"cap": DEFAULTS.metrics.exact_count_limit}

LOAD_SQL = """
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, created_at, status,
                     available_at, attempts, lease_version, done_at)
SELECT 'order',
       'agg-' || (g %% %(aggregates)s),
       'OrderCreated',
       jsonb_build_object('seq', g, 'amount', g %% 9973, 'currency', 'EUR', 'note', repeat('x', %(pad)s)),
       now() - interval '3 days' + g * interval '1 ms',
       %(status)s,
       now() - interval '3 days' + g * interval '1 ms',
       CASE WHEN %(status)s = 'done' THEN 1 ELSE 0 END,
       CASE WHEN %(status)s = 'done' THEN 1 ELSE 0 END,
       CASE WHEN %(status)s = 'done' THEN now() - interval '2 days' + g * interval '1 ms' END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""


def load(
    dsn: str, table: str, *, done: int, pending: int, aggregates: int, pad: int, chunk: int, analyze: bool = True
) -> float:
    started = time.monotonic()
    stmt = sql.SQL(LOAD_SQL).format(table=c.ident(table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        serial = 0
        for status, n in (("done", done), ("pending", pending)):
            for first in range(0, n, chunk):
                count = min(chunk, n - first)
                conn.execute(
                    stmt,
                    {
                        "aggregates": aggregates,
                        "pad": pad,
                        "status": status,
                        "first": serial + 1,
                        "last": serial + count,
                    },
                )
                serial += count
                c.say(f"    {table}: {status} {first + count}/{n}")
        if analyze:
            c.say(f"    {table}: VACUUM (ANALYZE) ...")
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(c.ident(table)))
    return time.monotonic() - started


def claim_params(owner: str, batch: int, *, ordered: bool) -> dict[str, Any]:
    r = DEFAULTS.relay
    return {
        "owner": owner,
        "batch": batch,
        "lease_seconds": float(r.lease_seconds),
        "max_attempts": r.max_attempts,
        "ordered_types": [],
        "all_ordered": ordered,
        "after": None,
        "excluded_types": [],
        "max_batch_bytes": 2**62,
        "candidates": batch,
        "max_message_bytes": None,
        "first_always": True,
    }


def time_claims(store: OutboxStore, *, batch: int, reps: int, ordered: bool) -> dict[str, Any]:
    times = []
    sizes = []
    after: str | None = None  # the ordered claim goes round the aggregates as a worker does
    for i in range(reps):
        t0 = time.perf_counter()
        result = store.claim(
            owner=f"bench:{i}",
            batch=batch,
            lease_seconds=DEFAULTS.relay.lease_seconds,
            max_attempts=DEFAULTS.relay.max_attempts,
            ordered_types=["*"] if ordered else (),
            run_length=1,
            ordered_after=after,
        )
        times.append((time.perf_counter() - t0) * 1000)
        after = result.ordered_after
        sizes.append(len(result.rows))
        back = store.reschedule([Reschedule(r.id, r.lease_version, 0.0, None, True) for r in result.rows])
        if len(back) != len(result.rows):
            raise RuntimeError(f"fenced reschedule returned {len(back)} of {len(result.rows)} rows")
    return {
        "median_ms": round(c.median(times), 2),
        "p90_ms": round(c.pct(times, 90), 2),
        "min_ms": round(min(times), 2),
        "rows_per_claim": round(c.median(sizes)),
        "reps": reps,
    }


def time_stats(dsn: str, table: str, reps: int) -> dict[str, dict[str, Any]]:
    store_sql = OutboxStore(dsn, table).sql
    out = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in STATS:
            stmt = store_sql.query(name)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                conn.execute(stmt, dict(STATS_PARAMS, table=store_sql.regclass_text)).fetchall()
                times.append((time.perf_counter() - t0) * 1000)
            out[name] = {"median_ms": round(c.median(times), 2), "min_ms": round(min(times), 2), "reps": reps}
    return out


def explain(dsn: str, table: str, name: str, params: dict[str, Any] | None) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of a statement of the db/sql files, inside a rolled-back transaction."""
    store_sql = OutboxStore(dsn, table).sql
    with psycopg.connect(dsn) as conn:
        text = store_sql.query(name).as_string(conn)
        cur = ClientCursor(conn)
        try:
            if name.startswith("claim"):  # planned as the store plans its claims
                cur.execute(
                    "SELECT set_config(name, value, true) FROM jsonb_each_text(%s::jsonb) AS s(name, value)",
                    (json.dumps(store_module.CLAIM_SETTINGS),),
                )
            rows = cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + text, params).fetchall()
        finally:
            conn.rollback()
    return "\n".join(r[0] for r in rows)


def plan_time(plan: str) -> float | None:
    for line in plan.splitlines():
        if line.strip().startswith("Execution Time:"):
            return float(line.split(":")[1].split()[0])
    return None


def measure(dsn: str, table: str, args: argparse.Namespace) -> dict[str, Any]:
    store = OutboxStore(dsn, table, pool_size=1)
    store.open()
    try:
        store.claim(owner="warm", batch=1, lease_seconds=1, max_attempts=12)  # connection + catalog caches
        c.say(f"  {table}: timing claim x{args.reps} ...")
        claim = time_claims(store, batch=args.batch_size, reps=args.reps, ordered=False)
        unplanned = None
        if args.no_statistics:
            # Side by side: the same claim planned without CLAIM_SETTINGS (what versions
            # before this one did), on the same table without statistics.
            c.say(f"  {table}: timing claim without the planner settings x{args.reps} ...")
            saved = dict(store_module.CLAIM_SETTINGS)
            store_module.CLAIM_SETTINGS.clear()
            try:
                unplanned = time_claims(store, batch=args.batch_size, reps=args.reps, ordered=False)
            finally:
                store_module.CLAIM_SETTINGS.update(saved)
        c.say(f"  {table}: timing ordered claim x{args.reps} ...")
        ordered = time_claims(store, batch=args.batch_size, reps=args.reps, ordered=True)
    finally:
        store.close()
    c.say(f"  {table}: timing metrics queries x{args.stats_reps} ...")
    stats = time_stats(dsn, table, args.stats_reps)
    plans = {
        "claim": explain(dsn, table, "claim", claim_params("explain", args.batch_size, ordered=False)),
        "claim_ordered_heads": explain(
            dsn, table, "claim_ordered_heads", claim_params("explain", args.batch_size, ordered=True)
        ),
    }
    for name in STATS:
        plans[name] = explain(dsn, table, name, dict(STATS_PARAMS, table=OutboxStore(dsn, table).sql.regclass_text))
    extra = {"claim_without_settings": unplanned} if unplanned is not None else {}
    return {
        "claim": claim,
        "claim_ordered_heads": ordered,
        **extra,
        **stats,
        "plans": plans,
        "plan_execution_ms": {k: plan_time(v) for k, v in plans.items()},
    }


def measure_dead(dsn: str, args: argparse.Namespace, pad: int) -> dict[str, Any]:
    """Ordered claim and stats_blocked with 0 / 20k / 100k dead-only aggregates, side by side."""
    out: dict[str, Any] = {}
    blocked_params = {
        "all_ordered": True,
        "ordered_types": [],
        "limit": 100,
        "scan_cap": DEFAULTS.metrics.exact_count_limit,
    }
    for n in (int(x) for x in args.dead_aggregates.split(",") if x.strip()):
        table = c.new_table(f"dead{n}")
        try:
            c.migrate(dsn, table, notify_trigger=False, ordering=True)
            c.say(
                f"loading {table}: {n} dead-only aggregates + {args.dead_pending} pending rows over "
                f"{args.dead_live} aggregates ..."
            )
            c.add_dead_aggregates(dsn, table, n, payload_bytes=args.payload_bytes, analyze=False)
            load(
                dsn, table, done=0, pending=args.dead_pending, aggregates=args.dead_live, pad=pad, chunk=args.chunk
            )  # ends with VACUUM (ANALYZE): statistics of the whole mix
            c.checkpoint(dsn)
            store = OutboxStore(dsn, table, pool_size=1)
            store.open()
            try:
                store.claim(owner="warm", batch=1, lease_seconds=1, max_attempts=12, ordered_types=["*"])
                c.say(f"  {table}: timing ordered claim x{args.reps} ...")
                ordered = time_claims(store, batch=args.batch_size, reps=args.reps, ordered=True)
                status_times = []  # everything `status` and the gauge refresher run
                for _ in range(args.stats_reps):
                    t0 = time.perf_counter()
                    store.stats(ordered_types=["*"], count_cap=DEFAULTS.metrics.exact_count_limit)
                    status_times.append((time.perf_counter() - t0) * 1000)
            finally:
                store.close()
            times = []
            with psycopg.connect(dsn, autocommit=True) as conn:
                stmt = OutboxStore(dsn, table).sql.query("stats_blocked")
                for _ in range(args.stats_reps):
                    t0 = time.perf_counter()
                    blocked = conn.execute(stmt, blocked_params).fetchall()
                    times.append((time.perf_counter() - t0) * 1000)
            plans = {
                "claim_ordered_heads": explain(
                    dsn, table, "claim_ordered_heads", claim_params("explain", args.batch_size, ordered=True)
                ),
                "stats_blocked": explain(dsn, table, "stats_blocked", blocked_params),
            }
            out[str(n)] = {
                "dead_aggregates": n,
                "claim_ordered": ordered,
                "stats_blocked": {
                    "median_ms": round(c.median(times), 2),
                    "min_ms": round(min(times), 2),
                    "reps": args.stats_reps,
                    "blocked": len(blocked),
                },
                "status": {
                    "median_ms": round(c.median(status_times), 2),
                    "min_ms": round(min(status_times), 2),
                    "reps": args.stats_reps,
                },
                "plans": plans,
                "plan_execution_ms": {k: plan_time(v) for k, v in plans.items()},
            }
        finally:
            if not args.keep:
                c.drop_schema(dsn, table)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    c.add_server_args(parser)
    parser.add_argument(
        "--rows",
        type=int,
        default=1_000_000,
        help="done rows and pending rows of the large table, each (default 1000000)",
    )
    parser.add_argument("--small", type=int, default=10_000, help="pending rows of the small table (default 10000)")
    parser.add_argument(
        "--aggregates",
        type=int,
        default=100_000,
        help="distinct aggregate ids (default 100000; the ordered claim's worst case is few)",
    )
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS.relay.batch_size,
        help=f"claim batch (default: relay default, {DEFAULTS.relay.batch_size})",
    )
    parser.add_argument("--reps", type=int, default=20, help="claims timed per table (default 20)")
    parser.add_argument("--stats-reps", type=int, default=5, help="runs of each metrics query (default 5)")
    parser.add_argument("--chunk", type=int, default=250_000, help="rows per INSERT while loading")
    parser.add_argument("--no-plans", action="store_true", help="leave the EXPLAIN output out of the text report")
    parser.add_argument("--target-ratio", type=float, default=2.0)
    parser.add_argument(
        "--no-statistics",
        action="store_true",
        help="scale part: no ANALYZE after loading and autovacuum off for the tables (a backlog "
        "that arrived faster than autovacuum follows); also times the claim planned without "
        "the claim's planner settings, side by side",
    )
    parser.add_argument("--parts", default="scale,dead", help="scale (large vs small), dead (dead-only aggregates)")
    parser.add_argument(
        "--dead-aggregates",
        default="0,20000,100000",
        help="dead part: counts of aggregates holding only one old dead row (default 0,20000,100000)",
    )
    parser.add_argument("--dead-pending", type=int, default=20_000, help="dead part: pending rows (default 20000)")
    parser.add_argument(
        "--dead-live", type=int, default=2_000, help="dead part: aggregates of the pending rows (default 2000)"
    )
    parser.add_argument("--target-dead-ratio", type=float, default=1.5)
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    pad = max(0, args.payload_bytes - 70)

    report: dict[str, Any] = {"benchmark": "claim_scale", "parts": sorted(parts), "batch_size": args.batch_size}
    lines: list[str] = []
    targets: dict[str, Any] = {}
    with c.servers(args, need_broker=False) as (dsn, _):
        report["postgresql"] = c.server_version(dsn)
        if "scale" in parts:
            report.update(
                {
                    "rows_done": args.rows,
                    "rows_pending": args.rows,
                    "small_pending": args.small,
                    "aggregates": args.aggregates,
                }
            )
            large, small = c.new_table("claim_large"), c.new_table("claim_small")
            try:
                for table in (large, small):  # the ordered claim is timed too: the ordering indexes
                    c.migrate(dsn, table, notify_trigger=False, ordering=True)
                    if args.no_statistics:
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            conn.execute(
                                sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(c.ident(table))
                            )
                c.say(f"loading {large}: {args.rows} done + {args.rows} pending rows ...")
                report["load_seconds_large"] = round(
                    load(
                        dsn,
                        large,
                        done=args.rows,
                        pending=args.rows,
                        aggregates=args.aggregates,
                        pad=pad,
                        chunk=args.chunk,
                        analyze=not args.no_statistics,
                    ),
                    1,
                )
                c.say(f"loading {small}: {args.small} pending rows ...")
                load(
                    dsn,
                    small,
                    done=0,
                    pending=args.small,
                    aggregates=min(args.aggregates, args.small),
                    pad=pad,
                    chunk=args.chunk,
                    analyze=not args.no_statistics,
                )
                with psycopg.connect(dsn, autocommit=True) as conn:
                    report["large_table_size"] = conn.execute(
                        "SELECT pg_size_pretty(pg_total_relation_size(%s::regclass))", (large,)
                    ).fetchone()[0]
                c.checkpoint(dsn)
                report["large"] = measure(dsn, large, args)
                report["small"] = measure(dsn, small, args)
            finally:
                if not args.keep:
                    c.drop_schema(dsn, large)
                    c.drop_schema(dsn, small)
        if "dead" in parts:
            report["dead"] = measure_dead(dsn, args, pad)

    if "scale" in parts:
        lines += scale_lines(report, args, targets)
    if "dead" in parts:
        lines += dead_lines(report, args, targets)
    report["targets"] = targets
    c.emit(report, lines, args.json)
    return 0


def scale_lines(report: dict[str, Any], args: argparse.Namespace, targets: dict[str, Any]) -> list[str]:
    ratios = {}
    for name in ("claim", "claim_ordered_heads", *STATS):
        lo, hi = report["small"][name]["median_ms"], report["large"][name]["median_ms"]
        ratios[name] = round(hi / lo, 2) if lo else None
    report["ratios_large_over_small"] = ratios
    met = ratios["claim"] is not None and ratios["claim"] <= args.target_ratio
    targets["claim_ratio"] = {"target": f"<= {args.target_ratio:g}x", "value": ratios["claim"], "met": met}
    lines = [
        f"claim_scale: large = {args.rows:,} done + {args.rows:,} pending ({report['large_table_size']}, "
        f"{args.aggregates:,} aggregates) vs small = {args.small:,} pending; batch {args.batch_size}; "
        f"PostgreSQL {report['postgresql']}",
        f"  {'statement':<22}{'large ms':>10}{'small ms':>10}{'ratio':>8}   (median; EXPLAIN ANALYZE ms large/small)",
    ]
    for name in ("claim", "claim_ordered_heads", *STATS):
        lg, sm = report["large"][name], report["small"][name]
        pl, ps = report["large"]["plan_execution_ms"][name], report["small"]["plan_execution_ms"][name]
        lines.append(f"  {name:<22}{lg['median_ms']:>10.2f}{sm['median_ms']:>10.2f}{ratios[name]!s:>8}   ({pl} / {ps})")
    lines.append(
        f"  claim rows per call: {report['large']['claim']['rows_per_claim']} large, "
        f"{report['small']['claim']['rows_per_claim']} small; ordered: "
        f"{report['large']['claim_ordered_heads']['rows_per_claim']} / "
        f"{report['small']['claim_ordered_heads']['rows_per_claim']}"
    )
    if "claim_without_settings" in report["large"]:
        lg, sm = report["large"]["claim_without_settings"], report["small"]["claim_without_settings"]
        ratio = round(lg["median_ms"] / sm["median_ms"], 2) if sm["median_ms"] else None
        report["ratios_large_over_small"]["claim_without_settings"] = ratio
        lines.append(
            f"  {'claim, no settings':<22}{lg['median_ms']:>10.2f}{sm['median_ms']:>10.2f}{ratio!s:>8}   "
            "(the claim planned as before CLAIM_SETTINGS)"
        )
    lines.append(f"  statistics: {'none (no ANALYZE, autovacuum off)' if args.no_statistics else 'VACUUM (ANALYZE)'}")
    lines.append(f"  claim_ratio {ratios['claim']}   target <= {args.target_ratio:g}x   {'met' if met else 'NOT MET'}")
    if not args.no_plans:
        for name, plan in report["large"]["plans"].items():
            lines.append(f"\n--- EXPLAIN (ANALYZE, BUFFERS) {name}, large table ---")
            lines.append(plan)
    return lines


def dead_lines(report: dict[str, Any], args: argparse.Namespace, targets: dict[str, Any]) -> list[str]:
    dead = report["dead"]
    lines = [
        f"claim_scale, dead-only aggregates: {args.dead_pending:,} pending rows over {args.dead_live:,} aggregates "
        f"+ N aggregates holding one old dead row each; ordered claim batch {args.batch_size}, run_length 1; "
        f"PostgreSQL {report['postgresql']}",
        f"  {'dead-only':>10}{'ordered claim ms':>18}{'rows':>6}{'ratio':>7}{'stats_blocked ms':>18}{'ratio':>7}"
        f"{'status ms':>11}   (median; EXPLAIN ANALYZE ms heads / blocked)",
    ]
    base = dead.get("0")
    for key, d in dead.items():
        claim_ms, blocked_ms = d["claim_ordered"]["median_ms"], d["stats_blocked"]["median_ms"]
        r_claim = round(claim_ms / base["claim_ordered"]["median_ms"], 2) if base else None
        r_blocked = round(blocked_ms / base["stats_blocked"]["median_ms"], 2) if base else None
        d["ratio_vs_none"] = {"claim_ordered": r_claim, "stats_blocked": r_blocked}
        pe = d["plan_execution_ms"]
        lines.append(
            f"  {int(key):>10,}{claim_ms:>18.2f}{d['claim_ordered']['rows_per_claim']:>6}{r_claim!s:>7}"
            f"{blocked_ms:>18.2f}{r_blocked!s:>7}{d['status']['median_ms']:>11.2f}   "
            f"({pe['claim_ordered_heads']} / {pe['stats_blocked']})"
        )
    if base and len(dead) > 1:
        worst_key = max(dead, key=int)
        value = dead[worst_key]["ratio_vs_none"]["claim_ordered"]
        met = value is not None and value <= args.target_dead_ratio
        targets["dead_claim_ratio"] = {
            "target": f"<= {args.target_dead_ratio:g}x",
            "value": value,
            "met": met,
            "dead_aggregates": int(worst_key),
        }
        lines.append(
            f"  ordered claim with {int(worst_key):,} dead-only aggregates / none: {value}   "
            f"target <= {args.target_dead_ratio:g}x   {'met' if met else 'NOT MET'}"
        )
    if not args.no_plans:
        for key, d in dead.items():
            for name, plan in d["plans"].items():
                lines.append(f"\n--- EXPLAIN (ANALYZE, BUFFERS) {name}, {int(key):,} dead-only aggregates ---")
                lines.append(plan)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
