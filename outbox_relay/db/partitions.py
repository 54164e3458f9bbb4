"""A time-partitioned outbox ([partitioning]): which partitions should exist, and the
maintenance that makes it so (``outbox-relay maintain``, and a running relay every
``partitioning.maintain_interval_seconds``).

The rules it keeps:

- Partitions are ranges of ``created_at``, aligned to the Unix epoch in UTC (a day
  partition runs from 00:00 UTC), named after their start (``<table>_p2026120300``;
  to the minute, ``<table>_p202612030005``, for widths of whole minutes).
  The current one and ``premake`` after it exist; a default partition catches any row
  no range covers, so a writer never fails because maintenance fell behind.
- A partition is created as a separate empty table and then ATTACHed (SHARE UPDATE
  EXCLUSIVE on the outbox: writers, claims and finalizes go on), never with CREATE
  TABLE ... PARTITION OF (ACCESS EXCLUSIVE on the outbox).
- A partition whose whole range is older than ``retention`` is dropped (DETACH, then
  DROP, in one transaction) only while it holds no pending, processing or dead row;
  the check is made again under the DETACH's lock, so no row the relay or an operator
  still has to handle is ever dropped. A partition holding dead rows is kept until
  they are retried or skipped (the dead-row tools then work as on any table).
- Every DDL runs with a short ``lock_timeout`` and is retried with backoff: a long
  transaction holding a lock on the outbox makes the DDL give up, never makes writers
  queue behind it for longer than the lock_timeout.
- One maintainer per table at a time (a session advisory lock; others skip the round).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ..config import Settings
from ..errors import ConfigError
from .autovacuum import check_overrides, plan
from .retention import RetentionOps
from .schema import FILLFACTOR, TableSql

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Rows of the default partition counted at most (the gauge says "at least this many").
DEFAULT_ROWS_CAP = 1_000_000


@dataclass(frozen=True)
class PartitionLayout:
    """What [partitioning] asks of one outbox table."""

    interval_seconds: int
    premake: int
    retention_seconds: float
    lock_timeout_ms: int = 2000
    ddl_attempts: int = 5
    #: Storage parameters of every partition: the queue's fillfactor and autovacuum values.
    storage: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> PartitionLayout | None:
        p = settings.partitioning
        if not p.enabled:
            return None
        return cls(
            interval_seconds=p.interval_seconds,
            premake=p.premake,
            retention_seconds=p.retention_seconds,
            lock_timeout_ms=p.lock_timeout_ms,
            ddl_attempts=p.ddl_attempts,
            storage=partition_storage({k: str(v) for k, v in settings.database.autovacuum.items()}),
        )


def partition_storage(autovacuum: Mapping[str, str]) -> dict[str, str]:
    """A new partition's storage parameters: the layout's fillfactor, the queue's
    autovacuum defaults and the operator's database.autovacuum values (a partitioned
    table has no storage of its own to carry them)."""
    changes, _record, _kept = plan({}, {}, check_overrides(autovacuum))
    storage = {"fillfactor": str(FILLFACTOR)}
    storage.update({c.parameter: c.value for c in changes if c.value is not None})
    return storage


def range_start(at: datetime, interval_seconds: int) -> datetime:
    """The start of the partition holding ``at`` (epoch-aligned, UTC)."""
    seconds = int((at - _EPOCH).total_seconds() // interval_seconds) * interval_seconds
    return _EPOCH + timedelta(seconds=seconds)


def wanted_ranges(now: datetime, interval_seconds: int, premake: int) -> list[tuple[datetime, datetime]]:
    """The current partition's range and the ``premake`` ranges after it."""
    start = range_start(now, interval_seconds)
    step = timedelta(seconds=interval_seconds)
    return [(start + i * step, start + (i + 1) * step) for i in range(premake + 1)]


def partition_suffix(start: datetime, interval_seconds: int = 3600) -> str:
    """A partition's name after its start: to the hour (``p2026120307``) for widths of
    whole hours or days, to the minute (``p202612030705``) for the others. Bounds are
    epoch-aligned multiples of the width (a whole number of minutes), so within one
    table every name is unique and the names sort as their ranges do."""
    pattern = "%Y%m%d%H" if interval_seconds % 3600 == 0 else "%Y%m%d%H%M"
    return "p" + start.astimezone(UTC).strftime(pattern)


@dataclass(frozen=True)
class Partition:
    name: str  # unqualified (a partition lives in its table's schema)
    is_default: bool
    from_at: datetime | None
    to_at: datetime | None


@dataclass
class MaintenanceResult:
    """What one maintenance round did; ``ok`` when every DDL it meant to run ran."""

    skipped: str | None = None  # another maintainer held the table's lock
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # past retention, holding rows to handle (one line each)
    failed: list[str] = field(default_factory=list)  # one line each
    partitions: int = 0  # after the round, the default partition included
    default_rows: int = 0
    dedup_keys_purged: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self) -> list[str]:
        out = [f"created partition {n}" for n in self.created]
        out += [f"dropped partition {n}" for n in self.dropped]
        out += [f"kept {k}" for k in self.kept]
        out += [f"FAILED: {f}" for f in self.failed]
        if self.dedup_keys_purged:
            out.append(f"purged {self.dedup_keys_purged} dedup keys older than the retention")
        if self.default_rows:
            out.append(
                f"the default partition holds {self.default_rows} rows: no partition covers their created_at "
                "(see docs/how-to/partitioned-outbox.md)"
            )
        return out


def _is_lock_timeout(exc: BaseException) -> bool:
    return isinstance(exc, pg_errors.LockNotAvailable)


class PartitionOps(RetentionOps):
    # --- partitions ------------------------------------------------------------------
    def is_partitioned(self) -> bool:
        with self._mapped("partitions"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("is_partitioned"), {"table": self.sql.regclass_text}).fetchone()
            return bool(row and row[0])

    def partitions(self) -> list[Partition]:
        with self._mapped("partitions"), self._pool.connection() as conn:
            return _list_partitions(conn, self.sql)

    def default_partition_rows(self) -> int:
        with self._mapped("partitions"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.partition_query("default_partition_rows", self.sql.partition_name("default")),
                {"cap": DEFAULT_ROWS_CAP},
            ).fetchone()
            return int(row[0]) if row else 0

    def maintain_partitions(
        self, layout: PartitionLayout, *, sleep: Callable[[float], object] = time.sleep
    ) -> MaintenanceResult:
        """One maintenance round: partitions ahead, expired ones dropped, dedup keys
        older than the retention purged. ConfigError when the table is not partitioned."""
        if self.transaction_pooler:
            # The maintainer's session advisory lock needs one server connection
            # throughout, which a transaction pooler does not give.
            raise ConfigError(
                "partition maintenance needs a direct connection to PostgreSQL, not a transaction pooler: run "
                "`outbox-relay maintain` with database.dsn pointing at the database and "
                "database.transaction_pooler = false"
            )
        result = MaintenanceResult()
        key = "outbox-relay-maintain:" + self.table
        with self._mapped("maintain"), self._maintenance_connection() as conn:
            row = conn.execute(self.sql.query("is_partitioned"), {"table": self.sql.regclass_text}).fetchone()
            if not (row and row[0]):
                raise ConfigError(
                    f"table {self.table!r} is not partitioned: [partitioning] applies to a table `outbox-relay "
                    "migrate` created with it (converting an existing table: docs/how-to/partitioned-outbox.md)"
                )
            got = conn.execute(self.sql.query("maintenance_try_lock"), {"key": key}).fetchone()
            if not (got and got[0]):
                result.skipped = "another maintainer of this table is running"
                return result
            try:
                conn.execute(self.sql.query("utc_session"))
                self._create_ahead(conn, layout, result, sleep)
                self._drop_expired(conn, layout, result, sleep)
                result.partitions = len(_list_partitions(conn, self.sql))
                count = conn.execute(
                    self.sql.partition_query("default_partition_rows", self.sql.partition_name("default")),
                    {"cap": DEFAULT_ROWS_CAP},
                ).fetchone()
                result.default_rows = int(count[0]) if count else 0
            finally:
                conn.execute(self.sql.query("maintenance_unlock"), {"key": key})
        result.dedup_keys_purged = self._purge_old_keys(layout.retention_seconds)
        return result

    def _maintenance_connection(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._dsn, **dict(self._conn_kwargs, autocommit=True))

    def _create_ahead(
        self,
        conn: psycopg.Connection[Any],
        layout: PartitionLayout,
        result: MaintenanceResult,
        sleep: Callable[[float], object],
    ) -> None:
        now = database_now(conn, self.sql)
        existing = _list_partitions(conn, self.sql)
        for start, end in wanted_ranges(now, layout.interval_seconds, layout.premake):
            overlapping = [
                p
                for p in existing
                if not p.is_default and (p.from_at is None or p.from_at < end) and (p.to_at is None or p.to_at > start)
            ]
            if overlapping:
                # Covered already (by a partition of this range, or by the table a
                # conversion attached over everything before its boundary): nothing to do.
                covered = any(
                    (p.from_at is None or p.from_at <= start) and (p.to_at is None or p.to_at >= end)
                    for p in overlapping
                )
                if not covered:
                    result.failed.append(
                        f"range {start.isoformat()} to {end.isoformat()} overlaps partition "
                        f"{overlapping[0].name} of another width: left to the operator"
                    )
                continue
            name = self.sql.partition_name(partition_suffix(start, layout.interval_seconds))

            def create(name: str = name, start: datetime = start, end: datetime = end) -> None:
                create_partition(conn, self.sql, layout, name, start, end)

            error = self._ddl(conn, layout, create, sleep)
            if error is None:
                result.created.append(name)
            else:
                result.failed.append(f"create {name}: {error}")

    def _drop_expired(
        self,
        conn: psycopg.Connection[Any],
        layout: PartitionLayout,
        result: MaintenanceResult,
        sleep: Callable[[float], object],
    ) -> None:
        cutoff = database_now(conn, self.sql) - timedelta(seconds=layout.retention_seconds)
        for part in _list_partitions(conn, self.sql):
            if part.is_default or part.to_at is None or part.to_at > cutoff:
                continue
            if self._unfinished(conn, part.name):  # a first look without any lock
                result.kept.append(self._kept_line(conn, part.name))
                continue
            kept: list[bool] = []

            def detach_and_drop(name: str = part.name, kept: list[bool] = kept) -> None:
                kept.clear()
                conn.execute(self.sql.partition_query("detach_partition", name))
                # Again under the DETACH's ACCESS EXCLUSIVE lock on the partition: a row
                # written or retried since the first look is seen here, and kept.
                if self._unfinished(conn, name):
                    kept.append(True)
                    raise _KeepPartition
                conn.execute(self.sql.partition_query("drop_partition", name))

            error = self._ddl(conn, layout, detach_and_drop, sleep)
            if kept:
                result.kept.append(self._kept_line(conn, part.name))
            elif error is None:
                result.dropped.append(part.name)
            else:
                result.failed.append(f"drop {part.name}: {error}")

    def _unfinished(self, conn: psycopg.Connection[Any], name: str) -> bool:
        row = conn.execute(self.sql.partition_query("partition_unfinished", name)).fetchone()
        return bool(row and row[0])

    def _kept_line(self, conn: psycopg.Connection[Any], name: str) -> str:
        row = conn.execute(self.sql.partition_query("partition_dead_rows", name)).fetchone()
        dead = int(row[0]) if row else 0
        why = f"{dead} dead rows (retry or skip them)" if dead else "rows still to deliver"
        return f"partition {name} past the retention: it holds {why}"

    def _ddl(
        self,
        conn: psycopg.Connection[Any],
        layout: PartitionLayout,
        change: Callable[[], None],
        sleep: Callable[[float], object],
    ) -> str | None:
        """One DDL change in its own transaction under the lock_timeout, retried with
        jittered backoff while its lock is not available. None when it ran (or was
        deliberately rolled back), else why it did not."""
        delay = 0.2
        for attempt in range(1, layout.ddl_attempts + 1):
            try:
                with conn.transaction():
                    conn.execute(
                        self.sql.query("maintenance_lock_timeout"), {"lock_timeout": f"{layout.lock_timeout_ms}ms"}
                    )
                    change()
                return None
            except _KeepPartition:
                return None
            except pg_errors.LockNotAvailable:
                if attempt == layout.ddl_attempts:
                    return (
                        f"a lock on {self.table!r} was not available within {layout.lock_timeout_ms} ms, "
                        f"{attempt} times: a long transaction holds the table; the next round retries"
                    )
                sleep(random.uniform(delay / 2, delay))
                delay = min(delay * 2, 5.0)
            except pg_errors.CheckViolation as exc:  # the default partition holds rows of the range
                return f"{exc.diag.message_primary or exc}"
        return None  # pragma: no cover - the loop returns

    def _purge_old_keys(self, retention_seconds: float) -> int:
        """Dedup keys older than the retention whose row is gone (as `purge` does)."""
        total, after = 0, ""
        for _ in range(10_000):  # bounded: 10 000 chunks of 5 000 keys a round
            n, following = self.purge_dedup_keys_chunk(retention_seconds, 5000, after)
            total += n
            if following is None:
                break
            after = following
        return total


class _KeepPartition(Exception):
    """Rolls back a DETACH that found rows still to handle (the partition stays)."""


def storage_clause(layout: PartitionLayout) -> sql.Composed:
    return sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.SQL(param), sql.Literal(value))  # names checked by autovacuum.py
        for param, value in layout.storage.items()
    )


def create_partition(
    conn: psycopg.Connection[Any],
    table_sql: TableSql,
    layout: PartitionLayout,
    name: str,
    start: datetime,
    end: datetime,
) -> None:
    """A new empty table attached as the partition [start, end) (in the caller's transaction)."""
    conn.execute(table_sql.partition_query("create_partition_table", name, storage=storage_clause(layout)))
    conn.execute(
        table_sql.partition_query("attach_partition", name, from_at=sql.Literal(start), to_at=sql.Literal(end))
    )


def create_default_partition(conn: psycopg.Connection[Any], table_sql: TableSql, layout: PartitionLayout) -> bool:
    """The default partition, when missing (True: created now)."""
    name = table_sql.partition_name("default")
    if any(p.is_default for p in _list_partitions(conn, table_sql)):
        return False
    conn.execute(table_sql.partition_query("create_default_partition", name, storage=storage_clause(layout)))
    return True


def create_ahead_in_transaction(
    conn: psycopg.Connection[Any], table_sql: TableSql, layout: PartitionLayout
) -> list[str]:
    """migrate on a table it has just created: the current partition and those ahead."""
    names = []
    for start, end in wanted_ranges(database_now(conn, table_sql), layout.interval_seconds, layout.premake):
        name = table_sql.partition_name(partition_suffix(start, layout.interval_seconds))
        create_partition(conn, table_sql, layout, name, start, end)
        names.append(name)
    return names


def database_now(conn: psycopg.Connection[Any], table_sql: TableSql) -> datetime:
    row = conn.execute(table_sql.query("database_now")).fetchone()
    assert row is not None
    value: datetime = row[0]
    return value.astimezone(UTC)


def _list_partitions(conn: psycopg.Connection[Any], table_sql: TableSql) -> list[Partition]:
    rows = conn.execute(table_sql.query("list_partitions"), {"table": table_sql.regclass_text}).fetchall()
    return [
        Partition(
            name=str(relname),
            is_default=bool(is_default),
            from_at=from_at.astimezone(UTC) if from_at is not None else None,
            to_at=to_at.astimezone(UTC) if to_at is not None else None,
        )
        for _schema, relname, is_default, from_at, to_at in rows
    ]
