"""Test support for many outboxes: a database per source, created and dropped by the test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE


def db_dsn(dsn: str, database: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, dbname=database)


def create_database(pg_dsn: str, name: str, *, migrate: bool = True) -> str:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = db_dsn(pg_dsn, name)
    if migrate:
        with OutboxStore(dsn, "outbox", pool_size=1) as store:
            store.migrate(on_done=ON_DONE)
    return dsn


def drop_database(pg_dsn: str, name: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def databases(pg_dsn: str) -> Iterator[Callable[..., str]]:
    """make(suffix, migrate=True) -> dsn of a new database ``<prefix>_<suffix>``
    (``make.prefix``); all dropped after the test."""
    prefix = "src_" + uuid.uuid4().hex[:8]
    made: list[str] = []

    def make(suffix: str, *, migrate: bool = True) -> str:
        name = f"{prefix}_{suffix}"
        made.append(name)
        return create_database(pg_dsn, name, migrate=migrate)

    make.prefix = prefix  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for name in made:
            drop_database(pg_dsn, name)
