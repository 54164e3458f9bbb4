-- The consumer's inbox (outbox_relay.consumer.Inbox).
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: inbox_create
CREATE TABLE IF NOT EXISTS {table} (
    source       text        NOT NULL DEFAULT '',
    message_id   text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, message_id)
)

-- name: inbox_record
-- In the consumer's transaction. A concurrent consumer of the same message waits
-- here for ours; after we commit it sees the conflict (a duplicate), after we roll
-- back it inserts and processes the message itself.
INSERT INTO {table} (source, message_id) VALUES (%(source)s, %(message_id)s)
ON CONFLICT (source, message_id) DO NOTHING
RETURNING 1

-- name: inbox_purge
DELETE FROM {table} WHERE received_at < now() - make_interval(secs => %(older_than_seconds)s)
