"""A real HTTP server on 127.0.0.1 for publisher tests: records every request and
answers by a script.

    target = HttpTarget().start()
    target.script("/e/Flaky", Step(503), Step(200))          # per path
    target.script_id(42, Step(200, delay=1.5), Step(200))    # per message id (X-Outbox-message-id)
    ...
    target.requests_for(42)   # what the server received for row 42, in order
    target.stop()

A script is a list of steps consumed in order; its last step repeats. Message-id
scripts win over path scripts; unscripted requests get ``default`` (200).
The server speaks HTTP/1.1 with keep-alive, so the client's connection reuse is real.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Step:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    delay: float = 0.0


@dataclass
class Recorded:
    method: str
    path: str  # raw (still percent-encoded)
    headers: dict[str, str]  # lower-cased names
    body: bytes
    at: float
    client_port: int

    @property
    def message_id(self) -> int | None:
        value = self.headers.get("x-outbox-message-id")
        return int(value) if value is not None else None

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get("idempotency-key")

    @property
    def decoded_path(self) -> str:
        return unquote(urlsplit(self.path).path)


class HttpTarget:
    def __init__(self, default: Step | None = None, port: int = 0) -> None:
        self.default = default or Step(200)
        self._listen_port = port
        self.requests: list[Recorded] = []
        self._by_path: dict[str, list[Step]] = {}
        self._by_id: dict[int, list[Step]] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- script ------------------------------------------------------------------------
    def script(self, path: str, *steps: Step) -> None:
        with self._lock:
            self._by_path[path] = list(steps)

    def script_id(self, message_id: int, *steps: Step) -> None:
        with self._lock:
            self._by_id[int(message_id)] = list(steps)

    def _next_step(self, path: str, message_id: int | None) -> Step:
        with self._lock:
            steps = self._by_id.get(message_id) if message_id is not None else None
            if steps is None:
                steps = self._by_path.get(urlsplit(path).path)
            if not steps:
                return self.default
            return steps.pop(0) if len(steps) > 1 else steps[0]

    # --- records -----------------------------------------------------------------------
    def requests_for(self, message_id: int) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.message_id == message_id]

    def snapshot(self) -> list[Recorded]:
        with self._lock:
            return list(self.requests)

    # --- server ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpTarget:
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # http.server naming
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                record = Recorded(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                    time.monotonic(),
                    self.client_address[1],
                )
                with target._lock:
                    target.requests.append(record)
                step = target._next_step(self.path, record.message_id)
                if step.delay:
                    time.sleep(step.delay)
                payload = step.body.encode("utf-8")
                try:
                    self.send_response(step.status)
                    for name, value in step.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    self.wfile.flush()
                except OSError:  # the client gave up (timeout) and closed the connection
                    self.close_connection = True

            do_PUT = do_POST

            def log_message(self, format: str, *args: object) -> None:  # silence
                return

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False

            def handle_error(self, request, client_address) -> None:  # silence
                return

        self._server = Server(("127.0.0.1", self._listen_port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="http-target", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HttpTarget:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
