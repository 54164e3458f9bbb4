"""Apache Kafka brokers started by the project, for the tests and the benchmarks.

Real Apache Kafka (the version in ``java/kafka/pom.xml``) in KRaft mode, run from the
jars Maven puts in the local repository: no tarball, no Docker. What the distribution's
scripts do is done here:

- ``kafka-storage.sh format`` is ``kafka.tools.StorageTool format -t <cluster id> -c
  server.properties`` (with ``--add-scram`` to create SCRAM users in the metadata log);
- ``kafka-server-start.sh`` is ``kafka.Kafka server.properties``;
- ``kafka-configs.sh`` / ``kafka-acls.sh`` are ``org.apache.kafka.tools.ConfigCommand`` /
  ``AclCommand`` (``run_tool``).

``KafkaBroker`` is one combined broker + controller node; ``KafkaCluster`` is three of them
(one controller quorum of three voters, replication factor 3, ``min.insync.replicas=2``).
Each node keeps its log in a data directory on disk: a node stopped, killed (SIGKILL) or
paused (SIGSTOP) and started again serves what it acknowledged before.

The classpath: ``OUTBOX_RELAY_KAFKA_CLASSPATH`` (the classpath itself) if set, else the
file ``OUTBOX_RELAY_KAFKA_CLASSPATH_FILE`` (default
``$XDG_CACHE_HOME/outbox-relay/kafka-<version>.classpath``, written by ``./dev``), else
this module asks the machine's Maven for it once (``mvn dependency:build-classpath`` on
``java/kafka/pom.xml``; the jars are cached in ``~/.m2``). Java: ``OUTBOX_RELAY_JAVA``,
else ``$JAVA_HOME/bin/java``, else ``java`` on the PATH (Kafka 4 brokers need Java 17+).

Sized for a small shared machine (2 cores): a 384 MiB heap, the serial collector, one
network thread, two I/O threads, 8 MiB log segments, 4 partitions for the internal
topics, no initial rebalance delay. Importing this module needs neither Java nor Maven.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import OutboxRelayError

KAFKA_VERSION = "4.4.0"
POM_RELATIVE_PATH = Path("java") / "kafka" / "pom.xml"

# The per-node defaults for a small machine; ``properties=`` of a node or cluster
# overrides any of them.
SMALL_MACHINE_PROPERTIES: dict[str, str] = {
    "num.network.threads": "1",
    "num.io.threads": "2",
    "background.threads": "2",
    "num.recovery.threads.per.data.dir": "1",
    "num.replica.fetchers": "1",
    "log.cleaner.threads": "1",
    "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
    "log.segment.bytes": str(8 * 1024 * 1024),
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.num.partitions": "4",
    "group.initial.rebalance.delay.ms": "0",
    # Three JVMs starting together on two busy cores can take minutes to form their
    # quorum: a node gives up (and exits) after this long without registering.
    "initial.broker.registration.timeout.ms": "300000",
    "auto.create.topics.enable": "true",
    "num.partitions": "1",
}


class KafkaUnavailable(OutboxRelayError):
    """Java, Maven or the Kafka jars are missing, or a Kafka node did not start."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_cluster_id() -> str:
    """A cluster id as ``kafka-storage.sh random-uuid`` prints it (URL-safe base64 of
    16 random bytes, no padding), never starting with "-" (Kafka's ``Uuid.randomUuid``
    skips those too: a command line would read it as an option)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


# -- finding Java and the jars ------------------------------------------------------


def java_binary() -> str:
    explicit = os.environ.get("OUTBOX_RELAY_JAVA")
    if explicit:
        return explicit
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaUnavailable("Apache Kafka needs Java 17 or later: no 'java' on the PATH "
                               "(set JAVA_HOME or OUTBOX_RELAY_JAVA)")
    return found


def find_pom(start: Path | None = None) -> Path | None:
    """``java/kafka/pom.xml`` of the source tree this module runs from (searched upwards)."""
    explicit = os.environ.get("OUTBOX_RELAY_KAFKA_POM")
    if explicit:
        return Path(explicit)
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        candidate = parent / POM_RELATIVE_PATH
        if candidate.is_file():
            return candidate
    return None


def classpath_cache_file() -> Path:
    explicit = os.environ.get("OUTBOX_RELAY_KAFKA_CLASSPATH_FILE")
    if explicit:
        return Path(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "outbox-relay" / f"kafka-{KAFKA_VERSION}.classpath"


def _classpath_usable(text: str) -> bool:
    entries = [entry for entry in text.strip().split(os.pathsep) if entry]
    return bool(entries) and all(os.path.exists(entry) for entry in entries)


def resolve_classpath(pom: Path | None = None, cache_file: Path | None = None) -> str:
    """Ask Maven for the runtime classpath of ``pom`` and write it to ``cache_file``
    (what ``./dev`` does; the jars land in the local Maven repository)."""
    pom = pom or find_pom()
    if pom is None:
        raise KafkaUnavailable(f"cannot find {POM_RELATIVE_PATH} to fetch Apache Kafka "
                               "(set OUTBOX_RELAY_KAFKA_CLASSPATH or OUTBOX_RELAY_KAFKA_POM)")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailable("fetching Apache Kafka needs Maven ('mvn' on the PATH; Debian package maven)")
    cache_file = cache_file or classpath_cache_file()
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_name(cache_file.name + f".{os.getpid()}.tmp")
    done = subprocess.run([mvn, "-q", "-B", "-f", str(pom), "dependency:build-classpath",
                           f"-Dmdep.outputFile={partial}"], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not partial.is_file():
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise KafkaUnavailable("Maven could not fetch Apache Kafka: " + " | ".join(tail))
    os.replace(partial, cache_file)
    return cache_file.read_text().strip()


def kafka_classpath() -> str:
    explicit = os.environ.get("OUTBOX_RELAY_KAFKA_CLASSPATH")
    if explicit:
        return explicit
    cache_file = classpath_cache_file()
    pom = find_pom()
    if cache_file.is_file():
        text = cache_file.read_text().strip()
        stale = pom is not None and pom.stat().st_mtime > cache_file.stat().st_mtime
        if not stale and _classpath_usable(text):
            return text
    return resolve_classpath(pom, cache_file)


def kafka_available() -> bool:
    """True when Java and the Kafka jars are there (without fetching anything)."""
    try:
        java_binary()
    except KafkaUnavailable:
        return False
    if os.environ.get("OUTBOX_RELAY_KAFKA_CLASSPATH"):
        return True
    cache_file = classpath_cache_file()
    if cache_file.is_file() and _classpath_usable(cache_file.read_text()):
        return True
    return find_pom() is not None and shutil.which("mvn") is not None


_FALLBACK_LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT"><PatternLayout pattern="[%d] %p %m (%c)%n"/></Console>
  </Appenders>
  <Loggers><Root level="INFO"><AppenderRef ref="STDOUT"/></Root></Loggers>
</Configuration>
"""


def _log4j2_config(fallback_dir: Path) -> Path:
    pom = find_pom()
    if pom is not None and (pom.parent / "log4j2.xml").is_file():
        return pom.parent / "log4j2.xml"
    path = fallback_dir / "log4j2.xml"
    if not path.exists():
        path.write_text(_FALLBACK_LOG4J2)
    return path


def run_tool(main_class: str, args: Sequence[str], *, timeout: float = 120.0,
             heap_mb: int = 128) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's command-line tools by its main class (what the scripts in
    the distribution's ``bin/`` do), e.g. ``org.apache.kafka.tools.ConfigCommand``.
    Output is captured; a non-zero exit raises ``KafkaUnavailable`` with its last lines."""
    scratch = Path(tempfile.gettempdir())
    command = [java_binary(), f"-Xmx{heap_mb}m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               f"-Dlog4j2.configurationFile={_log4j2_config(scratch)}", "-cp", kafka_classpath(),
               main_class, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = [line for line in (done.stdout + done.stderr).strip().splitlines() if " INFO " not in line][-5:]
        raise KafkaUnavailable(f"{main_class.rsplit('.', 1)[-1]} failed (exit {done.returncode}): "
                               + " | ".join(tail))
    return done


def _class_data_sharing_options() -> list[str]:
    """Application class-data sharing: the first node to run writes an archive of the
    classes it loaded when it exits (``-XX:ArchiveClassesAtExit``), later nodes map it
    (``-XX:SharedArchiveFile``) and skip most class loading and verification. The JVM
    ignores an archive that does not match its classpath or build."""
    if os.environ.get("OUTBOX_RELAY_KAFKA_CDS", "1") == "0":
        return []
    archive = classpath_cache_file().with_suffix(".jsa")
    if archive.is_file() and archive.stat().st_size > 0:
        return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        marker = os.open(str(archive) + ".writing", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:
        return []  # another node is writing it, or the cache is read-only
    os.close(marker)
    return [f"-XX:ArchiveClassesAtExit={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]


# -- nodes --------------------------------------------------------------------------

_LIVE_NODES: weakref.WeakSet[KafkaBroker] = weakref.WeakSet()
# Formatted storage of stand-alone nodes, by (node id, SCRAM users), copied by later nodes.
_FORMATTED: dict[tuple[int, tuple[tuple[str, str], ...]], Path] = {}


def _read_properties(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


@atexit.register
def _kill_leftovers() -> None:
    """No JVM outlives the Python process that started it."""
    for node in list(_LIVE_NODES):
        with contextlib.suppress(Exception):
            node.kill()
    for template in _FORMATTED.values():
        shutil.rmtree(template.parent, ignore_errors=True)


class KafkaBroker:
    """One Apache Kafka node in KRaft combined mode (broker + controller) on loopback.

    Listeners: ``CLIENT`` (``bootstrap_servers``; its security protocol is
    ``client_protocol``: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, configured by
    ``properties`` such as ``listener.name.client.ssl.keystore.location``), ``INTERNAL``
    (plaintext, ``internal_bootstrap_servers``: between brokers and for the tests' own
    administration, whose principal is ``User:ANONYMOUS``) and ``CONTROLLER``.
    ``scram_users`` (name → password) are created as SCRAM-SHA-512 credentials when the
    storage is formatted, as ``kafka-storage format --add-scram`` does.

    Stand-alone by default; a ``KafkaCluster`` makes its nodes with ``cluster_id`` and
    ``voters`` shared by all.
    """

    def __init__(self, *, data_dir: str | os.PathLike[str] | None = None,
                 log_file: str | os.PathLike[str] | None = None, port: int | None = None,
                 node_id: int = 1, properties: Mapping[str, object] | None = None,
                 client_protocol: str = "PLAINTEXT", scram_users: Mapping[str, str] | None = None,
                 heap_mb: int = 384, cluster_id: str | None = None,
                 controller_port: int | None = None, voters: str | None = None,
                 replication_factor: int = 1, fast_start: bool = True) -> None:
        self._own_dir = data_dir is None
        self.base_dir = Path(data_dir) if data_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"outbox-relay-kafka-{node_id}-"))
        self.log_dir = self.base_dir / "log"
        self.log_file = Path(log_file) if log_file is not None else self.base_dir / "server.log"
        self.node_id = node_id
        self.port = port or free_port()
        self.internal_port = free_port()
        self.controller_port = controller_port or free_port()
        self.voters = voters or f"{node_id}@127.0.0.1:{self.controller_port}"
        # A stand-alone node's storage may be a copy of one formatted earlier in this
        # process (same node id and users): formatting costs a JVM start.
        self._reusable_format = cluster_id is None and voters is None
        self.cluster_id = cluster_id or new_cluster_id()
        self.client_protocol = client_protocol.upper()
        self.scram_users = dict(scram_users or {})
        self.heap_mb = heap_mb
        self.fast_start = fast_start
        self.replication_factor = replication_factor
        self.extra_properties = {k: str(v) for k, v in (properties or {}).items()}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_seconds: float | None = None  # how long the last start took

    # -- addresses --
    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def internal_bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.internal_port}"

    @property
    def durable(self) -> bool:
        """The log is on disk: what the node acknowledged survives a restart."""
        return True

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    # -- configuration --
    def server_properties(self) -> dict[str, str]:
        rf = self.replication_factor
        props: dict[str, str] = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "listeners": (f"CLIENT://127.0.0.1:{self.port},INTERNAL://127.0.0.1:{self.internal_port},"
                          f"CONTROLLER://127.0.0.1:{self.controller_port}"),
            "advertised.listeners": f"CLIENT://127.0.0.1:{self.port},INTERNAL://127.0.0.1:{self.internal_port}",
            "listener.security.protocol.map": (f"CLIENT:{self.client_protocol},INTERNAL:PLAINTEXT,"
                                               "CONTROLLER:PLAINTEXT"),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "INTERNAL",
            "log.dirs": str(self.log_dir),
            "offsets.topic.replication.factor": str(rf),
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(min(2, rf)),
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(min(2, rf)),
            "default.replication.factor": str(rf),
            "min.insync.replicas": str(min(2, rf)),
            **SMALL_MACHINE_PROPERTIES,
        }
        if self.client_protocol.startswith("SASL"):
            props.setdefault("sasl.enabled.mechanisms", "SCRAM-SHA-512")
            props.setdefault("listener.name.client.scram-sha-512.sasl.jaas.config",
                             "org.apache.kafka.common.security.scram.ScramLoginModule required;")
        props.update(self.extra_properties)
        return props

    @property
    def properties_file(self) -> Path:
        return self.base_dir / "server.properties"

    def _write_properties(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"{key}={value}" for key, value in self.server_properties().items()]
        self.properties_file.write_text("\n".join(lines) + "\n")

    def _java(self, main_class: str, args: Iterable[str], heap_mb: int, *, short_lived: bool = False) -> list[str]:
        quick: list[str] = []
        if short_lived or self.fast_start:
            # The client compiler only: a node starts in about half the CPU time, at the
            # price of peak throughput (benchmarks pass fast_start=False).
            quick.append("-XX:TieredStopAtLevel=1")
        if not short_lived:
            quick += _class_data_sharing_options()
        return [java_binary(), f"-Xmx{heap_mb}m", "-Xss512k", "-XX:+UseSerialGC", *quick,
                "-XX:MaxDirectMemorySize=128m", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={_log4j2_config(self.base_dir)}",
                f"-Dkafka.logs.dir={self.base_dir}", "-cp", kafka_classpath(), main_class, *args]

    @property
    def formatted(self) -> bool:
        return (self.log_dir / "meta.properties").is_file()

    def format(self) -> None:
        """``kafka-storage format``: write meta.properties and the bootstrap metadata."""
        self._write_properties()
        key = (self.node_id, tuple(sorted(self.scram_users.items())))
        template = _FORMATTED.get(key) if self._reusable_format else None
        if template is not None and template.is_dir():
            shutil.copytree(template, self.log_dir)
            self.cluster_id = _read_properties(template / "meta.properties")["cluster.id"]
            self._write_properties()
            return
        self._run_format()
        if self._reusable_format:
            copy = Path(tempfile.mkdtemp(prefix="outbox-relay-kafka-format-")) / "log"
            shutil.copytree(self.log_dir, copy)
            _FORMATTED[key] = copy

    def _run_format(self) -> None:
        args = ["format", "-t", self.cluster_id, "-c", str(self.properties_file)]
        for name, password in self.scram_users.items():
            args += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
        done = subprocess.run(self._java("kafka.tools.StorageTool", args, heap_mb=128, short_lived=True),
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            lines = [line for line in (done.stdout + done.stderr).splitlines() if " INFO " not in line]
            message = " | ".join(lines[-3:])
            for password in self.scram_users.values():
                message = message.replace(password, "***")
            raise KafkaUnavailable(f"kafka-storage format failed for node {self.node_id}: {message}")

    # -- lifecycle --
    def launch(self) -> None:
        """Start the JVM (formatting the storage the first time) without waiting."""
        if self.running:
            return
        if not self.formatted:
            self.format()
        else:
            self._write_properties()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self._java("kafka.Kafka", [str(self.properties_file)], heap_mb=self.heap_mb),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _LIVE_NODES.add(self)
        self._launched_at = time.monotonic()

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Wait until this node answers a metadata request on its internal listener and
        lists itself among the live brokers (registered with the controller, unfenced)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        admin = AdminClient({"bootstrap.servers": self.internal_bootstrap_servers, "log_level": 0,
                             "socket.connection.setup.timeout.ms": 2000, "reconnect.backoff.max.ms": 500})
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise KafkaUnavailable(f"Kafka node {self.node_id} exited (status {code}) while starting; "
                                       f"last lines of {self.log_file}: {self._log_tail()}")
            try:
                metadata = admin.list_topics(timeout=2)
                if self.node_id in metadata.brokers:
                    break
            except Exception:  # KafkaException until it answers
                pass
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"Kafka node {self.node_id} did not answer within {timeout:.0f}s; "
                                       f"last lines of {self.log_file}: {self._log_tail()}")
            time.sleep(0.2)
        self.started_seconds = time.monotonic() - self._launched_at

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        wanted = [line for line in text if " ERROR " in line or "Exception" in line] or text
        return " | ".join(wanted[-lines:])

    def start(self, timeout: float = 90.0) -> KafkaBroker:
        self.launch()
        try:
            self.wait_ready(timeout)
        except KafkaUnavailable:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a controlled shutdown: leadership moves away first), then SIGKILL
        if the node has not exited ``timeout`` seconds later. The data stays."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        _LIVE_NODES.discard(self)

    def kill(self) -> None:
        """SIGKILL, like a crashed machine's process (the page cache survives it, so
        does every message the node acknowledged)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        _LIVE_NODES.discard(self)

    def pause(self) -> None:
        """SIGSTOP: the node hangs with its connections open."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def resume_quietly(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self, *, kill: bool = True, timeout: float = 90.0) -> None:
        """Kill (or stop, ``kill=False``) and start again on the same ports with the same data."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start(timeout)

    def remove(self) -> None:
        """Stop and delete the data directory (if this object created it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def admin(self, **config: str | int | float) -> Any:
        """A confluent-kafka AdminClient on the internal (superuser) listener."""
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.internal_bootstrap_servers, "log_level": 3, **config})

    def create_topic(self, topic: str, *, partitions: int = 1, replication_factor: int | None = None,
                     config: Mapping[str, object] | None = None, timeout: float = 30.0) -> None:
        create_topic(self.admin(), topic, partitions=partitions,
                     replication_factor=replication_factor or self.replication_factor, config=config,
                     timeout=timeout)


def create_topic(admin: Any, topic: str, *, partitions: int, replication_factor: int,
                 config: Mapping[str, object] | None = None, timeout: float = 30.0) -> None:
    """Create ``topic`` and wait until every partition has a leader."""
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    new = NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor,
                   config={k: str(v) for k, v in (config or {}).items()})
    admin.create_topics([new], operation_timeout=timeout)[topic].result(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=5).topics.get(topic)
        if meta is not None and meta.error is None and len(meta.partitions) == partitions \
                and all(p.leader >= 0 for p in meta.partitions.values()):
            return
        time.sleep(0.1)
    raise KafkaUnavailable(f"topic {topic} has no leader for every partition after {timeout:.0f}s")


class KafkaCluster:
    """``size`` combined broker + controller nodes (default 3) forming one cluster:
    replication factor ``size`` for new and internal topics and ``min.insync.replicas=2``,
    so a partition takes writes with one node down and refuses them
    (NOT_ENOUGH_REPLICAS) with two down."""

    def __init__(self, size: int = 3, *, base_dir: str | os.PathLike[str] | None = None,
                 properties: Mapping[str, object] | None = None, heap_mb: int = 320,
                 client_protocol: str = "PLAINTEXT", scram_users: Mapping[str, str] | None = None) -> None:
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(
            tempfile.mkdtemp(prefix="outbox-relay-kafka-cluster-"))
        cluster_id = new_cluster_id()
        controller_ports = {node_id: free_port() for node_id in range(1, size + 1)}
        voters = ",".join(f"{node_id}@127.0.0.1:{port}" for node_id, port in controller_ports.items())
        self.nodes = [
            KafkaBroker(data_dir=self.base_dir / f"node-{node_id}", node_id=node_id, properties=properties,
                        heap_mb=heap_mb, cluster_id=cluster_id, controller_port=port, voters=voters,
                        replication_factor=size, client_protocol=client_protocol, scram_users=scram_users)
            for node_id, port in controller_ports.items()
        ]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    @property
    def internal_bootstrap_servers(self) -> str:
        return ",".join(node.internal_bootstrap_servers for node in self.nodes)

    @property
    def replication_factor(self) -> int:
        return len(self.nodes)

    def node(self, node_id: int) -> KafkaBroker:
        return next(node for node in self.nodes if node.node_id == node_id)

    def start(self, timeout: float = 120.0) -> KafkaCluster:
        """Format every node, launch them together (the controller quorum needs a
        majority to elect a leader) and wait until each answers."""
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready(timeout)
        except KafkaUnavailable:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.kill() if not node.running else None
        # SIGTERM all at once: one at a time, the last ones wait for a lost quorum.
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.resume_quietly()
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout=15)

    def remove(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def admin(self, **config: str | int | float) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.internal_bootstrap_servers, "log_level": 3, **config})

    def create_topic(self, topic: str, *, partitions: int = 1, replication_factor: int | None = None,
                     config: Mapping[str, object] | None = None, timeout: float = 30.0) -> None:
        create_topic(self.admin(), topic, partitions=partitions,
                     replication_factor=replication_factor or self.replication_factor, config=config,
                     timeout=timeout)

    def leader_of(self, topic: str, partition: int = 0, timeout: float = 30.0) -> KafkaBroker:
        """The node leading ``topic``/``partition`` now (asked of a live node)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if not node.running:
                    continue
                with contextlib.suppress(Exception):
                    meta = node.admin(log_level=0).list_topics(topic, timeout=3).topics.get(topic)
                    if meta is not None and partition in meta.partitions:
                        leader = meta.partitions[partition].leader
                        if leader >= 0:
                            return self.node(leader)
            time.sleep(0.2)
        raise KafkaUnavailable(f"no leader for {topic}[{partition}] within {timeout:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbox_relay.embedded_kafka [--resolve | --serve]``: print the cached
    classpath file after fetching it if needed, or run a single broker until Ctrl-C."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] == "--resolve":
        kafka_classpath()
        print(classpath_cache_file() if not os.environ.get("OUTBOX_RELAY_KAFKA_CLASSPATH") else "(from env)")
        return 0
    if args[0] == "--serve":
        with KafkaBroker() as node:
            print(f"Apache Kafka {KAFKA_VERSION} on {node.bootstrap_servers} "
                  f"(started in {node.started_seconds:.1f}s, log {node.log_file}); Ctrl-C stops it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while node.running:
                    time.sleep(1)
        return 0
    print("usage: python -m outbox_relay.embedded_kafka [--resolve | --serve]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
