-- Operator actions: dead rows (filter, list, summary, retry, skip), the audit trail, row and aggregate detail, retention (purge).
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: dead_retry
-- Back to pending, due now, with a fresh attempt budget. last_error stays visible
-- until the next outcome overwrites it.
UPDATE {table}
SET status = 'pending', attempts = 0, available_at = now()
WHERE id = ANY(%(ids)s) AND status = 'dead'
RETURNING id

-- name: dead_skip
UPDATE {table}
SET status = 'done', done_at = now(), last_error = %(reason)s
WHERE id = ANY(%(ids)s) AND status = 'dead'
RETURNING id

-- name: purge_chunk
-- Retention without an index on done rows: walk the table in id order (the primary
-- key) from %(after)s, %(limit)s rows a chunk, each chunk its own short transaction,
-- and delete the done rows among them older than the cutoff. A row done before the
-- cutoff was created before it, so the walk can stop at the first chunk holding no
-- row created before the cutoff (rows of a transaction that ran across the
-- cutoff may be left for the next purge). The DELETE re-checks status on the current
-- row version, so a concurrent purge or finalize is never overwritten.
WITH scanned AS (
    SELECT id, created_at FROM {table}
    WHERE id > %(after)s
    ORDER BY id
    LIMIT %(limit)s
), purged AS (
    DELETE FROM {table} AS o
    USING scanned AS s
    WHERE o.id = s.id AND o.status = 'done'
      AND o.done_at < now() - make_interval(secs => %(older_than_seconds)s)
    RETURNING o.id
)
SELECT (SELECT count(*) FROM purged) AS deleted,
       (SELECT max(id) FROM scanned) AS last_id,
       (SELECT count(*) FROM scanned
        WHERE created_at < now() - make_interval(secs => %(older_than_seconds)s)) AS old_rows

-- name: count_purgeable
-- Progress bar of an interactive purge only: a sequential count.
SELECT count(*) FROM {table}
WHERE status = 'done' AND done_at < now() - make_interval(secs => %(older_than_seconds)s)

-- name: purge_dedup_keys_chunk
-- Retention of dedup keys: keys older than the cutoff whose row is no longer in the
-- outbox (delivered and deleted, or purged), %(limit)s keys a chunk in key order.
WITH scanned AS (
    SELECT dedup_key FROM {dedup_keys} WHERE dedup_key > %(after)s ORDER BY dedup_key LIMIT %(limit)s
), purged AS (
    DELETE FROM {dedup_keys} AS k
    USING scanned AS s
    WHERE k.dedup_key = s.dedup_key
      AND k.created_at < now() - make_interval(secs => %(older_than_seconds)s)
      AND NOT EXISTS (SELECT 1 FROM {table} AS o WHERE o.id = k.outbox_id)
    RETURNING k.dedup_key
)
SELECT (SELECT count(*) FROM purged), (SELECT max(dedup_key) FROM scanned)

-- name: dead_filter
-- The predicate shared by every filtered dead-row statement (schema.py fills it in as
-- the placeholder dead_filter; the placeholder audit_table is the table's audit trail,
-- and status_count_upto's status placeholder a quoted literal, so that each count can
-- use its status's partial index). Every value is a bound parameter; NULL means
-- "any". error_contains is a case-insensitive substring test with strpos, so
-- LIKE wildcards in the operator's text mean nothing special. since/until bound
-- created_at (half-open: since <= created_at < until).
status = 'dead'
AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
AND (%(aggregate_type)s::text IS NULL OR aggregate_type = %(aggregate_type)s::text)
AND (%(aggregate_id)s::text IS NULL OR aggregate_id = %(aggregate_id)s::text)
AND (%(error_contains)s::text IS NULL
     OR strpos(lower(coalesce(last_error, '')), lower(%(error_contains)s::text)) > 0)
AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)

-- name: dead_count_upto
SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {dead_filter} LIMIT %(upto)s) AS counted

-- name: dead_page
-- One page of matching dead rows in id order, after %(after_id)s (keyset pagination).
SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, topic
FROM {table}
WHERE {dead_filter} AND id > %(after_id)s
ORDER BY id
LIMIT %(limit)s

-- name: dead_by_event_type
SELECT event_type, count(*) AS n
FROM {table}
WHERE {dead_filter}
GROUP BY event_type
ORDER BY n DESC, event_type
LIMIT %(top)s

-- name: dead_by_error
-- Errors grouped by their first line (cut to 200 characters).
SELECT left(split_part(coalesce(last_error, ''), chr(10), 1), 200) AS error, count(*) AS n
FROM {table}
WHERE {dead_filter}
GROUP BY 1
ORDER BY n DESC, 1
LIMIT %(top)s

-- name: dead_aggregates
-- How many aggregates the matching rows belong to, and the first few of them.
SELECT (SELECT count(DISTINCT aggregate_id) FROM {table} WHERE {dead_filter}) AS aggregates,
       ARRAY(SELECT DISTINCT aggregate_id FROM {table} WHERE {dead_filter}
             ORDER BY aggregate_id LIMIT %(top)s) AS sample

-- name: dead_retry_chunk
-- One bounded chunk of a filtered retry, in its own short transaction (autocommit):
-- the next %(chunk)s matching rows after %(after_id)s, SKIP LOCKED so it never waits
-- for a row someone else is changing; the audit entry is updated in the same
-- transaction. Same effect as dead_retry: pending, attempts 0, due now.
WITH chunk AS (
    SELECT id FROM {table}
    WHERE {dead_filter} AND id > %(after_id)s
    ORDER BY id
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE {table} AS o
    SET status = 'pending', attempts = 0, available_at = now()
    FROM chunk
    WHERE o.id = chunk.id
    RETURNING o.id
), audited AS (
    UPDATE {audit_table}
    SET rows_changed = rows_changed + (SELECT count(*) FROM changed)
    WHERE id = %(audit_id)s
    RETURNING id
)
SELECT id FROM changed ORDER BY id

-- name: dead_skip_chunk
-- As dead_retry_chunk, but marks the rows done without publishing (as dead_skip).
WITH chunk AS (
    SELECT id FROM {table}
    WHERE {dead_filter} AND id > %(after_id)s
    ORDER BY id
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE {table} AS o
    SET status = 'done', done_at = now(), last_error = %(reason)s
    FROM chunk
    WHERE o.id = chunk.id
    RETURNING o.id
), audited AS (
    UPDATE {audit_table}
    SET rows_changed = rows_changed + (SELECT count(*) FROM changed)
    WHERE id = %(audit_id)s
    RETURNING id
)
SELECT id FROM changed ORDER BY id

-- name: audit_begin
INSERT INTO {audit_table} (actor, source, action, selector, rows_matched, reason)
VALUES (%(actor)s, %(source)s, %(action)s, %(selector)s::jsonb, %(rows_matched)s, %(reason)s)
RETURNING id

-- name: audit_finish
UPDATE {audit_table} SET finished_at = now() WHERE id = %(audit_id)s

-- name: audit_list
-- Newest first, keyset pagination before %(before_id)s. rows_failed (a replay's rows
-- that could not be sent) is read through to_jsonb, so the trail of a table that
-- migrate has not yet given the column still lists (NULL).
SELECT id, started_at, finished_at, actor, source, action, selector::text AS selector,
       rows_matched, rows_changed, (to_jsonb(a) ->> 'rows_failed')::bigint AS rows_failed, reason
FROM {audit_table} AS a
WHERE (%(before_id)s::bigint IS NULL OR id < %(before_id)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s

-- name: row_detail
-- One row with everything an operator needs to understand it (any status).
SELECT id, aggregate_type, aggregate_id, event_type, jsonb_pretty(payload) AS payload, topic,
       jsonb_pretty(headers) AS headers, created_at, status, available_at, attempts,
       lease_owner, lease_until, lease_version, last_error, done_at, dedup_key,
       now() AS database_now
FROM {table}
WHERE id = %(id)s

-- name: aggregate_rows
-- An aggregate's unfinished rows in id order. Two arms, so that with ordering on each
-- reads its partial index ({idx_aggregate_active}, {idx_aggregate_dead}); without
-- the ordering indexes this reads the table, bounded by the statement timeout.
SELECT id, aggregate_type, event_type, status, attempts, created_at, available_at,
       lease_owner, lease_until, lease_version, last_error,
       available_at > now() AS not_due, coalesce(lease_until < now(), false) AS lease_expired,
       now() AS database_now
FROM (
    (SELECT * FROM {table} WHERE aggregate_id = %(aggregate_id)s AND status IN ('pending', 'processing')
     ORDER BY id LIMIT %(limit)s)
    UNION ALL
    (SELECT * FROM {table} WHERE aggregate_id = %(aggregate_id)s AND status = 'dead'
     ORDER BY id LIMIT %(limit)s)
) AS unfinished
ORDER BY id
LIMIT %(limit)s

-- name: aggregate_unfinished_count
SELECT (SELECT count(*) FROM {table}
        WHERE aggregate_id = %(aggregate_id)s AND status IN ('pending', 'processing'))
     + (SELECT count(*) FROM {table} WHERE aggregate_id = %(aggregate_id)s AND status = 'dead')

-- name: done_filter
-- The predicate of a replay (operator/replay.py): delivered rows, with the same bound
-- parameters as dead_filter (error_contains aside). A delivered row is done with no
-- last_error (finalize clears it); a row an operator skipped is done too but carries
-- the skip's reason in last_error and was never published, so it is never replayed.
status = 'done' AND last_error IS NULL
AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
AND (%(aggregate_type)s::text IS NULL OR aggregate_type = %(aggregate_type)s::text)
AND (%(aggregate_id)s::text IS NULL OR aggregate_id = %(aggregate_id)s::text)
AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)

-- name: replay_count_upto
-- No index covers done rows: a sequential count, bounded by the caller's budget.
SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {done_filter} LIMIT %(upto)s) AS counted

-- name: replay_sample
-- The first few rows a replay would send (a dry run's sample), in id order.
SELECT id, aggregate_type, aggregate_id, event_type, topic, created_at, done_at
FROM {table}
WHERE {done_filter}
ORDER BY id
LIMIT %(limit)s

-- name: replay_bounds
-- Where a replay's walk ends: the highest id when it starts, so rows written (and
-- delivered) while it runs are not chased.
SELECT coalesce(max(id), 0) FROM {table}

-- name: replay_walk
-- One step of a replay's walk of the table in id order (the primary key), like purge:
-- at most %(window)s rows after %(after_id)s and up to %(upto_id)s are looked at, and
-- of those at most %(chunk)s matching delivered rows are returned, whole, in id order.
-- One short read; no row is locked or changed. The first column is the last id looked
-- at (NULL: nothing left), on every row, and the one row with NULL columns when
-- nothing in the window matched. The window is cut by its last id (one value), never
-- joined back row by row: a join against the window's ids may be planned as a nested
-- loop over both (quadratic) when the table's statistics are stale or missing.
WITH bound AS (
    SELECT max(id) AS last_id FROM (
        SELECT id FROM {table}
        WHERE id > %(after_id)s AND id <= %(upto_id)s
        ORDER BY id
        LIMIT %(window)s
    ) AS scanned
), matched AS (
    SELECT id, aggregate_type, aggregate_id, event_type, payload::text AS payload, topic,
           headers::text AS headers, created_at, tombstone, partition, payload_bytes
    FROM {table}
    WHERE {done_filter} AND id > %(after_id)s AND id <= (SELECT last_id FROM bound)
    ORDER BY id
    LIMIT %(chunk)s
)
SELECT (SELECT last_id FROM bound) AS last_scanned, m.*
FROM (SELECT 1) AS one LEFT JOIN matched AS m ON true
ORDER BY m.id

-- name: audit_add_changed
-- A replay's messages the target acknowledged, added after each chunk.
UPDATE {audit_table} SET rows_changed = rows_changed + %(n)s WHERE id = %(audit_id)s

-- name: audit_finish_replay
-- A replay's end, with the rows that could not be sent.
UPDATE {audit_table} SET finished_at = now(), rows_failed = %(failed)s WHERE id = %(audit_id)s

-- name: audit_allows_replay
-- Whether migrate has let the audit trail record replays (step add_audit_replay).
SELECT EXISTS (SELECT 1 FROM pg_constraint
               WHERE conrelid = to_regclass(%(audit_table)s) AND contype = 'c'
                 AND pg_get_constraintdef(oid) LIKE '%%replay%%')
