-- Monitoring: queue depth, backlog age, expired leases, blocked aggregates, exact counts, throughput, and what holds vacuum back.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {idx_*}, {fn_notify},
-- {trg_notify} and {channel} are other quoted identifiers derived from it
-- (schema.py). They are filled in with psycopg.sql, never with string formatting.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.
-- Every time is the database's clock (now()), never a worker's.

-- name: stats_depth
-- Rows per status, each counted exactly up to %(cap)s from its partial index, so the
-- cost is bounded however large the table grows. Done rows have no index (nothing on
-- the relay's path reads them): they are counted exactly only while the whole table
-- holds at most the cap (a sequential read of at most that many rows), otherwise NULL;
-- a table the planner already knows to be larger (pg_class.reltuples) is not read at
-- all, so a large keep-mode table costs nothing here every refresh.
-- A status that reaches the cap, and done when NULL, is estimated from the planner's
-- statistics (stats_status_estimate).
-- %(from_at)s / %(from_id)s and %(leases_from)s (NULL: the front): where the pending and
-- processing counts start their index scans (see stats_backlog).
SELECT 'pending' AS status, count(*) AS n
FROM (SELECT 1 FROM {table}
      WHERE status = 'pending'
        AND (%(from_at)s::timestamptz IS NULL OR (available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint))
      LIMIT %(cap)s) AS p
UNION ALL
SELECT 'processing', count(*)
FROM (SELECT 1 FROM {table}
      WHERE status = 'processing' AND (%(leases_from)s::timestamptz IS NULL OR lease_until >= %(leases_from)s::timestamptz)
      LIMIT %(cap)s) AS r
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
-- While vacuum is held back, both indexes hold a dead entry for every row delivered
-- since, all at their front; each costs a heap visit, so reading from the front grows
-- with the age of the horizon. The relay then passes where its fast claims start
-- (claim_cursor.py GaugeBounds): the pending index from %(from_at)s / %(from_id)s, the
-- processing index from %(leases_from)s. Below them lie only rows already delivered,
-- and rows a full claim is about to take (a writer transaction that committed late);
-- NULL: from the front, exactly.
WITH backlog AS (
    (SELECT created_at, attempts FROM {table}
     WHERE status = 'pending'
       AND (%(from_at)s::timestamptz IS NULL OR (available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint))
     ORDER BY available_at, id LIMIT %(cap)s)
    UNION ALL
    (SELECT created_at, attempts FROM {table}
     WHERE status = 'processing' AND (%(leases_from)s::timestamptz IS NULL OR lease_until >= %(leases_from)s::timestamptz)
     ORDER BY lease_until LIMIT %(cap)s)
)
SELECT attempts, count(*) AS n, extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_seconds
FROM backlog GROUP BY attempts ORDER BY attempts

-- name: published_gauge_bounds
-- The relays' published starts (delivery.sql publish_gauge_bounds) that are fresh
-- (published in the last %(fresh_seconds)s): one row each. to_jsonb: no error on a
-- state table migrated before the column existed (no rows then).
SELECT e.value ->> 'due_at' AS due_at, (e.value ->> 'due_id')::bigint AS due_id,
       e.value ->> 'leases_from' AS leases_from, e.key AS process
FROM {state_table} AS s
CROSS JOIN LATERAL jsonb_each(coalesce(to_jsonb(s) -> 'gauge_bounds', '{{}}'::jsonb)) AS e
WHERE (e.value ->> 'at')::timestamptz > now() - make_interval(secs => %(fresh_seconds)s)

-- name: stats_expired
-- %(leases_from)s: as in stats_backlog.
SELECT count(*) AS n FROM {table}
WHERE status = 'processing' AND lease_until < now() AND (%(leases_from)s::timestamptz IS NULL OR lease_until >= %(leases_from)s::timestamptz)

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

-- name: database_now
SELECT now()

-- name: status_count_upto
-- Exact count of one status up to %(upto)s rows (NULL: all), read from that status's
-- partial index (an index-only scan once the visibility map is set). Done rows have
-- no index: their count reads the table, so it runs under the count's time budget.
-- %(from_at)s / %(from_id)s, %(leases_from)s: the bounds of stats_backlog (pending,
-- processing); {status} is a literal, so the planner drops the other status's bound.
SELECT count(*) FROM (
    SELECT 1 FROM {table}
    WHERE status = {status}
      AND ({status} <> 'pending' OR (%(from_at)s::timestamptz IS NULL OR (available_at, id) >= (%(from_at)s::timestamptz, %(from_id)s::bigint)))
      AND ({status} <> 'processing' OR (%(leases_from)s::timestamptz IS NULL OR lease_until >= %(leases_from)s::timestamptz))
    LIMIT %(upto)s) AS counted

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

-- name: xmin_horizon_holders
-- Everything that holds back the xmin horizon of an ordinary table of this database,
-- oldest first (PostgreSQL's rule, procarray.c ComputeXidHorizons): the xid or snapshot
-- xmin of every backend connected to this database (a VACUUM itself does not count);
-- a walsender without a slot whose standby sends hot_standby_feedback (connected to
-- no database, it holds back every database); the xid of every prepared transaction
-- of this database; the xmin of every replication slot (a physical slot's xmin is its
-- standby's feedback; a slot's catalog_xmin holds back only the system catalogs, not
-- this table). Backends in other databases and prepared transactions of other
-- databases do not hold back this table. The session running this query is left out.
-- visible: whether this role may read the backend's transaction start (a member of
-- pg_read_all_stats, or of the backend's own role); a backend's xid and xmin are
-- shown to every role. held_seconds: since the transaction (or the prepared
-- transaction) began; NULL for a slot and a walsender (they record no time) and for a
-- backend not visible.
WITH holders AS (
    SELECT 'backend'::text AS kind, a.pid, a.usename::text AS user_name, a.application_name, a.state,
           a.backend_type, a.xact_start, NULL::timestamptz AS prepared_at, NULL::text AS gid,
           NULL::text AS slot_name, NULL::text AS slot_type, NULL::boolean AS slot_active,
           CASE WHEN a.backend_xid IS NULL THEN a.backend_xmin
                WHEN a.backend_xmin IS NULL THEN a.backend_xid
                WHEN age(a.backend_xid) >= age(a.backend_xmin) THEN a.backend_xid
                ELSE a.backend_xmin END AS horizon,
           (pg_has_role('pg_read_all_stats', 'USAGE')
            OR (a.usesysid IS NOT NULL AND pg_has_role(a.usesysid, 'USAGE'))) AS visible,
           -- a walsender's xmin is its standby's feedback: no time of its own (as a slot)
           CASE WHEN a.backend_type <> 'walsender'
                THEN extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start))::float8 END AS held_seconds
    FROM pg_stat_activity AS a
    WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
      AND a.pid <> pg_backend_pid()
      AND (a.datname = current_database() OR (a.datid IS NULL AND a.backend_type = 'walsender'))
      AND NOT (a.backend_type = 'autovacuum worker' AND a.query LIKE 'autovacuum: VACUUM%%')
    UNION ALL
    SELECT 'prepared', NULL, p.owner::text, NULL, NULL, NULL, NULL, p.prepared, p.gid, NULL, NULL, NULL,
           p.transaction, true, extract(epoch FROM now() - p.prepared)::float8
    FROM pg_prepared_xacts AS p
    WHERE p.database = current_database()
    UNION ALL
    SELECT 'slot', s.active_pid, NULL, NULL, NULL, NULL, NULL, NULL, NULL, s.slot_name::text, s.slot_type,
           s.active, s.xmin, true, NULL
    FROM pg_replication_slots AS s
    WHERE s.xmin IS NOT NULL
)
SELECT kind, pid, user_name, application_name, state, backend_type, xact_start, prepared_at, gid,
       slot_name, slot_type, slot_active, horizon::text AS horizon_xid, age(horizon) AS age_xids, visible,
       CASE WHEN visible THEN held_seconds END AS held_seconds
FROM holders
ORDER BY age(horizon) DESC, held_seconds DESC NULLS LAST
LIMIT %(limit)s

-- name: vacuum_figures
-- The outbox's dead tuples, sizes and last vacuum, from the statistics views (no
-- table access: cheap at any size). Seconds since the last vacuum: manual or auto,
-- whichever is later; NULL if the table was never vacuumed.
-- A partitioned outbox has no storage of its own: the figures are its partitions'
-- (pg_partition_tree's leaves; a plain table is its own), summed, and the
-- seconds since the most recently vacuumed of them (old partitions that no longer
-- change are not vacuumed again, and say nothing about the queue's health).
SELECT coalesce(sum(s.n_dead_tup), 0)::bigint AS dead_tuples,
       coalesce(sum(s.n_live_tup), 0)::bigint AS live_tuples,
       coalesce(sum(pg_relation_size(t.relid)), 0)::bigint AS heap_bytes,
       coalesce(sum(pg_indexes_size(t.relid)), 0)::bigint AS index_bytes,
       extract(epoch FROM now() - max(greatest(s.last_vacuum, s.last_autovacuum)))::float8 AS since_vacuum_seconds,
       coalesce(sum(coalesce(s.autovacuum_count, 0) + coalesce(s.vacuum_count, 0)), 0)::bigint AS vacuums
FROM (SELECT p.relid FROM pg_partition_tree(%(table)s::regclass) AS p WHERE p.isleaf
      UNION
      SELECT c.oid FROM pg_class AS c WHERE c.oid = %(table)s::regclass AND c.relkind <> 'p') AS t
LEFT JOIN pg_stat_user_tables AS s ON s.relid = t.relid
