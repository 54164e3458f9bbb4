-- The record of numbered migrations (db/migrations.py lists the steps). One companion
-- table per outbox table, in its schema: the steps applied to that table, each once.
-- Loaded with the other sql/*.sql files; the same placeholders apply.

-- name: create_migrations_table
-- step is the primary key: a step recorded twice is an error, never a silent repeat.
CREATE TABLE IF NOT EXISTS {migrations_table} (
    step       integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migrations_applied
SELECT step FROM {migrations_table} ORDER BY step

-- name: record_migration
INSERT INTO {migrations_table} (step, name) VALUES (%(step)s, %(name)s)

-- name: state_has_on_done
-- State tables created before the mode existed lack its column (they kept done rows).
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(%(state_table)s) AND attname = 'on_done' AND NOT attisdropped)

-- name: forget_migrations
-- migrate --recreate-from-id: the outbox table was dropped but its record kept; the
-- record is emptied (in migrate's transaction) so every step runs again on a new table.
DELETE FROM {migrations_table}

-- name: restart_ids
-- migrate --recreate-from-id: the new table's ids start after every id the dropped one
-- used, so no consumer that deduplicates by message id takes a new row for an old one.
-- {first_id} is an integer literal.
ALTER TABLE {table} ALTER COLUMN id RESTART WITH {first_id}

-- name: forget_autovacuum_applied
-- migrate --recreate-from-id: the parameters recorded were set on the dropped table;
-- the new table gets the queue's defaults and the operator's database.autovacuum again.
UPDATE {state_table} SET autovacuum_applied = '{{}}'::jsonb
