"""Connections for a DSN that points at a transaction-pooling proxy (PgBouncer in
``pool_mode = transaction``, RDS Proxy, Supavisor, pgcat): ``database.transaction_pooler``.

Such a proxy hands each *transaction* to whichever server connection is free, so a
client may keep nothing on "its" server session between transactions:

- no startup ``options`` (PgBouncer refuses the connection: "unsupported startup
  parameter: options"), so ``statement_timeout`` cannot be set once per session;
- no server-side prepared statements (psycopg prepares a statement after 5
  executions; the next transaction may land on a server connection that does not
  have it): the store connects with ``prepare_threshold=None``;
- no LISTEN (notifications go to a server session nobody reads): the listener uses
  ``database.listen_dsn`` or the relay polls (store.open_listener, relay.py).

Every statement is still bounded by ``statement_timeout``, set *inside the
statement's own transaction* with ``set_config('statement_timeout', ms, true)``
(transaction-local, so nothing leaks to the next client of the server connection):

- an autocommit statement is sent in one pipeline with the set_config before it,
  then one Sync: both run in one implicit transaction (extended query protocol),
  in one round trip. The timeout must be set by a *previous* statement: the
  server arms the timer when a statement starts;
- in an explicit transaction (``conn.transaction()``) the set_config travels in the
  same pipeline as the transaction's first statement: no extra round trip either.

bench/pooler.py measures this against the alternatives (SET LOCAL in its own round
trip, BEGIN/SET LOCAL/statement/COMMIT pipelined) and against a direct connection.
Only ``Cursor.execute`` is bounded this way; the store uses nothing else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Self, cast

import psycopg
from psycopg import pq
from psycopg.abc import Params, Query, QueryNoTemplate
from psycopg.transaction import Transaction

from .schema import EXECUTABLE

# delivery.sql section "bound_statement" (transaction-local statement_timeout), its
# comment lines left out: they would travel with every statement.
_BOUND_STATEMENT = EXECUTABLE["bound_statement"]
_SETTINGS_STATEMENT = EXECUTABLE["statement_settings"]


class _ThreadState(threading.local):
    in_bounded_pipeline = False


_state = _ThreadState()


class _QuietBrokenPipeline(logging.Filter):
    """When the connection breaks inside ``_bounded``, psycopg's pipeline logs
    "error ignored terminating <Pipeline>" before the error itself propagates (and
    the store reports it as one line): drop that duplicate, and only that one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_state.in_bounded_pipeline and str(record.msg).startswith("error ignored terminating"))


logging.getLogger("psycopg").addFilter(_QuietBrokenPipeline())


class PoolerConnection(psycopg.Connection[Any]):
    """An autocommit connection whose every statement sets its own statement_timeout.

    ``statement_timeout_ms`` is set once per connection (the pool's ``configure``
    callback); 0 means unbounded, like ``statement_timeout = 0``.
    """

    statement_timeout_ms: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = BoundedCursor
        # True once the current explicit transaction has its timeout set.
        self._transaction_bounded = False

    @contextmanager
    def transaction(self, savepoint_name: str | None = None, force_rollback: bool = False) -> Iterator[Transaction]:
        if self.info.transaction_status == pq.TransactionStatus.IDLE:
            self._transaction_bounded = False  # a new outermost transaction
        with super().transaction(savepoint_name, force_rollback) as tx:
            yield tx

    def _needs_bound(self) -> bool:
        """Does the next statement need the set_config in front of it?"""
        if self.statement_timeout_ms <= 0 or self.info.pipeline_status != pq.PipelineStatus.OFF:
            return False  # unbounded by choice, or one of our own pipelined statements
        status = self.info.transaction_status
        if status == pq.TransactionStatus.IDLE:
            return True  # autocommit: the statement is its own transaction
        return status == pq.TransactionStatus.INTRANS and not self._transaction_bounded

    def _bounded(
        self, cursor: BoundedCursor, query: Query, params: Params | None, prepare: bool | None, binary: bool | None
    ) -> None:
        """set_config + the statement in one pipeline, one Sync: one round trip."""
        in_transaction = self.info.transaction_status == pq.TransactionStatus.INTRANS
        _state.in_bounded_pipeline = True
        try:
            # Leaving the pipeline sends the one Sync and waits for both results (an
            # explicit sync() before it would cost a second round trip).
            with self.pipeline():
                psycopg.Cursor(self).execute(_BOUND_STATEMENT, (str(self.statement_timeout_ms),), prepare=False)
                cursor.execute_unbounded(query, params, prepare=prepare, binary=binary)
        finally:
            _state.in_bounded_pipeline = False
        if in_transaction:
            self._transaction_bounded = True


def execute_with_settings(
    cursor: psycopg.Cursor[Any],
    query: Query,
    params: Params | None,
    settings: dict[str, str],
    *,
    prepare: bool | None = None,
    before: Sequence[tuple[psycopg.Cursor[Any], Query, Params | None]] = (),
) -> None:
    """Execute ``query`` under transaction-local ``settings``: a set_config statement
    (delivery.sql "statement_settings") pipelined in front of it, one Sync, one round trip.
    ``before``: statements (each on its own cursor, whose results the caller fetches)
    sent between the two, in the same transaction: in autocommit, all of them commit
    together or none does.
    In autocommit both run in one implicit transaction, so the settings end with it;
    in an explicit transaction they last until it ends. Through a transaction pooler
    the statement's statement_timeout rides in the same set_config. The caller
    fetches the results from ``cursor`` afterwards. ``prepare``: as psycopg's (True:
    a server-side prepared statement from the first call, which a transaction pooler
    must never be sent: the caller passes None there)."""
    conn = cursor.connection
    settings = dict(settings)
    bounds_transaction = False
    if isinstance(conn, PoolerConnection) and conn._needs_bound():
        settings.setdefault("statement_timeout", str(conn.statement_timeout_ms))  # a caller's own wins
        bounds_transaction = conn.info.transaction_status == pq.TransactionStatus.INTRANS
    _state.in_bounded_pipeline = True
    try:
        with conn.pipeline():  # leaving it sends the one Sync and waits for both results
            # Prepared on a direct connection once psycopg's threshold is reached (parsed
            # once per connection; PostgreSQL still plans it on each call, its cost
            # estimate favouring custom plans); never through a transaction pooler.
            prepare_settings = False if isinstance(conn, PoolerConnection) else None
            psycopg.Cursor(conn).execute(
                _SETTINGS_STATEMENT, (list(settings), list(settings.values())), prepare=prepare_settings
            )
            # Inside the pipeline a BoundedCursor does not bound again (_needs_bound).
            for other, other_query, other_params in before:
                other.execute(cast(QueryNoTemplate, other_query), other_params, prepare=prepare_settings)
            cursor.execute(cast(QueryNoTemplate, query), params, prepare=prepare)
    finally:
        _state.in_bounded_pipeline = False
    if bounds_transaction and isinstance(conn, PoolerConnection):
        conn._transaction_bounded = True


class BoundedCursor(psycopg.Cursor[Any]):
    """The cursor of a PoolerConnection: ``execute`` bounds the statement (see module doc)."""

    def execute(
        self, query: Query, params: Params | None = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Self:
        conn = self.connection
        if isinstance(conn, PoolerConnection) and conn._needs_bound():
            conn._bounded(self, query, params, prepare, binary)
            return self
        return self.execute_unbounded(query, params, prepare=prepare, binary=binary)

    def execute_unbounded(
        self, query: Query, params: Params | None = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Self:
        # One implementation serves both overloads of psycopg's execute(); the cast
        # only picks one for the type checker.
        return super().execute(cast(QueryNoTemplate, query), params, prepare=prepare, binary=binary)


def configure_bound(timeout_ms: int) -> Callable[[psycopg.Connection[Any]], None]:
    """The pool's ``configure`` callback: give each new connection its timeout."""

    def configure(conn: psycopg.Connection[Any]) -> None:
        if isinstance(conn, PoolerConnection):
            conn.statement_timeout_ms = max(0, int(timeout_ms))

    return configure
