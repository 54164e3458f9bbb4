-- The outbox table, its indexes, its companion tables (state, dedup keys, audit) and the wake-up trigger: what migrate creates and checks.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: schema_exists
SELECT to_regnamespace(%(schema)s) IS NOT NULL

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: create_table
CREATE TABLE IF NOT EXISTS {table} (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NULL,
    headers         jsonb       NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    lease_owner     text        NULL,
    lease_until     timestamptz NULL,
    lease_version   bigint      NOT NULL DEFAULT 0,
    last_error      text        NULL,
    done_at         timestamptz NULL,
    dedup_key       text        NULL,
    -- a row holds a lease exactly while it is processing
    CHECK ((status = 'processing') = (lease_until IS NOT NULL))
) WITH (fillfactor = {fillfactor})

-- name: table_fillfactor
-- The table's own fillfactor, NULL when it has none (PostgreSQL's default, 100).
SELECT (SELECT substring(o FROM 'fillfactor=(\d+)') FROM unnest(c.reloptions) AS o WHERE o LIKE 'fillfactor=%%')::int
FROM pg_class AS c WHERE c.oid = %(table)s::regclass

-- name: set_fillfactor
-- Inserts then leave half of every page free, so that a claim and a finalize can put
-- the row's new version on the same page: PostgreSQL then logs only the bytes that
-- changed (the lease columns) instead of the whole row with its payload, and needs no
-- extra lock record for moving the row (docs/explanation/cost-on-the-primary.md). Affects new
-- pages only; takes a lock that does not block reads or writes.
ALTER TABLE {table} SET (fillfactor = {fillfactor})

-- name: add_dedup_key
-- Tables created by an earlier version lack the optional dedup column.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS dedup_key text NULL

-- Indexes: one section per index ("index_<key>", schema.py lists which a layout has).
-- {concurrently} is empty inside migrate's transaction on a table it has just created,
-- and CONCURRENTLY on an existing table (no lock that blocks writers or relays).

-- name: index_pending
-- Due pending rows in (available_at, id) order: the claim reads the front of this
-- index and stops after LIMIT rows, however long the backlog.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_pending} ON {table} (available_at, id) WHERE status = 'pending'

-- name: index_processing
-- Leases by expiry: reclaim, reap and the expired_leases gauge.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_processing} ON {table} (lease_until) WHERE status = 'processing'

-- name: index_dead
-- Dead-letter listing.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_dead} ON {table} (id) WHERE status = 'dead'

-- name: index_dedup_key
-- enqueue(dedup_key=...): one row per key.
CREATE UNIQUE INDEX {concurrently} IF NOT EXISTS {idx_dedup_key} ON {table} (dedup_key) WHERE dedup_key IS NOT NULL

-- name: index_aggregate_active
-- Ordering only. Pending and processing rows per aggregate: the ordered claim's skip
-- scan and its head lookup (claim_ordered_heads), the runs behind a head, the
-- blocked-aggregates gauge. Dead rows are left out so that aggregates holding only
-- dead rows cost the ordered claim nothing, however many dead rows pile up.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_aggregate_active} ON {table} (aggregate_id, id)
    WHERE status IN ('pending', 'processing')

-- name: index_aggregate_dead
-- Ordering only. Dead rows per aggregate: "is an earlier row of this aggregate dead?"
-- (a dead head blocks its aggregate). Written only when a row goes dead.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_aggregate_dead} ON {table} (aggregate_id, id) WHERE status = 'dead'

-- name: drop_index
DROP INDEX {concurrently} IF EXISTS {index}

-- name: table_indexes
-- The table's indexes by name, and whether each is valid (a failed CREATE INDEX
-- CONCURRENTLY leaves an invalid one behind, which IF NOT EXISTS would keep).
SELECT c.relname, i.indisvalid
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = %(table)s::regclass

-- name: column_exists
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = %(table)s::regclass AND attname = %(column)s AND NOT attisdropped)

-- name: create_state_table
-- One row shared by all relays of this table: are they idle (waiting for work)? And
-- what does the finalize do with a delivered row (relay.on_done, set by migrate: a
-- property of the table, so every relay of it does the same)?
CREATE TABLE IF NOT EXISTS {state_table} (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    relays_idle boolean NOT NULL DEFAULT true,
    on_done     text    NOT NULL DEFAULT 'keep' CHECK (on_done IN ('keep', 'delete'))
);
INSERT INTO {state_table} (singleton, relays_idle) VALUES (true, true) ON CONFLICT DO NOTHING

-- name: add_on_done
-- State tables created by an earlier version lack the mode (they kept done rows).
ALTER TABLE {state_table} ADD COLUMN IF NOT EXISTS on_done text NOT NULL DEFAULT 'keep'
    CHECK (on_done IN ('keep', 'delete'))

-- name: set_on_done
UPDATE {state_table} SET on_done = %(on_done)s WHERE on_done <> %(on_done)s RETURNING on_done

-- name: table_mode
SELECT on_done FROM {state_table}

-- name: schema_current
-- Has migrate brought this table to this version (state mode, dedup key table, the
-- record columns tombstone, partition and payload_bytes that every claim reads, the
-- operator pauses table the claims read)?
SELECT to_regclass(%(dedup_keys)s) IS NOT NULL
   AND to_regclass(%(pauses_table)s) IS NOT NULL
   AND EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(%(state_table)s) AND attname = 'on_done' AND NOT attisdropped)
   AND (SELECT count(*) FROM pg_attribute
        WHERE attrelid = to_regclass(%(table)s) AND attname IN ('tombstone', 'partition', 'payload_bytes')
          AND NOT attisdropped) = 3

-- name: create_dedup_keys
-- enqueue(dedup_key=...): one row per key ever enqueued, so that a key is refused
-- again after its row was delivered and deleted (delete mode) or purged. Narrow (no
-- payload), written only by enqueues that carry a key; `purge --older-than` removes
-- keys older than the cutoff whose row is gone.
CREATE TABLE IF NOT EXISTS {dedup_keys} (
    dedup_key  text        PRIMARY KEY,
    outbox_id  bigint      NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)

-- name: backfill_dedup_keys
-- Keys of rows enqueued before the key table existed (or by an older enqueue()).
INSERT INTO {dedup_keys} (dedup_key, outbox_id, created_at)
SELECT dedup_key, id, created_at FROM {table} WHERE dedup_key IS NOT NULL
ON CONFLICT (dedup_key) DO NOTHING

-- name: create_notify_function
-- NOTIFY makes committing transactions queue behind each other (a global lock at
-- commit), so writers pay it only while a relay is idle. Writers only *read* the
-- flag (no row lock, so they never wait for each other here); the relay sets it:
-- idle after an empty claim, busy again when the relay keeps finding rows (runtime/wakeup.py).
-- While relays are busy (they claim again at once anyway) an insert costs one
-- index read of a one-row table. Statement-level: a bulk insert notifies once.
CREATE OR REPLACE FUNCTION {fn_notify}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM {state_table} WHERE relays_idle) THEN
        PERFORM pg_notify({channel_literal}, '');
    END IF;
    RETURN NULL;
END
$fn$

-- name: create_notify_trigger
-- Only when missing (migrate checks notify_trigger_exists first): creating a trigger
-- locks the table against writers, and the function it calls is replaced in place.
CREATE TRIGGER {trg_notify} AFTER INSERT ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {fn_notify}()

-- name: notify_trigger_exists
SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = %(table)s::regclass AND tgname = %(trigger)s)

-- name: migrate_lock_timeout
-- migrate's schema changes take short locks that writers queue behind: give up (and
-- retry) rather than wait behind a long transaction with every writer queued after it.
SET LOCAL lock_timeout = '5s'

-- name: migrate_try_lock
SELECT pg_try_advisory_lock(hashtextextended(%(key)s, 0))

-- name: migrate_unlock
SELECT pg_advisory_unlock(hashtextextended(%(key)s, 0))

-- name: drop_notify_trigger
DROP TRIGGER IF EXISTS {trg_notify} ON {table};
DROP FUNCTION IF EXISTS {fn_notify}()

-- name: table_exists
SELECT to_regclass(%(table)s) IS NOT NULL

-- name: create_audit_table
-- One row per retry/skip by an operator (CLI or console), appended before the first
-- chunk and brought up to date by every chunk in the chunk's own transaction, so
-- rows_changed is exact even if the operation is interrupted (finished_at stays NULL).
CREATE TABLE IF NOT EXISTS {audit_table} (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz NULL,
    actor         text        NOT NULL,
    source        text        NOT NULL,
    action        text        NOT NULL CHECK (action IN ('retry', 'skip')),
    selector      jsonb       NOT NULL,
    rows_matched  bigint      NULL,
    rows_changed  bigint      NOT NULL DEFAULT 0,
    reason        text        NULL
)

-- name: audit_action_checks
-- The CHECK constraints of the audit table's action column (step add_audit_replay
-- replaces the one create_audit_table made, whatever PostgreSQL named it).
SELECT conname FROM pg_constraint
WHERE conrelid = to_regclass(%(audit_table)s) AND contype = 'c'
  AND pg_get_constraintdef(oid) LIKE '%%action%%'

-- name: drop_audit_check
ALTER TABLE {audit_table} DROP CONSTRAINT {constraint}

-- name: add_audit_replay_check
-- The audit trail also records replays of delivered rows (operator/replay.py).
ALTER TABLE {audit_table} ADD CONSTRAINT {constraint} CHECK (action IN ('retry', 'skip', 'replay'))

-- name: add_audit_rows_failed
-- The rows a replay could not send (NULL for a retry or skip). IF NOT EXISTS: a table
-- recreated by `migrate --recreate-from-id` keeps its audit table, which has it already.
ALTER TABLE {audit_table} ADD COLUMN IF NOT EXISTS rows_failed bigint NULL

-- name: audit_table_exists
SELECT to_regclass(%(audit_table)s) IS NOT NULL

-- name: add_autovacuum_applied
-- What migrate last set of the table's autovacuum parameters (autovacuum.py): a value
-- still equal to it is migrate's own and may follow a new default; any other value is
-- an operator's and is kept.
ALTER TABLE {state_table} ADD COLUMN IF NOT EXISTS autovacuum_applied jsonb NOT NULL DEFAULT '{{}}'::jsonb

-- name: add_record_columns
-- What a row may ask of its Kafka record besides key and value (migration step 7):
-- tombstone = true sends a null value (a compacted topic then deletes the key; the
-- payload is not sent), partition = the partition to write to (NULL: the partitioner
-- chooses from the key). Neither rewrites the table: a constant default and a
-- nullable column are catalog changes only (PostgreSQL 11+), under a brief exclusive lock.
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS tombstone boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS partition integer NULL

-- name: add_payload_bytes
-- A row already encoded by its writer (migration step add_payload_bytes): payload_bytes
-- holds the value to publish as it is (Avro, Protobuf, any bytes); NULL: the JSON
-- payload is the value, as before. A nullable column without a default is a catalog
-- change only (no rewrite), under a brief exclusive lock.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS payload_bytes bytea NULL

-- name: add_gauge_bounds
-- Where the relays' fast claims start while vacuum is held back (claim_cursor.py
-- GaugeBounds), published for `outbox-relay status` in a process of its own: one entry
-- per relay process, {"<process>": {"due_at", "due_id", "leases_from", "at"}}; '{}'
-- while no relay is under pressure (delivery.sql publish_gauge_bounds).
ALTER TABLE {state_table} ADD COLUMN IF NOT EXISTS gauge_bounds jsonb NOT NULL DEFAULT '{{}}'::jsonb

-- name: autovacuum_state
SELECT (SELECT reloptions FROM pg_class WHERE oid = %(table)s::regclass) AS reloptions,
       (SELECT autovacuum_applied FROM {state_table}) AS applied

-- name: set_autovacuum_applied
UPDATE {state_table} SET autovacuum_applied = %(applied)s::jsonb

-- name: set_storage_parameter
-- {parameter} is a validated autovacuum parameter name, {value} a literal (autovacuum.py). Takes a
-- SHARE UPDATE EXCLUSIVE lock: reads, writes and relays go on.
ALTER TABLE {table} SET ({parameter} = {value})

-- name: reset_storage_parameter
ALTER TABLE {table} RESET ({parameter})
