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
