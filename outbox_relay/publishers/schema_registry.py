"""Kafka record values encoded against a Confluent-compatible Schema Registry.

``kafka.value_format = "avro"``, ``"json-schema"`` or ``"protobuf"``: the row's payload
(JSON text) is parsed and handed to confluent-kafka's own ``AvroSerializer`` /
``JSONSerializer`` / ``ProtobufSerializer`` (the last one with a message class built from
the registry's .proto text: ``protobuf_schema.py``), which encode it against the latest
schema of the row's subject (fetched from the registry and cached by the client for
``schema_registry.latest_cache_seconds``) and frame it in the Confluent wire format:
magic byte 0, the schema id (4 bytes, big endian), for Protobuf the message indexes,
the encoded value. Rows never register schemas; the files of
``schema_registry.schema_files`` are registered at start (``register_schema_files``).

What a failure does to the row (see ``encode``):

- the registry unreachable, timing out or answering 5xx (or 401/403): a transport-class
  retryable outcome, so the row waits without using up its attempts;
- no schema for the subject (404): the row is deferred (attempt refunded) for
  ``schema_registry.missing_schema_defer_seconds``, with one log line per subject;
- the payload does not fit the schema (or is not JSON): PermanentError with the
  serializer's text, for this row alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ..errors import ConfigError
from ..model import Defer, Message, Outcome, PermanentError, RetryableError
from .protobuf_schema import ProtobufMessages, ProtobufSchemaError, protoc_available

if TYPE_CHECKING:
    from ..config import Settings

log = structlog.get_logger("outbox_relay.schema_registry")

#: How long a registry failure is reported by ``problem()`` (for /readyz) after it was seen.
PROBLEM_MEMORY_SECONDS = 30.0
#: Minimum seconds between two log lines about the same subject's missing schema.
MISSING_SCHEMA_LOG_INTERVAL_SECONDS = 60.0


def subject_name(strategy: str, topic: str, event_type: str) -> str:
    """The subject of a value: ``topic`` -> ``<topic>-value``; ``record`` -> the row's
    event type (the record's name); ``topic-record`` -> ``<topic>-<event type>``."""
    if strategy == "record":
        return event_type
    if strategy == "topic-record":
        return f"{topic}-{event_type}"
    return f"{topic}-value"


class ProtobufParseError(ValueError):
    """The JSON payload does not map onto the Protobuf message."""


class SchemaFile:
    """One schema of ``schema_registry.schema_files``, read at start."""

    def __init__(self, subject: str, file_name: str, schema_type: str, text: str) -> None:
        self.subject = subject
        self.file_name = file_name
        self.schema_type = schema_type
        self.text = text


def read_schema_files(files: dict[str, str]) -> list[SchemaFile]:
    """The schema files, read and checked as far as the relay can (Avro and JSON Schema
    must be JSON, no file may be empty); ConfigError with one line naming the file."""
    from ..config import schema_file_type

    loaded: list[SchemaFile] = []
    for subject, file_name in files.items():
        where = f"schema_registry.schema_files: {subject}: {file_name!r}"
        schema_type = schema_file_type(file_name)
        if schema_type is None:
            raise ConfigError(f"{where}: unknown schema type (name it .avsc, .json or .proto)")
        try:
            text = Path(file_name).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError(f"{where} cannot be read ({reason})") from None
        if not text.strip():
            raise ConfigError(f"{where} is empty")
        if schema_type in ("AVRO", "JSON"):
            try:
                json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"{where} is not JSON ({exc})") from None
        loaded.append(SchemaFile(subject, file_name, schema_type, text))
    return loaded


class SchemaFileRefused(ConfigError):
    """The registry refused a schema file (incompatible with the subject's versions, or invalid)."""


class RegistryValueEncoder:
    """Encodes message values with one serializer per subject (created on first use)."""

    def __init__(
        self,
        value_format: str,
        client_conf: dict[str, Any],
        *,
        subject_name_strategy: str = "topic",
        missing_schema_defer_seconds: float = 15.0,
        log_missing: Callable[[str, str], None] | None = None,
        schema_files: list[SchemaFile] | None = None,
    ) -> None:
        try:
            from confluent_kafka.schema_registry import SchemaRegistryClient
        except ImportError as exc:  # the optional extra is not installed
            raise ConfigError(
                f'kafka.value_format = "{value_format}" needs the extra: pip install "outbox-relay[registry]" ({exc})'
            ) from None
        self.value_format = value_format
        self.client = SchemaRegistryClient(client_conf)
        self._protobuf: ProtobufMessages | None = None
        if value_format == "protobuf":
            missing = protoc_available()
            if missing is not None:
                raise ConfigError(
                    f'kafka.value_format = "protobuf" needs the extra: pip install "outbox-relay[protobuf]" ({missing})'
                )
            self._protobuf = ProtobufMessages(self.client)
        self._strategy = subject_name_strategy
        self._defer_seconds = missing_schema_defer_seconds
        self._log_missing = log_missing
        self._serializers: dict[str, Callable[..., bytes | None]] = {}
        self._lock = threading.Lock()
        self._problem: tuple[float, str] | None = None
        self._missing_logged: dict[str, float] = {}
        # schema_registry.schema_files not registered yet; rows wait until all are.
        self._unregistered_files = list(schema_files or [])
        self._files_lock = threading.Lock()
        self.files_refused: str | None = None  # the registry's refusal of a schema file (start-up error)

    # --- serializers -------------------------------------------------------------------
    def _serializer(self, subject: str) -> Callable[..., bytes | None]:
        serializer = self._serializers.get(subject)
        if serializer is not None:
            return serializer
        with self._lock:
            serializer = self._serializers.get(subject)
            if serializer is None:
                serializer = self._new_serializer(subject)
                self._serializers[subject] = serializer
        return serializer

    def _new_serializer(self, subject: str) -> Callable[..., bytes | None]:
        conf: dict[str, Any] = {
            "auto.register.schemas": False,
            "use.latest.version": True,
            # the subject is chosen here (subject_name), not by the serializer
            "subject.name.strategy": lambda ctx, record_name: subject,
        }
        if self.value_format == "avro":
            from confluent_kafka.schema_registry.avro import AvroSerializer

            return AvroSerializer(self.client, None, conf=conf)  # type: ignore[no-any-return]
        from confluent_kafka.schema_registry.json_schema import JSONSerializer

        return JSONSerializer(None, self.client, conf=conf)  # type: ignore[no-any-return]

    # --- schema files ------------------------------------------------------------------
    @property
    def files_pending(self) -> bool:
        """Are schema files still to be registered (or refused)?"""
        return bool(self._unregistered_files) or self.files_refused is not None

    def register_schema_files(self) -> str | None:
        """Register every schema file not registered yet, in the order given. None when
        all are registered; else why not: the registry's refusal (also kept in
        ``files_refused``: waiting does not fix it) or why it did not answer (the next
        call tries again). Registering a schema the subject already holds is a no-op."""
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        with self._files_lock:
            if self.files_refused is not None:
                return self.files_refused
            while self._unregistered_files:
                schema_file = self._unregistered_files[0]
                try:
                    self.client.register_schema(schema_file.subject, Schema(schema_file.text, schema_file.schema_type))
                except SchemaRegistryError as exc:
                    status = int(getattr(exc, "http_status_code", 0) or 0)
                    text = getattr(exc, "error_message", None) or str(exc)
                    what = f"the registry refused {schema_file.file_name!r} for subject {schema_file.subject}"
                    if status in (400, 409, 422):
                        self.files_refused = f"schema_registry.schema_files: {what} ({status}): {text}"
                        self._problem = (time.monotonic(), self.files_refused)
                        return self.files_refused
                    reason = (
                        f"schema registry answered {status or 'an error'} registering {schema_file.file_name!r} "
                        f"for subject {schema_file.subject}: {text}"
                    )
                    self._problem = (time.monotonic(), reason)
                    return reason
                except Exception as exc:  # httpx transport errors: the registry, not the file
                    reason = f"schema registry unreachable: {type(exc).__name__}: {exc}"
                    self._problem = (time.monotonic(), reason)
                    return reason
                self._unregistered_files.pop(0)
                # A version registered now is its subject's latest, not the one cached before.
                self.client.clear_latest_caches()  # type: ignore[no-untyped-call]
        return None

    # --- encoding ----------------------------------------------------------------------
    def encode(self, message: Message) -> bytes | Outcome | None:
        """The encoded value of ``message``, or the outcome of its row (an outcome
        exception instance) when it cannot be encoded now or ever. None: a tombstone."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError

        if message.value is None:
            return None
        if isinstance(message.value, bytes):
            return message.value  # payload_bytes: encoded by the row's writer, published as they are
        if self.files_pending:
            # Rows are encoded only with the schemas shipped with the configuration registered.
            why_not = self.register_schema_files()
            if why_not is not None:
                return RetryableError(f"{why_not}: the rows wait", transport=True)
        subject = subject_name(self._strategy, message.topic, message.event_type)
        try:
            payload = json.loads(message.value)
        except ValueError as exc:
            return PermanentError(f"schema registry: the payload is not JSON ({exc})")
        try:
            if self._protobuf is not None:
                return self._encode_protobuf(subject, message, payload)
            return self._serializer(subject)(payload, SerializationContext(message.topic, MessageField.VALUE))
        except SchemaRegistryError as exc:
            return self._registry_refused(subject, exc)
        except ProtobufSchemaError as exc:
            # The registry's schema, not the row: the row waits for a usable version.
            reason = f"schema registry: the latest schema of {subject} cannot be used: {exc}"
            self._problem = (time.monotonic(), reason)
            self._log_unusable(subject, str(exc))
            return Defer(self._defer_seconds, reason)
        except ProtobufParseError as exc:
            return PermanentError(f"schema registry: the payload does not fit the latest schema of {subject}: {exc}")
        except SerializationError as exc:
            return PermanentError(f"schema registry: the payload does not fit the latest schema of {subject}: {exc}")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # fastavro's refusals of a value that does not fit the schema
            return PermanentError(
                f"schema registry: the payload does not fit the latest schema of {subject}: {type(exc).__name__}: {exc}"
            )
        except Exception as exc:  # httpx transport errors (connect, read, timeout): the registry, not the row
            reason = f"schema registry unreachable: {type(exc).__name__}: {exc}"
            self._problem = (time.monotonic(), reason)
            return RetryableError(reason, transport=True)

    def _encode_protobuf(self, subject: str, message: Message, payload: Any) -> bytes | None:
        """The payload as the Protobuf message of the subject's latest schema (JSON mapped
        by google.protobuf.json_format: field names or their lowerCamelCase JSON names,
        enums by name or number, int64 as number or string, Timestamp as RFC 3339 text;
        an unknown field is an error), encoded by confluent-kafka's ProtobufSerializer."""
        from confluent_kafka.serialization import MessageField, SerializationContext
        from google.protobuf import json_format

        assert self._protobuf is not None
        message_class, serializer = self._protobuf.encoder_for(subject, message.event_type)
        if not isinstance(payload, dict):
            raise ProtobufParseError(f"a Protobuf message is a JSON object, not {type(payload).__name__}")
        try:
            value = json_format.ParseDict(payload, message_class())
        except json_format.ParseError as exc:
            raise ProtobufParseError(str(exc)) from None
        return serializer(value, SerializationContext(message.topic, MessageField.VALUE))  # type: ignore[no-any-return]

    def _log_unusable(self, subject: str, text: str) -> None:
        now = time.monotonic()
        if now - self._missing_logged.get(subject, -1e9) >= MISSING_SCHEMA_LOG_INTERVAL_SECONDS:
            self._missing_logged[subject] = now
            log.warning(
                "schema registry: the subject's latest schema cannot be used; its rows wait", subject=subject, why=text
            )

    def _registry_refused(self, subject: str, exc: Any) -> Outcome:
        status = int(getattr(exc, "http_status_code", 0) or 0)
        text = getattr(exc, "error_message", None) or str(exc)
        if status == 404:
            reason = f"schema registry: no schema registered for subject {subject} ({text})"
            self._problem = (time.monotonic(), reason)
            now = time.monotonic()
            if self._log_missing is not None and now - self._missing_logged.get(subject, -1e9) >= (
                MISSING_SCHEMA_LOG_INTERVAL_SECONDS
            ):
                self._missing_logged[subject] = now
                self._log_missing(subject, text)
            return Defer(self._defer_seconds, reason)
        reason = f"schema registry answered {status or 'an error'} for subject {subject}: {text}"
        self._problem = (time.monotonic(), reason)
        return RetryableError(reason, transport=True)

    def problem(self) -> str | None:
        """The last registry failure if it is recent (for /readyz), else None."""
        seen = self._problem
        if seen is None or time.monotonic() - seen[0] > PROBLEM_MEMORY_SECONDS:
            return None
        return seen[1]

    def clear_problem(self) -> None:
        self._problem = None


def client_config(settings: Settings) -> dict[str, Any]:
    """SchemaRegistryClient properties from Settings (secrets included: never log them)."""
    registry = settings.schema_registry
    conf: dict[str, Any] = {
        "url": registry.url,
        "timeout": registry.timeout_seconds,
        "cache.latest.ttl.sec": registry.latest_cache_seconds,
        # one try per row: a failing registry makes the row wait, it is not retried here
        "max.retries": 0,
    }
    if registry.ssl_ca_location:
        conf["ssl.ca.location"] = registry.ssl_ca_location
    password = registry.basic_auth_password()
    if registry.basic_auth_user and password is not None:
        # user:password (confluent-kafka has no basic.auth.credentials.source: it refuses the property)
        conf["basic.auth.user.info"] = f"{registry.basic_auth_user}:{password.get_secret_value()}"
    token = registry.bearer_token()
    if token is not None:
        conf["bearer.auth.credentials.source"] = "STATIC_TOKEN"
        conf["bearer.auth.token"] = token.get_secret_value()
        conf["bearer.auth.logical.cluster"] = registry.bearer_logical_cluster
    return conf


def encoder_from_settings(
    settings: Settings, log_missing: Callable[[str, str], None] | None = None
) -> RegistryValueEncoder | None:
    """The value encoder of ``kafka.value_format``; None for "json" (values as they are)."""
    if settings.kafka.value_format == "json":
        return None
    return RegistryValueEncoder(
        settings.kafka.value_format,
        client_config(settings),
        subject_name_strategy=settings.schema_registry.subject_name_strategy,
        missing_schema_defer_seconds=settings.schema_registry.missing_schema_defer_seconds,
        log_missing=log_missing,
        schema_files=read_schema_files(settings.schema_registry.schema_files),
    )
