"""Which outboxes a process serves: the static ``[sources.<name>]`` and the discovered ones.

Every source is described by a complete ``Settings`` of its own (``settings_for``): the
process's settings with ``database.dsn``/``database.table`` replaced by the source's and
its per-outbox overrides applied. Everything that takes ``Settings`` (the store, the
worker configuration, the gauges, every operator command) therefore works on one
source unchanged.
"""

from __future__ import annotations

from typing import Any

import psycopg
from pydantic import SecretStr

from .config import Settings
from .db.discovery import list_databases as discover_databases
from .errors import ConfigError
from .source_config import DATABASE_OVERRIDES, DEFAULT_SOURCE, KAFKA_OVERRIDES, RELAY_OVERRIDES, SourceSettings


def uses_sources(settings: Settings) -> bool:
    """Does this configuration name its outboxes (``[sources]`` or ``[discovery]``)?
    Without, ``[database]`` is the one source ``default`` and the process runs exactly
    as a single-outbox relay."""
    return bool(settings.sources) or settings.discovery.enabled


def settings_for(settings: Settings, source: SourceSettings) -> Settings:
    """The settings of one source: the process's, with the source's database and overrides."""
    database = settings.database.model_copy(
        update={"dsn": source.dsn, "table": source.table, "listen_dsn": None, **source.overrides(DATABASE_OVERRIDES)}
    )
    relay = settings.relay.model_copy(update=source.overrides(RELAY_OVERRIDES))
    kafka = settings.kafka.model_copy(update=source.overrides(KAFKA_OVERRIDES))
    return settings.model_copy(
        update={
            "database": database,
            "relay": relay,
            "kafka": kafka,
            "sources": {},
            "discovery": settings.discovery.model_copy(update={"dsn": None}),
        }
    )


def discovered_source(settings: Settings, database: str) -> SourceSettings:
    """The source of one discovered database: the discovery DSN with its database name."""
    assert settings.discovery.dsn is not None
    dsn = psycopg.conninfo.make_conninfo(settings.discovery.dsn.get_secret_value(), dbname=database)
    return SourceSettings(dsn=SecretStr(dsn), table=settings.discovery.table)


def list_databases(settings: Settings, *, connect_timeout_seconds: float | None = None) -> list[str]:
    """Names of the cluster's databases matching ``discovery.database_pattern``
    (that accept connections; templates excluded), sorted."""
    assert settings.discovery.dsn is not None
    timeout = connect_timeout_seconds or settings.database.connect_timeout_seconds
    return discover_databases(
        settings.discovery.dsn.get_secret_value(),
        settings.discovery.database_pattern,
        connect_timeout_seconds=timeout,
    )


def static_sources(settings: Settings) -> dict[str, Settings]:
    """The configured sources by name (``default`` alone without ``[sources]``/``[discovery]``)."""
    if not uses_sources(settings):
        return {DEFAULT_SOURCE: settings}
    return {name: settings_for(settings, source) for name, source in settings.sources.items()}


def all_sources(settings: Settings) -> dict[str, Settings]:
    """Static and (if configured) discovered sources; a static name wins over a database's."""
    found = static_sources(settings)
    if settings.discovery.enabled:
        for database in list_databases(settings):
            found.setdefault(database, settings_for(settings, discovered_source(settings, database)))
    return found


def source_settings(settings: Settings, name: str | None) -> Settings:
    """The settings of the source an operator command names with ``--source``.

    Without ``--source``: the only source there is (today's ``[database]``), or a
    ConfigError when several are configured. ``--source default`` names ``[database]``
    when no sources are configured."""
    if name is None:
        if not uses_sources(settings):
            return settings
        names = sorted(static_sources(settings))
        if len(names) == 1 and not settings.discovery.enabled:
            return static_sources(settings)[names[0]]
        raise ConfigError(
            "several sources are configured: name one with --source NAME"
            + (f" (configured: {', '.join(names)})" if names else "")
        )
    statics = static_sources(settings)
    if name in statics:
        return statics[name]
    if settings.discovery.enabled and name in list_databases(settings):
        return settings_for(settings, discovered_source(settings, name))
    known = sorted(statics) + (["<discovered databases>"] if settings.discovery.enabled else [])
    raise ConfigError(f"--source {name}: no such source (sources: {', '.join(known)})")


def describe(settings: Settings) -> dict[str, Any]:
    """What a source is, for status output (no secrets)."""
    params = psycopg.conninfo.conninfo_to_dict(settings.database.dsn.get_secret_value())
    return {"database": params.get("dbname"), "host": params.get("host"), "table": settings.database.table}
