"""A host of its own for a relay: a network namespace with one veth link per peer.

``RelayHost`` makes a network namespace and, for each peer (the database, the broker),
a link of its own: a router namespace between two veth pairs, relay namespace
(``10.231.<n>.<8k+2>``) -> router -> host (``10.231.<n>.<8k+6>``). Nothing is routed
anywhere else: the namespace has no default route, only a route to each link's host
address, so a relay inside it reaches exactly the addresses the test gave (and its own
loopback). On the host address a ``TcpProxy`` (``net_proxy.py``) listens and forwards
to the real server on loopback, so one link can be slowed or made lossy without
touching the other.

``Link.cut()`` puts a token bucket too small for any packet (``tbf rate 8bit burst 10``)
on both of the router's interfaces: every packet is dropped silently one hop away, no
RST, the TCP connections stay open on both sides, as when a route is lost (this kernel
has no netem; tbf is what it has). ``Link.heal()`` removes it. ``RelayHost.close()``
(also on ``with`` exit, whatever the test did) kills what runs in the namespace and
deletes the namespaces and the veth pairs.

Needs root and iproute2: ``netns_missing_reason()`` says why not, for ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from tests.helpers.net_proxy import TcpProxy

SUBNET_PREFIX = "10.231"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {result.stderr.strip()}")
    return result


def netns_missing_reason() -> str | None:
    """Why this machine cannot give a relay a network namespace (for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (Debian package iproute2)"
    probe = f"nrprobe{os.getpid()}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` refused: {added.stderr.strip()}"
    try:
        pair = _ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b", check=False)
        if pair.returncode != 0:
            return f"no veth pairs: {pair.stderr.strip()}"
        bucket = _tc(
            "qdisc",
            "add",
            "dev",
            f"{probe}a",
            "root",
            "tbf",
            "rate",
            "8bit",
            "burst",
            "10",
            "latency",
            "1ms",
            check=False,
        )
        if bucket.returncode != 0:
            return f"no tbf qdisc to cut a link with: {bucket.stderr.strip()}"
        return None
    finally:
        _ip("link", "del", f"{probe}a", check=False)
        _ip("netns", "del", probe, check=False)


def _free_subnet_octet() -> int:
    """A third octet no interface of the host uses yet (10.231.<n>.0/24)."""
    used = _ip("-o", "-4", "addr").stdout
    start = (os.getpid() * 7 + next(_counter) * 13) % 250
    for step in range(250):
        octet = (start + step) % 250 + 1
        if f" {SUBNET_PREFIX}.{octet}." not in used:
            return octet
    raise RuntimeError(f"no free {SUBNET_PREFIX}.x.0/24 subnet")


class Link:
    """One path between the namespace and the host, for one peer, through a router of
    its own: relay namespace <-veth-> router namespace <-veth-> host. A cut drops the
    packets in the router, one hop away from both ends, as a lost route does: each
    end's kernel sent its packets and hears nothing back (a drop at an end's own
    interface would be a local drop, which the sending kernel sees and treats apart)."""

    def __init__(self, host: RelayHost, name: str, index: int) -> None:
        self.name = name
        tag = host.tag
        base = 8 * index
        net = f"{SUBNET_PREFIX}.{host.octet}"
        self.router = f"{tag}r{index}"
        self.ns_if, self.router_ns_if = f"{tag}{index}n", f"{tag}{index}a"
        self.router_host_if, self.host_if = f"{tag}{index}b", f"{tag}{index}h"
        self.ns_address, router_ns_side = f"{net}.{base + 2}", f"{net}.{base + 1}"
        router_host_side, self.host_address = f"{net}.{base + 5}", f"{net}.{base + 6}"
        self._relay_ns = host.name
        self.proxies: list[TcpProxy] = []
        self.is_cut = False
        _ip("netns", "add", self.router)
        _ip("-n", self.router, "link", "set", "lo", "up")
        subprocess.run(
            ["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            check=True,
            capture_output=True,
            timeout=20,
        )
        # relay namespace <-> router
        _ip(
            "-n",
            self.router,
            "link",
            "add",
            self.router_ns_if,
            "type",
            "veth",
            "peer",
            "name",
            self.ns_if,
            "netns",
            host.name,
        )
        _ip("-n", self.router, "addr", "add", f"{router_ns_side}/30", "dev", self.router_ns_if)
        _ip("-n", self.router, "link", "set", self.router_ns_if, "up")
        _ip("-n", host.name, "addr", "add", f"{self.ns_address}/30", "dev", self.ns_if)
        _ip("-n", host.name, "link", "set", self.ns_if, "up")
        # router <-> host
        _ip(
            "-n",
            self.router,
            "link",
            "add",
            self.router_host_if,
            "type",
            "veth",
            "peer",
            "name",
            self.host_if,
            "netns",
            "1",
        )
        _ip("-n", self.router, "addr", "add", f"{router_host_side}/30", "dev", self.router_host_if)
        _ip("-n", self.router, "link", "set", self.router_host_if, "up")
        _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        # Each end reaches the other through the router, and nothing else.
        _ip("-n", host.name, "route", "add", f"{self.host_address}/32", "via", router_ns_side)
        _ip("route", "add", f"{self.ns_address}/32", "via", router_host_side, "dev", self.host_if)

    def forward(self, target: str, *, port: int = 0) -> TcpProxy:
        """A proxy on this link's host address forwarding to ``target`` (host:port)."""
        target_host, _, target_port = target.rpartition(":")
        proxy = TcpProxy(target_host, int(target_port), listen_host=self.host_address, listen_port=port).start()
        self.proxies.append(proxy)
        return proxy

    def cut(self) -> None:
        """Drop every packet on this link, both ways, silently (the connections stay open)."""
        for interface in (self.router_ns_if, self.router_host_if):
            _tc(
                "-n",
                self.router,
                "qdisc",
                "replace",
                "dev",
                interface,
                "root",
                "tbf",
                "rate",
                "8bit",
                "burst",
                "10",
                "latency",
                "1ms",
            )
        self.is_cut = True

    def heal(self) -> None:
        for interface in (self.router_ns_if, self.router_host_if):
            _tc("-n", self.router, "qdisc", "del", "dev", interface, "root", check=False)
        self.is_cut = False

    def set_delay(self, seconds: float) -> None:
        for proxy in self.proxies:
            proxy.delay_seconds = seconds

    def set_loss(self, fraction: float) -> None:
        for proxy in self.proxies:
            proxy.loss = fraction

    def close(self) -> None:
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                proxy.stop()
        self.proxies.clear()
        _ip("netns", "del", self.router, check=False)  # its veth ends, and with them their peers
        _ip("link", "del", self.host_if, check=False)


class RelayHost:
    """A network namespace with a veth link per peer (``links``: names, e.g. database, broker)."""

    def __init__(self, links: Sequence[str] = ("database", "broker")) -> None:
        self.tag = f"nr{uuid.uuid4().hex[:6]}"  # interface names: at most 15 characters
        self.name = f"{self.tag}ns"
        self.octet = _free_subnet_octet()
        self.links: dict[str, Link] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            for index, name in enumerate(links):
                self.links[name] = Link(self, name, index)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RelayHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A process inside the namespace, killed (with its group) at close."""
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen([*self.prefix, *argv], **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout_seconds: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=timeout_seconds, **kwargs)

    def http_status(self, url: str, timeout_seconds: float = 5.0) -> int | None:
        """The status of GET ``url`` made from inside the namespace (None: no answer)."""
        code = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            f"    print(urllib.request.urlopen(sys.argv[1], timeout={timeout_seconds}).status)\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)\n"
            "except Exception:\n"
            "    print('none')\n"
        )
        result = self.run([sys.executable, "-c", code, url], timeout_seconds=timeout_seconds + 10)
        text = result.stdout.strip()
        return int(text) if text.isdigit() else None

    def heal_all(self) -> None:
        for link in self.links.values():
            link.heal()

    def close(self) -> None:
        for proc in self._processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    proc.wait(timeout=10)
        for link in self.links.values():
            link.close()
        # Whatever still runs in the namespace (a relay started some other way).
        pids = _ip("netns", "pids", self.name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", self.name, check=False)
