"""WakeupOps: LISTEN/NOTIFY wake-ups. The relays mark themselves idle so inserts
notify, and each relay process listens on a dedicated connection (Listener)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from ..errors import DatabaseError
from .schema import TableSql
from .statement_counts import StatementCounts
from .store_core import StoreCore, _unset_in


class WakeupOps(StoreCore):
    # --- wake-ups --------------------------------------------------------------------
    def mark_idle(self) -> None:
        """Ask inserts to NOTIFY (see create_notify_function): the relays are idle."""
        with self._mapped("mark idle"), self._pool.connection() as conn:
            conn.execute(self.sql.query("mark_idle"))
        self.statement_counts.add("mark_idle")

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
            return Listener(conn, self.sql, self.statement_counts)


class Listener:
    """The LISTEN connection of one relay process (see create_notify_function)."""

    def __init__(
        self, conn: psycopg.Connection[Any], table_sql: TableSql, statement_counts: StatementCounts | None = None
    ) -> None:
        self._conn = conn
        self._sql = table_sql
        self._statement_counts = statement_counts

    def wait(self, timeout_seconds: float) -> bool:
        """True if a notification arrived within the timeout."""
        # Drain the generator before using the connection again: notifies() holds the
        # connection's lock while it is suspended.
        return bool(list(self._conn.notifies(timeout=timeout_seconds, stop_after=1)))

    def mark_busy(self) -> None:
        """Inserts need not notify until a worker finds nothing to claim again."""
        self._conn.execute(self._sql.query("mark_busy"))
        if self._statement_counts is not None:
            self._statement_counts.add("mark_busy")

    def close(self) -> None:
        self._conn.close()
