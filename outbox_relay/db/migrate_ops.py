"""MigrateOps: the table's layout. Create and migrate the table (numbered steps of
db/migrations.py under a session lock), converge its indexes, and the checks that
tell a relay whether the table fits its settings."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from ..errors import ConfigError, DatabaseError, SchemaMissing
from . import migrations
from .convert import convert_to_partitioned
from .partitions import PartitionLayout
from .schema import BASE_INDEXES, OBSOLETE_INDEXES, ORDERING_INDEXES
from .store_core import StoreCore

MIGRATE_NEEDS_DIRECT = (
    "migrate needs a direct connection to PostgreSQL, not a transaction pooler (it holds a session "
    "advisory lock and builds indexes CONCURRENTLY without a statement timeout): run it with "
    "database.dsn pointing at the database itself and database.transaction_pooler = false"
)

#: How often migrate retries its transactional part when a lock is not available.
_MIGRATE_LOCK_ATTEMPTS = 3


class MigrateOps(StoreCore):
    # --- schema ----------------------------------------------------------------------
    def migrate(
        self,
        *,
        notify_trigger: bool = True,
        ordering: bool = False,
        on_done: str = "keep",
        drop_ordering_indexes: bool = False,
        lock_wait_seconds: float = 600.0,
        autovacuum: Mapping[str, str] | None = None,
        recreate_from_id: int | None = None,
        partitioning: PartitionLayout | None = None,
        convert_to_partitioned: bool = False,
    ) -> list[str]:
        """Create table, indexes and the wake-up trigger; bring an existing table to this
        version's index layout. Safe to run again, and while relays and writers run:
        on an existing table indexes are built and dropped CONCURRENTLY (outside any
        transaction, no lock that blocks writers). ``ordering``: relay.ordered_event_types
        is set, so the ordering indexes must exist; without it they are left alone
        (other relays may be ordered) unless ``drop_ordering_indexes``. ``on_done``
        (relay.on_done) becomes the table's mode, which every relay's finalize reads.
        ``autovacuum`` (database.autovacuum): the operator's autovacuum parameters; the
        queue defaults of autovacuum.py fill in the rest without overwriting a value
        of the table's own. ``recreate_from_id``: a table dropped while its migration
        record was kept is recreated, its ids starting there; without it such a table is
        refused (SchemaMissing naming the option: see migrations.py).
        Layout changes are numbered steps applied once per table and recorded with it;
        what depends on this run's options runs every time (db/migrations.py states the
        rule). Returns notes for the operator (one line each)."""
        if on_done not in ("keep", "delete"):
            raise ValueError(f"on_done must be 'keep' or 'delete', not {on_done!r}")
        if self.transaction_pooler:
            # Through a transaction pooler the session lock could be taken on one server
            # connection and released on another, and the DDL connection's startup option
            # (no statement_timeout for CREATE INDEX CONCURRENTLY) is refused.
            raise ConfigError(MIGRATE_NEEDS_DIRECT)
        notes: list[str] = []
        lock_key = "outbox-relay-migrate:" + self.table
        with self._mapped("migrate"), self._ddl_connection() as conn:
            # A session lock taken by polling: a migration waiting for another must not
            # hold a snapshot, or the other's CREATE INDEX CONCURRENTLY would wait for it.
            deadline = time.monotonic() + lock_wait_seconds
            while not self._try_lock(conn, lock_key):
                if time.monotonic() > deadline:
                    raise DatabaseError(
                        f"migrate: another migration of {self.table!r} held its lock for {lock_wait_seconds:.0f}s"
                    )
                time.sleep(0.2)
            try:
                wanted = [*BASE_INDEXES, *(ORDERING_INDEXES if ordering else ())]
                if convert_to_partitioned:
                    notes += self._convert(conn, partitioning, wanted)
                for attempt in range(1, _MIGRATE_LOCK_ATTEMPTS + 1):
                    try:
                        notes += self._migrate_schema(
                            conn,
                            on_done=on_done,
                            notify_trigger=notify_trigger,
                            wanted=wanted,
                            autovacuum=autovacuum or {},
                            recreate_from_id=recreate_from_id,
                            partitioning=partitioning,
                        )
                        break
                    except pg_errors.LockNotAvailable:
                        if attempt == _MIGRATE_LOCK_ATTEMPTS:
                            raise DatabaseError(
                                f"migrate: a lock on {self.table!r} was not available within 5 s, "
                                f"{attempt} times: a long transaction holds the table; retry when it ended"
                            ) from None
                        time.sleep(1.0)
                notes += self._converge_indexes(
                    conn, wanted, ordering=ordering, drop_ordering_indexes=drop_ordering_indexes
                )
            finally:
                conn.execute(self.sql.query("migrate_unlock"), {"key": lock_key})
        return notes

    def _migrate_schema(
        self,
        conn: psycopg.Connection[Any],
        *,
        on_done: str,
        notify_trigger: bool,
        wanted: Sequence[str],
        autovacuum: Mapping[str, str],
        recreate_from_id: int | None,
        partitioning: PartitionLayout | None = None,
    ) -> list[str]:
        """The transactional part of migrate (db/migrations.py: the numbered steps not yet
        recorded for this table, then the every-run steps), under a lock timeout; it is
        retried as a whole."""
        with conn.transaction():
            conn.execute(self.sql.query("migrate_lock_timeout"))
            run = migrations.MigrationRun(
                conn,
                self.sql,
                on_done=on_done,
                notify_trigger=notify_trigger,
                wanted_indexes=wanted,
                autovacuum=autovacuum,
                recreate_from_id=recreate_from_id,
                partitioning=partitioning,
            )
            migrations.apply(run)
        return run.notes

    def _convert(
        self, conn: psycopg.Connection[Any], partitioning: PartitionLayout | None, wanted: Sequence[str]
    ) -> list[str]:
        """migrate --convert-to-partitioned (db/convert.py): only a plain table that
        exists and is at this version's layout; a partitioned one is left as it is."""
        if partitioning is None:
            raise ConfigError("--convert-to-partitioned needs [partitioning] (partitioning.interval)")
        if not self._exists(conn):
            return []  # a new table: the migrate below creates it partitioned
        row = conn.execute(self.sql.query("is_partitioned"), {"table": self.sql.regclass_text}).fetchone()
        if row and row[0]:
            return [f"{self.table} is partitioned already"]
        if not self._schema_current(conn):
            raise ConfigError(
                f"table {self.table!r} has the layout of an older version: run `outbox-relay migrate` first, "
                "then convert"
            )
        return convert_to_partitioned(conn, self.sql, partitioning, wanted_indexes=list(wanted))

    def _converge_indexes(
        self, conn: psycopg.Connection[Any], wanted: Sequence[str], *, ordering: bool, drop_ordering_indexes: bool
    ) -> list[str]:
        """Existing table: build missing (or invalid) indexes of the layout and drop the
        ones nothing reads any more, each CONCURRENTLY in autocommit."""
        notes: list[str] = []
        valid = self._index_validity(conn)
        row = conn.execute(self.sql.query("is_partitioned"), {"table": self.sql.regclass_text}).fetchone()
        partitioned = bool(row and row[0])
        if partitioned:
            for key in wanted:
                if not valid.get(self.sql.index_name(key)):
                    self._build_partitioned_index(conn, key)
                    notes.append(f"created index {self.sql.index_name(key)} (on each partition, concurrently)")
            return notes  # obsolete indexes never existed on a partitioned outbox
        for key in wanted:
            name = self.sql.index_name(key)
            if valid.get(name) is False:  # left behind by an interrupted CREATE INDEX CONCURRENTLY
                conn.execute(self.sql.drop_index(key, concurrently=True))
                valid.pop(name)
            if name not in valid:
                conn.execute(self.sql.index_ddl(key, concurrently=True))
                notes.append(f"created index {name}")
        droppable = [*OBSOLETE_INDEXES, *(ORDERING_INDEXES if drop_ordering_indexes and not ordering else ())]
        for key in droppable:
            name = self.sql.index_name(key)
            if name in valid:
                conn.execute(self.sql.drop_index(key, concurrently=True))
                notes.append(f"dropped index {name} (no statement of this layout reads it)")
        unused = [self.sql.index_name(k) for k in ORDERING_INDEXES if self.sql.index_name(k) in valid]
        if not ordering and not drop_ordering_indexes and unused:
            notes.append(
                f"relay.ordered_event_types is empty but the ordering indexes {', '.join(unused)} exist "
                "(kept: other relays may deliver in order); drop them with "
                "`outbox-relay migrate --drop-ordering-indexes` to save their WAL"
            )
        return notes

    def _build_partitioned_index(self, conn: psycopg.Connection[Any], key: str) -> None:
        """One missing index of a partitioned outbox (sql/partitions.sql says how); each
        step is idempotent, so an interrupted build is finished by the next migrate."""
        name = self.sql.index_name(key)
        qualified = self.sql.partition_ident(name).as_string(None)

        def on_only() -> None:
            conn.execute(self.sql.query("migrate_lock_timeout"))
            conn.execute(self.sql.partitioned_index_ddl(key, partition=None))

        for attempt in range(1, _MIGRATE_LOCK_ATTEMPTS + 1):
            try:
                with conn.transaction():
                    on_only()
                break
            except pg_errors.LockNotAvailable:
                if attempt == _MIGRATE_LOCK_ATTEMPTS:
                    raise DatabaseError(
                        f"migrate: a lock on {self.table!r} was not available within 5 s, {attempt} times: "
                        "a long transaction holds the table; retry when it ended"
                    ) from None
                time.sleep(1.0)
        attached = {str(r[0]) for r in conn.execute(self.sql.query("partition_indexes"), {"index": qualified})}
        for part in self.partitions_on(conn):
            part_index = self.sql.partition_index_name(part, key)
            if part_index in attached:
                continue
            conn.execute(self.sql.partitioned_index_ddl(key, partition=part))
            conn.execute(
                self.sql.query(
                    "attach_index",
                    index=self.sql.partition_ident(name),
                    partition_index=self.sql.partition_ident(part_index),
                )
            )

    def partitions_on(self, conn: psycopg.Connection[Any]) -> list[str]:
        rows = conn.execute(self.sql.query("list_partitions"), {"table": self.sql.regclass_text}).fetchall()
        return [str(r[1]) for r in rows]

    @contextlib.contextmanager
    def _ddl_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A dedicated autocommit connection without statement_timeout: building an
        index on a large table takes as long as it takes (a timeout would leave an
        invalid index behind)."""
        kwargs = dict(self._conn_kwargs, options="-c statement_timeout=0")
        with psycopg.connect(self._dsn, **kwargs) as conn:
            yield conn

    def _try_lock(self, conn: psycopg.Connection[Any], key: str) -> bool:
        row = conn.execute(self.sql.query("migrate_try_lock"), {"key": key}).fetchone()
        return bool(row and row[0])

    def _exists(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(self.sql.query("table_exists"), {"table": self.sql.regclass_text}).fetchone()
        return bool(row and row[0])

    def _state_has_mode(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            self.sql.query("state_has_on_done"), {"state_table": self.sql.regclass_of("relay_state")}
        ).fetchone()
        return bool(row and row[0])

    def _index_validity(self, conn: psycopg.Connection[Any]) -> dict[str, bool]:
        return {
            name: bool(ok)
            for name, ok in conn.execute(self.sql.query("table_indexes"), {"table": self.sql.regclass_text}).fetchall()
        }

    def missing_ordering_indexes(self) -> list[str]:
        """Ordering indexes the table lacks (or has only invalid): an ordered relay
        without them would claim by scanning the table."""
        with self._mapped("check indexes"), self._pool.connection() as conn:
            valid = self._index_validity(conn)
        return [self.sql.index_name(k) for k in ORDERING_INDEXES if not valid.get(self.sql.index_name(k))]

    def run_problem(self, *, ordering: bool, on_done: str) -> tuple[str, bool] | None:
        """For ``run``: why this table does not fit the relay's settings yet, as
        (message, waitable), or None. Waitable: the table is from an older version, or
        lacks the ordering indexes (a migrate may be building them right now, CREATE
        INDEX CONCURRENTLY commits after the table): the relay's start-up waits for
        them. Not waitable: another on_done mode, a configuration error. A database
        that does not answer, or a missing table, is check_ready's. Uses its own
        short-lived connection, not the pool."""
        try:
            with self._connect_once() as conn:
                if not self._exists(conn):
                    return None
                if not self._schema_current(conn):
                    return (
                        f"table {self.table!r} has the layout of an older version: run `outbox-relay migrate`",
                        True,
                    )
                valid = self._index_validity(conn)
                row = conn.execute(self.sql.query("table_mode")).fetchone()
        except psycopg.Error:
            return None
        mode = str(row[0]) if row else "keep"
        if mode != on_done:
            return (
                f"relay.on_done is {on_done!r} but table {self.table!r} is set up for {mode!r}: "
                "run `outbox-relay migrate` with the same settings first",
                False,
            )
        missing = [self.sql.index_name(k) for k in ORDERING_INDEXES if not valid.get(self.sql.index_name(k))]
        if ordering and missing:
            return (
                f"table {self.table!r} lacks the ordering indexes ({', '.join(missing)}) that "
                "relay.ordered_event_types needs: run `outbox-relay migrate` with the same settings",
                True,
            )
        return None

    def on_done_mode(self) -> str:
        """The table's relay.on_done mode (keep | delete), as migrate set it."""
        with self._mapped("table mode"), self._pool.connection() as conn:
            if not self._state_has_mode(conn):  # set up by an older version, which kept done rows
                return "keep"
            row = conn.execute(self.sql.query("table_mode")).fetchone()
            return str(row[0]) if row else "keep"

    def table_exists(self) -> bool:
        with self._mapped("check table"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("table_exists"), {"table": self.sql.regclass_text}).fetchone()
            return bool(row and row[0])

    def require_table(self) -> None:
        if not self.table_exists():
            raise SchemaMissing(f"table {self.table!r} does not exist: run `outbox-relay migrate` first")
