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

    def mark_busy(self) -> None:
        """Inserts need not NOTIFY: the relays claim back to back."""
        with self._mapped("mark busy"), self._pool.connection() as conn:
            conn.execute(self.sql.query("mark_busy"))
        self.statement_counts.add("mark_busy")

    @property
    def can_listen(self) -> bool:
        """False behind a transaction pooler without ``database.listen_dsn``: LISTEN
        through the proxy would never hear a notification, so the relay polls."""
        return self._listen_dsn is not None

    def open_listener(self) -> Listener:
        """A dedicated (non-pooled) autocommit connection for wake-ups: on the DSN
        itself, or on ``listen_dsn`` (always a direct connection). It waits for the
        waker lock (``Listener.become_waker``), then LISTENs (``Listener.listen``)."""
        if self._listen_dsn is None:
            raise DatabaseError(
                "listen: database.transaction_pooler is set and database.listen_dsn is not: "
                "LISTEN through a transaction pooler never hears a notification"
            )
        with self._mapped("listen"):
            kwargs = {k: v for k, v in self._direct_kwargs.items() if k not in self._tcp_params}
            kwargs.update(_unset_in(self._listen_dsn, self._tcp_params))
            conn = psycopg.connect(self._listen_dsn, **kwargs)
            return Listener(conn, self.sql, self.statement_counts)


class Listener:
    """The LISTEN connection of one relay process (see create_notify_function)."""

    def __init__(
        self, conn: psycopg.Connection[Any], table_sql: TableSql, statement_counts: StatementCounts | None = None
    ) -> None:
        self._conn = conn
        self._sql = table_sql
        self._statement_counts = statement_counts

    def become_waker(self) -> None:
        """Wait until this connection holds the table's waker lock (a session advisory
        lock: released when the connection ends). A blocked lock wait sends nothing and
        commits nothing, so a standby replica costs the database no transaction."""
        self._conn.execute("SET statement_timeout = 0")  # this one statement waits for as long as it must
        self._conn.execute(self._sql.query("waker_lock"), {"key": f"outbox-relay waker {self._sql.regclass_text}"})

    def listen(self) -> None:
        self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._sql.channel)))

    def cancel(self) -> None:
        """End a wait for the waker lock from another thread (the relay stops)."""
        try:
            self._conn.cancel_safe(timeout=2.0)
        except Exception:
            pass

    def wait(self, timeout_seconds: float) -> bool:
        """True if a notification arrived within the timeout."""
        # Drain the generator before using the connection again: notifies() holds the
        # connection's lock while it is suspended.
        return bool(list(self._conn.notifies(timeout=timeout_seconds, stop_after=1)))

    def close(self) -> None:
        self._conn.close()
