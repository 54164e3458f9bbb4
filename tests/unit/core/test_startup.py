"""The error `run` gives up with after relay.startup_timeout_seconds: every dependency
still down, named in one line, with the type (exit 1) of the database's when it is one."""

from __future__ import annotations

import pytest

from outbox_relay.core.startup import startup_gave_up
from outbox_relay.errors import BrokerUnavailable, DatabaseUnavailable, SchemaMissing


def test_both_down_names_the_database_and_the_broker():
    error = startup_gave_up(
        {
            "target": "cannot reach the Kafka cluster at 127.0.0.1:1: no broker answered",
            "database": "cannot connect to the database:\nconnection refused",
        },
        2.0,
    )
    assert isinstance(error, DatabaseUnavailable)
    assert str(error) == (
        "not ready within relay.startup_timeout_seconds (2 s), database and broker still down: "
        "database: cannot connect to the database: connection refused; "
        "broker: cannot reach the Kafka cluster at 127.0.0.1:1: no broker answered"
    )


def test_only_the_broker_down():
    error = startup_gave_up({"target": "cannot reach the Kafka cluster at k:9092: no broker answered"}, 1.5)
    assert isinstance(error, BrokerUnavailable)
    assert "(1.5 s), broker still down: broker: cannot reach the Kafka cluster at k:9092" in str(error)


def test_a_missing_table_is_schema_missing_and_says_migrate():
    error = startup_gave_up({"database": "table 'public.outbox' does not exist: run `outbox-relay migrate` first"}, 1)
    assert isinstance(error, SchemaMissing)
    assert "database still down: database: table 'public.outbox' does not exist" in str(error)


def test_nothing_down_is_a_caller_error():
    with pytest.raises(ValueError, match="at least one problem"):
        startup_gave_up({}, 1)
