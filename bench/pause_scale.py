#!/usr/bin/env python3
"""What does an operator pause of many pending rows cost the claim? Buffer counts, no timing.

One outbox table (migrated, ordering indexes built) with --free pending rows of an
unpaused event type, then --paused pending rows of the event type that gets paused,
older than the free ones (so, unparked, they would sit at the front of the claim's
index: the worst case). The figures are EXPLAIN (ANALYZE, BUFFERS) shared buffers
(hit + read) of ONE claim statement as the store sends it from the front of its
indexes (no claim cursor: the worst case), each in a rolled-back transaction, so
every phase claims the same rows. They do not depend on the machine's load.

  without          only the free rows (the paused rows not inserted yet)
  filtered only    the paused rows inserted and the pause recorded, but not parked:
                   the claim skips them by its filter, reading each (what parking avoids)
  parked           after `outbox-relay pause` parked them (operator/pauses.py), before
                   VACUUM: the old index entries are still at the front of the index
                   (a running relay's claim cursor starts after them)
  parked+vacuum    the same after VACUUM: what every claim costs for the pause's duration
  ordered          claim_ordered_heads (relay.ordered_event_types = ["*"]) without and
                   with the parked rows, which lie in --paused-aggregates aggregates:
                   the ordered claim visits each aggregate that has pending rows, so its
                   cost grows with the number of paused aggregates (documented limit)

and the statements the pause and the resume sent (one per --chunk rows).

    .venv/bin/python bench/pause_scale.py --paused 20000          # proves it works, in seconds
    .venv/bin/python bench/pause_scale.py --paused 1000000        # the target size
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import _common as c
import psycopg
from psycopg import ClientCursor, sql

from outbox_relay.config import load_settings
from outbox_relay.db import store as store_module
from outbox_relay.db.store import OutboxStore
from outbox_relay.operator.pauses import PauseTarget, pause, resume

DEFAULTS = load_settings(None)

LOAD_SQL = """
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
SELECT 'order', %(prefix)s || (g %% %(aggregates)s), %(event_type)s,
       jsonb_build_object('seq', g, 'note', repeat('x', %(pad)s)),
       %(start)s::timestamptz + g * interval '1 ms', %(start)s::timestamptz + g * interval '1 ms'
FROM generate_series(1, %(n)s) AS g
"""

_BUFFERS_RE = re.compile(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?")


def load(dsn: str, table: str, *, n: int, event_type: str, start: str, aggregates: int, prefix: str) -> None:
    stmt = sql.SQL(LOAD_SQL).format(table=c.ident(table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            stmt,
            {"n": n, "event_type": event_type, "start": start, "aggregates": aggregates, "pad": 100, "prefix": prefix},
        )


def vacuum(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(c.ident(table)))


def claim_params(batch: int) -> dict[str, Any]:
    r = DEFAULTS.relay
    return {
        "owner": "bench",
        "batch": batch,
        "lease_seconds": float(r.lease_seconds),
        "max_attempts": r.max_attempts,
        "ordered_types": [],
        "all_ordered": True,
        "after": None,
        "excluded_types": [],
        "max_batch_bytes": 2**62,
        "candidates": batch,
        "max_message_bytes": None,
        "first_always": True,
    }


def explain(dsn: str, table: str, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim statement, planned with the store's claim
    settings, in a transaction that is rolled back; the statement's shared buffers."""
    store_sql = OutboxStore(dsn, table).sql
    with psycopg.connect(dsn) as conn:
        text = store_sql.query(name).as_string(conn)
        cur = ClientCursor(conn)
        try:
            cur.execute(
                "SELECT set_config(name, value, true) FROM jsonb_each_text(%s::jsonb) AS s(name, value)",
                (json.dumps(store_module.CLAIM_SETTINGS),),
            )
            plan = [r[0] for r in cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + text, params).fetchall()]
        finally:
            conn.rollback()
    hit, read = _first_buffers(plan, 0, top=True)  # the top node: the whole statement
    scans: dict[str, dict[str, int]] = {}
    for part in ("due", "parked"):  # the index scans of the claim's CTEs that read the pending index
        block = _block(plan, f"CTE {part}")
        scan = next((i for i, line in enumerate(block) if "Index Scan using" in line and "_pending_idx" in line), None)
        if scan is not None:
            removed = next(
                (int(m.group(1)) for line in _block(block, block[scan].strip()) if (m := _REMOVED_RE.search(line))), 0
            )
            scans[part] = {"buffers": sum(_first_buffers(block, scan)), "rows_skipped": removed}
    claimed_block = _block(plan, "CTE claimed") or plan
    match = re.search(r"actual .* rows=(\d+)", claimed_block[1] if len(claimed_block) > 1 else "")
    return {
        "shared_hit": hit,
        "shared_read": read,
        "buffers": hit + read,
        "scans": scans,
        "claimed": int(match.group(1)) if match else None,
        "plan": plan,
    }


_REMOVED_RE = re.compile(r"Rows Removed by Filter: (\d+)")


def _block(plan: list[str], header: str) -> list[str]:
    """The lines of the plan node (or CTE) whose line is ``header``, with its children."""
    start = next((i for i, line in enumerate(plan) if line.strip() == header.strip()), None)
    if start is None:
        return []
    indent = len(plan[start]) - len(plan[start].lstrip())
    end = start + 1
    while end < len(plan) and (not plan[end].strip() or len(plan[end]) - len(plan[end].lstrip()) > indent):
        end += 1
    return plan[start:end]


def _first_buffers(plan: list[str], start: int, *, top: bool = False) -> tuple[int, int]:
    """(hit, read) of the node at line ``start``: its first Buffers line (children included)."""
    lines = plan if top else _block(plan, plan[start])
    for line in lines:
        match = _BUFFERS_RE.search(line)
        if match:
            return int(match.group(1) or 0), int(match.group(2) or 0)
    return 0, 0


class CountingStore(OutboxStore):
    """The store, counting the park/unpark statements a pause and a resume send."""

    park_statements = 0

    def park_chunk(self, **kwargs: Any) -> Any:
        self.park_statements += 1
        return super().park_chunk(**kwargs)

    def park_expired_chunk(self, **kwargs: Any) -> Any:
        self.park_statements += 1
        return super().park_expired_chunk(**kwargs)

    def unpark_chunk(self, **kwargs: Any) -> Any:
        self.park_statements += 1
        return super().unpark_chunk(**kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    c.add_server_args(parser)
    parser.add_argument("--paused", type=int, default=1_000_000, help="pending rows paused (default 1000000)")
    parser.add_argument("--free", type=int, default=10_000, help="pending rows not paused (default 10000)")
    parser.add_argument(
        "--paused-aggregates", type=int, default=100, help="aggregates the paused rows are spread over (default 100)"
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.relay.batch_size)
    parser.add_argument("--chunk", type=int, default=5000, help="rows per park/unpark statement (default 5000)")
    parser.add_argument("--plans", action="store_true", help="print the EXPLAIN output of each phase")
    args = parser.parse_args()

    report: dict[str, Any] = {"paused": args.paused, "free": args.free, "batch": args.batch_size}
    with c.servers(args, need_broker=False) as (dsn, _bootstrap):
        table = c.new_table("pause")
        c.migrate(dsn, table, ordering=True)
        store = CountingStore(dsn, table, pool_size=2)
        store.open()
        try:
            params = claim_params(args.batch_size)
            c.say(f"loading {args.free} free rows ...")
            load(dsn, table, n=args.free, event_type="Free", start="2026-01-02", aggregates=1000, prefix="free-")
            vacuum(dsn, table)
            phases: dict[str, Any] = {"without": explain(dsn, table, "claim", params)}
            ordered: dict[str, Any] = {"without": explain(dsn, table, "claim_ordered_heads", params)}
            c.say(f"loading {args.paused} rows to pause (older than the free ones) ...")
            load(
                dsn,
                table,
                n=args.paused,
                event_type="Held",
                start="2026-01-01",
                aggregates=args.paused_aggregates,
                prefix="held-",
            )
            vacuum(dsn, table)
            # The pause recorded without parking: what the claim's filter alone would cost.
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    store.sql.query("pause_insert"),
                    {"selector": "event_type", "value": "Held", "reason": "bench", "actor": "bench", "source": "cli"},
                )
            phases["filtered only"] = explain(dsn, table, "claim", params)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    store.sql.query("pause_end"),
                    {"actor": "bench", "id": None, "selector": "event_type", "value": "Held"},
                )
            c.say("pausing (parking) ...")
            made = pause(
                store,
                PauseTarget("event_type", "Held"),
                reason="bench",
                actor="bench",
                source="cli",
                max_attempts=DEFAULTS.relay.max_attempts,
                chunk_size=args.chunk,
            )
            report["pause_statements"] = store.park_statements
            report["rows_parked"] = made.rows_parked
            phases["parked"] = explain(dsn, table, "claim", params)
            vacuum(dsn, table)
            phases["parked+vacuum"] = explain(dsn, table, "claim", params)
            ordered["parked+vacuum"] = explain(dsn, table, "claim_ordered_heads", params)
            store.park_statements = 0
            c.say("resuming (unparking) ...")
            back = resume(
                store, pause_id=made.pause.id, target=None, actor="bench", source="cli", chunk_size=args.chunk
            )
            report["resume_statements"] = store.park_statements
            report["rows_unparked"] = back.rows_unparked
        finally:
            store.close()
    report["claim"] = {
        k: {x: v[x] for x in ("shared_hit", "shared_read", "buffers", "scans", "claimed")} for k, v in phases.items()
    }
    report["ordered_claim"] = {
        k: {x: v[x] for x in ("shared_hit", "shared_read", "buffers", "scans", "claimed")} for k, v in ordered.items()
    }
    lines = [
        f"pause_scale: {args.paused} paused rows (in {args.paused_aggregates} aggregates), {args.free} free rows, "
        f"batch {args.batch_size}",
        f"  pause: {report['rows_parked']} rows parked in {report['pause_statements']} statements; "
        f"resume: {report['rows_unparked']} unparked in {report['resume_statements']} statements",
        "  one claim statement: shared buffers (hit + read) of the whole statement, of its due scan of the",
        "  pending index (and the rows that scan skipped), of its scan for paused rows to park; rows claimed:",
    ]
    for name, figures in report["claim"].items():
        due = figures["scans"].get("due", {})
        parked = figures["scans"].get("parked", {})
        lines.append(
            f"    claim {name:<22} {figures['buffers']:>8}   due scan {due.get('buffers', 0):>7} "
            f"(skipped {due.get('rows_skipped', 0):>7})   park scan {parked.get('buffers', 0):>6}   "
            f"({figures['claimed']} claimed)"
        )
    for name, figures in report["ordered_claim"].items():
        lines.append(f"    ordered claim {name:<14} {figures['buffers']:>8}   ({figures['claimed']} claimed)")
    if args.plans:
        for name, figures in [*phases.items(), *(("ordered " + k, v) for k, v in ordered.items())]:
            lines += ["", f"-- {name}", *figures["plan"]]
    c.emit(report, lines, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
