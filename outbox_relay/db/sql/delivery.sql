-- Delivery: reap, claim (plain and ordered), the fenced finalize, lease extension, and the per-statement planner settings.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: mark_idle
-- A worker found nothing to claim: ask inserts to notify.
UPDATE {state_table} SET relays_idle = true WHERE NOT relays_idle

-- name: mark_busy
-- The relays keep finding rows (runtime/wakeup.py): inserts need not notify for now.
UPDATE {state_table} SET relays_idle = false WHERE relays_idle

-- name: waker_lock
-- The listen connection of one relay process among the replicas of a table: the
-- session advisory lock it holds while it listens and wakes the relays (the others
-- wait here, which costs no transaction, and take over when its connection ends).
-- The key shares the advisory lock space only through this hash.
SELECT pg_advisory_lock(hashtextextended(%(key)s, 0))

-- name: reap
-- Poison rows: claimed max_attempts times and never finalized (a worker died every
-- time). They never reach a finalize, so the claim is where they go dead. The CTE
-- keeps the last owner for the log line (RETURNING shows the row after the update).
-- Every UPDATE here that joins the rows a CTE picked also says
-- "o.id = ANY(ARRAY(SELECT id FROM <cte>))": an index condition on the primary key
-- whichever side of the join the planner puts the outbox on. With statistics that see
-- an almost empty outbox (delete mode drains it; an ANALYZE then counts a row or two
-- in all its pages) the join alone became a nested loop whose outer side read the whole
-- primary key: after one writer transaction committed 100 000 rows, every claim ran
-- into its statement timeout until autovacuum analyzed the table again.
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
WHERE o.id = victims.id AND o.id = ANY(ARRAY(SELECT id FROM victims))
RETURNING o.id, o.lease_version, victims.lease_owner

-- name: claim
-- The whole claim in one statement (one round trip, atomic in autocommit): reap
-- poison rows (as in "reap") and take up to LIMIT rows: expired leases first (the
-- oldest work), then due pending rows, each read from its own partial index in
-- order and cut by LIMIT, so the cost does not grow with the backlog. {row_lock} is
-- FOR UPDATE SKIP LOCKED: concurrent claims take disjoint rows. A claim of a few rows
-- while one worker claims at a time (store_core.py, the lockless claim) leaves it
-- out: the lock costs a WAL record per row, and the UPDATE writes its own; that claim
-- waits for a row another transaction holds (bounded by its lock_timeout) and takes
-- it only if it is still what it was picked as. The UPDATE makes ownership durable:
-- owner, deadline and a new fencing token. Reaped rows come back with reaped = true.
-- %(excluded_types)s: event types left to the ordered claim (empty: none).
-- Operator pauses (pauses.sql): "paused" reads the active ones once; neither scan takes
-- a row they match, and "parked" moves such rows out of the due index's front.
-- Byte budget: the batch takes rows while their payload + headers text (and
-- payload_bytes, a writer-encoded value) add up to at
-- most %(max_batch_bytes)s (a running sum in claim order; the first row is always
-- taken, so a single larger row is claimed alone), so
-- a batch of large events cannot exhaust the relay's memory. Only %(candidates)s rows
-- are looked at (the worker sizes it from the rows it saw last time), because sizing
-- a row detoasts its payload. A row above %(max_message_bytes)s (NULL: no limit) is
-- claimed without its payload: it goes dead at once, never held in memory.
-- Where the two index scans start (claim_cursor.py), so that neither walks the dead
-- entries piled up at the front of its index while vacuum is held back: the processing
-- index at {leases_bound} ("claim_leases_bound"), below which no live lease was left by
-- the last claims; the due index at {due_bound} ("claim_due_bound"). In a fast claim the
-- store fills them with those sections, whose parameters are never NULL (the front is
-- '-infinity'), so that they are index conditions in a generic plan too (an
-- "IS NULL OR" test would only be a filter there, walking the dead entries it is meant
-- to skip); a full claim, and anything else, gets true: the claim from the front.
-- due_at: a claimed due row's key, where later claims start.
-- {lease_scan}: false in most fast claims (the cursor looks for expired leases once a
-- second); true otherwise. {writers_look}: in a fast claim, the look for open writer
-- transactions (outbox_writers; it reads the catalogs only when %(writers_check)s,
-- 25 times a second): since, when the oldest young transaction that holds a write
-- lock on the outbox began, so that the due scan starts no later than the rows such a
-- transaction will commit (their available_at defaults to its start). The claim
-- reports it, and the cursor keeps it like a claimed key: the claims after that
-- transaction's commit, which no longer see its lock, still start at or below its
-- rows. The claim also reports the long writers the look saw (the cursor claims once
-- from the start of each after it ends). Elsewhere a row of NULLs.
WITH victims AS (
    SELECT id, lease_owner FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s
      AND {leases_bound}
      AND {lease_scan}
    FOR UPDATE SKIP LOCKED
), reaped AS (
    UPDATE {table} AS o
    SET status = 'dead',
        last_error = 'lease expired after ' || o.attempts || ' attempts without an outcome (worker crash or hang?)',
        lease_owner = NULL,
        lease_until = NULL
    FROM victims
    WHERE o.id = victims.id AND o.id = ANY(ARRAY(SELECT id FROM victims))
    RETURNING o.id, o.lease_version, victims.lease_owner
), writers AS MATERIALIZED (
    {writers_look}
), paused AS MATERIALIZED (
    {paused_selectors}
), expired AS (
    SELECT id, 0 AS part, lease_until AS sort_at, created_at AS row_created_at, lease_version AS row_lease_version,
           octet_length(payload::text) + coalesce(octet_length(headers::text), 0)
           + coalesce(octet_length(payload_bytes), 0) AS row_bytes
    FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts < %(max_attempts)s
      AND {leases_bound}
      AND {lease_scan}
      AND NOT (event_type = ANY(%(excluded_types)s))
      AND NOT (event_type = ANY((SELECT event_types FROM paused)::text[]) OR aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
               OR coalesce(topic = ANY((SELECT topics FROM paused)::text[]), false))
    ORDER BY lease_until
    LIMIT %(candidates)s
    {row_lock}
), due AS (
    SELECT id, 1 AS part, available_at AS sort_at, created_at AS row_created_at, lease_version AS row_lease_version,
           octet_length(payload::text) + coalesce(octet_length(headers::text), 0)
           + coalesce(octet_length(payload_bytes), 0) AS row_bytes
    FROM {table}
    WHERE status = 'pending' AND available_at <= now()
      AND {due_bound}
      AND NOT (event_type = ANY(%(excluded_types)s))
      AND NOT (event_type = ANY((SELECT event_types FROM paused)::text[]) OR aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
               OR coalesce(topic = ANY((SELECT topics FROM paused)::text[]), false))
    ORDER BY available_at, id
    LIMIT %(candidates)s
    {row_lock}
), due_reach AS (
    -- The last key "due" read: its last row when it found all it looked for, else the
    -- end of the due rows.
    SELECT coalesce(l.at, now()) AS at, coalesce(l.id, 9223372036854775807) AS id
    FROM (SELECT count(*) AS n FROM due) AS c
    LEFT JOIN (SELECT sort_at AS at, id FROM due ORDER BY sort_at DESC, id DESC LIMIT 1) AS l
           ON c.n >= %(candidates)s
), parked AS (
    -- Operator pauses (pauses.sql): a paused row that became due after its pause parked
    -- the others (inserted since, or rescheduled by a finalize) is parked too, so that
    -- later due scans do not read it again. Only in the range "due" just read (up to
    -- its last row when it found all it looked for, else every due row), so this costs
    -- no more index than "due", and nothing without an active pause (a one-time filter).
    -- = ANY(ARRAY(...)): the rows found are looked up by primary key (as a join, the
    -- planner may read the whole primary key index to match them).
    UPDATE {table} AS o SET available_at = o.available_at + {park_shift}
    WHERE o.id = ANY(ARRAY(
        SELECT id FROM {table}
        WHERE (SELECT any_active FROM paused)
          AND status = 'pending' AND available_at <= now()
          AND {due_bound}
          AND (available_at, id) <= ((SELECT at FROM due_reach), (SELECT id FROM due_reach))
          AND (event_type = ANY((SELECT event_types FROM paused)::text[])
               OR aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
               OR coalesce(topic = ANY((SELECT topics FROM paused)::text[]), false))
        ORDER BY available_at, id
        LIMIT %(candidates)s
        FOR UPDATE SKIP LOCKED))
    RETURNING o.id
), picked AS MATERIALIZED (
    SELECT id, row_bytes, part, row_created_at, row_lease_version FROM (
        SELECT id, row_bytes, part, row_created_at, row_lease_version,
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
    -- created_at too: on a partitioned outbox (partitioned by it) each picked row is
    -- then looked up in its own partition only, not in every partition's primary key.
    -- "picked" materialized: in a nested loop whose outer side is the outbox it would
    -- otherwise be sized (and sorted) again for every row.
    -- Still what it was picked as (always true of a row "expired" or "due" locked; a
    -- claim without {row_lock} takes only the rows no other transaction changed since
    -- its snapshot: on one that did, PostgreSQL waits for it and evaluates these
    -- conditions again on the row as it left it).
    WHERE o.id = picked.id AND o.created_at = picked.row_created_at AND o.id = ANY(ARRAY(SELECT id FROM picked))
      AND o.lease_version = picked.row_lease_version
      AND CASE WHEN picked.part = 0 THEN o.status = 'processing' AND o.lease_until < now()
               ELSE o.status = 'pending' AND o.available_at <= now() END
    RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
              CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL
                   ELSE o.payload::text END AS payload,
              o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes,
              CASE WHEN picked.part = 1 THEN o.available_at END AS due_at, o.tombstone, o.partition,
              CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL
                   ELSE o.payload_bytes END AS payload_bytes
)
SELECT false AS reaped, claimed.id, claimed.lease_version, claimed.attempts, claimed.aggregate_type,
       claimed.aggregate_id, claimed.event_type, claimed.payload, claimed.topic, claimed.headers,
       claimed.created_at, claimed.row_bytes, NULL::text AS reaped_owner, claimed.due_at,
       claimed.tombstone, claimed.partition, claimed.payload_bytes
FROM claimed
UNION ALL
SELECT true, reaped.id, reaped.lease_version, NULL::int, NULL::text, NULL::text, NULL::text, NULL::text,
       NULL::text, NULL::text, NULL::timestamptz, NULL::int, reaped.lease_owner, NULL::timestamptz,
       NULL::boolean, NULL::int, NULL::bytea
FROM reaped
{claim_report}

-- name: claim_due_bound
-- A fast claim's start in the due index (see "claim"): its cursor's key, or the start
-- of the oldest young writer transaction the look saw, whichever is lower.
(available_at, id) >= (least(%(from_at)s::timestamptz, (SELECT since FROM writers)),
                       CASE WHEN (SELECT since FROM writers) < %(from_at)s::timestamptz
                            THEN 0 ELSE %(from_id)s::bigint END)

-- name: claim_leases_bound
-- A fast claim's start in the processing index (see "claim").
lease_until >= %(leases_from)s::timestamptz

-- name: claim_sweep_due_bound
-- A step of the full claim's sweep (claim_cursor.py Sweep): one key range of the due
-- index, from %(from_at)s / %(from_id)s up to %(to_at)s / %(to_id)s (exclusive), so
-- that the step reads the dead entries of that range only. The scan starts at the
-- lower row comparison; it stops at the plain bound on available_at (an upper row
-- comparison alone does not end a btree scan: it would read on through every index
-- entry up to now(), without their heap visits), and the upper row comparison drops
-- the keys at to_at itself from to_id on.
(available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint)
AND available_at <= %(to_at)s::timestamptz
AND (available_at, id) < (%(to_at)s::timestamptz, %(to_id)s::bigint)

-- name: claim_sweep_leases_bound
-- The same step's range of the processing index (empty when %(leases_to)s is not above
-- %(leases_from)s).
lease_until >= %(leases_from)s::timestamptz AND lease_until < %(leases_to)s::timestamptz

-- name: outbox_writers
-- The other transactions that have written to the outbox and not yet ended (their
-- RowExclusiveLock is held until then, and released only after their commit is
-- visible), leaving out this relay's own sessions (same application_name: their claims
-- and finalizes never commit new rows). One row, read only when %(writers_check)s:
-- - since: the start of the oldest of them younger than %(writers_within_seconds)s.
--   Only those: one left open for longer (an import writing for minutes, a forgotten
--   BEGIN that wrote a row) would otherwise pin every fast claim to its start;
-- - long_writers: the older ones, as 'pid:start' (start: its xact_start in microseconds
--   since the Unix epoch, exactly its rows' default available_at), comma-separated,
--   oldest first ('' when none): the cursor remembers them and, once a look no longer
--   sees one, claims once from its start;
-- - looked_at_us: the database's clock just after the catalogs were read (microseconds
--   since the Unix epoch), so that the cursor applies looks in the order they were taken.
-- Another role's session shows its xact_start only to a role with pg_read_all_stats
-- (pg_monitor); without it such a writer is in neither column, and only the cursor's
-- window or a full claim covers its rows.
SELECT min(w.xact_start) FILTER (WHERE NOT w.is_long) AS since,
       CASE WHEN %(writers_check)s::boolean THEN
           coalesce(string_agg(w.pid::text || ':' || w.start_us::text, ',' ORDER BY w.xact_start)
                        FILTER (WHERE w.is_long), '')
       END AS long_writers,
       CASE WHEN %(writers_check)s::boolean THEN
           (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
       END AS looked_at_us
FROM (SELECT a.pid, a.xact_start,
             (extract(epoch FROM a.xact_start) * 1000000)::bigint AS start_us,
             a.xact_start < now() - make_interval(secs => %(writers_within_seconds)s::float8) AS is_long
      FROM pg_catalog.pg_locks AS l
      JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
      WHERE %(writers_check)s::boolean
        AND l.locktype = 'relation' AND l.relation = {table_oid}::regclass AND l.mode = 'RowExclusiveLock'
        AND l.granted AND l.pid <> pg_backend_pid()
        AND a.application_name IS DISTINCT FROM current_setting('application_name')
        AND a.xact_start IS NOT NULL) AS w

-- name: claim_report
-- Appended to "claim" by the store (claim_cursor.py): one more row (reaped = NULL)
-- with how many expired leases the statement looked at, how long it ran in the server
-- (microseconds, in the lease_version column: evaluated after the other parts, so it
-- covers the scans and the UPDATE, not the network), what its look for open writers
-- saw (outbox_writers: the young ones' oldest start in the created_at column, the long
-- writers in the event_type column, the look's clock in the payload column), its clock,
-- and how many rows it picked (in the attempts column: more than it claimed when
-- another claim took some first, which only a claim without {row_lock} can see).
UNION ALL
SELECT NULL, (SELECT count(*) FROM expired),
       (extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000000)::int,
       (SELECT count(*) FROM picked)::int, NULL, NULL, (SELECT long_writers FROM writers), (SELECT looked_at_us::text FROM writers), NULL,
       NULL, (SELECT since FROM writers), NULL, NULL, now(), NULL, NULL, NULL

-- name: publish_gauge_bounds
-- While its fast claims are in use (claim_cursor.py), a relay process publishes where
-- they start, every few seconds, for `outbox-relay status` in another process
-- (monitoring.sql published_gauge_bounds): its own entry of the state table's
-- gauge_bounds under %(process)s (%(bounds)s; NULL withdraws it), and it drops the
-- entries of processes that have not published for %(stale_seconds)s (gone, or no
-- longer under pressure and unable to withdraw). A write of a one-row table only
-- while vacuum is held back; nothing at all otherwise.
UPDATE {state_table}
SET gauge_bounds = coalesce((SELECT jsonb_object_agg(e.key, e.value)
                             FROM jsonb_each(gauge_bounds) AS e
                             WHERE e.key <> %(process)s
                               AND (e.value ->> 'at')::timestamptz > now() - make_interval(secs => %(stale_seconds)s)),
                            '{{}}'::jsonb)
                   || CASE WHEN %(bounds)s::jsonb IS NULL THEN '{{}}'::jsonb
                           ELSE jsonb_build_object(%(process)s::text,
                                                   %(bounds)s::jsonb || jsonb_build_object('at', now())) END

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
WITH RECURSIVE paused AS MATERIALIZED (
    -- operator pauses (pauses.sql)
    {paused_selectors}
), aggregates AS (
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
        SELECT f.id, f.status, f.available_at, f.lease_until, f.attempts, f.event_type, f.aggregate_type, f.topic
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
      -- a paused head (not parked yet) holds its aggregate back like a parked one
      AND NOT (h.event_type = ANY((SELECT event_types FROM paused)::text[]) OR h.aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
               OR coalesce(h.topic = ANY((SELECT topics FROM paused)::text[]), false))
      AND NOT EXISTS (
          SELECT 1 FROM {table} AS d
          WHERE d.aggregate_id = aggregates.aggregate_id AND d.status = 'dead' AND d.id < h.id
            AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s)))
    LIMIT %(batch)s
), candidates AS (
    -- = ANY(ARRAY(...)): the heads are computed once and looked up by primary key,
    -- whatever the planner believes about the table (with statistics from a moment
    -- when nothing was pending it would otherwise re-run the skip scan per row).
    SELECT o.id, octet_length(o.payload::text) + coalesce(octet_length(o.headers::text), 0)
                  + coalesce(octet_length(o.payload_bytes), 0) AS row_bytes
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
WHERE o.id = picked.id AND o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload::text END AS payload,
          o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes, o.tombstone, o.partition,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload_bytes END AS payload_bytes
)
-- last_aggregate: where the next claim's round-robin starts. Computed here because
-- "after" must follow the column's collation (the skip scan's order), which for
-- en_US or ICU collations is not Python's code-point order. database_now: the
-- statement's clock, where the fast ordered claims' discovery starts once they are in
-- use (ordered_bounds.py).
SELECT claimed.*, max(claimed.aggregate_id) OVER () AS last_aggregate, now() AS database_now FROM claimed

-- name: claim_ordered_runs
-- Behind each head just claimed (and still held by this transaction), take the
-- contiguous run of the aggregate's next ordered rows that are pending and due,
-- stopping at the first row that is not (processing, not yet due, or behind a dead
-- row). Nobody else can claim these rows while their head is unfinished, so order is
-- kept. Pending/processing rows come from {idx_aggregate_active}, the first dead row
-- behind the head (if any) from {idx_aggregate_dead}.
WITH paused AS MATERIALIZED (
    -- operator pauses (pauses.sql): a paused row ends a run
    {paused_selectors}
), heads AS (
    SELECT h.aggregate_id, h.head_id,
           coalesce((SELECT min(d.id) FROM {table} AS d
                     WHERE d.aggregate_id = h.aggregate_id AND d.status = 'dead' AND d.id > h.head_id
                       AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s))),
                    9223372036854775807) AS dead_id
    FROM unnest(%(aggregate_ids)s::text[], %(head_ids)s::bigint[]) AS h(aggregate_id, head_id)
), followers AS (
    SELECT f.id,
           bool_and(f.status = 'pending' AND f.available_at <= now() AND f.id < f.dead_id
                    AND NOT (f.event_type = ANY((SELECT event_types FROM paused)::text[])
                             OR f.aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
                             OR coalesce(f.topic = ANY((SELECT topics FROM paused)::text[]), false)))
               OVER (PARTITION BY f.aggregate_id ORDER BY f.id) AS contiguous
    FROM heads
    CROSS JOIN LATERAL (
        SELECT r.id, r.aggregate_id, r.status, r.available_at, heads.dead_id, r.event_type, r.aggregate_type, r.topic
        FROM {table} AS r
        WHERE r.aggregate_id = heads.aggregate_id
          AND r.id > heads.head_id
          AND r.status IN ('pending', 'processing')
          AND (%(all_ordered)s OR r.event_type = ANY(%(ordered_types)s))
        ORDER BY r.id
        LIMIT %(run_length)s
    ) AS f
), locked AS (
    SELECT t.id, octet_length(t.payload::text) + coalesce(octet_length(t.headers::text), 0)
                  + coalesce(octet_length(t.payload_bytes), 0) AS row_bytes
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
WHERE o.id = picked.id AND o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload::text END AS payload,
          o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes, o.tombstone, o.partition,
          CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload_bytes END AS payload_bytes

-- name: claim_ordered_discover
-- The fast ordered claim's first statement (ordered_bounds.py): which aggregates got a
-- due pending row of an ordered type since the last claims looked. It reads the due
-- index from {due_bound} ("claim_due_bound": the ordered claims' own cursor, with the
-- look for open writers {writers_look}, as in "claim"), at most %(scan_rows)s rows, and
-- returns their distinct aggregates. Rows waiting behind an aggregate's head are not
-- read again: their aggregate is in the visited set already. With %(reap)s (an
-- all-ordered relay: no plain claim reaps) and {lease_scan}, poison rows are reaped
-- from {leases_bound} as in "claim". Then one report row (kind 'report'): the last key
-- read when the scan was cut by its LIMIT, else the statement's clock (every due row up
-- to it was read), how long the statement ran in the server, the look's findings and
-- the clock.
WITH victims AS (
    SELECT id, lease_owner FROM {table}
    WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s
      AND {leases_bound}
      AND {lease_scan} AND %(reap)s::boolean
    FOR UPDATE SKIP LOCKED
), reaped AS (
    UPDATE {table} AS o
    SET status = 'dead',
        last_error = 'lease expired after ' || o.attempts || ' attempts without an outcome (worker crash or hang?)',
        lease_owner = NULL,
        lease_until = NULL
    FROM victims
    WHERE o.id = victims.id AND o.id = ANY(ARRAY(SELECT id FROM victims))
    RETURNING o.id, o.lease_version, victims.lease_owner
), writers AS MATERIALIZED (
    {writers_look}
), due AS MATERIALIZED (
    SELECT aggregate_id, available_at, id
    FROM {table}
    WHERE status = 'pending' AND available_at <= now()
      AND {due_bound}
      AND (%(all_ordered)s OR event_type = ANY(%(ordered_types)s))
    ORDER BY available_at, id
    LIMIT %(scan_rows)s
), reach AS (
    SELECT CASE WHEN (SELECT count(*) FROM due) >= %(scan_rows)s THEN l.available_at ELSE now() END AS at,
           CASE WHEN (SELECT count(*) FROM due) >= %(scan_rows)s THEN l.id ELSE 0 END AS id
    FROM (SELECT 1) AS one
    LEFT JOIN (SELECT available_at, id FROM due ORDER BY available_at DESC, id DESC LIMIT 1) AS l ON true
)
SELECT 'due' AS kind, d.aggregate_id, NULL::bigint AS id, NULL::bigint AS lease_version, NULL::text AS owner,
       NULL::timestamptz AS at, NULL::text AS long_writers, NULL::text AS looked_at_us, NULL::timestamptz AS since,
       NULL::timestamptz AS database_now
FROM (SELECT DISTINCT aggregate_id FROM due) AS d
UNION ALL
SELECT 'reaped', NULL, reaped.id, reaped.lease_version, reaped.lease_owner, NULL, NULL, NULL, NULL, NULL
FROM reaped
UNION ALL
SELECT 'report', NULL, (SELECT id FROM reach),
       (extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000000)::bigint, NULL,
       (SELECT at FROM reach), (SELECT long_writers FROM writers), (SELECT looked_at_us::text FROM writers),
       (SELECT since FROM writers), now()

-- name: claim_ordered_heads_bounded
-- The fast ordered claim's heads (ordered_bounds.py explains the rule): for each
-- aggregate of %(aggregate_ids)s, its first pending or processing row of an ordered
-- type at or above its proven bound %(bounds)s (every ordered row of it below the
-- bound is finished), read from {idx_aggregate_active} at that key instead of from the
-- aggregate's front, and whether an ordered dead row lies below that row (a probe of
-- {idx_aggregate_dead}, which holds only rows that went dead, as in
-- "claim_ordered_heads"). A row found so is its aggregate's head; it is claimed under
-- the same conditions as in "claim_ordered_heads" (due, or an expired lease with
-- attempts left; not paused; no dead row before it), at most %(batch)s of them, in
-- the order of the arrays, within the byte budget. The claimed rows come first (kind
-- = 'claimed', the Claimed columns), then one row per aggregate looked at (kind =
-- 'looked': the aggregate, its first unfinished row, whether a dead row blocks it),
-- from which the process moves the bounds.
WITH paused AS MATERIALIZED (
    -- operator pauses (pauses.sql)
    {paused_selectors}
), looked AS MATERIALIZED (
    SELECT v.aggregate_id, v.ord, h.id, h.status, h.available_at, h.lease_until, h.attempts,
           h.event_type, h.aggregate_type, h.topic,
           h.id IS NOT NULL AND EXISTS (
               SELECT 1 FROM {table} AS d
               WHERE d.aggregate_id = v.aggregate_id AND d.status = 'dead' AND d.id < h.id
                 AND (%(all_ordered)s OR d.event_type = ANY(%(ordered_types)s))) AS blocked
    FROM unnest(%(aggregate_ids)s::text[], %(bounds)s::bigint[]) WITH ORDINALITY AS v(aggregate_id, bound, ord)
    LEFT JOIN LATERAL (
        SELECT f.id, f.status, f.available_at, f.lease_until, f.attempts, f.event_type, f.aggregate_type, f.topic
        FROM {table} AS f
        WHERE f.aggregate_id = v.aggregate_id AND f.id >= v.bound
          AND f.status IN ('pending', 'processing')
          AND (%(all_ordered)s OR f.event_type = ANY(%(ordered_types)s))
        ORDER BY f.id
        LIMIT 1
    ) AS h ON true
), heads AS (
    SELECT l.id FROM looked AS l
    WHERE l.id IS NOT NULL AND NOT l.blocked
      AND ((l.status = 'pending' AND l.available_at <= now())
        OR (l.status = 'processing' AND l.lease_until < now() AND l.attempts < %(max_attempts)s))
      AND NOT (l.event_type = ANY((SELECT event_types FROM paused)::text[])
               OR l.aggregate_type = ANY((SELECT aggregate_types FROM paused)::text[])
               OR coalesce(l.topic = ANY((SELECT topics FROM paused)::text[]), false))
    ORDER BY l.ord
    LIMIT %(batch)s
), candidates AS (
    -- by primary key, the conditions checked again on the row locked (as in "claim_ordered_heads")
    SELECT o.id, octet_length(o.payload::text) + coalesce(octet_length(o.headers::text), 0)
                  + coalesce(octet_length(o.payload_bytes), 0) AS row_bytes
    FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM heads))
      AND ((o.status = 'pending' AND o.available_at <= now())
        OR (o.status = 'processing' AND o.lease_until < now() AND o.attempts < %(max_attempts)s))
    FOR UPDATE OF o SKIP LOCKED
), picked AS (
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
    WHERE o.id = picked.id AND o.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id, o.event_type,
              CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload::text END AS payload,
              o.topic, o.headers::text AS headers, o.created_at, picked.row_bytes, o.tombstone, o.partition,
              CASE WHEN picked.row_bytes > %(max_message_bytes)s::bigint THEN NULL ELSE o.payload_bytes END AS payload_bytes
)
SELECT 'claimed' AS kind, claimed.*, NULL::boolean AS blocked
FROM claimed
UNION ALL
SELECT 'looked', looked.id, NULL, NULL, NULL, looked.aggregate_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, looked.blocked
FROM looked

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
-- coalesce(o.status = 'processing', false): the same test (status is never NULL) in a
-- form the planner cannot match to the processing index's predicate, so the rows are
-- looked up by primary key. Matched, the planner chose, whenever its statistics said
-- few rows were processing, to read the whole processing index and hash-join it with
-- the batch: while vacuum is held back that index holds a dead entry for every row
-- finalized since, and the finalize then read all of them (1.15 s per 1000-row batch
-- after 150 000 deliveries behind a held snapshot, instead of a few ms).
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
    -- 0.2-0.8 s per 1000-row batch instead of ~5 ms. FINALIZE_SETTINGS (db/delivery.py):
    -- no bitmap scans, whose reading of the processing index grew with every row
    -- finalized since the last VACUUM (a bitmap scan never marks an index entry dead;
    -- an index scan does, and skips it from then on).
    DELETE FROM {table} AS o
    USING unnest(%(done_ids)s::bigint[], %(done_versions)s::bigint[]) AS f(id, version)
    WHERE (SELECT delete_done FROM mode)
      AND o.id = ANY(%(done_ids)s::bigint[])
      AND o.id = f.id AND coalesce(o.status = 'processing', false) AND o.lease_version = f.version {strict}
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
      -- every id of the batch, as an array: a primary key lookup whatever the
      -- statistics say about the table's size (see "deleted")
      AND o.id = ANY(%(done_ids)s::bigint[] || %(ids)b::bigint[])
      AND o.id = f.id AND coalesce(o.status = 'processing', false) AND o.lease_version = f.version {strict}
    RETURNING o.id
)
SELECT id FROM deleted
UNION ALL
SELECT id FROM updated

-- name: extend_lease
-- The lease keeper: push the deadline of rows this claim still owns. {strict}: under the
-- strict policy an expired lease is not revived (the owner could then finalize).
-- coalesce(...): rows by primary key, never the processing index (see "finalize").
UPDATE {table} AS o
SET lease_until = now() + make_interval(secs => %(lease_seconds)s)
FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS f(id, version)
WHERE o.id = f.id AND coalesce(o.status = 'processing', false) AND o.lease_version = f.version {strict}
RETURNING o.id

-- name: has_due_rows
-- Is a row claimable now (a due pending row or an expired lease)? Two index probes:
-- the front of the pending index and the front of the processing index. A process
-- serving many sources asks each idle one this instead of listening on it.
SELECT EXISTS (SELECT 1 FROM {table} WHERE status = 'pending' AND available_at <= now())
    OR EXISTS (SELECT 1 FROM {table} WHERE status = 'processing' AND lease_until < now())

-- name: status_of
SELECT id, status FROM {table} WHERE id = ANY(%(ids)s)

-- name: state_of
SELECT id, status, lease_version FROM {table} WHERE id = ANY(%(ids)s)

-- name: aggregate_lock
-- Transaction-scoped: held until the caller commits, so two writers of one aggregate
-- commit in the order they obtained ids. The key space is shared with other advisory
-- lock users only through this hash of (table, aggregate_id).
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_key)s, 0))

-- name: statement_settings
-- Planner settings of the claim and the finalize, set transaction-locally by a
-- statement pipelined in front of them (one round trip; pooler.execute_with_settings,
-- db/delivery.py CLAIM_SETTINGS / FINALIZE_SETTINGS). Both must touch only the rows they
-- work on, with and without statistics that describe the table:
-- - the claim reads its partial indexes in order and stops after LIMIT rows
--   (enable_bitmapscan = off). Without statistics that know the backlog (a table
--   filled faster than autovacuum's ANALYZE follows, or restored without statistics)
--   the planner expects a few hundred pending rows and prefers a bitmap scan of ALL
--   of them plus a sort: every claim then read, sized and sorted the whole backlog
--   (243 ms per claim at a 300 000-row backlog instead of 8 ms), a quadratic drain.
-- - the finalize (and the lease keeper's extend_lease, the same join) reads the processing
--   index with an index scan, never a bitmap scan
--   (see "finalize").
-- - neither reads the whole table (enable_seqscan = off): the claim's UPDATE finds its
--   picked rows, the finalize its batch, by primary key. An ANALYZE taken while vacuum
--   is held back sees a few thousand live rows in a table of hundreds of MB of dead
--   versions; the planner then chose a sequential scan of the whole heap for the
--   finalize's DELETE and UPDATE and the claim's UPDATE (1.5-2.5 s each instead of
--   ~10 ms, for the minute until the next ANALYZE: delivery stalled, backlog 109 000).
--   With it, jit = off: before PostgreSQL 18 a disabled node still costs 1e10, over
--   jit_above_cost, and JIT-compiling the statement took 1.5 s on every call.
-- - the finalize joins its batch's arrays to its rows with a hash join
--   (enable_nestloop = off): with the same statistics the planner expected one outbox
--   row and put the unnest of the 1 000-element arrays inside a nested loop, run again
--   for each of the 1 000 rows (2 s per finalize until the next ANALYZE or vacuum).
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
