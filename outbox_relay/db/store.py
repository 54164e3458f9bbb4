"""OutboxStore: the only module that speaks SQL to the outbox table.

Every method borrows a pooled connection for one short statement or transaction
and gives it back: no connection is held while a batch is being published.
psycopg errors are mapped to the project's own exceptions by ``_mapped``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors
from psycopg import sql

from ..core.filters import DeadFilter
from ..core.ordering import OrderingRule
from ..errors import (
    CommitOutcomeUnknown,
    ConfigError,
    DatabaseError,
    DatabaseRefused,
    DatabaseUnavailable,
    SchemaMissing,
)
from ..model import Claimed as Claimed  # re-exported: callers that read claims import it from the store
from ..model import FinalizeItem as FinalizeItem  # re-exported with Claimed
from . import migrations
from .claim_cursor import ClaimOutcome, ClaimPlan, DueCursor
from .pooler import PoolerConnection, configure_bound, execute_with_settings
from .schema import BASE_INDEXES, EXECUTABLE, OBSOLETE_INDEXES, ORDERING_INDEXES, TableSql
from .vacuum_health import VacuumFigures, XminHorizon, holders_from_rows

STATUSES = ("pending", "processing", "done", "dead")
# Statuses with a partial index of their own: counting them reads only their entries.
INDEXED_STATUSES = ("pending", "processing", "dead")
MIGRATE_NEEDS_DIRECT = (
    "migrate needs a direct connection to PostgreSQL, not a transaction pooler (it holds a session "
    "advisory lock and builds indexes CONCURRENTLY without a statement timeout): run it with "
    "database.dsn pointing at the database itself and database.transaction_pooler = false"
)
# stats(): up to this many dead rows the blocked-aggregates query walks the dead rows
# (three index probes each); above it, the aggregates that have work.
BLOCKED_FROM_DEAD_ROWS = 1000


@dataclass(slots=True)
class ClaimResult:
    rows: list[Claimed]
    reaped: list[tuple[int, int, str | None]] = field(default_factory=list)  # (id, version, owner)
    # Where the next ordered claim should start (round-robin); None: from the first
    # aggregate (an empty string is a valid aggregate_id, so it cannot mean "start").
    ordered_after: str | None = None


@dataclass(slots=True)
class Reschedule:
    id: int
    lease_version: int
    delay_seconds: float
    error: str | None
    refund_attempt: bool


@dataclass(slots=True)
class Stats:
    queue_depth: dict[str, int]
    oldest_pending_age_seconds: float
    expired_leases: int
    attempts: dict[int, int]
    blocked_aggregates: list[tuple[str, int]]
    estimated_statuses: list[str] = field(default_factory=list)  # counts above the exact-count cap


@dataclass(frozen=True, slots=True)
class Count:
    """A row count that is exact, or a lower bound when counting ran out of time."""

    n: int
    exact: bool = True

    def __str__(self) -> str:
        return str(self.n) if self.exact else f"\u2265 {self.n}"


@dataclass(slots=True)
class DeadSummary:
    """Matching dead rows grouped for an operator (top entries only)."""

    by_event_type: list[tuple[str, int]]
    by_error: list[tuple[str, int]]
    aggregates: int
    sample_aggregates: list[str]


_PASSWORD_RE = re.compile(r"(password\s*=\s*)(\S+)|(://[^:/@\s]*:)([^@\s]*)(@)", re.IGNORECASE)


def redact_dsn(text: str, dsn: str | None = None) -> str:
    """Remove passwords from a DSN or from an error message that may quote one."""
    if dsn:
        try:
            password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
        except psycopg.ProgrammingError:
            password = None
        if password:
            text = text.replace(str(password), "***")
    return _PASSWORD_RE.sub(lambda m: (m.group(1) + "***") if m.group(1) else (m.group(3) + "***" + m.group(5)), text)


# Connection failures that waiting cannot fix. Everything else (refused, timed out,
# the server starting up, shutting down or in recovery, too many connections, a
# standby refusing a read-write session during failover) is waited for.
_PERMANENT_CONNECT_SQLSTATES = frozenset(
    {
        "28000",  # invalid_authorization_specification: no pg_hba.conf entry, role does not exist
        "28P01",  # invalid_password
        "3D000",  # invalid_catalog_name: database does not exist
    }
)
_PERMANENT_CONNECT_MARKERS = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "authentication failed",
    "no password supplied",
    "certificate",
    "sslmode value",
    "server does not support ssl",
    "tlsv1 alert",
    "unknown ca",
)


#: How often migrate retries its transactional part when a lock is not available.
_MIGRATE_LOCK_ATTEMPTS = 3


def connect_failure_is_permanent(exc: BaseException) -> bool:
    """True if a failed connection attempt cannot succeed by waiting (see above)."""
    if getattr(exc, "sqlstate", None) in _PERMANENT_CONNECT_SQLSTATES:
        return True
    text = str(exc).lower()
    if "does not exist" in text and ('role "' in text or 'database "' in text):
        return True
    return any(marker in text for marker in _PERMANENT_CONNECT_MARKERS)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def finalize_params(items: Sequence[FinalizeItem]) -> dict[str, Any]:
    """The parameters of delivery.sql "finalize" for a batch's decisions: delivered
    rows as two arrays of their own (the common case, usually the whole batch), every
    other outcome in six parallel arrays (usually empty)."""
    done_ids: list[int] = []
    done_versions: list[int] = []
    others: list[FinalizeItem] = []
    for item in items:
        if item.status == "done":
            done_ids.append(item.id)
            done_versions.append(item.lease_version)
        else:
            others.append(item)
    return {
        # As array literals: one join in C instead of binary-dumping each integer in
        # Python (~1 us per row of a batch, measured with py-spy on a drain).
        "done_ids": _bigint_array(done_ids),
        "done_versions": _bigint_array(done_versions),
        "ids": [i.id for i in others],
        "versions": [i.lease_version for i in others],
        "statuses": [i.status for i in others],
        "delays": [max(0.0, float(i.delay_seconds)) for i in others],
        "errors": [i.error for i in others],
        "refunds": [1 if i.refund_attempt else 0 for i in others],
    }


def _bigint_array(values: Sequence[int]) -> str:
    """``bigint[]`` input text (the values are ints: nothing to quote)."""
    return "{" + ",".join(map(str, values)) + "}"


# Planner settings of the claim and the finalize (delivery.sql "statement_settings"
# says why): plans that touch only the rows of the batch, whatever the statistics say.
CLAIM_SETTINGS = {"enable_bitmapscan": "off"}
FINALIZE_SETTINGS = {"enable_bitmapscan": "off"}  # also the heartbeat's extend_lease (the same join)


def _unset_in(dsn: str, params: Mapping[str, int]) -> dict[str, int]:
    """The connection parameters ``dsn`` does not set itself."""
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    return {k: v for k, v in params.items() if k not in given}


class OutboxStore:
    """Statements on one outbox table over a connection pool (autocommit connections)."""

    def __init__(
        self,
        dsn: str,
        table: str = "outbox",
        *,
        pool_size: int = 4,
        connect_timeout_seconds: float = 5.0,
        statement_timeout_ms: int = 10_000,
        application_name: str = "outbox-relay",
        transaction_pooler: bool = False,
        listen_dsn: str | None = None,
        tcp_params: Mapping[str, int] | None = None,
    ) -> None:
        self._dsn = dsn
        # TCP keepalives and tcp_user_timeout bound how long a statement waits on a
        # connection whose packets vanish (a partition, a half-open connection) by the
        # relay's settings rather than the kernel's retransmission limit. What the DSN
        # says itself is kept.
        self._tcp_params = dict(tcp_params or {})
        self.sql = TableSql(table)
        self.table = table
        self._connect_timeout = connect_timeout_seconds
        self.transaction_pooler = transaction_pooler
        # The LISTEN connection needs a session of its own: never through a pooler.
        self._listen_dsn = listen_dsn or (None if transaction_pooler else dsn)
        # A direct connection sets statement_timeout once, as a startup option. psycopg
        # prepares a statement after 5 executions, which saves parsing the long claim
        # and finalize on every batch; but after 5 more PostgreSQL may switch a prepared
        # statement to its generic plan, and the finalize's generic plan (estimated for
        # 10-element arrays and the few rows processing when statistics were taken)
        # takes 3-10x longer on a 1000-row batch. Custom plans keep the saving without
        # that cliff (bench/pooler.py measures all three).
        self._direct_kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(1, round(connect_timeout_seconds)),
            "application_name": application_name,
            "options": f"-c statement_timeout={int(statement_timeout_ms)} -c plan_cache_mode=force_custom_plan",
            **_unset_in(dsn, self._tcp_params),
        }
        pool_class: type[psycopg.Connection[Any]] = psycopg.Connection
        configure: Callable[[psycopg.Connection[Any]], None] | None = None
        if transaction_pooler:
            # Through a transaction-pooling proxy: no startup options, no server-side
            # prepared statements, each statement bounded inside its own transaction.
            self._conn_kwargs = {k: v for k, v in self._direct_kwargs.items() if k != "options"}
            self._conn_kwargs["prepare_threshold"] = None
            pool_class = PoolerConnection
            configure = configure_bound(statement_timeout_ms)
        else:
            self._conn_kwargs = self._direct_kwargs
        self._connection_class, self._configure = pool_class, configure
        self._pool = psycopg_pool.ConnectionPool(
            dsn,
            connection_class=pool_class,
            min_size=1,
            max_size=max(1, pool_size),
            kwargs=self._conn_kwargs,
            configure=configure,
            open=False,
            name="outbox-relay",
            timeout=max(connect_timeout_seconds, 5.0),
        )
        self._opened = False
        self._ping_lock = threading.Lock()
        self._ping_probe: tuple[threading.Event, list[bool]] | None = None  # the last readiness probe

        # Where plain claims start reading the due index (claim_cursor.py): shared by
        # every worker of this store, so claims stay flat while vacuum is held back.
        self.due_cursor = DueCursor()
        self._claim_statement = self.sql.query(
            "claim",
            due_from_at=sql.Placeholder("from_at"),
            due_from_id=sql.Placeholder("from_id"),
            leases_from=sql.Placeholder("leases_from"),
            claim_report=sql.SQL(EXECUTABLE["claim_report"]),
        )

    # --- lifecycle -------------------------------------------------------------------
    def open(self, *, wait: bool = True, fail_fast: bool = False) -> None:
        """Open the pool. ``fail_fast`` (one-shot commands): one connection attempt
        first, and its error at once, rather than the pool retrying a server that
        refuses for ``connect_timeout_seconds`` + 1 s."""
        if self._opened:
            return
        if fail_fast:
            try:
                with self._connect_once():
                    pass
            except psycopg.Error as exc:
                raise DatabaseUnavailable(
                    f"cannot connect to the database: {redact_dsn(_first_line(exc), self._dsn)}"
                ) from None
        try:
            self._pool.open(wait=wait, timeout=self._connect_timeout + 1)
        except psycopg_pool.PoolTimeout as exc:
            self._pool.close(timeout=0)
            reason = self._probe_reason()
            raise DatabaseUnavailable(f"cannot connect to the database: {reason}") from exc
        self._opened = True

    def check_ready(self) -> str | None:
        """Can the relay start? None if the database answers and the table exists;
        otherwise why not, for something that may fix itself (server down or starting,
        failover in progress, table not migrated yet). Raises ``DatabaseRefused`` for
        what waiting cannot fix (authentication, TLS verification, unknown role or
        database). Uses its own short-lived connection, not the pool."""
        try:
            with self._connect_once() as conn:
                row = conn.execute(self.sql.query("table_exists"), {"table": self.sql.regclass_text}).fetchone()
                current = self._schema_current(conn)
        except psycopg.Error as exc:
            reason = redact_dsn(_first_line(exc), self._dsn)
            if connect_failure_is_permanent(exc):
                raise DatabaseRefused(f"the database refused the connection: {reason}") from None
            return f"cannot connect to the database: {reason}"
        if not (row and row[0]):
            return f"table {self.table!r} does not exist: run `outbox-relay migrate` first"
        if not current:
            return (
                f"table {self.table!r} was set up by an older version of outbox-relay: run `outbox-relay migrate` first"
            )
        return None

    def _connect_once(self) -> psycopg.Connection[Any]:
        """A connection outside the pool, set up as the pool's are."""
        conn = self._connection_class.connect(self._dsn, **self._conn_kwargs)
        if self._configure is not None:
            self._configure(conn)
        return conn

    def _probe_reason(self) -> str:
        try:
            with self._connect_once():
                return "connection pool timed out"
        except psycopg.Error as exc:
            return redact_dsn(_first_line(exc), self._dsn)

    def close(self) -> None:
        if self._opened:
            self._opened = False
            self._pool.close(timeout=5)

    def __enter__(self) -> OutboxStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def redact(self, text: str) -> str:
        text = redact_dsn(text, self._dsn)
        return redact_dsn(text, self._listen_dsn) if self._listen_dsn and self._listen_dsn != self._dsn else text

    @contextlib.contextmanager
    def _mapped(self, what: str, *, commit_unknown: bool = False) -> Iterator[None]:
        """Map psycopg errors to ours. ``commit_unknown``: the statement commits by
        itself (autocommit), so a broken connection leaves its outcome unknown."""
        try:
            yield
        except pg_errors.UndefinedTable as exc:
            raise SchemaMissing(f"table {self.table!r} does not exist: run `outbox-relay migrate` first") from exc
        except psycopg_pool.PoolTimeout as exc:
            raise DatabaseUnavailable(
                f"{what}: no database connection available (pool exhausted or server down)"
            ) from exc
        except psycopg.OperationalError as exc:
            message = f"{what}: {self.redact(_first_line(exc))}"
            if commit_unknown and not isinstance(exc, pg_errors.QueryCanceled):
                raise CommitOutcomeUnknown(message) from exc
            raise DatabaseUnavailable(message) from exc
        except psycopg.Error as exc:
            raise DatabaseError(f"{what}: {self.redact(_first_line(exc))}") from exc

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self._mapped("database"):
            with self._pool.connection() as conn:
                yield conn

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
        of the table's own.
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
                for attempt in range(1, _MIGRATE_LOCK_ATTEMPTS + 1):
                    try:
                        notes += self._migrate_schema(
                            conn,
                            on_done=on_done,
                            notify_trigger=notify_trigger,
                            wanted=wanted,
                            autovacuum=autovacuum or {},
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
            )
            migrations.apply(run)
        return run.notes

    def _converge_indexes(
        self, conn: psycopg.Connection[Any], wanted: Sequence[str], *, ordering: bool, drop_ordering_indexes: bool
    ) -> list[str]:
        """Existing table: build missing (or invalid) indexes of the layout and drop the
        ones nothing reads any more, each CONCURRENTLY in autocommit."""
        notes: list[str] = []
        valid = self._index_validity(conn)
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

    def _schema_current(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            self.sql.query("schema_current"),
            {"dedup_keys": self.sql.regclass_of("dedup_keys"), "state_table": self.sql.regclass_of("relay_state")},
        ).fetchone()
        return bool(row and row[0])

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

    def mark_idle(self) -> None:
        """Ask inserts to NOTIFY (see create_notify_function): the relays are idle."""
        with self._mapped("mark idle"), self._pool.connection() as conn:
            conn.execute(self.sql.query("mark_idle"))

    def table_exists(self) -> bool:
        with self._mapped("check table"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("table_exists"), {"table": self.sql.regclass_text}).fetchone()
            return bool(row and row[0])

    def require_table(self) -> None:
        if not self.table_exists():
            raise SchemaMissing(f"table {self.table!r} does not exist: run `outbox-relay migrate` first")

    # --- claim -----------------------------------------------------------------------
    def claim(
        self,
        *,
        owner: str,
        batch: int,
        lease_seconds: float,
        max_attempts: int,
        ordered_types: Sequence[str] = (),
        run_length: int = 1,
        ordered_after: str | None = None,
        max_batch_bytes: int = 2**62,
        candidates: int | None = None,
        max_message_bytes: int | None = None,
    ) -> ClaimResult:
        """Reap poison rows, then claim up to ``batch`` rows, in one short transaction
        committed before this returns (so before any publish)."""
        ordering = OrderingRule.of(ordered_types)
        all_ordered = ordering.all_types
        types = ordering.explicit_types
        params: dict[str, Any] = {
            "owner": owner,
            "batch": batch,
            "lease_seconds": float(lease_seconds),
            "max_attempts": max_attempts,
            "ordered_types": types,
            "all_ordered": all_ordered,
            "max_batch_bytes": max_batch_bytes,
            "candidates": max(1, min(batch, candidates if candidates is not None else batch)),
            "max_message_bytes": max_message_bytes,
        }
        # The connection breaking during COMMIT leaves the claim's outcome unknown:
        # CommitOutcomeUnknown propagates and nothing is published; if it did commit,
        # the rows' lease expires and a later claim takes them (never publish what may not be ours).
        rows: list[Claimed] = []
        plan = self.due_cursor.begin()
        outcomes: list[ClaimOutcome] = []  # what each claim statement saw, for the cursor
        started = time.monotonic()
        try:
            result = self._claim(
                ordering, params, rows, plan, outcomes, run_length=run_length, ordered_after=ordered_after
            )
        except BaseException:
            self.due_cursor.failed(plan)
            raise
        self.due_cursor.end(plan, outcomes, time.monotonic() - started)
        return result

    def _claim(
        self,
        ordering: OrderingRule,
        params: dict[str, Any],
        rows: list[Claimed],
        plan: ClaimPlan,
        lowest: list[ClaimOutcome],
        *,
        run_length: int,
        ordered_after: str | None,
    ) -> ClaimResult:
        all_ordered = ordering.all_types
        types = ordering.explicit_types
        batch = int(params["batch"])
        max_batch_bytes = int(params["max_batch_bytes"])
        start_at, start_id = plan.start if plan.start is not None else (None, None)
        params = dict(params, from_at=start_at, from_id=start_id, leases_from=plan.leases_from)
        if not ordering.enabled:
            # One statement, autocommit: reap + claim in a single round trip.
            with self._mapped("claim", commit_unknown=True), self._pool.connection() as conn:
                reaped = self._plain_claim(conn.cursor(), dict(params, excluded_types=[]), rows, lowest)
            rows.sort(key=lambda c: c.id)  # RETURNING order is unspecified
            return ClaimResult(rows=rows, reaped=reaped)
        # Ordered: several statements in one short transaction (heads, runs, the rest).
        next_after: str | None = None
        with self._mapped("claim", commit_unknown=True), self._pool.connection() as conn:
            with conn.transaction():
                cur = conn.cursor()
                unordered = dict(params, excluded_types=types)
                # The first statement sets the claim's planner settings for the whole
                # transaction (_plain_claim does it in the else branch).
                if all_ordered:
                    execute_with_settings(cur, self.sql.query("reap"), params, CLAIM_SETTINGS)
                    reaped = [(r[0], r[1], r[2]) for r in cur.fetchall()]
                else:
                    # Unordered rows get up to half of every batch first, so a large
                    # ordered backlog can never starve them (and vice versa).
                    reaped = self._plain_claim(
                        cur,
                        dict(unordered, batch=max(1, batch // 2), max_batch_bytes=max(1, max_batch_bytes // 2)),
                        rows,
                        lowest,
                    )
                head_room = batch - len(rows)
                params = dict(params, batch=head_room)

                def bytes_left() -> int:
                    return max_batch_bytes - sum(r.size_bytes for r in rows)

                def claim_heads(after: str | None, limit: int) -> list[Claimed]:
                    head_params = dict(
                        params, after=after, batch=limit, max_batch_bytes=bytes_left(), first_always=not rows
                    )
                    found = cur.execute(self.sql.query("claim_ordered_heads"), head_params).fetchall()
                    if found:  # the last aggregate in the column's collation order (see delivery.sql)
                        last_aggregate[0] = found[0][-1]
                    return [Claimed(*r[:-1]) for r in found]

                # Round-robin over aggregates: start after where the last claim ended,
                # wrap around to the beginning if that end of the range had too few.
                heads: list[Claimed] = []
                last_aggregate: list[str | None] = [None]
                if head_room > 0 and (bytes_left() > 0 or not rows):
                    heads = claim_heads(ordered_after, head_room)
                    rows.extend(heads)
                    if len(heads) < head_room and ordered_after is not None and bytes_left() > 0:
                        seen = {h.id for h in heads}
                        more = [h for h in claim_heads(None, head_room - len(heads)) if h.id not in seen]
                        heads.extend(more)
                        rows.extend(more)
                if heads:
                    next_after = last_aggregate[0]
                if heads and run_length > 1 and batch > len(rows) and bytes_left() > 0:
                    run_params = dict(
                        params,
                        run_length=run_length - 1,
                        room=batch - len(rows),
                        aggregate_ids=[h.aggregate_id for h in heads],
                        head_ids=[h.id for h in heads],
                        max_batch_bytes=bytes_left(),
                    )
                    rows.extend(Claimed(*r) for r in cur.execute(self.sql.query("claim_ordered_runs"), run_params))
                room = batch - len(rows)
                if not all_ordered and room > 0 and bytes_left() > 0:
                    reaped += self._plain_claim(
                        cur, dict(unordered, batch=room, max_batch_bytes=bytes_left()), rows, lowest
                    )
        rows.sort(key=lambda c: c.id)  # RETURNING order is unspecified
        return ClaimResult(rows=rows, reaped=reaped, ordered_after=next_after)

    def _plain_claim(
        self, cur: Any, params: dict[str, Any], rows: list[Claimed], outcomes: list[ClaimOutcome]
    ) -> list[tuple[int, int, str | None]]:
        """Run the reap + claim statement; append claimed rows (and what the statement
        saw to ``outcomes``, for the claim cursor), return reaped ones."""
        reaped: list[tuple[int, int, str | None]] = []
        params = dict(params, candidates=min(params["candidates"], params["batch"]))
        execute_with_settings(cur, self._claim_statement, params, CLAIM_SETTINGS)
        keys: list[tuple[dt.datetime, int]] = []
        database_now: dt.datetime | None = None
        expired_seen = 0
        for record in cur.fetchall():
            if record[0] is None:  # the statement's clock and expired leases looked at
                expired_seen, database_now = int(record[1]), record[13]
            elif record[0]:
                reaped.append((record[1], record[2], record[12]))
            else:
                rows.append(Claimed(*record[1:12]))
                if record[13] is not None:
                    keys.append((record[13], record[1]))
        outcomes.append(
            ClaimOutcome(
                lowest=min(keys) if keys else None,
                database_now=database_now,
                leases_exhausted=expired_seen < int(params["candidates"]),
            )
        )
        return reaped

    # --- fenced finalize -------------------------------------------------------------
    def finalize(self, items: Sequence[FinalizeItem], *, strict: bool = False) -> set[int]:
        """Write every decision of a batch in one fenced statement; return the ids it
        accepted (the others lost their lease to a newer claim)."""
        if not items:
            return set()
        params = finalize_params(items)
        with self._mapped("finalize"), self._pool.connection() as conn:
            cur = conn.cursor()
            execute_with_settings(cur, self.sql.query("finalize", strict=strict), params, FINALIZE_SETTINGS)
            return {r[0] for r in cur.fetchall()}

    # Conveniences over finalize() for scripts, benchmarks and tests.
    def mark_done(self, claims: Sequence[tuple[int, int]], *, strict: bool = False) -> set[int]:
        """(id, lease_version) pairs -> ids actually finalized (the rest lost their lease)."""
        return self.finalize([FinalizeItem(i, v, "done") for i, v in claims], strict=strict)

    def reschedule(self, items: Sequence[Reschedule], *, strict: bool = False) -> set[int]:
        return self.finalize(
            [FinalizeItem(i.id, i.lease_version, "pending", i.delay_seconds, i.error, i.refund_attempt) for i in items],
            strict=strict,
        )

    def mark_dead(self, items: Sequence[tuple[int, int, str]], *, strict: bool = False) -> set[int]:
        return self.finalize([FinalizeItem(i, v, "dead", 0.0, e) for i, v, e in items], strict=strict)

    def extend_lease(
        self, claims: Sequence[tuple[int, int]], lease_seconds: float, *, strict: bool = False
    ) -> set[int]:
        if not claims:
            return set()
        ids = [row_id for row_id, _ in claims]
        versions = [version for _, version in claims]
        with self._mapped("extend lease"), self._pool.connection() as conn:
            cur = conn.cursor()  # the finalize's join, so the finalize's planner settings
            execute_with_settings(
                cur,
                self.sql.query("extend_lease", strict=strict),
                {"ids": list(ids), "versions": list(versions), "lease_seconds": float(lease_seconds)},
                FINALIZE_SETTINGS,
            )
            return {r[0] for r in cur.fetchall()}

    # --- monitoring ------------------------------------------------------------------
    def stats(
        self,
        *,
        ordered_types: Sequence[str] = (),
        timeout_ms: int | None = None,
        include_depth: bool = True,
        count_cap: int = 100_000,
        blocked_limit: int = 100,
    ) -> Stats:
        """The monitoring reads (depth per status, oldest pending age, blocked aggregates), one read-only snapshot."""
        ordering = OrderingRule.of(ordered_types)
        with self._mapped("stats"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
            # These walk the front of the claim's partial indexes up to count_cap, like the
            # claim: without statistics a bitmap scan read the whole backlog instead
            # (stats_backlog 101 -> 37 ms at a 200 000-row backlog; 37 -> 29 ms analyzed).
            conn.execute("SET LOCAL enable_bitmapscan = off")
            depth = dict.fromkeys(STATUSES, 0)
            estimated: list[str] = []
            if include_depth:
                unknown: list[str] = []  # done rows in a table above the cap (no index counts them)
                for status, n in conn.execute(
                    self.sql.query("stats_depth"), {"cap": count_cap, "table": self.sql.regclass_text}
                ).fetchall():
                    if n is None:
                        unknown.append(status)
                    else:
                        depth[status] = int(n)
                capped = [status for status, n in depth.items() if n >= count_cap]
                if capped or unknown:
                    rows = conn.execute(
                        self.sql.query("stats_status_estimate"),
                        {"table": self.sql.regclass_text, "schema": self.sql.schema_name, "name": self.sql.table_name},
                    ).fetchall()
                    estimates = {status: int(n) for status, n in rows}
                    for status in capped:
                        depth[status] = max(count_cap, estimates.get(status, count_cap))
                        estimated.append(status)
                    for status in unknown:
                        depth[status] = estimates.get(status, 0)
                        estimated.append(status)
            attempts: dict[int, int] = {}
            oldest_age = 0.0
            for a, n, age in conn.execute(self.sql.query("stats_backlog"), {"cap": count_cap}).fetchall():
                attempts[int(a)] = int(n)
                oldest_age = max(oldest_age, float(age))
            expired = conn.execute(self.sql.query("stats_expired")).fetchone()
            blocked: list[tuple[str, int]] = []
            dead_rows = depth["dead"] if include_depth else None
            if ordering.enabled and dead_rows != 0:  # no dead row, no blocked aggregate
                # Walk whichever is smaller: few dead rows, or the aggregates with work
                # (at most count_cap of them), so the cost never follows the operator's
                # backlog of dead rows.
                few_dead = dead_rows is not None and dead_rows <= BLOCKED_FROM_DEAD_ROWS
                blocked = [
                    (r[0], int(r[1]))
                    for r in conn.execute(
                        self.sql.query("stats_blocked_from_dead" if few_dead else "stats_blocked"),
                        {
                            "ordered_types": ordering.explicit_types,
                            "all_ordered": ordering.all_types,
                            "limit": blocked_limit,
                            "scan_cap": count_cap,
                        },
                    ).fetchall()
                ]
        return Stats(
            queue_depth=depth,
            estimated_statuses=estimated,
            oldest_pending_age_seconds=oldest_age,
            expired_leases=int(expired[0]) if expired else 0,
            attempts=attempts,
            blocked_aggregates=blocked,
        )

    def xmin_horizon(self, *, limit: int = 5, timeout_ms: int | None = None) -> XminHorizon:
        """What holds back vacuum of this table, oldest first (vacuum_health.py)."""
        with self._mapped("xmin horizon"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_ms))))
            cur = conn.execute(self.sql.query("xmin_horizon_holders"), {"limit": limit}, prepare=False)
            names = [d.name for d in cur.description or ()]
            rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return XminHorizon(holders_from_rows(rows))

    def vacuum_figures(self, *, timeout_ms: int | None = None) -> VacuumFigures:
        """Dead tuples, heap and index size, last vacuum of the table (statistics views only)."""
        with self._mapped("vacuum figures"), self._pool.connection() as conn, conn.transaction():
            if timeout_ms:
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_ms))))
            row = conn.execute(self.sql.query("vacuum_figures"), {"table": self.sql.regclass_text}).fetchone()
        assert row is not None
        return VacuumFigures(
            dead_tuples=int(row[0]),
            live_tuples=int(row[1]),
            heap_bytes=int(row[2]),
            index_bytes=int(row[3]),
            since_vacuum_seconds=float(row[4]) if row[4] is not None else None,
            vacuums=int(row[5]),
        )

    def ping(self, timeout_seconds: float = 2.0) -> bool:
        """Does the database answer ``SELECT 1`` within ``timeout_seconds``? Answers in
        time even when the statement hangs (a half-open connection holds it until the
        TCP user timeout): the probe runs on a thread of its own, and while one still
        hangs no other is started (a probe every second must not pile up threads)."""
        with self._ping_lock:
            if self._ping_probe is None or self._ping_probe[0].is_set():
                done, answered = threading.Event(), [False]

                def probe() -> None:
                    try:
                        with self._pool.connection(timeout=timeout_seconds) as conn:
                            conn.execute("SELECT 1")
                        answered[0] = True
                    except (psycopg.Error, psycopg_pool.PoolTimeout):
                        pass
                    finally:
                        done.set()

                self._ping_probe = (done, answered)
                threading.Thread(target=probe, name="database-ping", daemon=True).start()
            done, answered = self._ping_probe
        return done.wait(timeout_seconds) and answered[0]

    # --- dead-letter operations ------------------------------------------------------
    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        with self._mapped("look up rows"), self._pool.connection() as conn:
            return {r[0]: r[1] for r in conn.execute(self.sql.query("status_of"), {"ids": list(ids)}).fetchall()}

    def states(self, ids: Sequence[int]) -> dict[int, tuple[str, int]]:
        """id -> (status, lease_version)."""
        with self._mapped("look up rows"), self._pool.connection() as conn:
            return {r[0]: (r[1], r[2]) for r in conn.execute(self.sql.query("state_of"), {"ids": list(ids)}).fetchall()}

    def dead_retry(self, ids: Sequence[int]) -> set[int]:
        with self._mapped("dead retry"), self._pool.connection() as conn:
            return {r[0] for r in conn.execute(self.sql.query("dead_retry"), {"ids": list(ids)}).fetchall()}

    def dead_skip(self, ids: Sequence[int], reason: str) -> set[int]:
        with self._mapped("dead skip"), self._pool.connection() as conn:
            return {
                r[0] for r in conn.execute(self.sql.query("dead_skip"), {"ids": list(ids), "reason": reason}).fetchall()
            }

    # --- operator console / CLI: filters, exact counts, audit -------------------------------
    # Everything the CLI's filtered dead-letter commands and the console read or change.
    # Filters are bound parameters (filters.DeadFilter.sql_params); statements run with
    # prepare=False so PostgreSQL plans each one with the actual filter values (a
    # generic plan could not use the partial indexes). Bulk changes go chunk by chunk,
    # one short autocommit statement each, through operations.change_dead.
    def database_now(self) -> dt.datetime:
        with self._mapped("read clock"), self._pool.connection() as conn:
            row = conn.execute(self.sql.query("database_now")).fetchone()
            assert row is not None and isinstance(row[0], dt.datetime)  # timestamptz: an aware datetime
            return row[0]

    def audit_table_exists(self) -> bool:
        with self._mapped("check audit table"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("audit_table_exists"), {"audit_table": self.sql.audit_regclass_text}
            ).fetchone()
            return bool(row and row[0])

    def require_audit_table(self) -> None:
        if not self.audit_table_exists():
            raise SchemaMissing(
                f"the audit table of {self.table!r} does not exist: run `outbox-relay migrate` "
                "(this version records every retry/skip there); nothing was changed"
            )

    def _bounded_count(
        self, query: Any, params: dict[str, Any], *, first_upto: int, budget_ms: int, indexed: bool = True
    ) -> Count:
        """Count exactly within ``budget_ms``; if that runs out, a lower bound.

        Counts up to ``first_upto`` rows (from an index: cheap, always done, under the
        connection's own statement timeout; without one, under the budget too), then up
        to 4x as many per step under what is left of the budget, and finally without a
        limit. A step that runs out of time leaves the previous step's limit as the
        proven lower bound. Re-counting from the start at each step costs at most a
        third more than one full count.
        """
        deadline = time.monotonic() + budget_ms / 1000.0
        upto: int | None = max(1, first_upto)
        lower = 0
        with self._pool.connection() as conn:
            first = True
            while True:
                bounded = not first or not indexed
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if bounded and remaining_ms < 1:
                    return Count(lower, exact=False)
                try:
                    with conn.transaction():
                        if bounded:
                            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(remaining_ms)))
                        row = conn.execute(query, dict(params, upto=upto), prepare=False).fetchone()
                except pg_errors.QueryCanceled:
                    if not bounded:
                        raise
                    return Count(lower, exact=False)
                first = False
                n = int(row[0]) if row else 0
                if upto is None or n < upto:
                    return Count(n, exact=True)
                lower = n
                upto = upto * 4 if upto < 64_000_000 else None

    def exact_depth(
        self, *, budget_ms: int, statuses: Sequence[str] = STATUSES, first_upto: int = 100_000
    ) -> dict[str, Count]:
        """Rows per status, counted exactly from each status's partial index while the
        shared budget lasts; a status whose count runs out is a lower bound. Counted
        in the order dead, pending, processing, done (done has no index and is usually
        the largest: it gets what is left of the budget)."""
        order = [s for s in ("dead", "pending", "processing", "done") if s in statuses]
        deadline = time.monotonic() + budget_ms / 1000.0
        out: dict[str, Count] = {}
        with self._mapped("count rows"):
            for status in order:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                out[status] = self._bounded_count(
                    self.sql.query("status_count_upto", status=sql.Literal(status)),
                    {},
                    first_upto=first_upto,
                    budget_ms=left_ms,
                    indexed=status in INDEXED_STATUSES,
                )
        return {s: out[s] for s in statuses}

    def dead_count(self, selector: DeadFilter, *, budget_ms: int, first_upto: int = 100_000) -> Count:
        """Dead rows matching ``selector`` (its limit applied), exactly while the budget lasts."""
        with self._mapped("count dead rows"):
            count = self._bounded_count(
                self.sql.query("dead_count_upto"), selector.sql_params(), first_upto=first_upto, budget_ms=budget_ms
            )
        if selector.limit is not None and count.n >= selector.limit:
            return Count(selector.limit, exact=True)
        return count

    def dead_page(self, selector: DeadFilter, *, after_id: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """One page of matching dead rows in id order after ``after_id``."""
        with self._mapped("dead list"), self._pool.connection() as conn:
            cur = conn.execute(
                self.sql.query("dead_page"), dict(selector.sql_params(), after_id=after_id, limit=limit), prepare=False
            )
            names = [d.name for d in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def dead_summary(self, selector: DeadFilter, *, timeout_ms: int, top: int = 10) -> DeadSummary | None:
        """Matching dead rows by event type, by error and by aggregate; None if the
        grouping did not finish within ``timeout_ms`` (huge dead-letter backlogs)."""
        params = dict(selector.sql_params(), top=top)
        try:
            with self._mapped("dead summary"), self._pool.connection() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, timeout_ms))))
                by_type = [
                    (r[0], int(r[1]))
                    for r in conn.execute(self.sql.query("dead_by_event_type"), params, prepare=False).fetchall()
                ]
                by_error = [
                    (r[0], int(r[1]))
                    for r in conn.execute(self.sql.query("dead_by_error"), params, prepare=False).fetchall()
                ]
                agg = conn.execute(self.sql.query("dead_aggregates"), params, prepare=False).fetchone()
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.QueryCanceled):
                return None
            raise
        return DeadSummary(
            by_event_type=by_type,
            by_error=by_error,
            aggregates=int(agg[0]) if agg else 0,
            sample_aggregates=list(agg[1]) if agg else [],
        )

    def dead_change_chunk(
        self, action: str, selector: DeadFilter, *, after_id: int, chunk: int, audit_id: int, reason: str | None = None
    ) -> list[int]:
        """Retry or skip the next ``chunk`` matching rows after ``after_id`` in one short
        transaction that also adds them to audit entry ``audit_id``; their ids, ascending."""
        name = {"retry": "dead_retry_chunk", "skip": "dead_skip_chunk"}[action]
        params = dict(selector.sql_params(), after_id=after_id, chunk=chunk, audit_id=audit_id, reason=reason)
        with self._mapped(f"dead {action}", commit_unknown=True), self._pool.connection() as conn:
            return [int(r[0]) for r in conn.execute(self.sql.query(name), params, prepare=False).fetchall()]

    def audit_begin(
        self,
        *,
        actor: str,
        source: str,
        action: str,
        selector: dict[str, Any],
        rows_matched: int | None,
        reason: str | None,
    ) -> int:
        with self._mapped("audit"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("audit_begin"),
                {
                    "actor": actor,
                    "source": source,
                    "action": action,
                    "selector": json.dumps(selector),
                    "rows_matched": rows_matched,
                    "reason": reason,
                },
            ).fetchone()
            assert row is not None
            return int(row[0])

    def audit_finish(self, audit_id: int) -> None:
        with self._mapped("audit"), self._pool.connection() as conn:
            conn.execute(self.sql.query("audit_finish"), {"audit_id": audit_id})

    def audit_list(self, *, limit: int = 50, before_id: int | None = None) -> list[dict[str, Any]]:
        """Audit entries, newest first."""
        with self._mapped("audit list"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("audit_list"), {"limit": limit, "before_id": before_id})
            names = [d.name for d in cur.description or ()]
            entries = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        for entry in entries:
            entry["selector"] = json.loads(entry["selector"])
        return entries

    def row_detail(self, row_id: int) -> dict[str, Any] | None:
        with self._mapped("read row"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("row_detail"), {"id": row_id})
            names = [d.name for d in cur.description or ()]
            row = cur.fetchone()
            return dict(zip(names, row, strict=True)) if row else None

    def aggregate_rows(self, aggregate_id: str, *, limit: int = 100) -> tuple[list[dict[str, Any]], int]:
        """An aggregate's first ``limit`` unfinished rows in id order, and how many it has."""
        with self._mapped("read aggregate"), self._pool.connection() as conn:
            cur = conn.execute(self.sql.query("aggregate_rows"), {"aggregate_id": aggregate_id, "limit": limit})
            names = [d.name for d in cur.description or ()]
            found = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            total_row = conn.execute(
                self.sql.query("aggregate_unfinished_count"), {"aggregate_id": aggregate_id}
            ).fetchone()
        return found, int(total_row[0]) if total_row else 0

    def published_per_bucket(
        self, *, window_seconds: int = 3600, bucket_seconds: int = 300, timeout_ms: int = 2000
    ) -> list[int] | None:
        """Rows finalized done per bucket over the window, oldest bucket first; None if
        counting did not finish within ``timeout_ms``."""
        buckets = [0] * (window_seconds // bucket_seconds)
        try:
            with self._mapped("published rate"), self._pool.connection() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, timeout_ms))))
                for bucket, n in conn.execute(
                    self.sql.query("published_per_bucket"),
                    {"window_seconds": window_seconds, "bucket_seconds": bucket_seconds},
                ).fetchall():
                    if 0 <= bucket < len(buckets):
                        buckets[len(buckets) - 1 - bucket] = int(n)
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, pg_errors.QueryCanceled):
                return None
            raise
        return buckets

    # --- retention -------------------------------------------------------------------
    def count_purgeable(self, older_than_seconds: float) -> int:
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("count_purgeable"), {"older_than_seconds": float(older_than_seconds)}
            ).fetchone()
            return int(row[0]) if row else 0

    def purge_chunk(self, older_than_seconds: float, limit: int, after: int = 0) -> tuple[int, int | None]:
        """Delete the done rows older than the cutoff among the next ``limit`` rows by
        id after ``after``. Returns (rows deleted, where the next chunk starts), the
        latter None once no row further on can be old enough (see purge_chunk)."""
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("purge_chunk"),
                {"older_than_seconds": float(older_than_seconds), "limit": limit, "after": after},
            ).fetchone()
        deleted, last_id, old_rows = (int(row[0]), row[1], int(row[2])) if row else (0, None, 0)
        return deleted, (int(last_id) if last_id is not None and old_rows > 0 else None)

    def purge_dedup_keys_chunk(self, older_than_seconds: float, limit: int, after: str = "") -> tuple[int, str | None]:
        """Delete dedup keys older than the cutoff whose row is gone, among the next
        ``limit`` keys after ``after``. Returns (keys deleted, next start or None at the end)."""
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("purge_dedup_keys_chunk"),
                {"older_than_seconds": float(older_than_seconds), "limit": limit, "after": after},
            ).fetchone()
        deleted, last_key = (int(row[0]), row[1]) if row else (0, None)
        return deleted, (str(last_key) if last_key is not None else None)

    # --- wake-ups --------------------------------------------------------------------
    @property
    def can_listen(self) -> bool:
        """False behind a transaction pooler without ``database.listen_dsn``: LISTEN
        through the proxy would never hear a notification, so the relay polls."""
        return self._listen_dsn is not None

    def open_listener(self) -> Listener:
        """A dedicated (non-pooled) autocommit connection LISTENing on the table's
        channel: on the DSN itself, or on ``listen_dsn`` (always a direct connection)."""
        if self._listen_dsn is None:
            raise DatabaseError(
                "listen: database.transaction_pooler is set and database.listen_dsn is not: "
                "LISTEN through a transaction pooler never hears a notification"
            )
        with self._mapped("listen"):
            kwargs = {k: v for k, v in self._direct_kwargs.items() if k not in self._tcp_params}
            kwargs.update(_unset_in(self._listen_dsn, self._tcp_params))
            conn = psycopg.connect(self._listen_dsn, **kwargs)
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.sql.channel)))
            except BaseException:
                conn.close()
                raise
            return Listener(conn, self.sql)


class Listener:
    """The LISTEN connection of one relay process (see create_notify_function)."""

    def __init__(self, conn: psycopg.Connection[Any], table_sql: TableSql) -> None:
        self._conn = conn
        self._sql = table_sql

    def wait(self, timeout_seconds: float) -> bool:
        """True if a notification arrived within the timeout."""
        # Drain the generator before using the connection again: notifies() holds the
        # connection's lock while it is suspended.
        return bool(list(self._conn.notifies(timeout=timeout_seconds, stop_after=1)))

    def mark_busy(self) -> None:
        """Inserts need not notify until a worker finds nothing to claim again."""
        self._conn.execute(self._sql.query("mark_busy"))

    def close(self) -> None:
        self._conn.close()
