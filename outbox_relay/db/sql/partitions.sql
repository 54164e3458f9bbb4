-- A time-partitioned outbox ([partitioning]): the partitioned table, its partitions, and
-- what maintenance reads and changes (db/partitions.py decides, this only states).
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- {table} is the quoted, possibly schema-qualified outbox table; {partition} one of its
-- partitions, quoted and qualified the same way. Filled in with psycopg.sql.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.

-- name: create_partitioned_table
-- The outbox partitioned by range of created_at. The primary key must hold the
-- partition key, so it is (id, created_at): id alone stays unique because it comes from
-- the one identity sequence of the parent, and every statement that finds rows by id
-- (id = ANY(...): finalize, lease extension, dead retry/skip) stays correct; it probes
-- each partition's primary key index (one probe per partition, see the how-to page).
-- No fillfactor here: a partitioned table has no storage of its own, every partition
-- gets the queue's fillfactor and autovacuum parameters when it is created.
-- {status_check}, {lease_check}: the names PostgreSQL gives a plain table's checks
-- (a converted table's own names: a partition's checks must be named as its parent's).
CREATE TABLE IF NOT EXISTS {table} (
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NULL,
    headers         jsonb       NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending'
                    CONSTRAINT {status_check} CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    lease_owner     text        NULL,
    lease_until     timestamptz NULL,
    lease_version   bigint      NOT NULL DEFAULT 0,
    last_error      text        NULL,
    done_at         timestamptz NULL,
    dedup_key       text        NULL,
    CONSTRAINT {lease_check} CHECK ((status = 'processing') = (lease_until IS NOT NULL)),
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at)

-- name: index_dedup_key_partitioned
-- enqueue(dedup_key=...) on a partitioned outbox: a unique index of a partitioned table
-- must hold the partition key, so this one is plain; one row per key is kept by the
-- key table's primary key ({dedup_keys}), which enqueue claims first.
CREATE INDEX {concurrently} IF NOT EXISTS {idx_dedup_key} ON {table} (dedup_key) WHERE dedup_key IS NOT NULL

-- name: is_partitioned
SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%(table)s)), false)

-- name: create_default_partition
-- The safety net: a row whose created_at no partition covers (maintenance stopped for
-- longer than the partitions made ahead, or a writer setting created_at far in the
-- past or future) lands here instead of failing the writer's transaction. The gauge
-- outbox_relay_table_partition_default_rows shows it; maintenance never drops it.
CREATE TABLE IF NOT EXISTS {partition} PARTITION OF {table} DEFAULT WITH ({storage})

-- name: create_partition_table
-- A partition to be: a table of the outbox's columns and checks, empty, not yet
-- attached (nobody else can use it, so its lock is no one's wait).
CREATE TABLE IF NOT EXISTS {partition} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH ({storage})

-- name: attach_partition
-- ATTACH takes SHARE UPDATE EXCLUSIVE on the outbox (writers, claims and finalizes go
-- on) where CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE. It also checks
-- that the default partition holds no row of the new range (an index-less scan of the
-- default partition, normally empty) under a lock that claims wait for: hence the
-- short lock_timeout of every maintenance statement. {from_at}, {to_at}: timestamptz
-- literals (a DDL takes no parameters).
ALTER TABLE {table} ATTACH PARTITION {partition} FOR VALUES FROM ({from_at}) TO ({to_at})

-- name: list_partitions
-- The outbox's partitions and their ranges (read with the session's TimeZone; the
-- range texts are cast back in the same session, so no zone is lost). from_at is NULL
-- for MINVALUE, to_at for MAXVALUE; is_default for the default partition.
SELECT n.nspname, c.relname,
       pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' AS is_default,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz AS from_at,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz AS to_at
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE i.inhparent = %(table)s::regclass
ORDER BY from_at NULLS FIRST

-- name: partition_unfinished
-- Does a partition hold a row the relay or an operator still has to handle? Three
-- probes of the partition's own partial indexes (pending, processing, dead): cheap
-- whatever the partition's size.
SELECT EXISTS (SELECT 1 FROM {partition} WHERE status = 'pending')
    OR EXISTS (SELECT 1 FROM {partition} WHERE status = 'processing')
    OR EXISTS (SELECT 1 FROM {partition} WHERE status = 'dead')

-- name: partition_dead_rows
SELECT count(*) FROM {partition} WHERE status = 'dead'

-- name: detach_partition
-- Not CONCURRENTLY: PostgreSQL refuses DETACH ... CONCURRENTLY while the table has a
-- default partition. The ACCESS EXCLUSIVE lock it takes on the outbox is held for a
-- catalog change only; waiting for it is bounded by the lock_timeout.
ALTER TABLE {table} DETACH PARTITION {partition}

-- name: drop_partition
DROP TABLE {partition}

-- name: default_partition_rows
-- Rows in the default partition (normally none), counted up to %(cap)s.
SELECT count(*) FROM (SELECT 1 FROM {partition} LIMIT %(cap)s) AS d

-- name: maintenance_lock_timeout
-- Every maintenance DDL waits at most this long for its lock (then it is retried with
-- backoff): writers that queue behind a DDL waiting for a lock wait no longer.
SELECT set_config('lock_timeout', %(lock_timeout)s, true)

-- name: maintenance_try_lock
-- One maintainer per table at a time (relays' periodic maintenance, CronJobs).
SELECT pg_try_advisory_lock(hashtextextended(%(key)s, 0))

-- name: maintenance_unlock
SELECT pg_advisory_unlock(hashtextextended(%(key)s, 0))

-- name: utc_session
SET TIME ZONE 'UTC'

-- Converting an existing plain outbox (migrate --convert-to-partitioned, migrate_ops.py).
-- The plain table becomes the partition of everything before a boundary; no row moves.
-- What takes long runs first, without blocking writers: two indexes built CONCURRENTLY
-- and a range check validated under SHARE UPDATE EXCLUSIVE. Then one short transaction
-- under ACCESS EXCLUSIVE swaps the names and attaches the table (catalog changes only).

-- name: convert_index_id_created_at
-- The partition's match for the partitioned table's primary key (id, created_at).
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {table} (id, created_at)

-- name: convert_index_dedup_plain
-- The partition's match for the partitioned table's (non-unique) dedup index.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {table} (dedup_key) WHERE dedup_key IS NOT NULL

-- name: convert_range_check_exists
SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = %(table)s::regclass AND conname = %(constraint)s)

-- name: convert_add_range_check
-- Every row of the plain table was created before {boundary} (a timestamptz literal at
-- least one partition width ahead): NOT VALID takes its lock for a catalog change only.
ALTER TABLE {table} ADD CONSTRAINT {constraint} CHECK (created_at < {boundary}) NOT VALID

-- name: convert_range_check_bound
-- The boundary of a range check added by an earlier, interrupted conversion.
SELECT (regexp_match(pg_get_constraintdef(oid), '''([^'']+)'''))[1]::timestamptz
FROM pg_constraint WHERE conrelid = %(table)s::regclass AND conname = %(constraint)s

-- name: convert_validate_range_check
-- Reads the whole table under SHARE UPDATE EXCLUSIVE: writers and relays go on. Once
-- valid, ATTACH trusts it and does not scan the table under its own lock.
ALTER TABLE {table} VALIDATE CONSTRAINT {constraint}

-- name: convert_lock
LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE

-- name: rename_table
ALTER TABLE {table} RENAME TO {new_name}

-- name: rename_index
ALTER INDEX {index} RENAME TO {new_name}

-- name: drop_primary_key
-- The plain table's primary key on id (and its index) gives way to the one on
-- (id, created_at), which serves every lookup by id as well (its first column).
ALTER TABLE {partition} DROP CONSTRAINT {constraint}

-- name: primary_key_name
SELECT conname FROM pg_constraint WHERE conrelid = %(table)s::regclass AND contype = 'p'

-- name: drop_identity
-- A partition takes its ids from the partitioned table's identity, never its own.
ALTER TABLE {partition} ALTER COLUMN id DROP IDENTITY

-- name: check_constraints
-- The plain table's two checks (status values; a lease exactly while processing), by name.
SELECT conname, pg_get_constraintdef(oid) LIKE '%%lease_until%%' AS is_lease
FROM pg_constraint WHERE conrelid = %(table)s::regclass AND contype = 'c' AND conname <> %(range_check)s

-- name: max_id_of
SELECT coalesce(max(id), 0) FROM {partition}

-- name: primary_key_using_index
-- ATTACH pairs the partitioned table's primary key with the partition's.
ALTER TABLE {partition} ADD CONSTRAINT {constraint} PRIMARY KEY USING INDEX {index}

-- name: attach_first_partition
ALTER TABLE {table} ATTACH PARTITION {partition} FOR VALUES FROM (MINVALUE) TO ({to_at})

-- name: drop_trigger_of
DROP TRIGGER IF EXISTS {trigger} ON {partition}

-- name: table_privileges
-- Privileges granted on the plain table (its owner's own left out): the partitioned
-- table gets the same, so writers, relays and operators keep working.
SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END, a.privilege_type
FROM pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
WHERE c.oid = %(table)s::regclass AND a.grantee <> c.relowner

-- name: grant_privilege
-- {privilege}: a privilege name read from aclexplode; {grantee}: a role or PUBLIC.
GRANT {privilege} ON {table} TO {grantee}

-- Building a missing index of a partitioned outbox (migrate, e.g. the ordering indexes
-- once relay.ordered_event_types is set): CREATE INDEX CONCURRENTLY does not exist for a
-- partitioned table, and a plain build would block writers for its whole length. So:
-- the index on the partitioned table alone (ON ONLY: invalid, a catalog change under a
-- brief lock and lock_timeout), the same index built CONCURRENTLY on each partition,
-- each attached to it; the index turns valid once every partition's is attached.

-- name: attach_index
ALTER INDEX {index} ATTACH PARTITION {partition_index}

-- name: partition_indexes
-- The partitions' indexes already attached to one index of the partitioned table.
SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%(index)s)

-- name: create_partitions_ahead_at_apply
-- migrate --print-sql: the current partition and {premake} after it, computed when the
-- script is applied (from its transaction's now(), as migrate computes them), not when
-- it was printed: the same epoch-aligned ranges of {width_seconds} seconds, the same
-- names ({name_prefix} and the start in UTC as {name_format}), the same storage
-- parameters ({storage}), each made empty and then attached (as maintenance does).
-- {schema}: the table's schema, or '' for one on the search_path.
DO $partitions$
DECLARE
    width constant bigint := {width_seconds};
    first_start constant timestamptz := to_timestamp(floor(extract(epoch FROM now()) / width) * width);
    range_start timestamptz;
    range_end timestamptz;
    partition_name text;
    qualified text;
BEGIN
    FOR i IN 0..{premake} LOOP
        range_start := first_start + make_interval(secs => i * width);
        range_end := range_start + make_interval(secs => width);
        partition_name := {name_prefix} || to_char(range_start AT TIME ZONE 'UTC', {name_format});
        qualified := CASE WHEN {schema} = '' THEN format('%%I', partition_name)
                          ELSE format('%%I.%%I', {schema}, partition_name) END;
        EXECUTE format('CREATE TABLE %%s (LIKE %%s INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (%%s)',
                       qualified, {table_text}, {storage});
        EXECUTE format('ALTER TABLE %%s ATTACH PARTITION %%s FOR VALUES FROM (%%L) TO (%%L)',
                       {table_text}, qualified, range_start, range_end);
    END LOOP;
END
$partitions$
