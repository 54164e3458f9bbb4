-- GRANT statements printed by `outbox-relay grants`, one section per role kind.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: grant_connect
-- Least privilege (`outbox-relay grants`): role is a validated role name and schema
-- the table's schema, both quoted identifiers. The table's owner runs `migrate`,
-- and the roles below never need to own anything.
GRANT CONNECT ON DATABASE {database} TO {role}

-- name: grant_relay
-- `run`: claim, lease extension and finalize change only the delivery columns, never what
-- the application wrote. SELECT ... FOR UPDATE needs UPDATE on one column, which this
-- gives. DELETE: the one finalize statement deletes delivered rows when the table's
-- mode is on_done = delete, and PostgreSQL checks the privilege even when the keep
-- mode deletes nothing. The state table holds the relays' idle flag and the mode. The
-- claims read the active operator pauses (and park paused rows: available_at).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, UPDATE (status, available_at, attempts, lease_owner, lease_until, lease_version, last_error, done_at),
    DELETE ON {table} TO {role};
GRANT SELECT, UPDATE ON {state_table} TO {role};
GRANT SELECT ON {pauses_table} TO {role}

-- name: grant_operator
-- `status`, `dead list|retry|skip`, `replay`, `aggregate show`, `audit list`, `purge` and
-- the console: read every row (replay only reads, and publishes); retry/skip change a dead row's status, attempts, due time
-- and last_error, and append to the audit trail (never rewrite who did what: only the
-- progress columns); purge deletes old done rows, then the dedup keys older than the
-- cutoff whose row is gone. The commands read the table's mode from the state table.
-- pause/resume add and end operator pauses and park/unpark rows (available_at).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, UPDATE (status, available_at, attempts, last_error, done_at), DELETE ON {table} TO {role};
GRANT SELECT, DELETE ON {dedup_keys} TO {role};
GRANT SELECT ON {state_table} TO {role};
GRANT SELECT, INSERT (actor, source, action, selector, rows_matched, reason),
    UPDATE (rows_changed, rows_failed, finished_at) ON {audit_table} TO {role};
GRANT SELECT, INSERT (selector, value, reason, paused_by, paused_from), UPDATE (resumed_at, resumed_by)
    ON {pauses_table} TO {role}

-- name: grant_writer
-- `enqueue()`: insert the application's columns only (never status, attempts or a
-- lease); read back only ids and dedup keys (RETURNING id, the dedup_key conflict
-- arbiter and look-up), never other rows' payloads. dedup_key=... also claims the key
-- in the key table and links it to its row. The wake-up trigger reads the relays' idle
-- flag in the writer's transaction. ordered=True takes an advisory lock: no privilege.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at, dedup_key,
               tombstone, partition, payload_bytes)
    ON {table} TO {role};
GRANT SELECT (id, dedup_key) ON {table} TO {role};
GRANT SELECT (dedup_key, outbox_id), INSERT (dedup_key), UPDATE (outbox_id) ON {dedup_keys} TO {role};
GRANT SELECT ON {state_table} TO {role}

-- MVCC pressure: what keeps vacuum from removing the outbox's dead rows, and how
-- vacuum is keeping up (vacuum_health.py).

-- name: grant_read_all_stats
-- The relay's xmin horizon gauge and `status` name the session that holds vacuum back,
-- and its fast claims see when an open writer transaction began (delivery.sql
-- outbox_writers):
-- PostgreSQL shows another role's transaction start only to members of
-- pg_read_all_stats (or pg_monitor, which includes it). Granting a predefined role
-- needs a superuser (or, from PostgreSQL 16, a role with ADMIN on it).
GRANT pg_read_all_stats TO {role}
