#!/usr/bin/env python3
"""What does an operator see right after a bulk failure? Counts side by side, one run.

Inserts --dead rows straight as `dead` (a bad deploy) into a table that already has
--done finished rows (ANALYZEd before the failure, as autovacuum would have), then:

  capped + planner   what `status` reported before exact counts: exact up to
                     metrics.exact_count_limit, above it max(limit, planner estimate)
  exact, cold        OutboxStore.exact_depth right after the insert (visibility map
                     not yet set: the index-only scan still visits the heap)
  exact, vacuumed    the same after VACUUM (a true index-only scan)
  filtered           dead_count with an event-type + error filter (what
                     `dead retry --dry-run` and the console count)

each timed --reps times (median), with the true number of dead rows next to it.

    .venv/bin/python bench/exact_count.py                    # 1M dead + 1M done, embedded PostgreSQL 18
    .venv/bin/python bench/exact_count.py --dsn postgresql://postgres@127.0.0.1:5432/test --dead 200000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common as c
import psycopg
from psycopg import sql

from outbox_relay.config import load_settings
from outbox_relay.core.filters import DeadFilter
from outbox_relay.db.store import OutboxStore

DEFAULTS = load_settings(None)


def timed(fn: Any, reps: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return c.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dead", type=int, default=1_000_000, help="dead rows of the bulk failure")
    parser.add_argument("--done", type=int, default=1_000_000, help="done rows already in the table")
    parser.add_argument("--reps", type=int, default=5)
    c.add_server_args(parser)
    args = parser.parse_args()
    cap = DEFAULTS.metrics.exact_count_limit
    budget = DEFAULTS.metrics.exact_count_timeout_ms
    with c.servers(args, need_broker=False) as (dsn, _):
        table = c.new_table("exactcount")
        c.migrate(dsn, table)
        t = c.ident(table)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                c.say(f"inserting {args.done} done rows, ANALYZE ...")
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, done_at)"
                        " SELECT 'order', 'o-' || (g %% 10000), 'OrderPaid', '{{}}', 'done', now()"
                        " FROM generate_series(1, %s) AS g"
                    ).format(t),
                    (args.done,),
                )
                conn.execute(sql.SQL("VACUUM ANALYZE {}").format(t))
                c.say(f"bulk failure: {args.dead} dead rows ...")
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts,"
                        " last_error) SELECT 'payment', 'p-' || (g %% 10000), CASE WHEN g %% 4 = 0 THEN 'OrderCreated'"
                        " ELSE 'PaymentCaptured' END, '{{}}', 'dead', 12, 'retries exhausted: UNKNOWN_TOPIC_OR_PART'"
                        " FROM generate_series(1, %s) AS g"
                    ).format(t),
                    (args.dead,),
                )
            store = OutboxStore(dsn, table, pool_size=2, statement_timeout_ms=60_000)
            with store:
                capped_ms, stats = timed(lambda: store.stats(count_cap=cap), args.reps)
                cold_ms, cold = timed(lambda: store.exact_depth(budget_ms=budget, first_upto=cap), 1)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(sql.SQL("VACUUM {}").format(t))
                warm_ms, warm = timed(lambda: store.exact_depth(budget_ms=budget, first_upto=cap), args.reps)
                selector = DeadFilter(event_type="PaymentCaptured", error_contains="unknown_topic")
                filtered_ms, filtered = timed(lambda: store.dead_count(selector, budget_ms=budget), args.reps)
            lines = [
                f"PostgreSQL {c.server_version(dsn)}; {args.dead} dead rows just inserted, {args.done} done rows;"
                f" exact_count_limit {cap}, count budget {budget} ms",
                f"  {'method':<34}{'dead reported':>16}{'done reported':>16}{'ms (median)':>14}",
                f"  {'capped + planner estimate (old)':<34}{stats.queue_depth['dead']:>16}"
                f"{stats.queue_depth['done']:>16}{capped_ms:>14.1f}",
                f"  {'exact, right after the insert':<34}{cold['dead']!s:>16}{cold['done']!s:>16}{cold_ms:>14.1f}",
                f"  {'exact, after VACUUM':<34}{warm['dead']!s:>16}{warm['done']!s:>16}{warm_ms:>14.1f}",
                f"  {'filtered dead count':<34}{filtered!s:>16}{'':>16}{filtered_ms:>14.1f}"
                f"   (true: {args.dead - args.dead // 4})",
            ]
            c.emit(
                {
                    "dead": args.dead,
                    "done": args.done,
                    "capped_ms": capped_ms,
                    "capped_dead": stats.queue_depth["dead"],
                    "exact_cold_ms": cold_ms,
                    "exact_warm_ms": warm_ms,
                    "filtered_ms": filtered_ms,
                    "exact_dead": cold["dead"].n,
                    "filtered": filtered.n,
                },
                lines,
                args.json,
            )
        finally:
            if not args.keep:
                c.drop_schema(dsn, table)


if __name__ == "__main__":
    main()
