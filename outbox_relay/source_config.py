"""Settings of many outboxes served by one process: ``[sources.<name>]`` and ``[discovery]``.

A *source* is one outbox table in one database. Each source has its own ``dsn`` and
``table`` and may override the settings that belong to an outbox (its topic template,
message format, ordering, lease, attempts, on_done mode); everything else (workers,
batch budget, the producer, metrics) is process-wide and comes from the usual sections.

Without ``[sources]`` and ``[discovery]`` the ``[database]``/``[relay]`` sections are
the one source named ``default`` and the process runs exactly as a single-outbox relay.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

# Same rule as database.table: one or two plain identifiers, always sent quoted.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?\Z")
# Source names appear in metric labels, log lines, CLI flags and URLs: keep them plain.
SOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}\Z")
DEFAULT_SOURCE = "default"

# Per-outbox settings a source may override, by the section they override.
RELAY_OVERRIDES = (
    "ordered_event_types",
    "max_run_length",
    "on_done",
    "max_attempts",
    "lease_seconds",
    "strict_lease",
    "backoff_base_seconds",
    "backoff_cap_seconds",
    "max_error_chars",
    "batch_size",
)
KAFKA_OVERRIDES = ("topic_template", "message_format", "cloudevents_source")
DATABASE_OVERRIDES = ("statement_timeout_ms",)


def _inherit(setting: str) -> str:
    return f"This source's {setting} (unset: the process's)."


def _check_dsn(value: SecretStr | None) -> SecretStr | None:
    import psycopg

    if value is None:
        return None
    try:
        psycopg.conninfo.conninfo_to_dict(value.get_secret_value())
    except psycopg.ProgrammingError:
        # libpq's message quotes the offending fragment, often the password: never echo it.
        raise ValueError("invalid connection string (check quoting and %-encoding; value not shown)") from None
    return value


def _check_table(value: str | None) -> str | None:
    if value is not None and not _TABLE_RE.match(value):
        raise ValueError(
            f"invalid table name {value!r}: use 'name' or 'schema.name' made of letters, digits and underscores"
        )
    return value


class SourceSettings(BaseModel):
    """One outbox: where it is, and the per-outbox settings that differ from the process's."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dsn: SecretStr = Field(description="libpq connection string or URI of the source's database (secret).")
    table: str = Field(default="outbox", description="The source's outbox table, optionally schema-qualified.")
    statement_timeout_ms: int | None = Field(default=None, ge=0, description=_inherit("database.statement_timeout_ms"))
    topic_template: str | None = Field(default=None, description=_inherit("kafka.topic_template"))
    message_format: Literal["contract", "cloudevents-binary", "cloudevents-structured", "debezium"] | None = Field(
        default=None, description=_inherit("kafka.message_format")
    )
    cloudevents_source: str | None = Field(default=None, min_length=1, description=_inherit("kafka.cloudevents_source"))
    ordered_event_types: list[str] | None = Field(default=None, description=_inherit("relay.ordered_event_types"))
    max_run_length: int | None = Field(default=None, ge=1, description=_inherit("relay.max_run_length"))
    on_done: Literal["keep", "delete"] | None = Field(default=None, description=_inherit("relay.on_done"))
    max_attempts: int | None = Field(default=None, ge=1, description=_inherit("relay.max_attempts"))
    lease_seconds: float | None = Field(default=None, ge=0.2, description=_inherit("relay.lease_seconds"))
    strict_lease: bool | None = Field(default=None, description=_inherit("relay.strict_lease"))
    backoff_base_seconds: float | None = Field(default=None, gt=0, description=_inherit("relay.backoff_base_seconds"))
    backoff_cap_seconds: float | None = Field(default=None, gt=0, description=_inherit("relay.backoff_cap_seconds"))
    max_error_chars: int | None = Field(default=None, ge=50, description=_inherit("relay.max_error_chars"))
    batch_size: int | None = Field(default=None, ge=1, le=10_000, description=_inherit("relay.batch_size"))

    @field_validator("dsn")
    @classmethod
    def _dsn_ok(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_dsn(value)

    @field_validator("table")
    @classmethod
    def _table_ok(cls, value: str) -> str | None:
        return _check_table(value)

    @field_validator("ordered_event_types", mode="before")
    @classmethod
    def _split_types(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def overrides(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The given settings this source sets (None = inherit the process's)."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class DiscoverySettings(BaseModel):
    """Serve every database of a cluster whose name matches a pattern (one source each)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dsn: SecretStr | None = Field(
        default=None,
        description="Connection string of any database of the cluster to discover in (secret); unset = no "
        "discovery. Discovered sources connect with it, the database name replaced.",
    )
    database_pattern: str = Field(
        default="%", min_length=1, description="SQL LIKE pattern of the database names to serve, e.g. tenant_%."
    )
    table: str = Field(default="outbox", description="Outbox table in every discovered database.")
    refresh_interval_seconds: float = Field(
        default=30.0, gt=0, description="How often the cluster's database list is read again."
    )

    @field_validator("dsn")
    @classmethod
    def _dsn_ok(cls, value: SecretStr | None) -> SecretStr | None:
        return _check_dsn(value)

    @field_validator("table")
    @classmethod
    def _table_ok(cls, value: str) -> str | None:
        return _check_table(value)

    @property
    def enabled(self) -> bool:
        return self.dsn is not None


def check_source_names(names: list[str]) -> None:
    for name in names:
        if not SOURCE_NAME_RE.match(name):
            raise ValueError(f"sources.{name}: invalid source name: use letters, digits, '_', '-' and '.'")
