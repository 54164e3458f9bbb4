-- Operator pauses (operator/pauses.py holds the rules): `outbox-relay pause` and
-- `resume`, the console's pause page and its API. One small companion table per outbox,
-- created by migration step 9 (create_pauses); the claim statements read its active
-- rows (delivery.sql "claim", "claim_ordered_heads", "claim_ordered_runs").
-- Loaded with the other sql/*.sql files; the same placeholders apply.
--
-- Parking: a paused pending row's available_at is moved forward by {park_shift}
-- (an interval of whole hours, about 1000 years: an exact number of microseconds, so
-- moving back gives the original value to the microsecond whatever the time zone or
-- calendar) and is then above {park_floor} (the year 2900). The claim's due scan reads
-- the pending index (available_at, id) from its front and stops after LIMIT rows, so
-- parked rows, at the far end of that index, are never read however many there are;
-- their relative order (available_at, id) is kept, and so is every other column
-- (attempts, lease_version). A row whose own available_at is beyond the year 2900 is
-- taken for a parked one: delays that long are not supported.
--
-- Statements match a row against the active pauses with
-- `event_type = ANY((SELECT event_types FROM paused)::text[])`: the cast makes the
-- array one value (without it, ANY((SELECT ...)) is read as ANY over the subquery's
-- rows, and text = text[] does not exist), computed once per statement.

-- name: create_pauses
-- One row per pause; resumed_at set by its resume (kept: the pause history). At most
-- one active pause per (selector, value).
CREATE TABLE IF NOT EXISTS {pauses_table} (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    selector    text        NOT NULL CHECK (selector IN ('event_type', 'topic', 'aggregate_type')),
    value       text        NOT NULL,
    reason      text        NOT NULL,
    paused_by   text        NOT NULL,
    paused_from text        NOT NULL,
    paused_at   timestamptz NOT NULL DEFAULT now(),
    resumed_at  timestamptz NULL,
    resumed_by  text        NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS {idx_pauses_active} ON {pauses_table} (selector, value) WHERE resumed_at IS NULL

-- name: add_audit_pause_check
-- The audit trail also records pauses and resumes (step create_pauses).
ALTER TABLE {audit_table} ADD CONSTRAINT {constraint}
    CHECK (action IN ('retry', 'skip', 'replay', 'pause', 'resume'))

-- name: pauses_table_exists
SELECT to_regclass(%(pauses_table)s) IS NOT NULL

-- name: paused_selectors
-- The active pauses as three arrays, one per selector (a CTE of the claim statements:
-- read once per claim, a handful of rows).
SELECT count(*) > 0 AS any_active,
       coalesce(array_agg(value) FILTER (WHERE selector = 'event_type'), ARRAY[]::text[]) AS event_types,
       coalesce(array_agg(value) FILTER (WHERE selector = 'topic'), ARRAY[]::text[]) AS topics,
       coalesce(array_agg(value) FILTER (WHERE selector = 'aggregate_type'), ARRAY[]::text[]) AS aggregate_types
FROM {pauses_table} WHERE resumed_at IS NULL

-- name: pause_insert
-- A new active pause; NULL when one for the same selector and value is already active.
INSERT INTO {pauses_table} (selector, value, reason, paused_by, paused_from)
VALUES (%(selector)s, %(value)s, %(reason)s, %(actor)s, %(source)s)
ON CONFLICT (selector, value) WHERE resumed_at IS NULL DO NOTHING
RETURNING id, paused_at

-- name: pause_end
-- Resume: the active pause given by id, or by selector and value (id NULL).
UPDATE {pauses_table} SET resumed_at = now(), resumed_by = %(actor)s
WHERE resumed_at IS NULL
  AND (CASE WHEN %(id)s::bigint IS NOT NULL THEN id = %(id)s::bigint
            ELSE selector = %(selector)s AND value = %(value)s END)
RETURNING id, selector, value, reason, paused_by, paused_at, resumed_at

-- name: pauses_list
-- The active pauses, newest first; with %(all)s also the resumed ones, after them.
SELECT p.id, p.selector, p.value, p.reason, p.paused_by, p.paused_from, p.paused_at, p.resumed_at, p.resumed_by
FROM {pauses_table} AS p
WHERE %(all)s OR p.resumed_at IS NULL
ORDER BY p.resumed_at IS NULL DESC, p.id DESC
LIMIT %(limit)s

-- name: paused_rows_count
-- Pending rows parked by a pause, up to %(count_cap)s (a range scan of the pending
-- index beyond {park_floor}: the gauge and `status` must stay cheap with a million).
SELECT count(*) FROM (
    SELECT 1 FROM {table} WHERE status = 'pending' AND available_at >= {park_floor} LIMIT %(count_cap)s
) AS parked

-- name: pause_gauges
-- The metrics refresher (monitoring_reads, in its transaction): the ids of the active
-- pauses and the pending rows parked, up to %(count_cap)s (as paused_rows_count).
SELECT (SELECT coalesce(array_agg(id ORDER BY id), ARRAY[]::bigint[]) FROM {pauses_table} WHERE resumed_at IS NULL),
       (SELECT count(*) FROM (
            SELECT 1 FROM {table} WHERE status = 'pending' AND available_at >= {park_floor} LIMIT %(count_cap)s
        ) AS parked)

-- name: park_chunk
-- Pause: park the next chunk of pending rows the pause matches, walking the pending
-- index in (available_at, id) order after %(after_at)s / %(after_id)s (NULL: from the
-- front); rows a claim is taking right now are passed over (SKIP LOCKED: they are
-- being delivered, or come back as pending rows that the claim parks). Returns each
-- parked row's original key, the last one is where the next chunk starts.
WITH chunk AS (
    SELECT id FROM {table}
    WHERE status = 'pending' AND available_at < {park_floor}
      AND (%(after_at)s::timestamptz IS NULL OR (available_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
      AND CASE %(selector)s WHEN 'event_type' THEN event_type = %(value)s
                            WHEN 'topic' THEN topic IS NOT DISTINCT FROM %(value)s
                            ELSE aggregate_type = %(value)s END
    ORDER BY available_at, id
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o SET available_at = o.available_at + {park_shift}
WHERE o.id = ANY(ARRAY(SELECT id FROM chunk))  -- by primary key (see delivery.sql "claim", parked)
RETURNING o.id, o.available_at - {park_shift} AS original_at

-- name: unpark_chunk
-- Resume: give the next chunk of parked rows the ended pause matched their original
-- available_at back (so they come due in their old order), unless another active pause
-- still matches them (those stay parked). Walks the parked end of the pending index
-- after %(after_at)s / %(after_id)s (a parked key; NULL: from the start of the parked
-- range) and returns every row it looked at with its parked key, so the next chunk
-- starts after the last one. No SKIP LOCKED: a parked row is locked only for the
-- moment a claim or another pause looks at it, and a row passed over would stay parked.
WITH active AS MATERIALIZED (
    {paused_selectors}
), chunk AS (
    SELECT r.id, r.available_at,
           NOT (r.event_type = ANY((SELECT event_types FROM active)::text[])
                OR r.aggregate_type = ANY((SELECT aggregate_types FROM active)::text[])
                OR coalesce(r.topic = ANY((SELECT topics FROM active)::text[]), false)) AS free
    FROM {table} AS r
    WHERE r.status = 'pending' AND r.available_at >= {park_floor}
      AND (%(after_at)s::timestamptz IS NULL OR (r.available_at, r.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
      AND CASE %(selector)s WHEN 'event_type' THEN r.event_type = %(value)s
                            WHEN 'topic' THEN r.topic IS NOT DISTINCT FROM %(value)s
                            ELSE r.aggregate_type = %(value)s END
    ORDER BY r.available_at, r.id
    LIMIT %(chunk)s
    FOR UPDATE
), moved AS (
    UPDATE {table} AS o SET available_at = o.available_at - {park_shift}
    WHERE o.id = ANY(ARRAY(SELECT id FROM chunk WHERE free))  -- by primary key
    RETURNING o.id
)
SELECT chunk.id, chunk.available_at, chunk.free, (SELECT count(*) FROM moved) AS moved FROM chunk

-- name: park_expired_chunk
-- Pause: rows the pause matches whose lease has expired (their relay died or hung
-- before an outcome) are parked too, as pending rows: a new lease_version fences the
-- lost owner out, as a reclaim would; attempts are kept. Rows that used every attempt
-- (%(max_attempts)s) are left to the reaper, which sends them dead as without a pause.
-- Their available_at (when they were due) moves like a pending row's. By primary key.
UPDATE {table} AS o
SET status = 'pending', lease_owner = NULL, lease_until = NULL, lease_version = o.lease_version + 1,
    available_at = o.available_at + {park_shift}
WHERE o.id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts < %(max_attempts)s
      AND available_at < {park_floor}
      AND CASE %(selector)s WHEN 'event_type' THEN event_type = %(value)s
                            WHEN 'topic' THEN topic IS NOT DISTINCT FROM %(value)s
                            ELSE aggregate_type = %(value)s END
    ORDER BY lease_until
    LIMIT %(chunk)s
    FOR UPDATE SKIP LOCKED))
RETURNING o.id
