"""A TLS-terminating TCP proxy (asyncio + the stdlib's OpenSSL) in front of a plain listener.

tansu 0.6 accepts ``--cert``/``--key`` but never wraps its connections in TLS (its
acceptor is built and unused), so the TLS tests put this in front of it, the way
stunnel or a TLS-terminating load balancer fronts a plaintext service: real TLS
handshakes with certificates made by the test, optionally requiring a client
certificate (mutual TLS). The broker advertises the proxy's port, so every
connection the client opens goes through TLS.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from pathlib import Path

from outbox_relay._embedded.embedded import free_port


class TlsProxy:
    def __init__(
        self, target_port: int, *, cert: Path, key: Path, client_ca: Path | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.target_port = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(str(cert), str(key))
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(str(client_ca))
        self.handshakes_failed = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TlsProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._server = future.result(timeout=10)
        return self

    async def _serve(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, ssl=self.context, ssl_handshake_timeout=10
        )

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        self._writers.add(upstream_writer)
        await asyncio.gather(
            self._pipe(client_reader, upstream_writer),
            self._pipe(upstream_reader, client_writer),
            return_exceptions=True,
        )
        self._writers.difference_update((client_writer, upstream_writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, ssl.SSLError):
            pass  # either side went away: close the other
        finally:
            writer.close()

    async def _shutdown(self) -> None:
        # Closing every transport ends each pipe with EOF, so the handlers finish by
        # themselves (cancelling stream handlers makes asyncio log spurious errors).
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # no TLS close_notify exchange: the peers may be gone
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.wait(tasks, timeout=5) if tasks else None

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> TlsProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
