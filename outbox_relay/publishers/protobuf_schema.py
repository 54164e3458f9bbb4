"""Protobuf message classes built from the .proto text a Schema Registry holds.

``kafka.value_format = "protobuf"`` encodes the row's JSON payload with confluent-kafka's
own ``ProtobufSerializer``, which wants a generated message class. The relay has none:
it builds one for each schema version it meets. The subject's schema (its .proto text,
the registry's default format) and the schemas it references are compiled by protoc
(the one shipped in the ``grpcio-tools`` package, run as ``python -m grpc_tools.protoc``)
into a ``FileDescriptorSet``, from which ``google.protobuf`` makes the message class.

Why not ask the registry for the compiled form (``?format=serialized``)? Confluent's
registry answers a base64 ``FileDescriptorProto`` there, but Apicurio Registry (3.3)
answers the raw bytes decoded as UTF-8, which replaces every byte above 0x7F: the
descriptor cannot be read back. Compiling the text works against both.

The serializer asks its client for the subject's latest schema in the ``serialized``
format; ``PinnedRegistry`` answers with the version the class was built from (as a
base64 ``FileDescriptorProto``, the Confluent form), so the schema id framed in the value
is always the one whose schema encoded it.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: How long one protoc run may take.
PROTOC_TIMEOUT_SECONDS = 60.0
#: The file name the subject's own schema is compiled under (references keep theirs).
MAIN_FILE_NAME = "outbox_relay_subject_value.proto"

_SAFE_REFERENCE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.proto\Z")


class ProtobufSchemaError(Exception):
    """The registry's Protobuf schema cannot be compiled or used (one line)."""


def protoc_available() -> str | None:
    """None when protoc (grpcio-tools) and the protobuf runtime are installed, else why not."""
    try:
        import grpc_tools  # noqa: F401
        from google.protobuf import json_format  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def _well_known_include() -> str:
    import grpc_tools

    return os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")


def compile_proto(main_text: str, referenced: dict[str, str]) -> Any:
    """The ``FileDescriptorSet`` of ``main_text`` (compiled as ``MAIN_FILE_NAME``) and every
    file it imports: ``referenced`` maps an import name to its text; google/protobuf/*
    comes with protoc. ProtobufSchemaError with protoc's first error line on failure."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory(prefix="outbox-relay-proto-") as workdir:
        root = Path(workdir) / "src"
        for name, text in {**referenced, MAIN_FILE_NAME: main_text}.items():
            if not _SAFE_REFERENCE_RE.match(name) or ".." in name.split("/"):
                raise ProtobufSchemaError(f"a referenced schema has a name protoc cannot take: {name!r}")
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        out = Path(workdir) / "set.pb"
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{_well_known_include()}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            MAIN_FILE_NAME,
        ]
        try:
            done = subprocess.run(
                command, cwd=root, capture_output=True, text=True, timeout=PROTOC_TIMEOUT_SECONDS, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ProtobufSchemaError(f"protoc could not run: {type(exc).__name__}: {exc}") from None
        if done.returncode != 0:
            lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            first = lines[0] if lines else f"exit status {done.returncode}"
            raise ProtobufSchemaError(f"protoc refused the schema: {first}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def choose_message(compiled: CompiledSchema, event_type: str) -> Any:
    """The message a value is encoded as: the top-level message whose full name is the
    row's event type, else the first message of the file (Confluent's default, message
    index [0])."""
    declared = [message.name for message in compiled.file_protos[MAIN_FILE_NAME].message_type]
    if not declared:
        raise ProtobufSchemaError("the schema declares no message")
    messages = compiled.file.message_types_by_name
    for name in declared:
        if messages[name].full_name == event_type:
            return messages[name]
    return messages[declared[0]]


class CompiledSchema:
    """One schema version: its id, its files in a pool of their own, and the serializers
    made for its messages."""

    def __init__(self, registered: Any, descriptor_set: Any, reference_names: dict[tuple[str, int], str]) -> None:
        from google.protobuf import descriptor_pool

        self.registered = registered
        self.reference_names = reference_names  # (subject, version) -> import name
        self.pool = descriptor_pool.DescriptorPool()
        self.file_protos = {file_proto.name: file_proto for file_proto in descriptor_set.file}
        for file_proto in descriptor_set.file:  # dependencies come first in a FileDescriptorSet
            self.pool.Add(file_proto)
        self.file = self.pool.FindFileByName(MAIN_FILE_NAME)
        self.serializers: dict[str, tuple[Any, Any]] = {}  # message full name -> (class, serializer)

    def base64_of(self, name: str) -> str:
        return base64.standard_b64encode(self.file_protos[name].SerializeToString()).decode("ascii")


class PinnedRegistry:
    """The client a ``ProtobufSerializer`` is given: the subject's latest schema is the
    version ``compiled`` was built from, in the Confluent ``serialized`` form (base64
    ``FileDescriptorProto``); references likewise; anything else goes to the real client."""

    def __init__(self, client: Any, compiled: CompiledSchema, references: dict[tuple[str, int], str]) -> None:
        self._client = client
        self._compiled = compiled
        self._references = references  # (subject, version) -> import name

    def get_latest_version(self, subject_name: str, fmt: str | None = None) -> Any:
        from confluent_kafka.schema_registry import RegisteredSchema, Schema

        registered = self._compiled.registered
        schema = Schema(
            self._compiled.base64_of(MAIN_FILE_NAME), "PROTOBUF", references=registered.schema.references or []
        )
        return RegisteredSchema(
            subject=registered.subject,
            version=registered.version,
            schema_id=registered.schema_id,
            guid=registered.guid,
            schema=schema,
        )

    def get_version(self, subject_name: str, version: int, deleted: bool = False, fmt: str | None = None) -> Any:
        from confluent_kafka.schema_registry import RegisteredSchema, Schema

        name = self._references.get((subject_name, int(version)))
        if name is None:
            return self._client.get_version(subject_name, version, deleted, fmt)
        referenced = self._client.get_version(subject_name, version, deleted)
        schema = Schema(self._compiled.base64_of(name), "PROTOBUF", references=referenced.schema.references or [])
        return RegisteredSchema(
            subject=subject_name, version=version, schema_id=referenced.schema_id, guid=referenced.guid, schema=schema
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class ProtobufMessages:
    """Message classes and serializers per (subject, schema id), built on first use."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._compiled: dict[tuple[str, int], CompiledSchema] = {}
        # One protoc run per schema version, not one per worker meeting it first.
        self._compile_lock = threading.Lock()

    def _references(self, schema: Any, texts: dict[str, str], names: dict[tuple[str, int], str], depth: int) -> None:
        """The text of every schema ``schema`` references, transitively, by import name."""
        if depth > 32:
            raise ProtobufSchemaError("the schema's references nest deeper than 32")
        for reference in schema.references or []:
            if reference.name in texts or reference.name.startswith("google/protobuf/"):
                continue
            referenced = self._client.get_version(reference.subject, reference.version)
            texts[reference.name] = referenced.schema.schema_str
            names[(reference.subject, int(reference.version))] = reference.name
            self._references(referenced.schema, texts, names, depth + 1)

    def _compile(self, subject: str, latest: Any) -> CompiledSchema:
        if (latest.schema.schema_type or "AVRO").upper() != "PROTOBUF":
            raise ProtobufSchemaError(
                f"the latest schema of {subject} is {latest.schema.schema_type or 'AVRO'}, not PROTOBUF"
            )
        texts: dict[str, str] = {}
        names: dict[tuple[str, int], str] = {}
        self._references(latest.schema, texts, names, 0)
        return CompiledSchema(latest, compile_proto(latest.schema.schema_str, texts), names)

    def encoder_for(self, subject: str, event_type: str) -> tuple[Any, Any]:
        """(message class, serializer) for the subject's latest schema. Raises the
        registry client's errors (SchemaRegistryError, transport errors) as they are,
        ProtobufSchemaError for a schema that cannot be used: never an error a caller
        could take for the row's."""
        try:
            return self._encoder_for(subject, event_type)
        except (AttributeError, KeyError, TypeError, ValueError, LookupError) as exc:
            raise ProtobufSchemaError(f"{type(exc).__name__}: {exc}") from None

    def _encoder_for(self, subject: str, event_type: str) -> tuple[Any, Any]:
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
        from google.protobuf import message_factory

        latest = self._client.get_latest_version(subject)  # cached for latest_cache_seconds
        key = (subject, int(latest.schema_id))
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._compile_lock:
                compiled = self._compiled.get(key) or self._compile(subject, latest)
                self._compiled[key] = compiled
        descriptor = choose_message(compiled, event_type)
        made = compiled.serializers.get(descriptor.full_name)
        if made is None:
            message_class = message_factory.GetMessageClass(descriptor)
            serializer = ProtobufSerializer(
                message_class,
                PinnedRegistry(self._client, compiled, compiled.reference_names),
                conf={
                    "auto.register.schemas": False,
                    "use.latest.version": True,
                    # google/protobuf/* imports are known to every reader: no reference
                    "skip.known.types": True,
                    # the subject is chosen by the relay (subject_name), not by the serializer
                    "subject.name.strategy": lambda ctx, record_name: subject,
                },
            )
            made = (message_class, serializer)
            compiled.serializers[descriptor.full_name] = made
        return made
