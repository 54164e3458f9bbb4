"""[sources.<name>] and [discovery]: loading, per-source overrides, name resolution for
--source, secrets."""

from __future__ import annotations

import pytest

from outbox_relay.config import load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.sources import settings_for, source_settings, static_sources, uses_sources


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("OUTBOX_RELAY_"):
            monkeypatch.delenv(key)


def test_sources_from_environment_with_overrides(monkeypatch):
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_A__DSN", "postgresql://u:sekret@db-a/app")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_A__TOPIC_TEMPLATE", "a.{aggregate_type}")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__DSN", "postgresql://u@db-b/app")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__TABLE", "events.outbox")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__ON_DONE", "delete")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__ORDERED_EVENT_TYPES", '["*"]')
    monkeypatch.setenv("OUTBOX_RELAY_RELAY__MAX_ATTEMPTS", "7")
    settings = load_settings()
    assert uses_sources(settings)
    sources = static_sources(settings)
    assert sorted(sources) == ["tenant_a", "tenant_b"]
    a, b = sources["tenant_a"], sources["tenant_b"]
    assert a.database.dsn.get_secret_value() == "postgresql://u:sekret@db-a/app"
    assert a.kafka.topic_template == "a.{aggregate_type}" and a.relay.on_done == "keep"
    assert b.database.table == "events.outbox" and b.relay.on_done == "delete"
    assert b.relay.ordered_event_types == ["*"] and b.kafka.topic_template == "outbox.{aggregate_type}"
    assert a.relay.max_attempts == b.relay.max_attempts == 7  # process-wide value inherited
    assert "sekret" in settings.secret_values
    assert "sekret" not in repr(settings)


def test_without_sources_the_database_section_is_the_default_source():
    settings = load_settings(None, database={"dsn": "postgresql://u@h/db", "table": "app.outbox"})
    assert not uses_sources(settings)
    assert list(static_sources(settings)) == ["default"]
    assert source_settings(settings, None) is settings
    assert source_settings(settings, "default").database.table == "app.outbox"
    with pytest.raises(ConfigError, match="--source other: no such source"):
        source_settings(settings, "other")


def test_several_sources_need_a_name_on_the_command_line():
    settings = load_settings(None, sources={"a": {"dsn": "postgresql://h/a"}, "b": {"dsn": "postgresql://h/b"}})
    with pytest.raises(ConfigError, match="name one with --source NAME"):
        source_settings(settings, None)
    assert source_settings(settings, "b").database.dsn.get_secret_value() == "postgresql://h/b"
    one = load_settings(None, sources={"only": {"dsn": "postgresql://h/a", "max_attempts": 3}})
    assert source_settings(one, None).relay.max_attempts == 3


def test_unknown_source_setting_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__A__DNS", "postgresql://h/a")
    with pytest.raises(ConfigError, match=r"OUTBOX_RELAY_SOURCES__A__DNS.*did you mean OUTBOX_RELAY_SOURCES__A__DSN"):
        load_settings()


def test_bad_source_values_name_the_setting_and_hide_the_dsn():
    with pytest.raises(ConfigError, match=r"sources\.a\.table"):
        load_settings(None, sources={"a": {"dsn": "postgresql://h/a", "table": "bad;name"}})
    with pytest.raises(ConfigError, match=r"sources\.a\.dsn") as info:
        load_settings(None, sources={"a": {"dsn": "host=h password='unterminated"}})
    assert "unterminated" not in str(info.value)
    with pytest.raises(ConfigError, match=r"sources\.a\.dsn.*(missing|required)"):
        load_settings(None, sources={"a": {"table": "outbox"}})
    with pytest.raises(ConfigError, match="invalid source name"):
        load_settings(None, sources={"a b": {"dsn": "postgresql://h/a"}})


def test_a_source_lease_must_outlast_the_shared_producer_timeout():
    with pytest.raises(ConfigError, match=r"sources\.a\.lease_seconds \(5\) must be above"):
        load_settings(
            None,
            relay={"lease_seconds": 30},
            kafka={"delivery_timeout_seconds": 10},
            sources={"a": {"dsn": "postgresql://h/a", "lease_seconds": 5}},
        )


def test_discovered_source_takes_the_discovery_dsn_with_its_database_name():
    from outbox_relay.sources import discovered_source

    settings = load_settings(
        None,
        discovery={
            "dsn": "postgresql://u:pw@cluster:5433/postgres",
            "database_pattern": "tenant_%",
            "table": "app.outbox",
        },
    )
    assert uses_sources(settings) and static_sources(settings) == {}
    source = settings_for(settings, discovered_source(settings, "tenant_42"))
    import psycopg

    params = psycopg.conninfo.conninfo_to_dict(source.database.dsn.get_secret_value())
    assert params["dbname"] == "tenant_42" and params["host"] == "cluster" and params["port"] == "5433"
    assert source.database.table == "app.outbox"
    assert "pw" in settings.secret_values
