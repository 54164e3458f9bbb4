-- All SQL of outbox-relay, one named section per statement ("-- name: <name>").
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
-- Has migrate brought this table to this version (state mode, dedup key table)?
SELECT to_regclass(%(dedup_keys)s) IS NOT NULL
   AND EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass(%(state_table)s) AND attname = 'on_done' AND NOT attisdropped)

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
-- idle after an empty claim, busy again when its listener receives a notification.
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

-- name: mark_idle
-- A worker found nothing to claim: ask inserts to notify.
UPDATE {state_table} SET relays_idle = true WHERE NOT relays_idle

-- name: mark_busy
-- A notification arrived, workers are awake: inserts need not notify for now.
UPDATE {state_table} SET relays_idle = false WHERE relays_idle

-- name: table_exists
SELECT to_regclass(%(table)s) IS NOT NULL

-- name: reap
-- Poison rows: claimed max_attempts times and never finalized (a worker died every
-- time). They never reach a finalize, so the claim is where they go dead. The CTE
-- keeps the last owner for the log line (RETURNING shows the row after the update).
WITH victims AS (
    SELECT id, lease_owner FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
SET status = 'dead',
    last_error = 'lease expired after ' || o.attempts || ' attempts without an outcome (worker crash or hang?)',
    lease_owner = NULL,
    lease_until = NULL
FROM victims
WHERE o.id = victims.id
RETURNING o.id, o.lease_version, victims.lease_owner

-- name: claim
-- The whole claim in one statement (one round trip, atomic in autocommit): reap
-- poison rows (as in "reap") and take up to LIMIT rows: expired leases first (the
-- oldest work), then due pending rows, each read from its own partial index in
-- order and cut by LIMIT, so the cost does not grow with the backlog. SKIP LOCKED
-- makes concurrent claims take disjoint rows; the UPDATE makes ownership durable:
-- owner, deadline and a new fencing token. Reaped rows come back with reaped = true.
-- %(excluded_types)s: event types left to the ordered claim (empty: none).
-- Byte budget: the batch takes rows while their payload + headers text add up to at
-- most %(max_batch_bytes)s (a running sum in claim order; the first row is always
-- taken, so a single larger row is claimed alone), so
-- a batch of large events cannot exhaust the relay's memory. Only %(candidates)s rows
-- are looked at (the worker sizes it from the rows it saw last time), because sizing
-- a row detoasts its payload. A row above %(max_message_bytes)s (NULL: no limit) is
-- claimed without its payload: it goes dead at once, never held in memory.
WITH victims AS (
    SELECT id, lease_owner FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s
    FOR UPDATE SKIP LOCKED
), reaped AS (
    UPDATE {table} AS o
    SET status = 'dead',
        last_error = 'lease expired after ' || o.attempts || ' attempts without an outcome (worker crash or hang?)',
        lease_owner = NULL,
        lease_until = NULL
    FROM victims
    WHERE o.id = victims.id
    RETURNING o.id, o.lease_version, victims.lease_owner
), expired AS (
    SELECT id, 0 AS part, lease_until AS sort_at,
           octet_length(payload::text) + coalesce(octet_length(headers::text), 0) AS row_bytes
    FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts < %(max_attempts)s
      AND NOT (event_type = ANY(%(excluded_types)s))
    ORDER BY lease_until
    LIMIT %(candidates)s
    FOR UPDATE SKIP LOCKED
), due AS (
    SELECT id, 1 AS part, available_at AS sort_at,
           octet_length(payload::text) + coalesce(octet_length(headers::text), 0) AS row_bytes
    FROM {table}
    WHERE status = 'pending' AND available_at <= now()
      AND NOT (event_type = ANY(%(excluded_types)s))
    ORDER BY available_at, id
    LIMIT %(candidates)s
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id, row_bytes FROM (
        SELECT id, row_bytes,
               row_number() OVER w AS n,
               sum(row_bytes) OVER w AS bytes_through
        FROM (SELECT * FROM expired UNION ALL SELECT * FROM due) AS both_kinds
        WINDOW w AS (ORDER BY part, sort_at, id)
    ) AS sized
    WHERE n <= %(batch)s AND (n = 1 OR bytes_through <= %(max_batch_bytes)s)
), claimed AS (
    UPDATE {table} AS o
    SET status = 'processing',
        lease_owner = %(owner)s,
        lease_until = now() + make_interval(secs => %(lease_seconds)s),
        lease_version = o.lease_version + 1,
        attempts = o.attempts + 1
    FROM picked
    WHERE o.id = picked.id
    RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
              CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL
                   ELSE o.payload::text END AS payload,
              o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes
)
SELECT false AS reaped, claimed.*, NULL::text AS reaped_owner FROM claimed
UNION ALL
SELECT true, reaped.id, reaped.lease_version, NULL::int, NULL::text, NULL::text, NULL::text, NULL::text,
       NULL::text, NULL::text, NULL::timestamptz, NULL::int, reaped.lease_owner
FROM reaped

-- name: claim_ordered_heads
-- Ordered event types: only the head of an aggregate is claimable, i.e. its first
-- pending/processing row of an ordered type, and only if no earlier row of an ordered
-- type is dead (a dead head blocks its aggregate until retried or skipped). Instead of
-- scanning rows — most of which wait behind a head in flight when aggregates are hot —
-- this walks the distinct aggregate_ids of {idx_aggregate_active} (pending and
-- processing rows only) with a recursive skip scan, one index probe per aggregate,
-- starting after %(after)s so successive claims go round the aggregates instead of
-- always favouring the first ones. Aggregates whose only unfinished rows are dead are
-- not in that index, so they cost nothing however many pile up; a blocked aggregate
-- (dead head, pending rows behind it) is visited and turned down by one probe of
-- {idx_aggregate_dead}. %(all_ordered)s = true means ["*"].
WITH RECURSIVE aggregates AS (
    (SELECT a.aggregate_id FROM {table} AS a
     WHERE a.status IN ('pending', 'processing')
       AND (%(after)s::text IS NULL OR a.aggregate_id > %(after)s)  -- NULL: from the start ('' is an id)
     ORDER BY a.aggregate_id LIMIT 1)
    UNION ALL
    SELECT (SELECT n.aggregate_id FROM {table} AS n
            WHERE n.status IN ('pending', 'processing') AND n.aggregate_id > aggregates.aggregate_id
            ORDER BY n.aggregate_id LIMIT 1)
    FROM aggregates
    WHERE aggregates.aggregate_id IS NOT NULL
), heads AS (
    SELECT h.id
    FROM aggregates
    CROSS JOIN LATERAL (
        SELECT f.id, f.status, f.available_at, f.lease_until, f.attempts
        FROM {table} AS f
        WHERE f.aggregate_id = aggregates.aggregate_id
          AND f.status IN ('pending', 'processing')
          AND (%(all_ordered)s OR f.event_type = ANY(%(ordered_types)s))
        ORDER BY f.id
        LIMIT 1
    ) AS h
    WHERE aggregates.aggregate_id IS NOT NULL
      AND ((h.status = 'pending' AND h.available_at <= now())
        OR (h.status = 'processing' AND h.lease_until < now() AND h.attempts < %(max_attempts)s))
      AND NOT EXISTS (
          SELECT 1 FROM {table} AS d
          WHERE d.aggregate_id = aggregates.aggregate_id AND d.status = 'dead' AND d.id < h.id
            AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s)))
    LIMIT %(batch)s
), candidates AS (
    -- = ANY(ARRAY(...)): the heads are computed once and looked up by primary key,
    -- whatever the planner believes about the table (with statistics from a moment
    -- when nothing was pending it would otherwise re-run the skip scan per row).
    SELECT o.id, octet_length(o.payload::text) + coalesce(octet_length(o.headers::text), 0) AS row_bytes
    FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM heads))
      AND ((o.status = 'pending' AND o.available_at <= now())
        OR (o.status = 'processing' AND o.lease_until < now() AND o.attempts < %(max_attempts)s))
    FOR UPDATE OF o SKIP LOCKED
), picked AS (
    -- The byte budget, as in "claim": heads while their running sum fits what is left
    -- of %(max_batch_bytes)s; the first one always when %(first_always)s (nothing else
    -- was claimed yet), so one large head is claimed alone rather than never.
    SELECT id, row_bytes FROM (
        SELECT id, row_bytes, row_number() OVER w AS n, sum(row_bytes) OVER w AS bytes_through
        FROM candidates WINDOW w AS (ORDER BY id)
    ) AS sized
    WHERE (%(first_always)s AND n = 1) OR bytes_through <= %(max_batch_bytes)s
), claimed AS (
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease_seconds)s),
    lease_version = o.lease_version + 1,
    attempts = o.attempts + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload::text END AS payload,
          o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes
)
-- last_aggregate: where the next claim's round-robin starts. Computed here because
-- "after" must follow the column's collation (the skip scan's order), which for
-- en_US or ICU collations is not Python's code-point order.
SELECT claimed.*, max(claimed.aggregate_id) OVER () AS last_aggregate FROM claimed

-- name: claim_ordered_runs
-- Behind each head just claimed (and still held by this transaction), take the
-- contiguous run of the aggregate's next ordered rows that are pending and due,
-- stopping at the first row that is not (processing, not yet due, or behind a dead
-- row). Nobody else can claim these rows while their head is unfinished, so order is
-- kept. Pending/processing rows come from {idx_aggregate_active}, the first dead row
-- behind the head (if any) from {idx_aggregate_dead}.
WITH heads AS (
    SELECT h.aggregate_id, h.head_id,
           coalesce((SELECT min(d.id) FROM {table} AS d
                     WHERE d.aggregate_id = h.aggregate_id AND d.status = 'dead' AND d.id > h.head_id
                       AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s))),
                    9223372036854775807) AS dead_id
    FROM unnest(%(aggregate_ids)s::text[], %(head_ids)s::bigint[]) AS h(aggregate_id, head_id)
), followers AS (
    SELECT f.id,
           bool_and(f.status = 'pending' AND f.available_at <= now() AND f.id < f.dead_id)
               OVER (PARTITION BY f.aggregate_id ORDER BY f.id) AS contiguous
    FROM heads
    CROSS JOIN LATERAL (
        SELECT r.id, r.aggregate_id, r.status, r.available_at, heads.dead_id
        FROM {table} AS r
        WHERE r.aggregate_id = heads.aggregate_id
          AND r.id > heads.head_id
          AND r.status IN ('pending', 'processing')
          AND (%(all_ordered)s OR r.event_type = ANY(%(ordered_types)s))
        ORDER BY r.id
        LIMIT %(run_length)s
    ) AS f
), locked AS (
    SELECT t.id, octet_length(t.payload::text) + coalesce(octet_length(t.headers::text), 0) AS row_bytes
    FROM {table} AS t
    WHERE t.id = ANY(ARRAY(SELECT id FROM followers WHERE contiguous))  -- once, by primary key
      AND t.status = 'pending'
    ORDER BY t.id          -- cutting at %(room)s keeps a prefix of every run
    LIMIT %(room)s
    FOR UPDATE OF t SKIP LOCKED
), picked AS (
    -- The byte budget left after the heads; a cut in id order keeps a prefix of every run.
    SELECT id, row_bytes FROM (
        SELECT id, row_bytes, sum(row_bytes) OVER (ORDER BY id) AS bytes_through FROM locked
    ) AS sized
    WHERE bytes_through <= %(max_batch_bytes)s
)
UPDATE {table} AS o
SET status = 'processing',
    lease_owner = %(owner)s,
    lease_until = now() + make_interval(secs => %(lease_seconds)s),
    lease_version = o.lease_version + 1,
    attempts = o.attempts + 1
FROM picked
WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload::text END AS payload,
          o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes

-- name: finalize
-- Every outcome of a batch in ONE fenced statement (one round trip): the decisions
-- come in as arrays (decision.py decides, this only writes). Only the claim that
-- still holds lease_version may write; rows that do not match are lost leases.
-- {strict} is either empty or "AND o.lease_until > now()" (strict lease policy).
--   done:    %(done_ids)s / %(done_versions)s (array literals: usually the whole batch).
--            The table's mode (on_done in {state_table}, set by migrate) says:
--            keep:   done_at = now(), last_error cleared
--            delete: the row is deleted — a DELETE record instead of a new row version
--   every other outcome comes as six parallel arrays (usually empty):
--   pending: due after delay_seconds; a NULL error keeps the previous last_error
--            (a release is not a failure); refund = 1 gives the claim's attempt back
--   dead:    last_error = the reason
-- The six arrays travel in binary format (the b placeholders).
WITH decided AS (
    SELECT f.id, f.version, 'done'::text AS status, 0::float8 AS delay_seconds, NULL::text AS error, 0 AS refund
    FROM unnest(%(done_ids)s::bigint[], %(done_versions)s::bigint[]) AS f(id, version)
    UNION ALL
    SELECT * FROM unnest(%(ids)b::bigint[], %(versions)b::bigint[], %(statuses)b::text[],
                         %(delays)b::float8[], %(errors)b::text[], %(refunds)b::int[])
             AS f(id, version, status, delay_seconds, error, refund)
), mode AS (
    SELECT coalesce((SELECT on_done = 'delete' FROM {state_table}), false) AS delete_done
), deleted AS (
    -- (SELECT ...) rather than a join with mode: a condition without columns of the
    -- joined tables is checked once, before the join, so a keep-mode table never runs
    -- this join. The delivered rows come as arrays of their own, not as "decided WHERE
    -- status = 'done'", and o.id = ANY(them): the planner then knows how many there
    -- are and looks them up by primary key. With statistics taken while hardly any row
    -- was processing (the usual case: autovacuum's ANALYZE of an idle outbox), it
    -- otherwise guessed ~5 delivered rows and rescanned them for every processing row:
    -- 0.2-0.8 s per 1000-row batch instead of ~5 ms. FINALIZE_SETTINGS (store.py):
    -- no bitmap scans, whose reading of the processing index grew with every row
    -- finalized since the last VACUUM (a bitmap scan never marks an index entry dead;
    -- an index scan does, and skips it from then on).
    DELETE FROM {table} AS o
    USING unnest(%(done_ids)s::bigint[], %(done_versions)s::bigint[]) AS f(id, version)
    WHERE (SELECT delete_done FROM mode)
      AND o.id = ANY(%(done_ids)s::bigint[])
      AND o.id = f.id AND o.status = 'processing' AND o.lease_version = f.version {strict}
    RETURNING o.id
), updated AS (
    UPDATE {table} AS o
    SET status = f.status,
        done_at = CASE WHEN f.status = 'done' THEN now() ELSE o.done_at END,
        available_at = CASE WHEN f.status = 'pending' THEN now() + make_interval(secs => f.delay_seconds)
                            ELSE o.available_at END,
        attempts = greatest(o.attempts - f.refund, 0),
        last_error = CASE WHEN f.status = 'done' THEN NULL ELSE coalesce(f.error, o.last_error) END,
        lease_owner = NULL,
        lease_until = NULL
    FROM decided AS f, mode
    WHERE NOT (mode.delete_done AND f.status = 'done')
      AND o.id = f.id AND o.status = 'processing' AND o.lease_version = f.version {strict}
    RETURNING o.id
)
SELECT id FROM deleted
UNION ALL
SELECT id FROM updated

-- name: extend_lease
-- Heartbeat: push the deadline of rows this claim still owns. {strict}: under the
-- strict policy an expired lease is not revived (the owner could then finalize).
UPDATE {table} AS o
SET lease_until = now() + make_interval(secs => %(lease_seconds)s)
FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS f(id, version)
WHERE o.id = f.id AND o.status = 'processing' AND o.lease_version = f.version {strict}
RETURNING o.id

-- name: stats_depth
-- Rows per status, each counted exactly up to %(cap)s from its partial index, so the
-- cost is bounded however large the table grows. Done rows have no index (nothing on
-- the relay's path reads them): they are counted exactly only while the whole table
-- holds at most the cap (a sequential read of at most that many rows), otherwise NULL;
-- a table the planner already knows to be larger (pg_class.reltuples) is not read at
-- all, so a large keep-mode table costs nothing here every refresh.
-- A status that reaches the cap, and done when NULL, is estimated from the planner's
-- statistics (stats_status_estimate).
SELECT 'pending' AS status, count(*) AS n FROM (SELECT 1 FROM {table} WHERE status = 'pending' LIMIT %(cap)s) AS p
UNION ALL
SELECT 'processing', count(*) FROM (SELECT 1 FROM {table} WHERE status = 'processing' LIMIT %(cap)s) AS r
UNION ALL
SELECT 'dead', count(*) FROM (SELECT 1 FROM {table} WHERE status = 'dead' LIMIT %(cap)s) AS d
UNION ALL
SELECT 'done', CASE WHEN g.large THEN NULL
                    WHEN count(s.status) <= %(cap)s THEN count(s.status) FILTER (WHERE s.status = 'done') END
FROM (SELECT coalesce((SELECT c.reltuples FROM pg_class AS c WHERE c.oid = %(table)s::regclass), -1)
             > %(cap)s AS large) AS g
LEFT JOIN LATERAL (SELECT t.status FROM {table} AS t WHERE NOT g.large LIMIT %(cap)s + 1) AS s ON true
GROUP BY g.large

-- name: stats_status_estimate
-- Planner statistics (kept fresh by autovacuum's ANALYZE): rows per status value.
SELECT v.status, (v.freq * greatest(c.reltuples, 0))::bigint AS n
FROM pg_stats AS s
JOIN pg_class AS c ON c.oid = %(table)s::regclass
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs) AS v(status, freq)
WHERE s.schemaname = coalesce(%(schema)s, current_schema()) AND s.tablename = %(name)s AND s.attname = 'status'

-- name: stats_backlog
-- The unfinished rows' attempts histogram and the age of the oldest, in one pass over
-- at most %(cap)s pending rows (in due order, from {idx_pending}) and %(cap)s
-- processing rows (by lease expiry, from {idx_processing}) — the indexes the claim
-- reads anyway, so no index on created_at costs WAL on every insert and claim. Exact
-- while the backlog is below the cap; beyond it, figures of the rows due first.
WITH backlog AS (
    (SELECT created_at, attempts FROM {table} WHERE status = 'pending' ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT created_at, attempts FROM {table} WHERE status = 'processing' ORDER BY lease_until LIMIT %(cap)s)
)
SELECT attempts, count(*) AS n, extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_seconds
FROM backlog GROUP BY attempts ORDER BY attempts

-- name: stats_expired
SELECT count(*) AS n FROM {table} WHERE status = 'processing' AND lease_until < now()

-- name: stats_blocked
-- Aggregates whose earliest unfinished ordered row is dead while ordered rows wait
-- behind it. Walks the aggregates that have pending or processing rows (the skip scan
-- of claim_ordered_heads over {idx_aggregate_active}, at most %(scan_cap)s of them) and
-- probes each for an earlier dead row ({idx_aggregate_dead}): the cost follows the
-- aggregates with work, never the number of dead rows (a dead backlog must not slow the gauge).
WITH RECURSIVE aggregates AS (
    (SELECT a.aggregate_id FROM {table} AS a
     WHERE a.status IN ('pending', 'processing')
     ORDER BY a.aggregate_id LIMIT 1)
    UNION ALL
    SELECT (SELECT n.aggregate_id FROM {table} AS n
            WHERE n.status IN ('pending', 'processing') AND n.aggregate_id > aggregates.aggregate_id
            ORDER BY n.aggregate_id LIMIT 1)
    FROM aggregates
    WHERE aggregates.aggregate_id IS NOT NULL
), visited AS (
    SELECT aggregate_id FROM aggregates WHERE aggregate_id IS NOT NULL LIMIT %(scan_cap)s
)
SELECT v.aggregate_id, d.id AS dead_id
FROM visited AS v
CROSS JOIN LATERAL (
    SELECT f.id FROM {table} AS f
    WHERE f.aggregate_id = v.aggregate_id AND f.status IN ('pending', 'processing')
      AND (%(all_ordered)s OR f.event_type = ANY(%(ordered_types)s))
    ORDER BY f.id LIMIT 1
) AS h
CROSS JOIN LATERAL (
    SELECT d.id FROM {table} AS d
    WHERE d.aggregate_id = v.aggregate_id AND d.status = 'dead' AND d.id < h.id
      AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s))
    ORDER BY d.id LIMIT 1
) AS d
ORDER BY d.id
LIMIT %(limit)s

-- name: stats_blocked_from_dead
-- The same answer as stats_blocked, walking the dead rows instead (in id order, three
-- index probes each): cheaper while dead rows are fewer than the aggregates with work,
-- and store.stats picks it only then, so neither walk grows with the other's size.
SELECT d.aggregate_id, d.id AS dead_id
FROM {table} AS d
WHERE d.status = 'dead'
  AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s))
  AND NOT EXISTS (
      SELECT 1 FROM {table} AS prev
      WHERE prev.aggregate_id = d.aggregate_id AND prev.id < d.id AND prev.status = 'dead'
        AND (%(all_ordered)s OR prev.event_type = ANY(%(ordered_types)s)))
  AND NOT EXISTS (
      SELECT 1 FROM {table} AS prev
      WHERE prev.aggregate_id = d.aggregate_id AND prev.id < d.id AND prev.status IN ('pending', 'processing')
        AND (%(all_ordered)s OR prev.event_type = ANY(%(ordered_types)s)))
  AND EXISTS (
      SELECT 1 FROM {table} AS nxt
      WHERE nxt.aggregate_id = d.aggregate_id AND nxt.id > d.id AND nxt.status IN ('pending', 'processing')
        AND (%(all_ordered)s OR nxt.event_type = ANY(%(ordered_types)s)))
ORDER BY d.id
LIMIT %(limit)s

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

-- name: status_of
SELECT id, status FROM {table} WHERE id = ANY(%(ids)s)

-- name: state_of
SELECT id, status, lease_version FROM {table} WHERE id = ANY(%(ids)s)

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

-- name: enqueue
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(topic)s, %(headers)s,
        now() + make_interval(secs => %(delay_seconds)s))
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
-- wrote without a key row.
WITH new_row AS (
    INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at, dedup_key)
    VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s, %(topic)s, %(headers)s,
            now() + make_interval(secs => %(delay_seconds)s), %(dedup_key)s)
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
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

-- name: aggregate_lock
-- Transaction-scoped: held until the caller commits, so two writers of one aggregate
-- commit in the order they obtained ids. The key space is shared with other advisory
-- lock users only through this hash of (table, aggregate_id).
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_key)s, 0))

-- name: statement_settings
-- Planner settings of the claim and the finalize, set transaction-locally by a
-- statement pipelined in front of them (one round trip; pooler.execute_with_settings,
-- store.py CLAIM_SETTINGS / FINALIZE_SETTINGS). Both must touch only the rows they
-- work on, with and without statistics that describe the table:
-- - the claim reads its partial indexes in order and stops after LIMIT rows
--   (enable_bitmapscan = off). Without statistics that know the backlog (a table
--   filled faster than autovacuum's ANALYZE follows, or restored without statistics)
--   the planner expects a few hundred pending rows and prefers a bitmap scan of ALL
--   of them plus a sort: every claim then read, sized and sorted the whole backlog
--   (243 ms per claim at a 300 000-row backlog instead of 8 ms), a quadratic drain.
-- - the finalize (and the heartbeat's extend_lease, the same join) reads the processing
--   index with an index scan, never a bitmap scan
--   (see "finalize").
-- Also carries the transaction_pooler's statement_timeout when the statement needs
-- one (pooler.py).
SELECT set_config(name, value, true) FROM unnest(%s::text[], %s::text[]) AS s(name, value)

-- name: bound_statement
-- database.transaction_pooler: the statement_timeout of the one statement (or the
-- one transaction) that follows in the same transaction, set inside it because a
-- transaction-pooling proxy takes no startup options and keeps no session state.
-- is_local = true: it ends with the transaction, so nothing leaks to the next
-- client of the server connection (pooler.py).
SELECT set_config('statement_timeout', %s, true)

-- Consumer side (outbox_relay.consumer): the inbox table lives in the CONSUMER's
-- database; {table} is the inbox table there.

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

-- ===================================================================================
-- Operator console and CLI: filtered dead-letter operations, exact
-- counts, aggregate diagnosis, the audit trail. (This banner has no placeholders:
-- it ends the section above, whose text is formatted.)
-- ===================================================================================

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

-- name: audit_table_exists
SELECT to_regclass(%(audit_table)s) IS NOT NULL

-- name: database_now
SELECT now()

-- name: status_count_upto
-- Exact count of one status up to %(upto)s rows (NULL: all), read from that status's
-- partial index (an index-only scan once the visibility map is set). Done rows have
-- no index: their count reads the table, so it runs under the count's time budget.
SELECT count(*) FROM (SELECT 1 FROM {table} WHERE status = {status} LIMIT %(upto)s) AS counted

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
-- Newest first, keyset pagination before %(before_id)s.
SELECT id, started_at, finished_at, actor, source, action, selector::text AS selector,
       rows_matched, rows_changed, reason
FROM {audit_table}
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

-- name: published_per_bucket
-- Rows finalized done in the last %(window_seconds)s, per bucket of %(bucket_seconds)s
-- (bucket 0 = the most recent). Done rows have no index, so this reads the table: the
-- console runs it under a short timeout and says so when it runs out. Rows deleted on
-- done (relay.on_done = delete) or purged are not counted.
SELECT floor(extract(epoch FROM now() - done_at) / %(bucket_seconds)s)::int AS bucket, count(*) AS n
FROM {table}
WHERE status = 'done' AND done_at > now() - make_interval(secs => %(window_seconds)s)
GROUP BY 1
ORDER BY 1

-- name: grant_connect
-- Least privilege (`outbox-relay grants`): role is a validated role name and schema
-- the table's schema, both quoted identifiers. The table's owner runs `migrate`,
-- and the roles below never need to own anything.
GRANT CONNECT ON DATABASE {database} TO {role}

-- name: grant_relay
-- `run`: claim, heartbeat and finalize change only the delivery columns, never what
-- the application wrote. SELECT ... FOR UPDATE needs UPDATE on one column, which this
-- gives. DELETE: the one finalize statement deletes delivered rows when the table's
-- mode is on_done = delete, and PostgreSQL checks the privilege even when the keep
-- mode deletes nothing. The state table holds the relays' idle flag and the mode.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, UPDATE (status, available_at, attempts, lease_owner, lease_until, lease_version, last_error, done_at),
    DELETE ON {table} TO {role};
GRANT SELECT, UPDATE ON {state_table} TO {role}

-- name: grant_operator
-- `status`, `dead list|retry|skip`, `aggregate show`, `audit list`, `purge` and the
-- console: read every row; retry/skip change a dead row's status, attempts, due time
-- and last_error, and append to the audit trail (never rewrite who did what: only the
-- progress columns); purge deletes old done rows, then the dedup keys older than the
-- cutoff whose row is gone. The commands read the table's mode from the state table.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, UPDATE (status, available_at, attempts, last_error, done_at), DELETE ON {table} TO {role};
GRANT SELECT, DELETE ON {dedup_keys} TO {role};
GRANT SELECT ON {state_table} TO {role};
GRANT SELECT, INSERT (actor, source, action, selector, rows_matched, reason), UPDATE (rows_changed, finished_at)
    ON {audit_table} TO {role}

-- name: grant_writer
-- `enqueue()`: insert the application's columns only (never status, attempts or a
-- lease); read back only ids and dedup keys (RETURNING id, the dedup_key conflict
-- arbiter and look-up), never other rows' payloads. dedup_key=... also claims the key
-- in the key table and links it to its row. The wake-up trigger reads the relays' idle
-- flag in the writer's transaction. ordered=True takes an advisory lock: no privilege.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, topic, headers, available_at, dedup_key)
    ON {table} TO {role};
GRANT SELECT (id, dedup_key) ON {table} TO {role};
GRANT SELECT (dedup_key, outbox_id), INSERT (dedup_key), UPDATE (outbox_id) ON {dedup_keys} TO {role};
GRANT SELECT ON {state_table} TO {role}
