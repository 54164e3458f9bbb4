"""Settings: a TOML file, then ``OUTBOX_RELAY_*`` environment variables, then CLI flags.

Precedence (highest first): CLI flags (passed as init kwargs) > environment >
TOML file > defaults. Nested settings use ``__`` in environment names, e.g.
``OUTBOX_RELAY_RELAY__LEASE_SECONDS=30``.

Secrets (the DSN password, the SASL password) are ``SecretStr`` so that neither
``repr`` nor a validation error ever shows them.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .errors import ConfigError
from .source_config import DiscoverySettings, SourceSettings, check_source_names

# One or two plain identifiers ("outbox" or "app.outbox"). Names are always sent to
# PostgreSQL quoted (psycopg.sql.Identifier); this pattern additionally refuses
# anything that could only be a mistake or an injection attempt (quotes, semicolons,
# spaces), so the error is raised at start-up and names the setting.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?\Z")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


# librdkafka properties the relay sets itself, and why they may not come from kafka.extra.
_MANAGED_PRODUCER_PROPERTIES = {
    "enable.idempotence": "the relay relies on the idempotent producer (per-partition order, no duplicates "
    "from its own retries)",
    "acks": "a row is done only once every in-sync replica has it (acks=all)",
    "request.required.acks": "a row is done only once every in-sync replica has it (acks=all)",
    "message.timeout.ms": "use kafka.delivery_timeout_seconds (checked against the lease)",
    "delivery.timeout.ms": "use kafka.delivery_timeout_seconds (checked against the lease)",
    "message.max.bytes": "use kafka.message_max_bytes (bigger rows go dead before they are fetched)",
}
# librdkafka's built-in partitioners (its `partitioner` property).
Partitioner = Literal["murmur2_random", "murmur2", "consistent_random", "consistent", "random", "fnv1a", "fnv1a_random"]
PARTITIONERS: tuple[str, ...] = get_args(Partitioner)
# kafka.extra names whose values are secrets (scrubbed from every log line).
_SECRET_EXTRA_RE = re.compile(r"password|secret|\.pem$|sasl\.oauthbearer\.config|token", re.IGNORECASE)
# Standard Webhooks symmetric secrets: "whsec_" + base64 of 24 to 64 random bytes.
WEBHOOK_SECRET_PREFIX = "whsec_"
WEBHOOK_SECRET_MIN_BYTES = 24
WEBHOOK_SECRET_MAX_BYTES = 64
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_duration(text: str) -> float:
    """``'30s'``, ``'15m'``, ``'12h'``, ``'7d'`` (or a bare number of seconds) -> seconds."""
    match = _DURATION_RE.match(str(text))
    if not match:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h or d, e.g. 30s, 15m, 12h, 7d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatabaseSettings(_Section):
    """Where the outbox lives."""

    dsn: SecretStr = Field(
        default=SecretStr("postgresql://postgres@localhost:5432/postgres"),
        description="libpq connection string or URI of the database holding the outbox (secret).",
    )
    table: str = Field(default="outbox", description="Outbox table, optionally schema-qualified (app.outbox).")
    pool_size: int = Field(
        default=0,
        ge=0,
        le=200,
        description="Connections in the relay's pool; 0 = workers + 4 "
        "(claims and finalizes, lease keeper, gauges, /readyz).",
    )
    pool_max_idle_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A pool (per source) that grew past one connection is back to one within this long after its "
        "last busy moment: psycopg_pool closes at most one connection per check, one that stayed unused for a "
        "whole period, so its max_idle is set to this divided by the pool's size.",
    )
    connect_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of one connection attempt.")
    statement_timeout_ms: int = Field(
        default=10_000,
        ge=0,
        description="statement_timeout of relay connections; bounds every claim/finalize (0 = none).",
    )
    tcp_keepalives_idle_seconds: int = Field(
        default=5,
        ge=0,
        description="libpq keepalives_idle: seconds a connection may be silent before TCP keepalive probes "
        "start (0 = no keepalives); with interval and count, how soon a connection whose peer "
        "vanished is dropped while the relay waits on it. A value in dsn wins.",
    )
    tcp_keepalives_interval_seconds: int = Field(
        default=2,
        ge=1,
        description="libpq keepalives_interval: seconds between unanswered keepalive probes.",
    )
    tcp_keepalives_count: int = Field(
        default=3,
        ge=1,
        description="libpq keepalives_count: unanswered probes before the connection is dropped.",
    )
    tcp_user_timeout_ms: int = Field(
        default=10_000,
        ge=0,
        description="libpq tcp_user_timeout: how long sent data may stay unacknowledged before the connection "
        "is dropped (a statement or finalize sent into a partition fails after this, not after "
        "the kernel's ~15 minutes of retransmissions); 0 = the kernel's default. A value in dsn wins.",
    )
    transaction_pooler: bool = Field(
        default=False,
        description="dsn points at a transaction-pooling proxy (PgBouncer pool_mode = transaction, RDS Proxy): "
        "no startup options, no server-side prepared statements, statement_timeout set inside "
        "each statement's transaction, and LISTEN only on listen_dsn.",
    )
    autovacuum: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Autovacuum storage parameters migrate sets on the outbox, e.g. "
        '{autovacuum_vacuum_threshold = 5000}; "default" removes one. Unset ones get the queue '
        "defaults (scale factor 0, threshold 1000, cost delay 0) unless the table has its own value.",
    )
    listen_dsn: SecretStr | None = Field(
        default=None,
        description="Direct (unpooled) DSN used only by the one LISTEN connection per relay process; default: "
        "dsn, or none if transaction_pooler is set (idle workers then poll) (secret).",
    )

    def tcp_params(self) -> dict[str, int]:
        """libpq's TCP liveness parameters from these settings (the DSN's own values win)."""
        if self.tcp_keepalives_idle_seconds == 0:
            params = {"keepalives": 0}
        else:
            params = {
                "keepalives": 1,
                "keepalives_idle": self.tcp_keepalives_idle_seconds,
                "keepalives_interval": self.tcp_keepalives_interval_seconds,
                "keepalives_count": self.tcp_keepalives_count,
            }
        if self.tcp_user_timeout_ms:
            params["tcp_user_timeout"] = self.tcp_user_timeout_ms
        return params

    @field_validator("autovacuum")
    @classmethod
    def _check_autovacuum(cls, value: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        return dict(check_autovacuum_overrides(value))

    @field_validator("dsn", "listen_dsn")
    @classmethod
    def _check_dsn(cls, value: SecretStr | None) -> SecretStr | None:
        import psycopg

        if value is None:
            return None
        try:
            psycopg.conninfo.conninfo_to_dict(value.get_secret_value())
        except psycopg.ProgrammingError:
            # libpq's message quotes the offending fragment, often the password: never echo it.
            raise ValueError("invalid connection string (check quoting and %-encoding; value not shown)") from None
        return value

    @field_validator("table")
    @classmethod
    def _check_table(cls, value: str) -> str:
        if not _TABLE_RE.match(value):
            raise ValueError(
                f"invalid table name {value!r}: use 'name' or 'schema.name' made of letters, digits and underscores"
            )
        return value


class KafkaSettings(_Section):
    """The Kafka cluster and how messages are produced."""

    bootstrap_servers: str = Field(default="localhost:9092", description="Comma-separated host:port list.")
    topic_template: str = Field(
        default="outbox.{aggregate_type}",
        description="Topic for rows without their own `topic`; placeholders {aggregate_type} and {event_type}.",
    )
    delivery_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Producer message.timeout.ms in seconds; default derived from the lease (40% of it, at most 60 s).",
    )
    linger_ms: float = Field(default=5.0, ge=0, description="Producer linger.ms: how long to wait to fill a batch.")
    message_max_bytes: int = Field(
        default=1_000_000,
        ge=1000,
        description="Largest message the producer accepts; bigger rows go dead with a clear reason.",
    )
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="none", description="Producer compression.type."
    )
    security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = Field(
        default="plaintext", description="security.protocol."
    )
    sasl_mechanism: str | None = Field(default=None, description="sasl.mechanism, e.g. PLAIN or SCRAM-SHA-512.")
    sasl_username: str | None = Field(default=None, description="sasl.username.")
    sasl_password: SecretStr | None = Field(default=None, description="sasl.password (secret).")
    ssl_ca_location: str | None = Field(
        default=None,
        description="ssl.ca.location: PEM file of the CA(s) that signed the brokers' certificates "
        "(default: the system's CA store).",
    )
    ssl_certificate_location: str | None = Field(
        default=None,
        description="ssl.certificate.location: PEM client certificate (mutual TLS).",
    )
    ssl_key_location: str | None = Field(
        default=None,
        description="ssl.key.location: PEM private key of the client certificate.",
    )
    ssl_key_password: SecretStr | None = Field(
        default=None,
        description="ssl.key.password: passphrase of an encrypted client key (secret).",
    )
    client_id: str = Field(default="outbox-relay", description="client.id reported to the brokers.")
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="Any other librdkafka producer property, passed through as is (JSON object in env).",
    )
    partitioner: Partitioner = Field(
        default="murmur2_random",
        description="Partitioner of keyed messages (librdkafka's `partitioner`). murmur2_random: the Java "
        "producer's placement, so an aggregate lands where Kafka Connect, Debezium or a Java service puts the same "
        "key (librdkafka's own default, consistent_random, hashes with CRC32: other partitions). Changing it moves "
        "aggregates to other partitions (see Message formats). `kafka.extra.partitioner` may set it instead, "
        "not both with different values.",
    )
    timestamp: Literal["send_time", "created_at"] = Field(
        default="send_time",
        description="The record's timestamp (CreateTime): send_time (default) = when the relay produces it; "
        "created_at = the row's created_at (millisecond precision). A topic with message.timestamp.type="
        "LogAppendTime replaces either with the broker's clock. With created_at, a backlog delivered late "
        "carries old timestamps: time-based retention (retention.ms) may delete it soon after it arrives, "
        "and a broker with message.timestamp.before.max.ms refuses records older than that.",
    )
    message_format: Literal["contract", "cloudevents-binary", "cloudevents-structured", "debezium"] = Field(
        default="contract",
        description="Wire format of every message (Kafka and HTTP): contract, cloudevents-binary, "
        "cloudevents-structured or debezium (see Formats).",
    )
    cloudevents_source: str | None = Field(
        default=None,
        min_length=1,
        description="CloudEvents `source` attribute; default /outbox-relay/<database.table>.",
    )
    value_format: Literal["json", "avro", "json-schema", "protobuf"] = Field(
        default="json",
        description="Encoding of each Kafka record's value: json (default) = the payload's JSON text as it is; "
        "avro, json-schema or protobuf = the payload encoded against the latest schema of its subject in the "
        "Schema Registry ([schema_registry], extra `registry`; protobuf: extra `protobuf`), in the Confluent wire "
        "format (magic byte 0, schema id; protobuf: then the message indexes). "
        'Needs kafka.message_format = "contract".',
    )

    @field_validator("cloudevents_source")
    @classmethod
    def _check_source(cls, value: str | None) -> str | None:
        if value is not None and not all(0x20 < ord(c) < 0x7F or ord(c) > 0x9F for c in value):
            raise ValueError("must be a URI-reference without spaces or control characters")
        return value

    @field_validator("ssl_ca_location", "ssl_certificate_location", "ssl_key_location")
    @classmethod
    def _check_readable_file(cls, value: str | None) -> str | None:
        # librdkafka would refuse it too, but later and in its own words.
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError(f"file {value!r} does not exist or is not readable")
        return value

    @model_validator(mode="after")
    def _check_client_certificate(self) -> KafkaSettings:
        if bool(self.ssl_certificate_location) != bool(self.ssl_key_location):
            raise ValueError("kafka.ssl_certificate_location and kafka.ssl_key_location go together (mutual TLS)")
        return self

    @field_validator("extra")
    @classmethod
    def _check_extra(cls, value: dict[str, str]) -> dict[str, str]:
        """Properties the relay's guarantees rest on cannot be overridden through extra."""
        for name in value:
            if name in _MANAGED_PRODUCER_PROPERTIES:
                raise ValueError(f"{name!r} cannot be set through kafka.extra: {_MANAGED_PRODUCER_PROPERTIES[name]}")
        return value

    @model_validator(mode="after")
    def _check_partitioner(self) -> KafkaSettings:
        """``kafka.extra.partitioner`` (a librdkafka property passed through as is) keeps
        working and wins over the default; set together with ``kafka.partitioner`` it
        must say the same, else which one applies would be a guess."""
        passed = self.extra.get("partitioner")
        if passed is None:
            return self
        if passed not in PARTITIONERS:
            known = ", ".join(PARTITIONERS)
            raise ValueError(f"kafka.extra.partitioner {passed!r} is not one of librdkafka's: {known}")
        if "partitioner" in self.model_fields_set and passed != self.partitioner:
            raise ValueError(
                f"kafka.partitioner ({self.partitioner}) and kafka.extra.partitioner ({passed}) disagree: set only one"
            )
        return self

    @property
    def effective_partitioner(self) -> str:
        """The partitioner the producer is given: ``kafka.extra.partitioner`` when set."""
        return self.extra.get("partitioner", self.partitioner)

    @field_validator("topic_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        try:
            value.format(aggregate_type="a", event_type="e")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"invalid topic template {value!r}: only {{aggregate_type}} and {{event_type}} may be used"
            ) from exc
        return value


SubjectNameStrategy = Literal["topic", "record", "topic-record"]

#: The Schema Registry's schema type of a schema file, told by how its name ends.
SCHEMA_FILE_TYPES = {".avsc": "AVRO", ".json": "JSON", ".proto": "PROTOBUF"}


def schema_file_type(file_name: str) -> str | None:
    """AVRO, JSON or PROTOBUF for a schema file's name, None for another ending."""
    return SCHEMA_FILE_TYPES.get(Path(file_name).suffix.lower())


class SchemaRegistrySettings(_Section):
    """The Confluent-compatible Schema Registry of kafka.value_format = "avro" / "json-schema" / "protobuf"."""

    url: str | None = Field(
        default=None,
        description="Base URL of the registry's Confluent API, e.g. http://registry:8081 "
        "(Apicurio: http://host:8080/apis/ccompat/v7). Required when kafka.value_format is not json.",
    )
    basic_auth_user: str | None = Field(default=None, description="User name of HTTP basic authentication.")
    basic_auth_password_file: str | None = Field(
        default=None,
        description="File holding the basic-authentication password (secret; read at start, never printed).",
    )
    basic_auth_password_env: str | None = Field(
        default=None,
        description="Name of an environment variable holding the basic-authentication password (instead of a file).",
    )
    bearer_token_file: str | None = Field(
        default=None, description="File holding a bearer token sent as Authorization: Bearer (secret)."
    )
    bearer_token_env: str | None = Field(
        default=None, description="Name of an environment variable holding the bearer token (instead of a file)."
    )
    bearer_logical_cluster: str = Field(
        default="",
        description="Sent with a bearer token as target-sr-cluster (Confluent Cloud: the registry's lsrc-... id).",
    )
    ssl_ca_location: str | None = Field(
        default=None, description="PEM file of the CA(s) that signed the registry's certificate (https URLs)."
    )
    subject_name_strategy: SubjectNameStrategy = Field(
        default="topic",
        description="Subject whose latest schema encodes a value: topic = <topic>-value; record = the row's "
        "event_type; topic-record = <topic>-<event_type>.",
    )
    auto_register: bool = Field(
        default=False,
        description="Register schemas from the relay. Not supported: the relay has no schema of its own to "
        "register; subjects must be registered beforehand (must stay false).",
    )
    schema_files: dict[str, str] = Field(
        default_factory=dict,
        description="Schemas the relay registers at start, subject -> file: .avsc = Avro, .json = JSON Schema, "
        ".proto = Protobuf (self-contained or importing only google/protobuf/*). Registering the same schema again "
        "is a no-op; a schema the registry refuses (incompatible, invalid) stops the start with the registry's "
        "reason; while the registry does not answer the relay waits. Relative paths are taken from the working "
        "directory. Rows are never registered from (auto_register stays false).",
    )
    timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="Timeout of one request to the registry.")
    missing_schema_defer_seconds: float = Field(
        default=15.0,
        gt=0,
        description="How long a row waits (attempt refunded) when its subject has no schema in the registry.",
    )
    latest_cache_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long the latest schema of a subject is cached before it is asked again "
        "(a newly registered version is used after at most this long).",
    )

    @field_validator("basic_auth_password_env", "bearer_token_env")
    @classmethod
    def _check_env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME_RE.match(value):
            raise ValueError("must be the name of an environment variable (letters, digits, _), not a secret")
        return value

    @field_validator("ssl_ca_location")
    @classmethod
    def _check_ca_file(cls, value: str | None) -> str | None:
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError(f"file {value!r} does not exist or is not readable")
        return value

    @field_validator("schema_files")
    @classmethod
    def _check_schema_files(cls, value: dict[str, str]) -> dict[str, str]:
        for subject, file_name in value.items():
            if not subject.strip():
                raise ValueError("a subject name is empty")
            if schema_file_type(file_name) is None:
                known = ", ".join(SCHEMA_FILE_TYPES)
                raise ValueError(f"{subject}: {file_name!r} ends in none of {known} (the schema type is told by it)")
            if not os.path.isfile(file_name) or not os.access(file_name, os.R_OK):
                raise ValueError(f"{subject}: file {file_name!r} does not exist or is not readable")
        return value

    @field_validator("auto_register")
    @classmethod
    def _check_auto_register(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "not supported yet: the relay holds no schema to register; register the subject's schema beforehand"
            )
        return value

    @model_validator(mode="after")
    def _check_credentials(self) -> SchemaRegistrySettings:
        if self.basic_auth_password_file and self.basic_auth_password_env:
            raise ValueError("schema_registry.basic_auth_password_file and _env: set only one")
        if self.bearer_token_file and self.bearer_token_env:
            raise ValueError("schema_registry.bearer_token_file and _env: set only one")
        has_password = bool(self.basic_auth_password_file or self.basic_auth_password_env)
        if has_password != bool(self.basic_auth_user):
            raise ValueError("schema_registry.basic_auth_user and its password go together")
        if has_password and (self.bearer_token_file or self.bearer_token_env):
            raise ValueError("schema_registry: basic authentication and a bearer token exclude each other")
        return self

    def _secret(
        self, file_name: str | None, env_name: str | None, what: str, environ: Mapping[str, str]
    ) -> SecretStr | None:
        if file_name:
            where = f"schema_registry.{what}_file: {file_name!r}"
            try:
                text = Path(file_name).read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                raise ConfigError(f"{where} does not exist") from None
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise ConfigError(f"{where} cannot be read ({reason})") from None
            if not text:
                raise ConfigError(f"{where} is empty")
            return SecretStr(text)
        if env_name:
            value = environ.get(env_name, "").strip()
            if not value:
                raise ConfigError(f"environment variable {env_name} (schema_registry.{what}_env) is not set or empty")
            return SecretStr(value)
        return None

    def basic_auth_password(self, environ: Mapping[str, str] | None = None) -> SecretStr | None:
        """The basic-authentication password from its file or variable; ConfigError
        (one line, naming where, never the content) when it cannot be read."""
        env = os.environ if environ is None else environ
        return self._secret(self.basic_auth_password_file, self.basic_auth_password_env, "basic_auth_password", env)

    def bearer_token(self, environ: Mapping[str, str] | None = None) -> SecretStr | None:
        """The bearer token from its file or variable (ConfigError as above)."""
        env = os.environ if environ is None else environ
        return self._secret(self.bearer_token_file, self.bearer_token_env, "bearer_token", env)


class RelaySettings(_Section):
    """The claim -> publish -> finalize loop."""

    workers: int = Field(default=4, ge=1, le=64, description="Worker threads per relay process.")
    batch_size: int = Field(default=1000, ge=1, le=10_000, description="Rows claimed per batch by one worker.")
    lease_seconds: float = Field(
        default=30.0, ge=0.2, description="How long a claim owns its rows before others may take them."
    )
    max_attempts: int = Field(default=12, ge=1, description="Claims per row before it goes dead (a crash counts).")
    ordered_event_types: list[str] = Field(
        default_factory=list,
        description='Event types delivered in per-aggregate order; ["*"] = all, [] = none.',
    )
    max_run_length: int = Field(
        default=100,
        ge=1,
        description="Ordered claim: rows of one aggregate taken behind its head in one claim.",
    )
    on_done: Literal["keep", "delete"] = Field(
        default="keep",
        description='What the finalize does with a delivered row: "keep" it as done until `purge`, or '
        '"delete" it (about half the WAL). A property of the table: `migrate` sets it, `run` checks it.',
    )
    finalize_synchronous_commit: Literal["on", "off"] = Field(
        default="off",
        description="PostgreSQL's synchronous_commit for the finalize (claims always commit durably). "
        '"off": the finalize does not wait for its WAL to reach disk (or a synchronous standby), which '
        "spares the database a flush per batch; a server crash or failover may lose the last fraction of a "
        "second of finalizes, and those rows are delivered again when their lease expires (at-least-once, "
        'fencing intact: the lost finalize never reuses a token). "on": every finalize is durable.',
    )
    strict_lease: bool = Field(
        default=False,
        description="If true an owner whose lease expired can never finalize, even if nobody reclaimed the row.",
    )
    poll_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        description="Idle sleep between empty claims (jittered) of each worker when the relay does not "
        "listen for inserts (relay.listen_notify = false, or a transaction pooler without database.listen_dsn).",
    )
    claim_linger_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="The shortest time between two claims of a worker whose last claim was not full, while "
        "inserts arrive at least twice per this many milliseconds (a hundred events per second and more; "
        "always when the relays are busy or nobody listens): one claim then takes several rows instead of one "
        "each. It adds at most this much to a row's latency. Slower, a row is claimed at once. 0: never wait.",
    )
    finalize_hold_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="While the relay listens for inserts and a worker sleeps between small batches: how long "
        "the finalize of a delivered batch may wait for the worker's next claim, so that both go in one "
        "transaction and one round trip (one transaction per event at a few tens of events per second instead "
        "of two). Delivery is not delayed, only the row's turn to done (done_at); at most a tenth of "
        "relay.lease_seconds. Not with ordered event types. 0: finalize at once.",
    )
    idle_poll_interval_seconds: float = Field(
        default=5.0,
        gt=0,
        description="While the relay listens for inserts: how often one idle worker of the process claims "
        "anyway (the others sleep until woken), the safety net for a notification that cannot come (a row "
        "inserted while the idle flag turned, an expired lease of a crashed replica). A row this process "
        "rescheduled is claimed when it becomes due, not at this interval.",
    )
    listen_notify: bool = Field(default=True, description="Wake idle workers on insert via LISTEN/NOTIFY.")
    backoff_base_seconds: float = Field(default=1.0, gt=0, description="Retry backoff base (full jitter).")
    backoff_cap_seconds: float = Field(default=300.0, gt=0, description="Retry backoff cap.")
    startup_timeout_seconds: float = Field(
        default=0.0,
        ge=0,
        description="How long `run` waits at start for the database, the table and the broker (0 = until they "
        "answer); with sources: for the broker and at least one ready source, then exit 1.",
    )
    shutdown_timeout_seconds: float = Field(
        default=10.0, ge=0, description="On SIGTERM, how long to wait for in-flight batches before releasing them."
    )
    lease_extend_after_fraction: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Extend a batch's lease once its delivery has taken this fraction of the lease.",
    )
    owner: str = Field(default_factory=default_owner, description="Lease owner prefix (default host:pid).")
    publisher: str = Field(
        default="kafka",
        description='"kafka", "http", an installed plug-in (entry point group outbox_relay.publishers), '
        'or "package.module:factory" returning a Publisher.',
    )
    max_error_chars: int = Field(default=1000, ge=50, description="last_error is truncated to this length.")
    max_batch_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="A claim stops adding rows once their payload + headers bytes reach this (always >= 1 row).",
    )
    max_in_flight_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Payload + headers bytes claimed but not yet finalized, per process; workers wait above it.",
    )

    @field_validator("ordered_event_types", mode="before")
    @classmethod
    def _split_types(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value


_INTERVAL_RE = re.compile(r"^\s*(\d+)\s*(minutes?|mins?|hours?|days?|m|h|d)\s*\Z", re.IGNORECASE)
_INTERVAL_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400}
#: The shortest partition width: partitions are named after their start to the minute.
MIN_PARTITION_INTERVAL_SECONDS = 60


def parse_partition_interval(text: str) -> int:
    """A partition width in whole minutes, hours or days (``'5 minutes'``, ``'1 hour'``,
    ``'6 hours'``, ``'1 day'``, ``'7 days'``, or ``'15m'``, ``'12h'``, ``'1d'``) -> seconds,
    at least one minute. Partitions are aligned to the Unix epoch in UTC, so every bound
    falls on a whole minute and names made of the start to the minute stay unique and
    sort by time; a width that does not divide a week would drift against weekdays: any
    whole number is still accepted, the alignment is documented."""
    match = _INTERVAL_RE.match(str(text))
    if not match or int(match.group(1)) == 0:
        raise ValueError(
            f"invalid partition interval {text!r}: use a whole number of minutes, hours or days, at least "
            '1 minute, e.g. "5 minutes", "1 hour", "6 hours", "1 day", "7 days"'
        )
    return int(match.group(1)) * _INTERVAL_UNIT_SECONDS[match.group(2).lower()[0]]


class PartitioningSettings(_Section):
    """A time-partitioned outbox (keep mode): partitions by created_at, retention by
    dropping whole partitions instead of deleting rows (docs/how-to/partitioned-outbox.md)."""

    interval: str | None = Field(
        default=None,
        description='Width of one partition: "1 hour", "1 day", or any whole number of minutes, hours or days '
        '("5 minutes", "6 hours", "7 days"; at least 1 minute). Set: `migrate` creates a new outbox partitioned '
        "by range of created_at. Unset (default): a plain table.",
    )
    retention: str = Field(
        default="7d",
        description="How long rows are kept, counted from created_at: a partition whose whole range is older "
        "than this is dropped once it holds no pending, processing or dead row (30s, 15m, 12h, 7d).",
    )
    premake: int = Field(default=4, ge=1, le=1000, description="Partitions created ahead of the current one.")
    maintain_interval_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How often a running relay creates partitions ahead and drops expired ones "
        "(with maintain_in_relay).",
    )
    maintain_in_relay: bool = Field(
        default=True,
        description="Does `run` do the partition maintenance itself (besides `outbox-relay maintain`)? It needs "
        "the table's owner: with a least-privilege relay role, set false and run `maintain` as the owner.",
    )
    lock_timeout_ms: int = Field(
        default=2000,
        ge=10,
        le=60_000,
        description="lock_timeout of every partition DDL: the longest a writer may queue behind one attempt.",
    )
    ddl_attempts: int = Field(
        default=5, ge=1, le=100, description="Attempts of one partition DDL whose lock was not available."
    )

    @field_validator("interval")
    @classmethod
    def _check_interval(cls, value: str | None) -> str | None:
        if value is not None:
            parse_partition_interval(value)
        return value

    @field_validator("retention")
    @classmethod
    def _check_retention(cls, value: str) -> str:
        parse_duration(value)
        return value

    @model_validator(mode="after")
    def _check_premade_span(self) -> PartitioningSettings:
        # The partitions made ahead must outlast two of the relay's maintenance rounds
        # (one may fail and be retried): else rows land in the default partition, and a
        # partition for their range can no longer be attached. Matters with short widths.
        if self.interval is None or not self.maintain_in_relay:
            return self
        ahead_seconds = self.premake * self.interval_seconds
        if ahead_seconds < 2 * self.maintain_interval_seconds:
            raise ValueError(
                f"premake = {self.premake} partitions of {self.interval!r} cover {ahead_seconds} s ahead, less than "
                f"two maintenance rounds (2 x maintain_interval_seconds = {2 * self.maintain_interval_seconds:g} s): "
                "raise premake or lower maintain_interval_seconds"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    @property
    def interval_seconds(self) -> int:
        return parse_partition_interval(self.interval or "")

    @property
    def retention_seconds(self) -> float:
        return parse_duration(self.retention)


class MetricsSettings(_Section):
    """The Prometheus sidecar."""

    enabled: bool = Field(default=True, description="Serve /metrics, /healthz and /readyz.")
    host: str = Field(default="0.0.0.0", description="Address the metrics server binds.")
    port: int = Field(default=9464, ge=0, le=65535, description="Port of the metrics server (0 = any free port).")
    refresh_interval_seconds: float = Field(default=5.0, gt=0, description="How often gauges are read from the table.")
    idle_refresh_interval_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How often gauges are read while the relay is idle: no row claimed or finalized since the "
        "last read, which found nothing pending or processing. The first claim of a row brings back "
        "metrics.refresh_interval_seconds at the next tick. At most the larger of the two.",
    )
    query_timeout_ms: int = Field(default=2000, ge=1, description="statement_timeout of each gauge query.")
    exact_count_limit: int = Field(
        default=100_000,
        ge=1,
        description="Rows per status counted at every refresh; above it the gauge shows the last slow exact count.",
    )
    exact_count_interval_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How often a status above exact_count_limit is counted exactly for the depth gauge.",
    )
    exact_count_timeout_ms: int = Field(
        default=10_000,
        ge=1,
        description="Time budget of an exact count (gauge, status, dead list, console); past it: a lower bound (>= N).",
    )
    xmin_horizon_warn_seconds: float = Field(
        default=300.0,
        ge=0,
        description="Log one warning when the oldest xmin horizon holding back vacuum of the outbox (a long "
        "transaction, a prepared transaction, a replication slot) is older than this (0 = never).",
    )


class HttpPublisherSettings(_Section):
    """The built-in HTTP publisher (relay.publisher = "http")."""

    url_template: str = Field(
        default="http://localhost:8080/events/{event_type}",
        description="Target URL; placeholders {aggregate_type}, {aggregate_id}, {event_type}, {topic}, {id}.",
    )
    timeout_seconds: float | None = Field(
        default=None, gt=0, description="Per-request timeout; default derived from the lease (25% of it, at most 30 s)."
    )
    max_concurrency: int = Field(default=16, ge=1, le=512, description="Requests in flight per batch.")
    done_statuses: list[int] = Field(
        default_factory=lambda: [409], description="Non-2xx statuses meaning 'already done'."
    )
    defer_statuses: list[int] = Field(
        default_factory=list, description="Statuses meaning 'not yet': defer, attempt refunded."
    )
    defer_seconds: float = Field(
        default=30.0, gt=0, description="Delay of a deferred row when no Retry-After is given."
    )
    headers: dict[str, str] = Field(default_factory=dict, description="Extra headers sent with every request.")
    signing_secret_files: list[str] = Field(
        default_factory=list,
        description="Files each holding one Standard Webhooks signing secret (whsec_ + base64 of 24 to 64 random "
        "bytes): every request then carries webhook-id, webhook-timestamp and webhook-signature, one signature per "
        "secret (several = rotation). Secrets are read from files or signing_secrets_env only, never written in "
        "the configuration.",
    )
    signing_secrets_env: str | None = Field(
        default=None,
        description="Name of an environment variable holding signing secrets (whsec_..., space-separated), "
        "used besides signing_secret_files.",
    )

    @field_validator("signing_secrets_env")
    @classmethod
    def _check_signing_secrets_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME_RE.match(value):
            raise ValueError("must be the name of an environment variable (letters, digits, _), not a secret")
        return value

    @property
    def signs_requests(self) -> bool:
        return bool(self.signing_secret_files) or self.signing_secrets_env is not None

    def signing_secrets(self, environ: Mapping[str, str] | None = None) -> list[SecretStr]:
        """The Standard Webhooks secrets (``whsec_...``) from the files, then from the
        environment variable; ConfigError (one line, naming the file or variable, never
        the content) if one cannot be read or is not a secret of that format."""
        env = os.environ if environ is None else environ
        found: list[tuple[str, str]] = []  # (where it came from, secret)
        for file_name in self.signing_secret_files:
            where = f"http.signing_secret_files: {file_name!r}"
            try:
                text = Path(file_name).read_text(encoding="utf-8")
            except FileNotFoundError:
                raise ConfigError(f"{where} does not exist") from None
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise ConfigError(f"{where} cannot be read ({reason})") from None
            words = text.split()
            if len(words) != 1:
                raise ConfigError(f"{where} must hold exactly one secret (it holds {len(words)} words)")
            found.append((where, words[0]))
        if self.signing_secrets_env is not None:
            where = f"environment variable {self.signing_secrets_env} (http.signing_secrets_env)"
            value = env.get(self.signing_secrets_env)
            if value is None or not value.split():
                raise ConfigError(f"{where} is not set or empty")
            found.extend((where, word) for word in value.split())
        for where, secret in found:
            problem = webhook_secret_problem(secret)
            if problem:
                raise ConfigError(f"{where}: {problem}")
        return [SecretStr(secret) for _, secret in found]


def webhook_secret_bytes(secret: str) -> bytes:
    """``whsec_<base64>`` -> the HMAC key; ValueError (never quoting the secret) otherwise."""
    import base64
    import binascii

    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        raise ValueError(f"not a Standard Webhooks secret (it must start with {WEBHOOK_SECRET_PREFIX})")
    try:
        key = base64.b64decode(secret[len(WEBHOOK_SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the part after {WEBHOOK_SECRET_PREFIX} is not valid base64") from None
    if not WEBHOOK_SECRET_MIN_BYTES <= len(key) <= WEBHOOK_SECRET_MAX_BYTES:
        raise ValueError(
            f"the key is {len(key)} bytes; the Standard Webhooks scheme wants "
            f"{WEBHOOK_SECRET_MIN_BYTES} to {WEBHOOK_SECRET_MAX_BYTES} random bytes"
        )
    return key


def webhook_secret_problem(secret: str) -> str | None:
    try:
        webhook_secret_bytes(secret)
    except ValueError as exc:
        return str(exc)
    return None


class RateLimitSettings(_Section):
    """One ``[[limits]]`` entry: a token bucket for the messages to one topic or one HTTP host."""

    topic: str | None = Field(default=None, description="Limit the messages to this topic (exact name).")
    host: str | None = Field(
        default=None, description="Limit the requests to this host of http.url_template (name without port)."
    )
    rate_per_second: float = Field(gt=0, le=1_000_000, description="Messages per second, per relay process.")
    burst: int = Field(
        default=1, ge=1, le=1_000_000, description="Messages that may go at once after a quiet spell (bucket size)."
    )

    @model_validator(mode="after")
    def _check_match(self) -> RateLimitSettings:
        if (self.topic is None) == (self.host is None):
            raise ValueError("give exactly one of topic or host")
        for name in ("topic", "host"):
            value = getattr(self, name)
            if value is not None and (not value or value != value.strip()):
                raise ValueError(f"{name} must be a non-empty name without surrounding spaces")
        return self


class OtelSettings(_Section):
    """OpenTelemetry tracing (the ``otel`` extra). Exporter, endpoint, service name,
    sampler and resource come from the standard ``OTEL_*`` variables."""

    enabled: bool = Field(
        default=False,
        description="Trace every published message (needs outbox-relay[otel]); configure the exporter with "
        "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...",
    )


class ConsoleSettings(_Section):
    """The operator console (`outbox-relay console`, extra `console`)."""

    token: SecretStr | None = Field(
        default=None,
        description="Access token (secret) for pages, API and actions; unset = read-only console that refuses actions.",
    )
    host: str = Field(default="127.0.0.1", description="Address the console binds.")
    port: int = Field(default=9465, ge=0, le=65535, description="Port of the console (0 = any free port).")
    page_size: int = Field(default=50, ge=1, le=500, description="Dead rows / audit entries per page.")
    statement_timeout_ms: int = Field(default=5000, ge=100, description="statement_timeout of every console query.")
    chunk_size: int = Field(default=1000, ge=1, le=10_000, description="Rows per transaction of a bulk retry/skip.")
    sources_refresh_seconds: float = Field(
        default=15.0,
        ge=1,
        le=3600,
        description="How old the figures of the list of sources (queue depth, oldest pending age, reachable) may "
        "get before a request has every source read again, a few at a time in the background; the list is "
        "answered from the figures held meanwhile.",
    )
    session_hours: float = Field(default=12.0, gt=0, description="How long a console login lasts.")
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description="Addresses or networks (CIDR) of the TLS-terminating reverse proxies in front of the console, "
        "whose X-Forwarded-Proto and X-Forwarded-For are believed (https, client address); "
        '[] = none; ["*"] = any peer, believing the forgeable left-most X-Forwarded-For (avoid).',
    )
    cookie_secure: Literal["auto", "always"] = Field(
        default="auto",
        description='Secure flag of the session cookie: "auto" = when the login came over https (directly or '
        'by a trusted proxy\'s X-Forwarded-Proto), "always" = also on plain http.',
    )
    login_max_failures: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Wrong tokens (login form or bearer) from one client address before it is locked out.",
    )
    login_lockout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="First lockout; doubles with every further wrong token, up to 1 h (or this, if longer). "
        "Answered 429 with Retry-After, the token not even checked.",
    )

    @field_validator("forwarded_allow_ips", mode="before")
    @classmethod
    def _split_proxies(cls, value: Any) -> Any:
        if isinstance(value, str):  # "10.0.0.7, 10.0.1.0/24" as uvicorn's --forwarded-allow-ips takes it
            return value.split(",")
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _check_proxies(cls, value: list[str]) -> list[str]:
        import ipaddress

        cleaned = [item.strip() for item in value if item.strip()]
        for item in cleaned:
            if item == "*":
                continue
            try:
                ipaddress.ip_network(item) if "/" in item else ipaddress.ip_address(item)
            except ValueError:
                raise ValueError(
                    f"{item!r} is not an IP address or network (e.g. 10.0.0.7, 10.0.0.0/8, "
                    "fd00::/8; a network's host bits must be zero)"
                ) from None
        if "*" in cleaned and len(cleaned) > 1:
            raise ValueError('"*" (trust any address) goes alone')
        return cleaned


class LogSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level.")
    format: Literal["auto", "json", "console"] = Field(
        default="auto", description="Output: auto (console on a terminal, JSON lines otherwise), json or console."
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_RELAY_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    schema_registry: SchemaRegistrySettings = Field(default_factory=SchemaRegistrySettings)
    relay: RelaySettings = Field(default_factory=RelaySettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    http: HttpPublisherSettings = Field(default_factory=HttpPublisherSettings)
    otel: OtelSettings = Field(default_factory=OtelSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    partitioning: PartitioningSettings = Field(default_factory=PartitioningSettings)
    # Many outboxes from one process (source_config.py); empty = [database] is the one source.
    sources: dict[str, SourceSettings] = Field(default_factory=dict)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    # [[limits]]: token buckets per topic or HTTP host (core/rate_limit.py); per process.
    limits: list[RateLimitSettings] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _CURRENT_TOML.get("path")
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @model_validator(mode="after")
    def _check_timeouts(self) -> Settings:
        lease = self.relay.lease_seconds
        explicit = self.kafka.delivery_timeout_seconds
        if explicit is not None and explicit >= lease:
            raise ValueError(
                f"kafka.delivery_timeout_seconds ({explicit:g}) must be below relay.lease_seconds ({lease:g}): "
                "a delivery still pending when the lease ends would be published twice"
            )
        http_timeout = self.http.timeout_seconds
        if http_timeout is not None and http_timeout >= lease:
            raise ValueError(f"http.timeout_seconds ({http_timeout:g}) must be below relay.lease_seconds ({lease:g})")
        return self

    # --- derived values -------------------------------------------------------------
    @property
    def delivery_timeout_seconds(self) -> float:
        """Producer delivery timeout: explicit, or 40 % of the lease (capped at 60 s)."""
        if self.kafka.delivery_timeout_seconds is not None:
            return self.kafka.delivery_timeout_seconds
        return min(60.0, self.relay.lease_seconds * 0.4)

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        seen: set[tuple[str, str]] = set()
        for index, limit in enumerate(self.limits):
            kind, value = ("topic", limit.topic) if limit.topic is not None else ("host", limit.host or "")
            key = (kind, value.lower() if kind == "host" else value)
            if key in seen:
                raise ValueError(f"limits[{index}]: a second limit for {kind} {value!r}")
            seen.add(key)
            if kind == "host" and self.relay.publisher != "http":
                raise ValueError(f'limits[{index}]: a host limit applies to relay.publisher = "http" only')
        return self

    @model_validator(mode="after")
    def _check_value_format(self) -> Settings:
        if self.kafka.value_format == "json":
            if self.schema_registry.schema_files:
                raise ValueError(
                    "schema_registry.schema_files: the relay registers schemas only for the value formats that use "
                    'them (kafka.value_format = "avro", "json-schema" or "protobuf")'
                )
            return self
        if self.schema_registry.url is None:
            raise ValueError(f'kafka.value_format = "{self.kafka.value_format}" needs schema_registry.url')
        if self.kafka.message_format != "contract":
            raise ValueError(
                f'kafka.value_format = "{self.kafka.value_format}" works with kafka.message_format = "contract" '
                f"only (not yet with {self.kafka.message_format})"
            )
        if self.relay.publisher != "kafka":
            raise ValueError(
                f'kafka.value_format = "{self.kafka.value_format}" applies to relay.publisher = "kafka" only'
            )
        return self

    @model_validator(mode="after")
    def _check_budgets(self) -> Settings:
        if self.relay.max_in_flight_bytes < self.relay.max_batch_bytes:
            raise ValueError(
                f"relay.max_in_flight_bytes ({self.relay.max_in_flight_bytes}) must be at least "
                f"relay.max_batch_bytes ({self.relay.max_batch_bytes}): a worker could never claim"
            )
        return self

    @model_validator(mode="after")
    def _check_sources(self) -> Settings:
        check_source_names(list(self.sources))
        floor = self.delivery_timeout_seconds
        for name, source in self.sources.items():
            if source.lease_seconds is not None and source.lease_seconds <= floor:
                raise ValueError(
                    f"sources.{name}.lease_seconds ({source.lease_seconds:g}) must be above the producer's delivery "
                    f"timeout ({floor:g} s, shared by every source): a delivery still pending when the lease ends "
                    "would be published twice"
                )
        return self

    @property
    def http_timeout_seconds(self) -> float:
        if self.http.timeout_seconds is not None:
            return self.http.timeout_seconds
        return min(30.0, self.relay.lease_seconds * 0.25)

    @property
    def pool_size(self) -> int:
        return self.database.pool_size or self.relay.workers + 4

    @property
    def listens_for_wakeups(self) -> bool:
        """Does the relay hold a LISTEN connection? Not through a transaction pooler:
        there only with database.listen_dsn; without it idle workers poll."""
        db = self.database
        return self.relay.listen_notify and (db.listen_dsn is not None or not db.transaction_pooler)

    @property
    def secret_values(self) -> list[str]:
        """Every secret a log line or an error message must never show: the DSNs
        (whole, and their passwords and sslpassword), the SASL password, the Kafka
        client key's passphrase, the console token and the webhook signing secrets."""
        import psycopg

        secrets: list[str] = []
        dsns = [self.database.dsn, self.database.listen_dsn, self.discovery.dsn]
        dsns.extend(source.dsn for source in self.sources.values())
        for dsn in dsns:
            if dsn is None:
                continue
            text = dsn.get_secret_value()
            secrets.append(text)
            try:
                params = psycopg.conninfo.conninfo_to_dict(text)
            except psycopg.ProgrammingError:
                params = {}
            for name in ("password", "sslpassword"):  # sslpassword: passphrase of an encrypted sslkey
                if params.get(name):
                    secrets.append(str(params[name]))
        for secret in (self.kafka.sasl_password, self.kafka.ssl_key_password):
            if secret is not None:
                secrets.append(secret.get_secret_value())
        if self.console.token is not None:
            secrets.append(self.console.token.get_secret_value())
        for registry_secret in self._registry_secrets():
            secrets.append(registry_secret.get_secret_value())
        # Secrets passed straight to librdkafka through kafka.extra (OAuth client
        # secrets, keystore passwords, inline PEM keys).
        secrets.extend(value for name, value in self.kafka.extra.items() if _SECRET_EXTRA_RE.search(name))
        # The webhook signing secrets, and their base64 part (a secret is a secret in either spelling).
        if self.http.signs_requests:
            try:
                signing = [secret.get_secret_value() for secret in self.http.signing_secrets()]
            except ConfigError:
                signing = []  # reported where the publisher is built; nothing of it can leak before
            for signing_secret in signing:
                secrets.extend((signing_secret, signing_secret.removeprefix(WEBHOOK_SECRET_PREFIX)))
        return secrets

    def _registry_secrets(self) -> list[SecretStr]:
        try:
            found = [self.schema_registry.basic_auth_password(), self.schema_registry.bearer_token()]
        except ConfigError:
            return []  # reported where the publisher is built; nothing of it can leak before
        return [secret for secret in found if secret is not None]


_CURRENT_TOML: dict[str, Path | None] = {"path": None}


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build settings from file + env + overrides; raise ConfigError with one readable line.

    ``overrides`` are nested dicts, e.g. ``{"relay": {"workers": 8}}`` (CLI flags).
    """
    path_text = config_file or os.environ.get("OUTBOX_RELAY_CONFIG")
    path: Path | None = None
    if path_text:
        path = Path(path_text)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        check_toml_file(path)
    _CURRENT_TOML["path"] = path
    check_environment(os.environ)
    try:
        # pydantic-settings deep-merges its sources, so {"relay": {"workers": 8}}
        # overrides only that key and leaves the section's others to env and file.
        return Settings(**overrides)
    except ConfigError:
        raise
    except Exception as exc:  # pydantic ValidationError, TOML decode errors
        raise ConfigError(describe_validation_error(exc)) from None
    finally:
        _CURRENT_TOML["path"] = None


_TOML_POSITION_RE = re.compile(r"^(?P<problem>.*) \(at line (?P<line>\d+), column (?P<column>\d+)\)$", re.DOTALL)


def check_toml_file(path: Path) -> None:
    """Refuse a file TOML cannot read with one line naming the file and, as TOML reports
    them, the line and column (pydantic-settings would report the problem without the file)."""
    import tomllib

    try:
        with path.open("rb") as stream:
            tomllib.load(stream)
    except tomllib.TOMLDecodeError as exc:
        # tomllib writes the position into its message: "<problem> (at line L, column C)".
        message = " ".join(str(exc).split())
        position = _TOML_POSITION_RE.match(message)
        if position is None:  # "... (at end of document)" and other shapes: as TOML says it
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {message}") from None
        raise ConfigError(
            f"config file {str(path)!r}, line {position['line']}, column {position['column']}: "
            f"not valid TOML: {position['problem']}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}): TOML files are UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None


ENV_PREFIX = "OUTBOX_RELAY_"


def _section_fields(section: str) -> list[str]:
    model = Settings.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    return list(model.model_fields)


def _closest(name: str, choices: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``OUTBOX_RELAY_<SECTION>__<NAME>`` variables that name no setting.

    pydantic-settings silently ignores a variable whose section does not exist, so a
    typo such as ``OUTBOX_RELAY_KAFKAA__BOOTSTRAP_SERVERS`` would start a relay on the
    defaults. Variables without ``__`` (``OUTBOX_RELAY_CONFIG``, the test suite's
    ``OUTBOX_RELAY_TEST_DSN``) are not settings and are left alone."""
    sections = list(Settings.model_fields)
    for variable in sorted(environ):
        if not variable.upper().startswith(ENV_PREFIX):
            continue
        section, sep, rest = variable[len(ENV_PREFIX) :].partition("__")
        if not sep:
            continue
        section, name = section.lower(), rest.split("__", 1)[0].lower()
        if section == "sources":  # OUTBOX_RELAY_SOURCES__<NAME>__<SETTING>: the name is the source's
            _check_source_variable(variable, rest)
            continue
        if section == "limits":  # a list: only as a whole
            raise ConfigError(
                f"unknown environment variable {variable}: [[limits]] is set as a whole, "
                'as JSON in OUTBOX_RELAY_LIMITS (e.g. [{"topic": "orders", "rate_per_second": 50}])'
            )
        if section not in sections:
            guess = _closest(section, sections)
            hint = f"; did you mean {ENV_PREFIX}{guess.upper()}__{rest.upper()}?" if guess else ""
            raise ConfigError(
                f"unknown environment variable {variable}: there is no settings section "
                f"{section!r} (sections: {', '.join(sections)}){hint}"
            )
        fields = _section_fields(section)
        if name not in fields:
            guess = _closest(name, fields)
            hint = f"; did you mean {ENV_PREFIX}{section.upper()}__{guess.upper()}?" if guess else ""
            raise ConfigError(
                f"unknown environment variable {variable}: section {section!r} has no setting {name!r}{hint}"
            )


def _check_source_variable(variable: str, rest: str) -> None:
    name, sep, setting = rest.partition("__")
    fields = list(SourceSettings.model_fields)
    if not sep or not name or setting.lower() not in fields:
        guess = _closest(setting.lower(), fields) if sep else None
        hint = f"; did you mean {ENV_PREFIX}SOURCES__{name.upper()}__{guess.upper()}?" if guess else ""
        raise ConfigError(
            f"unknown environment variable {variable}: use {ENV_PREFIX}SOURCES__<NAME>__<SETTING> "
            f"with a setting among {', '.join(fields)}{hint}"
        )


def _describe_extra(loc: tuple[str | int, ...]) -> str:
    """An unknown section or key (TOML file or init arguments), with the closest valid name."""
    sections = list(Settings.model_fields)
    if len(loc) == 1:
        guess = _closest(str(loc[0]), sections)
        hint = f"; did you mean [{guess}]?" if guess else f" (sections: {', '.join(sections)})"
        return f"unknown settings section [{loc[0]}]{hint}"
    section, name = str(loc[0]), str(loc[1])
    guess = _closest(name, _section_fields(section)) if section in sections else None
    hint = f"; did you mean {section}.{guess}?" if guess else ""
    return f"{section}.{name}: unknown setting{hint}"


def describe_validation_error(exc: Exception) -> str:
    """One line naming the setting and the problem, never echoing a secret's value."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors(include_input=False, include_url=False):
            location = tuple(p for p in err.get("loc", ()) if p != "__root__")
            if err.get("type") == "extra_forbidden" and 1 <= len(location) <= 2:
                parts.append(_describe_extra(location))
                continue
            loc = ".".join(str(p) for p in location)
            msg = err.get("msg", "invalid")
            msg = msg.removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "invalid configuration: " + "; ".join(parts)
    complex_env = _unparsable_complex_env()
    if complex_env:
        return (
            f"invalid configuration: {complex_env} must be JSON "
            '(a list such as ["OrderCreated", "OrderPaid"] or an object such as {"key": "value"})'
        )
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"invalid configuration: {text}"


def _unparsable_complex_env() -> str | None:
    """The OUTBOX_RELAY_* variable of a list/dict setting whose value is not JSON, if any."""
    import json

    for section_name, section_field in Settings.model_fields.items():
        model = section_field.annotation
        for name, field in getattr(model, "model_fields", {}).items():
            origin = getattr(field.annotation, "__origin__", None)
            if origin not in (list, dict):
                continue
            env = f"OUTBOX_RELAY_{section_name.upper()}__{name.upper()}"
            raw = os.environ.get(env)
            if raw is None:
                continue
            try:
                json.loads(raw)
            except ValueError:
                return env
    return None


_AUTOVACUUM_PARAMETER_RE = re.compile(
    r"^(autovacuum_[a-z_]+|log_autovacuum_min_duration|vacuum_truncate|vacuum_index_cleanup)\Z"
)
_AUTOVACUUM_VALUE_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}\Z")


def check_autovacuum_overrides(overrides: Mapping[str, object]) -> dict[str, str]:
    """Validate ``database.autovacuum``: autovacuum storage parameter names, plain values
    (they are written into an ALTER TABLE: a name is sent as an identifier of this
    shape, a value as a literal)."""
    out: dict[str, str] = {}
    for name, value in overrides.items():
        if not _AUTOVACUUM_PARAMETER_RE.match(name):
            raise ValueError(
                f"{name!r} is not an autovacuum storage parameter (autovacuum_*, "
                "log_autovacuum_min_duration, vacuum_truncate, vacuum_index_cleanup)"
            )
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if not _AUTOVACUUM_VALUE_RE.match(text):
            raise ValueError(f"{name}: {text!r} is not a plain number, boolean or 'default'")
        out[name] = text
    return out
