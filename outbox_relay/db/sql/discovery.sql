-- Discovery: the databases of a cluster that a process serving many sources serves.
-- One named section per statement ("-- name: <name>"); names are unique across sql/*.sql.
-- Parameters use psycopg's %(name)s style, so a literal percent sign is written %%.

-- name: list_databases
-- The databases matching discovery.database_pattern that accept connections; templates excluded.
SELECT datname FROM pg_database
WHERE datname LIKE %(pattern)s AND datallowconn AND NOT datistemplate
ORDER BY datname
