"""StoreCore: what every part of OutboxStore stands on.

The connection pool and its settings, opening and closing it, readiness checks,
the mapping of psycopg errors to the project's own exceptions (``_mapped``),
password redaction, the liveness ping, and the bounded exact count that both the
monitoring reads and the dead-letter counts use. Each job of the store (migrate,
delivery, monitoring, dead rows, retention, wake-ups) is a class of its own module
that inherits this one; ``store.OutboxStore`` combines them.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Self

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors
from psycopg import sql

from ..errors import (
    CommitOutcomeUnknown,
    DatabaseError,
    DatabaseRefused,
    DatabaseUnavailable,
    SchemaMissing,
)
from .claim_cursor import DueCursor, sweep_step_seconds
from .ordered_bounds import AggregateBounds
from .pooler import PoolerConnection, configure_bound
from .schema import CLAIM_ROW_LOCK, EXECUTABLE, TableSql
from .statement_counts import StatementCounts


@dataclass(frozen=True, slots=True)
class Count:
    """A row count that is exact, or a lower bound when counting ran out of time."""

    n: int
    exact: bool = True

    def __str__(self) -> str:
        return str(self.n) if self.exact else f"\u2265 {self.n}"


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


def _unset_in(dsn: str, params: Mapping[str, int]) -> dict[str, int]:
    """The connection parameters ``dsn`` does not set itself."""
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    return {k: v for k, v in params.items() if k not in given}


def pool_max_idle(release_within_seconds: float, max_size: int) -> float:
    """psycopg_pool's ``max_idle`` for a pool (min_size 1) that must be back to one
    connection within ``release_within_seconds`` of its last busy moment.

    psycopg_pool shrinks only on its own periodic check, every ``max_idle`` seconds from
    the pool's opening: a check closes ONE connection, and only if at least one stayed
    unused during the whole period since the previous check. A pool of n connections
    that goes idle in the middle of a period therefore closes its first spare at the
    end of the next period at the latest and one more per period after that: it is
    back to one connection within n periods. With ``max_idle`` = the bound divided by
    the pool's largest size, any pool is back to one within the bound."""
    return max(1.0, release_within_seconds / max(1, max_size))


class StoreCore:
    """Statements on one outbox table over a connection pool (autocommit connections):
    the pool, its lifecycle and the helpers every job of the store uses."""

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
        pool_max_idle_seconds: float = 60.0,
    ) -> None:
        self._dsn = dsn
        # TCP keepalives and tcp_user_timeout bound how long a statement waits on a
        # connection whose packets vanish (a partition, a half-open connection) by the
        # relay's settings rather than the kernel's retransmission limit. What the DSN
        # says itself is kept.
        self._tcp_params = dict(tcp_params or {})
        self.sql = TableSql(table)
        self.table = table
        self.statement_counts = StatementCounts()
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
            max_idle=pool_max_idle(pool_max_idle_seconds, max(1, pool_size)),
        )
        self._opened = False
        self._ping_lock = threading.Lock()
        self._ping_probe: tuple[threading.Event, list[bool]] | None = None  # the last readiness probe

        # Where plain claims start reading the due index (claim_cursor.py): shared by
        # every worker of this store, so claims stay flat while vacuum is held back.
        self.due_cursor = DueCursor(sweep_step_seconds=sweep_step_seconds(statement_timeout_ms))
        self._gauge_bounds_unsupported = False  # the state table has no gauge_bounds column (not migrated)
        self.gauge_bounds_publish_failures = 0
        report = sql.SQL(EXECUTABLE["claim_report"])

        def fast_claim(row_lock: sql.Composable) -> sql.Composed:
            return self.sql.query(
                "claim",
                due_bound=sql.SQL(EXECUTABLE["claim_due_bound"]),
                leases_bound=sql.SQL(EXECUTABLE["claim_leases_bound"]),
                lease_scan=sql.SQL("{}::boolean").format(sql.Placeholder("lease_scan")),
                writers_look=self.sql.query("outbox_writers", table_oid=sql.Literal(self.sql.regclass_text)),
                claim_report=report,
                row_lock=row_lock,
            )

        locked, no_lock = sql.SQL(CLAIM_ROW_LOCK), sql.SQL("")
        self._claim_statement = fast_claim(locked)
        # A full claim (from the front of both indexes) is the statement with its start
        # bounds written as NULL: the plan of the claim without bounds, and an entry of
        # its own in pg_stat_statements, so full and fast claims are measured apart.
        self._full_claim_statement = self.sql.query("claim", claim_report=report, row_lock=locked)
        # The same two without the row lock (delivery.sql "claim"): the claim of a few
        # rows while one worker claims at a time (delivery.py LOCKLESS_CLAIM_SETTINGS).
        self._lockless_claim_statement = fast_claim(no_lock)
        self._lockless_full_claim_statement = self.sql.query("claim", claim_report=report, row_lock=no_lock)
        # A step of the full claim's sweep (claim_cursor.py Sweep): one key range of each index.
        self._sweep_claim_statement = self.sql.query(
            "claim",
            due_bound=sql.SQL(EXECUTABLE["claim_sweep_due_bound"]),
            leases_bound=sql.SQL(EXECUTABLE["claim_sweep_leases_bound"]),
            claim_report=sql.SQL(EXECUTABLE["claim_report"]),
        )
        # The ordered claims (relay.ordered_event_types) have a cursor of their own:
        # where their discovery scan of the due index starts (fast claims), and when a
        # full ordered claim comes round; and the per-aggregate bounds their fast claims
        # read the aggregate index from (ordered_bounds.py). Fast once the least of three
        # full ordered claims took fast_above_seconds (0.1 s) or more: they are timed in
        # the client (several statements), so the per-row rule, which would react to a
        # busy client machine (an empty claim of 5 ms in three round trips), is off.
        # Its full claims stay whole statements (no sweep): the ordered claim reads the
        # aggregate index, not the ranges a sweep step is made of.
        self.ordered_cursor = DueCursor(fast_above_seconds_per_row=float("inf"), sweep=False)
        self.ordered_bounds = AggregateBounds()
        self._ordered_discover_statement = self.sql.query(
            "claim_ordered_discover",
            due_bound=sql.SQL(EXECUTABLE["claim_due_bound"]),
            leases_bound=sql.SQL(EXECUTABLE["claim_leases_bound"]),
            lease_scan=sql.SQL("{}::boolean").format(sql.Placeholder("lease_scan")),
            writers_look=self.sql.query("outbox_writers", table_oid=sql.Literal(self.sql.regclass_text)),
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

    def __enter__(self) -> Self:
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

    # --- liveness --------------------------------------------------------------------
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

    # --- helpers shared by the jobs --------------------------------------------------
    def _schema_current(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            self.sql.query("schema_current"),
            {
                "dedup_keys": self.sql.regclass_of("dedup_keys"),
                "pauses_table": self.sql.pauses_regclass_text,
                "state_table": self.sql.regclass_of("relay_state"),
                "table": self.sql.regclass_text,
            },
        ).fetchone()
        return bool(row and row[0])

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
