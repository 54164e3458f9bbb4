"""A test-only audit of every transition of the outbox rows, to prove fencing held.

``install_audit`` adds ``AFTER UPDATE`` and ``AFTER DELETE`` triggers that record (id, old/new status,
old/new ``lease_version``, owners, lease expiry) in ``<schema>.chaos_audit``;
``check_audit`` replays it and lists every stale finalize, stale lease extension or
claim of an unexpired lease. Used by the chaos suite and the failover test (the
trigger and its table replicate to a standby with the rest of the schema).
"""

from __future__ import annotations

from collections import Counter

import psycopg


def install_audit(dsn: str, table: str) -> str:
    schema, name = table.split(".")
    audit = f'"{schema}"."chaos_audit"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""
            CREATE TABLE {audit} (
                seq         bigserial PRIMARY KEY,
                id          bigint NOT NULL,
                old_status  text NOT NULL,
                new_status  text NOT NULL,
                old_version bigint NOT NULL,
                new_version bigint NOT NULL,
                old_owner   text,
                new_owner   text,
                old_lease_until timestamptz,
                tx_now      timestamptz NOT NULL,
                at          timestamptz NOT NULL DEFAULT clock_timestamp()
            )""")
        conn.execute(f"""
            CREATE FUNCTION "{schema}".chaos_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $fn$
            BEGIN
                INSERT INTO {audit} (id, old_status, new_status, old_version, new_version,
                                     old_owner, new_owner, old_lease_until, tx_now)
                VALUES (OLD.id, OLD.status, NEW.status, OLD.lease_version, NEW.lease_version,
                        OLD.lease_owner, NEW.lease_owner, OLD.lease_until, now());
                RETURN NULL;
            END
            $fn$""")
        conn.execute(f"""
            CREATE TRIGGER chaos_audit AFTER UPDATE ON "{schema}"."{name}"
            FOR EACH ROW EXECUTE FUNCTION "{schema}".chaos_audit_fn()""")
        # relay.on_done = delete: a done finalize deletes the row; record it as a
        # transition to "deleted" that keeps the version, so it is checked like one.
        conn.execute(f"""
            CREATE FUNCTION "{schema}".chaos_audit_delete_fn() RETURNS trigger LANGUAGE plpgsql AS $fn$
            BEGIN
                INSERT INTO {audit} (id, old_status, new_status, old_version, new_version,
                                     old_owner, new_owner, old_lease_until, tx_now)
                VALUES (OLD.id, OLD.status, 'deleted', OLD.lease_version, OLD.lease_version,
                        OLD.lease_owner, NULL, OLD.lease_until, now());
                RETURN NULL;
            END
            $fn$""")
        conn.execute(f"""
            CREATE TRIGGER chaos_audit_delete AFTER DELETE ON "{schema}"."{name}"
            FOR EACH ROW EXECUTE FUNCTION "{schema}".chaos_audit_delete_fn()""")
    return audit


def check_audit(dsn: str, audit: str) -> tuple[list[str], Counter]:
    """Replay the audit per row in seq order (row locks serialise a row's updates, so
    seq order is commit order per row). A processing -> processing update that keeps the
    version is the lease keeper's extension (fenced like a finalize); one that bumps it is a claim
    of an expired lease. Returns (violations, transition counts)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        records = conn.execute(
            f"SELECT seq, id, old_status, new_status, old_version, new_version, old_owner, new_owner, "
            f"old_lease_until < tx_now FROM {audit} ORDER BY id, seq"
        ).fetchall()
    violations: list[str] = []
    counts: Counter = Counter()
    highest: dict[int, int] = {}
    for seq, row_id, old, new, old_v, new_v, old_owner, new_owner, lease_expired in records:
        top = highest.get(row_id, 0)
        if old == "processing" and new == "processing" and new_v == old_v:  # the lease keeper extended the lease
            counts["processing->processing (lease extended)"] += 1
            if new_owner != old_owner:
                violations.append(f"seq {seq} id {row_id}: lease extension changed owner {old_owner} -> {new_owner}")
            if new_v != top:
                violations.append(
                    f"seq {seq} id {row_id}: STALE lease extension by {old_owner} "
                    f"with version {new_v}, row had reached version {top}"
                )
            continue
        counts[f"{old}->{new}"] += 1
        if new == "processing" and old in ("pending", "processing"):  # a claim
            if new_v != old_v + 1:
                violations.append(f"seq {seq} id {row_id}: claim set version {old_v} -> {new_v} (not +1)")
            if old == "processing" and not lease_expired:
                violations.append(f"seq {seq} id {row_id}: claim took an unexpired lease of {old_owner} v{old_v}")
            highest[row_id] = max(top, new_v)
        elif old == "processing" and new in ("done", "deleted", "pending", "dead"):  # a finalize (or the reaper)
            if new_v != old_v:
                violations.append(f"seq {seq} id {row_id}: finalize {old}->{new} changed version {old_v} -> {new_v}")
            if new_v != top:
                violations.append(
                    f"seq {seq} id {row_id}: STALE finalize {old}->{new} by {old_owner} "
                    f"with version {new_v}, row had reached version {top}"
                )
        else:
            violations.append(f"seq {seq} id {row_id}: unexpected transition {old}->{new} (v{old_v} -> v{new_v})")
    return violations, counts
