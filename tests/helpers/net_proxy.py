"""A TCP proxy of the tests' own that does what netem would: delay, loss, blackhole.

This machine's kernel has no ``netem``, so a link's latency and loss are made here,
between a client and its server, on an asyncio loop in a thread of the test process:

- ``delay_seconds``: every chunk is forwarded that long after it arrived, in each
  direction (a round trip costs twice that), in order;
- ``loss``: the fraction of chunks that behave like a lost TCP segment: the stream
  stalls for a retransmission timeout (``retransmit_seconds``, Linux's minimum RTO is
  200 ms) before that chunk and everything behind it goes on (a byte stream never
  loses bytes: TCP resends them; what the application sees is the stall);
- ``blackhole``: whatever arrives is read and thrown away, nothing is answered, the
  connections stay open (a peer that stopped answering; the kernel still acknowledges,
  so this is a hung peer, not a lost route: ``netns.Link.cut`` drops packets);
- ``kill_connections()``: closes every proxied connection (both sides see a reset/EOF).

``hold_downstream`` holds the server's answers (queued, not lost) until it is cleared:
with ``watch_upstream`` it stops a client right after a request of interest went out.
``KafkaRequestWatcher`` reads the request framing of the Kafka protocol (int32 size,
int16 api_key) so a test can act the moment a Produce request reached the broker.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

CHUNK_BYTES = 65536
KAFKA_PRODUCE_API_KEY = 0


class KafkaRequestWatcher:
    """Follows one client->broker byte stream and calls ``on_request(api_key)`` per request."""

    def __init__(self, on_request: Callable[[int], None]) -> None:
        self._on_request = on_request
        self._header = b""  # first bytes of the next request (size + api_key)
        self._remaining = 0  # bytes of the current request still to come

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._remaining:
                step = min(self._remaining, len(view))
                self._remaining -= step
                view = view[step:]
                continue
            need = 6 - len(self._header)
            self._header += bytes(view[:need])
            view = view[need:]
            if len(self._header) == 6:
                size, api_key = struct.unpack(">ih", self._header)
                self._header = b""
                self._remaining = max(0, size - 2)
                self._on_request(api_key)


class TcpProxy:
    """Listens on ``listen_host:listen_port`` (0 = a free port) and forwards to
    ``target_host:target_port``, or to a Unix socket when ``target_host`` is a path
    (a PostgreSQL socket directory: ``<dir>/.s.PGSQL.<port>``)."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        retransmit_seconds: float = 0.2,
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.delay_seconds = 0.0
        self.loss = 0.0
        self.retransmit_seconds = retransmit_seconds
        self.blackhole = False
        self.hold_downstream = threading.Event()  # set: the server's answers wait
        self.watch_upstream: Callable[[], Callable[[bytes], None]] | None = None  # per connection
        self._random = random.Random(7)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((listen_host, listen_port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"proxy-{self.port}", daemon=True)
        self._started = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> TcpProxy:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, sock=self._sock)
            self._started.set()

        self._loop.run_until_complete(serve())
        self._loop.run_forever()
        self._loop.close()

    def stop(self) -> None:
        if not self._thread.is_alive():
            self._sock.close()
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- controls (callable from any thread) ---------------------------------------------
    def kill_connections(self) -> None:
        def abort() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        self._loop.call_soon_threadsafe(abort)

    def connection_count(self) -> int:
        return len(self._writers) // 2

    # --- forwarding -------------------------------------------------------------------
    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            host, port = self.target
            if host.startswith("/"):
                server_reader, server_writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
            else:
                server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, server_writer}
        watch = self.watch_upstream() if self.watch_upstream is not None else None
        try:
            await asyncio.gather(
                self._pipe(client_reader, server_writer, watch=watch, downstream=False),
                self._pipe(server_reader, client_writer, watch=None, downstream=True),
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a reset, or the proxy stopping
        finally:
            for writer in (client_writer, server_writer):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        watch: Callable[[bytes], None] | None,
        downstream: bool,
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, writer, downstream=downstream))
        due = 0.0
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                if self.blackhole:
                    continue
                now = time.monotonic()
                stall = self.retransmit_seconds if self.loss and self._random.random() < self.loss else 0.0
                # In order: a chunk never overtakes the one before it (head-of-line, as TCP).
                due = max(due, now + self.delay_seconds + stall)
                if watch is not None:
                    watch(data)
                queue.put_nowait((due, data))
        finally:
            queue.put_nowait(None)
            await sender
            writer.transport.abort()

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter, *, downstream: bool
    ) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            while downstream and self.hold_downstream.is_set():
                await asyncio.sleep(0.01)
            if self.blackhole:
                continue
            writer.write(data)
            try:
                await writer.drain()
            except OSError:
                return


def start_proxy(target: str, **kwargs: Any) -> TcpProxy:
    """A started proxy to ``host:port``."""
    host, _, port = target.rpartition(":")
    return TcpProxy(host, int(port), **kwargs).start()
