-- The write side: enqueue() and its deduplication keys.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: enqueue
-- {record_columns} / {record_values}: the tombstone and partition columns, only when the
-- caller asks for either (so that a plain enqueue also works on a table migrate has not
-- yet given those columns).
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at {record_columns})
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(topic)s, %(headers)s,
        now() + make_interval(secs => %(delay_seconds)s) {record_values})
RETURNING id

-- name: enqueue_dedup_key
-- enqueue(dedup_key=...), step 1: claim the key. The key table's primary key decides:
-- a concurrent enqueuer of the same key waits for ours, then sees the conflict; a key
-- whose row was delivered and deleted (delete mode) or purged is still here. ON
-- CONFLICT DO NOTHING never aborts the caller's transaction.
INSERT INTO {dedup_keys} (dedup_key) VALUES (%(dedup_key)s)
ON CONFLICT (dedup_key) DO NOTHING
RETURNING dedup_key

-- name: enqueue_dedup
-- Step 2 (the key was new): the row, and the key's link to it. The outbox's own
-- unique index on dedup_key still refuses a key held by a row an older enqueue()
-- wrote without a key row. ON CONFLICT without a target: the id never conflicts (one
-- identity sequence), so only that index can, and a partitioned outbox, whose dedup
-- index cannot be unique (sql/partitions.sql), takes the same statement.
WITH new_row AS (
    INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at, dedup_key
                         {record_columns})
    VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(topic)s, %(headers)s,
            now() + make_interval(secs => %(delay_seconds)s), %(dedup_key)s {record_values})
    ON CONFLICT DO NOTHING
    RETURNING id
), linked AS (
    UPDATE {dedup_keys} AS k SET outbox_id = new_row.id FROM new_row WHERE k.dedup_key = %(dedup_key)s
)
SELECT id FROM new_row

-- name: find_dedup
-- The row a duplicate key belongs to (it may be delivered and gone by now); links a
-- key claimed in step 1 to a row an older enqueue() wrote.
WITH found AS (
    SELECT coalesce((SELECT outbox_id FROM {dedup_keys} WHERE dedup_key = %(dedup_key)s),
                    (SELECT id FROM {table} WHERE dedup_key = %(dedup_key)s)) AS id
), linked AS (
    UPDATE {dedup_keys} AS k SET outbox_id = found.id FROM found
    WHERE k.dedup_key = %(dedup_key)s AND k.outbox_id IS NULL AND found.id IS NOT NULL
)
SELECT id FROM found
