"""The databases of a cluster that ``[discovery]`` turns into sources (sql/discovery.sql)."""

from __future__ import annotations

import psycopg

from ..errors import DatabaseUnavailable
from .schema import EXECUTABLE
from .store_core import redact_dsn


def list_databases(dsn: str, pattern: str, *, connect_timeout_seconds: float) -> list[str]:
    """Names of the cluster's databases matching the LIKE ``pattern`` (that accept
    connections; templates excluded), sorted. ``DatabaseUnavailable`` (DSN redacted)
    when the cluster cannot be listed."""
    try:
        with psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=max(1, round(connect_timeout_seconds)),
            application_name="outbox-relay-discovery",
        ) as conn:
            rows = conn.execute(EXECUTABLE["list_databases"], {"pattern": pattern}).fetchall()
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(f"discovery: cannot list the databases: {redact_dsn(first, dsn)}") from None
    return [str(row[0]) for row in rows]
