"""The built-in HTTP publisher (``relay.publisher = "http"``, settings under ``http``).

Each outbox row becomes one ``POST`` to ``http.url_template``:

- **URL**: the template formatted with ``{aggregate_type}``, ``{aggregate_id}``,
  ``{event_type}``, ``{topic}`` and ``{id}``; every value is percent-encoded
  (``/`` included), so a row can never change the URL's shape.
- **Body**: the payload as JSON text (UTF-8), exactly as stored;
  ``Content-Type: application/json``. A row with ``payload_bytes`` (encoded by its
  writer): those bytes, ``Content-Type`` = the row's ``content-type`` header, else
  ``application/octet-stream``.
- **Headers**: every header of the message contract (``message_id``,
  ``event_type``, ``aggregate_type``, ``aggregate_id``, then the row's own
  ``headers``) as ``X-Outbox-<name>``, with ``_`` in the name turned into ``-``
  (proxies such as nginx drop header names containing underscores), e.g.
  ``X-Outbox-message-id: 42``, ``X-Outbox-event-type: OrderPaid``. HTTP header
  names are case-insensitive. A row header whose name is not an HTTP token or whose
  value is not printable ASCII cannot be sent: the row goes ``dead`` with that
  reason (nothing is silently altered). The W3C trace context (``traceparent``,
  ``tracestate``) keeps its own header name.
- **Formats** (``kafka.message_format``, ``outbox_relay.formats``): in
  ``cloudevents-binary`` the request is the CloudEvents HTTP binding's binary mode
  (``ce-specversion``, ``ce-id``, ``ce-source``, ``ce-type``, ``ce-subject``,
  ``ce-time``, percent-encoded, ``Content-Type: application/json``, body = payload);
  in ``cloudevents-structured`` its structured mode (``Content-Type:
  application/cloudevents+json``, body = the envelope). ``debezium`` sends the
  payload with ``X-Outbox-id``.
- ``Idempotency-Key: outbox-<message_id>``: derived only from the outbox id, so
  every retry, every lease takeover and every replica sends the same key for the
  same row. Receivers that honour it turn at-least-once into one effect. (The key
  is unique per outbox table: if several tables feed one endpoint, route them to
  different URLs.)
- **Signatures** (Standard Webhooks, when ``http.signing_secret_files`` or
  ``http.signing_secrets_env`` is set): ``webhook-id`` = the row's ``message_id``
  (the outbox id, decimal: the same on every retry, takeover, replica and replay),
  ``webhook-timestamp`` = unix seconds when this attempt is sent, and
  ``webhook-signature`` = ``v1,<base64(HMAC-SHA256(key, "<id>.<timestamp>.<body>"))>``
  over the exact body bytes sent, one space-separated signature per configured
  secret (``whsec_<base64 key>``), so a secret can be rotated without downtime.
  The keys are never logged, never part of an error and not shown by ``repr``.
- ``http.headers`` (e.g. ``Authorization``) are sent with every request; they may
  override ``Content-Type`` (except in the CloudEvents formats, whose media type is
  part of the binding) and ``User-Agent`` but never ``Idempotency-Key``, an
  ``X-Outbox-*``/``ce-*`` header, the trace context or (when signing) a
  ``webhook-*`` header. Their values are never logged.

Outcomes (the same four as every publisher's, see ``outbox_relay.core.decision``):

============================================  ==================================================
response                                      outcome
============================================  ==================================================
``http.done_statuses`` (default 409)          done: the target already has it
``http.defer_statuses`` (default none)        ``Defer(Retry-After or http.defer_seconds)``,
                                              attempt refunded
2xx                                           done
408, 429, 5xx                                 ``RetryableError``; ``Retry-After`` (seconds or
                                              HTTP-date) is the backoff floor
timeout (connect, read, write, pool)          ``RetryableError`` (connect timeouts are transport)
connection refused / reset / closed           ``RetryableError(transport=True)``
any other status (other 4xx, 3xx, 1xx)        ``PermanentError("HTTP <status>: <body…>")``, dead
============================================  ==================================================

The first matching line wins (so configured statuses override the defaults).
``Retry-After`` values beyond a day are capped to a day. Redirects are not
followed (a 3xx means the URL is wrong). Error bodies are read up to 64 KiB and
quoted in ``last_error`` as one line of at most 300 characters; the URL in an
error names scheme, host and path only (no credentials, no query string).

Concurrency and time: one ``httpx.Client`` (thread-safe, keep-alive pool sized
``max_concurrency x workers``) serves all workers. A batch sends at most
``http.max_concurrency`` requests at a time. Rows of an *ordered* event type
(``relay.ordered_event_types``) are sent one after another per aggregate, and
after a failure the rest of that aggregate's run is not sent (``NotDelivered``).
Each request's timeout is ``http.timeout_seconds`` (default 25 % of the lease, at
most 30 s), clipped to the batch's remaining time, so ``publish_batch`` returns
by ``timeout_seconds``: a request still without a response then is a
``RetryableError`` (it may have landed: the idempotency key covers it), a request
never started is ``NotDelivered`` (released, attempt refunded).

``probe()`` opens a TCP connection to the target's host and port (when the host
part of the template has no placeholders): the relay's circuit breaker uses it, so
a batch in which every request failed to connect (target down as a whole) releases
its rows with the attempt refunded and pauses claiming until the target accepts
connections again, instead of burning attempts toward dead.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime
from string import Formatter
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote, urlsplit

import httpx

from ..config import webhook_secret_bytes
from ..core.formats import (
    BYTES_CONTENT_TYPE,
    CE_HTTP_PREFIX,
    CONTENT_TYPE_HEADER,
    HTTP_HEADER_PREFIX,
    TRACE_HEADERS,
    http_header_name,
    http_headers,
)
from ..core.ordering import RELEASED_AFTER_FAILURE, chains
from ..errors import ConfigError
from ..model import Defer, Message, NotDelivered, Outcome, PermanentError, RetryableError
from .base import Publisher

if TYPE_CHECKING:
    from ..config import Settings

URL_FIELDS = ("aggregate_type", "aggregate_id", "event_type", "topic", "id")
HEADER_PREFIX = HTTP_HEADER_PREFIX
IDEMPOTENCY_PREFIX = "outbox-"
BODY_LIMIT_BYTES = 64 * 1024
ERROR_BODY_CHARS = 300
RETRYABLE_4XX = frozenset({408, 429})
MAX_RETRY_AFTER_SECONDS = 86400.0  # a Retry-After beyond a day is capped to a day
#: A tombstone row (``tombstone = true``: a null Kafka value, a delete on a compacted
#: topic) has no body to POST and no HTTP equivalent the relay could choose for every
#: receiver: it goes dead with this reason rather than being sent as something else.
TOMBSTONE_OVER_HTTP = (
    "cannot send over HTTP: the row is a tombstone (a null Kafka value for a compacted topic); "
    "the HTTP publisher has no body to send for it"
)
_RESERVED_HEADERS = frozenset({"idempotency-key", "content-length", "host", "transfer-encoding"})
_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VALUE_RE = re.compile(r"^[\x20-\x7e\t]*$")  # visible ASCII, space and tab; no CR/LF
_PENDING = object()
# Standard Webhooks header names (lower case, as the specification spells them).
WEBHOOK_ID_HEADER = "webhook-id"
WEBHOOK_TIMESTAMP_HEADER = "webhook-timestamp"
WEBHOOK_SIGNATURE_HEADER = "webhook-signature"
WEBHOOK_SIGNATURE_VERSION = "v1"  # symmetric: HMAC-SHA256
_WEBHOOK_HEADERS = frozenset({WEBHOOK_ID_HEADER, WEBHOOK_TIMESTAMP_HEADER, WEBHOOK_SIGNATURE_HEADER})


def idempotency_key(message: Message) -> str:
    """The same for every attempt at one row, whichever worker or replica sends it."""
    return f"{IDEMPOTENCY_PREFIX}{message.id}"


def header_name(name: str) -> str:
    """Contract header name -> HTTP header name (``message_id`` -> ``X-Outbox-message-id``)."""
    return http_header_name(name)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """``Retry-After`` (delay-seconds or HTTP-date) -> seconds from now (at most a day),
    or None if absent or invalid."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        current = datetime.now(UTC).timestamp() if now is None else now
        return min(MAX_RETRY_AFTER_SECONDS, max(0.0, when.timestamp() - current))
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(MAX_RETRY_AFTER_SECONDS, seconds)


def _one_line(data: bytes, charset: str | None, limit: int = ERROR_BODY_CHARS) -> str:
    try:
        text = data.decode(charset or "utf-8", errors="replace")
    except LookupError:
        text = data.decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_header(name: str, value: str, what: str) -> str | None:
    """None if sendable, else the reason it is not."""
    if not _TOKEN_RE.match(name):
        return f"{what} name {name!r} is not a valid HTTP header name"
    if not _VALUE_RE.match(value):
        return f"{what} {name!r}: value is not printable ASCII (HTTP headers cannot carry it)"
    return None


class WebhookSigner:
    """Signs requests the Standard Webhooks way with one or more HMAC-SHA256 keys.

    Several keys = rotation: the receiver accepts a request if any signature in the
    space-separated ``webhook-signature`` list verifies with a key it knows. The keys
    stay inside this object: ``repr`` shows only how many there are."""

    __slots__ = ("_keys",)

    def __init__(self, secrets: Sequence[str]) -> None:
        if not secrets:
            raise ConfigError("webhook signing needs at least one secret")
        keys: list[bytes] = []
        for position, secret in enumerate(secrets, start=1):
            try:
                keys.append(webhook_secret_bytes(secret))
            except ValueError as exc:  # the message never quotes the secret
                raise ConfigError(f"webhook signing secret #{position}: {exc}") from None
        self._keys = tuple(keys)

    def __repr__(self) -> str:
        return f"WebhookSigner(<{len(self._keys)} secret(s)>)"

    __str__ = __repr__

    @property
    def key_count(self) -> int:
        return len(self._keys)

    def headers(self, webhook_id: str, timestamp_seconds: int, body: bytes) -> dict[str, str]:
        """The three ``webhook-*`` headers for one attempt at sending ``body``.

        ``webhook_id`` must not contain ``.`` (the signed content is dot-delimited); the
        relay passes the decimal outbox id."""
        if "." in webhook_id:
            raise ValueError("a webhook id must not contain '.'")
        signed = f"{webhook_id}.{timestamp_seconds}.".encode("ascii") + body
        signatures = " ".join(
            f"{WEBHOOK_SIGNATURE_VERSION},"
            + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")
            for key in self._keys
        )
        return {
            WEBHOOK_ID_HEADER: webhook_id,
            WEBHOOK_TIMESTAMP_HEADER: str(timestamp_seconds),
            WEBHOOK_SIGNATURE_HEADER: signatures,
        }


def webhook_id(message: Message) -> str:
    """The Standard Webhooks id of a row: its ``message_id`` (the decimal outbox id),
    identical for every attempt, lease takeover, replica and replay of the row."""
    return message.message_id


class HttpPublisher(Publisher):
    """POSTs each message to a URL; see the module docstring for the exact contract."""

    name: ClassVar[str] = "http"
    # probe() opens a TCP connection to the target: the circuit breaker can use it.
    can_probe: ClassVar[bool] = True
    # The target may come and go; a relay starts without it (the breaker waits).
    must_answer_at_start: ClassVar[bool] = False

    def __init__(
        self,
        url_template: str,
        *,
        timeout_seconds: float,
        max_concurrency: int = 16,
        done_statuses: Iterable[int] = (409,),
        defer_statuses: Iterable[int] = (),
        defer_seconds: float = 30.0,
        headers: Mapping[str, str] | None = None,
        max_connections: int | None = None,
        user_agent: str = "outbox-relay",
        transport: httpx.BaseTransport | None = None,
        signer: WebhookSigner | None = None,
    ) -> None:
        self.url_template = self._check_template(url_template)
        if timeout_seconds <= 0:
            raise ConfigError("http.timeout_seconds must be positive")
        if max_concurrency < 1:
            raise ConfigError("http.max_concurrency must be at least 1")
        self.timeout_seconds = float(timeout_seconds)
        self.max_concurrency = int(max_concurrency)
        self.done_statuses = frozenset(int(s) for s in done_statuses)
        self.defer_statuses = frozenset(int(s) for s in defer_statuses)
        both = self.done_statuses & self.defer_statuses
        if both:
            raise ConfigError(f"http.done_statuses and http.defer_statuses both contain {sorted(both)}")
        for status in self.done_statuses | self.defer_statuses:
            if not 100 <= status <= 599:
                raise ConfigError(f"http status {status} in done_statuses/defer_statuses is not an HTTP status")
        self.defer_seconds = float(defer_seconds)
        self.signer = signer

        base = {"Content-Type": "application/json", "User-Agent": user_agent, "Accept": "*/*"}
        for name, value in (headers or {}).items():
            problem = _check_header(str(name), str(value), "http.headers")
            if problem:
                raise ConfigError(problem)  # names the header, never echoes its value (often a credential)
            lowered = name.lower()
            if (
                lowered in _RESERVED_HEADERS
                or lowered in TRACE_HEADERS
                or lowered.startswith((HEADER_PREFIX.lower(), CE_HTTP_PREFIX))
                or (signer is not None and lowered in _WEBHOOK_HEADERS)
            ):
                raise ConfigError(f"http.headers may not set {name!r}: the publisher sets it per message")
            for existing in list(base):
                if existing.lower() == lowered:
                    del base[existing]
            base[name] = value
        self._base_headers = base

        connections = max(self.max_concurrency, int(max_connections or self.max_concurrency))
        self._client = httpx.Client(
            timeout=httpx.Timeout(self.timeout_seconds),
            limits=httpx.Limits(
                max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=30.0
            ),
            follow_redirects=False,
            transport=transport,
        )
        self._closed = False
        # Set by abort() at the shutdown deadline: stop waiting, release what has no answer.
        self.aborting = threading.Event()

    def abort(self) -> None:
        self.aborting.set()

    def describe_target(self) -> str:
        parts = urlsplit(self.url_template.format(**dict.fromkeys(URL_FIELDS, "x")))
        return f"the HTTP target {parts.scheme}://{parts.netloc.rpartition('@')[2]}"  # never credentials

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpPublisher:
        h = settings.http
        try:
            from importlib.metadata import version

            agent = f"outbox-relay/{version('outbox-relay')}"
        except Exception:
            agent = "outbox-relay"
        return cls(
            h.url_template,
            timeout_seconds=settings.http_timeout_seconds,
            max_concurrency=h.max_concurrency,
            done_statuses=h.done_statuses,
            defer_statuses=h.defer_statuses,
            defer_seconds=h.defer_seconds,
            headers=h.headers,
            max_connections=h.max_concurrency * settings.relay.workers,
            user_agent=agent,
            signer=WebhookSigner([s.get_secret_value() for s in h.signing_secrets()]) if h.signs_requests else None,
        )

    # --- configuration checks --------------------------------------------------------
    @staticmethod
    def _check_template(template: str) -> str:
        # The template is not echoed: it may carry credentials (user:password@host, ?token=).
        try:
            names = [field for _, field, _, _ in Formatter().parse(template) if field is not None]
        except ValueError as exc:
            raise ConfigError(f"http.url_template is not a valid template: {exc}") from None
        for name in names:
            if name not in URL_FIELDS:
                raise ConfigError(
                    f"http.url_template: unknown placeholder {{{name}}}; use "
                    + ", ".join("{" + f + "}" for f in URL_FIELDS)
                )
        sample = template.format(**dict.fromkeys(URL_FIELDS, "x"))
        parts = urlsplit(sample)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("http.url_template must be an absolute http:// or https:// URL")
        return template

    # --- message -> request ----------------------------------------------------------
    def limit_keys(self, message: Message) -> Mapping[str, str]:
        """``[[limits]]`` match a message by its topic or by the host its request goes to."""
        try:
            host = urlsplit(self.url_for(message)).hostname
        except ValueError:
            host = None
        return {"topic": message.topic} if host is None else {"topic": message.topic, "host": host}

    def url_for(self, message: Message) -> str:
        values = {
            "aggregate_type": message.aggregate_type,
            "aggregate_id": message.aggregate_id,
            "event_type": message.event_type,
            "topic": message.topic,
            "id": str(message.id),
        }
        return self.url_template.format(**{k: quote(v, safe="") for k, v in values.items()})

    def headers_for(self, message: Message) -> dict[str, str]:
        headers = dict(self._base_headers)
        wire = http_headers(message.format, message.headers)
        for (name, _), (http_name, value) in zip(message.headers, wire, strict=True):
            problem = _check_header(http_name, value, "header")
            if problem:
                raise PermanentError(f"cannot send over HTTP: {problem} (row header {name!r})")
            if http_name == "Content-Type":  # the format's media type wins over http.headers
                for existing in [n for n in headers if n.lower() == "content-type"]:
                    del headers[existing]
            headers[http_name] = value
        headers["Idempotency-Key"] = idempotency_key(message)
        return headers

    # --- one request -----------------------------------------------------------------
    def send(self, message: Message, *, timeout_seconds: float | None = None) -> Outcome:
        """POST one message and classify the response; never raises an outcome."""
        timeout = self.timeout_seconds if timeout_seconds is None else min(self.timeout_seconds, timeout_seconds)
        if message.value is None:
            return PermanentError(TOMBSTONE_OVER_HTTP)
        try:
            url = self.url_for(message)
            headers = self.headers_for(message)
        except PermanentError as exc:
            return exc
        parts = urlsplit(url)
        where = f"POST {parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"  # no credentials, no query
        if isinstance(message.value, bytes):
            # A row its writer encoded (payload_bytes): the body is its bytes, and their
            # media type the row's content-type header (application/octet-stream without
            # one). The CloudEvents formats carry it already (Content-Type, datacontenttype).
            body = message.value
            if not message.format.is_cloudevents:
                for existing in [n for n in headers if n.lower() == "content-type"]:
                    del headers[existing]
                headers["Content-Type"] = next(
                    (v for n, v in message.headers if n.lower() == CONTENT_TYPE_HEADER), BYTES_CONTENT_TYPE
                )
        else:
            body = message.value.encode("utf-8")
        if self.signer is not None:
            # Signed over the exact bytes sent, with this attempt's time (receivers refuse stale timestamps).
            headers.update(self.signer.headers(webhook_id(message), int(time.time()), body))
        try:
            request = self._client.build_request(
                "POST", url, content=body, headers=headers, timeout=httpx.Timeout(timeout)
            )
            response = self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            kind = type(exc).__name__
            return RetryableError(
                f"HTTP timeout after {timeout:.3g}s ({kind}): {where}", transport=isinstance(exc, httpx.ConnectTimeout)
            )
        except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError) as exc:
            return RetryableError(f"HTTP connection failed ({type(exc).__name__}: {exc}): {where}", transport=True)
        except httpx.UnsupportedProtocol as exc:
            return PermanentError(f"HTTP unsupported URL ({exc}): {where}")
        except httpx.InvalidURL as exc:
            return PermanentError(f"HTTP invalid URL ({exc})")
        except httpx.HTTPError as exc:
            return RetryableError(f"HTTP error ({type(exc).__name__}: {exc}): {where}")
        try:
            return self._classify(response, where)
        finally:
            response.close()

    def _read_body(self, response: httpx.Response) -> bytes:
        chunks: list[bytes] = []
        size = 0
        try:
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size >= BODY_LIMIT_BYTES:
                    break
        except httpx.HTTPError:
            pass  # the status line is the outcome; a broken body only loses the detail
        return b"".join(chunks)[:BODY_LIMIT_BYTES]

    def _classify(self, response: httpx.Response, where: str) -> Outcome:
        status = response.status_code
        body = self._read_body(response)  # also lets the connection be reused

        def detail() -> str:
            text = _one_line(body, response.charset_encoding)
            return f"HTTP {status}: {text}" if text else f"HTTP {status} ({where})"

        if status in self.done_statuses:
            return None
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        if status in self.defer_statuses:
            return Defer(self.defer_seconds if retry_after is None else retry_after, detail())
        if 200 <= status < 300:
            return None
        if status in RETRYABLE_4XX or 500 <= status < 600:
            return RetryableError(detail(), retry_after_seconds=retry_after, throttled=status == 429)
        if 300 <= status < 400:
            location = response.headers.get("Location")
            return PermanentError(
                f"HTTP {status}: redirect not followed"
                + (f" (Location: {location[:200]})" if location else "")
                + f": {where}"
            )
        return PermanentError(detail())

    # --- the Publisher contract ------------------------------------------------------
    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("HttpPublisher is closed")
        deadline = time.monotonic() + max(0.0, timeout_seconds)
        n = len(messages)
        if n == 0:
            return []
        outcomes: list[Any] = [_PENDING] * n
        started = [False] * n
        lock = threading.Lock()
        stop = threading.Event()

        # Unordered rows are independent; rows of an ordered aggregate form one chain,
        # sent in sequence and stopped at its first failure.
        batch_chains = chains(messages)

        def run_chain(chain: list[int]) -> None:
            failed = False
            for i in chain:
                remaining = deadline - time.monotonic()
                if (
                    failed
                    or stop.is_set()
                    or self.aborting.is_set()
                    or remaining <= 0.01
                    or (cancel is not None and cancel.is_set())
                ):
                    with lock:
                        if outcomes[i] is _PENDING:
                            outcomes[i] = NotDelivered(
                                RELEASED_AFTER_FAILURE if failed else "not sent before the batch deadline"
                            )
                    continue
                with lock:
                    if outcomes[i] is not _PENDING:  # the batch already gave up on it
                        continue
                    started[i] = True
                outcome = self.send(messages[i], timeout_seconds=remaining)
                with lock:
                    if outcomes[i] is _PENDING:
                        outcomes[i] = outcome
                failed = outcome is not None

        executor = ThreadPoolExecutor(
            max_workers=min(self.max_concurrency, len(batch_chains)), thread_name_prefix="http-publish"
        )
        futures = [executor.submit(run_chain, chain) for chain in batch_chains]
        executor.shutdown(wait=False)  # threads exit once their (deadline-bounded) chains finish
        try:
            while not self.aborting.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # Wait in slices so an abort (shutdown) cuts the wait short.
                _done, not_done = wait(futures, timeout=min(remaining, 0.1))
                for f in _done:
                    exc = f.exception()
                    if exc is not None:
                        raise exc  # a bug, not an outcome: not swallowed as retryable
                if not not_done:
                    break
        finally:
            stop.set()
            for f in futures:
                f.cancel()
        with lock:
            for i in range(n):
                if outcomes[i] is _PENDING:
                    if not started[i]:
                        outcomes[i] = NotDelivered("not sent before the batch deadline")
                    elif self.aborting.is_set():
                        outcomes[i] = NotDelivered("no HTTP response before shutdown")
                    else:
                        outcomes[i] = RetryableError(
                            f"HTTP timeout: no response within the batch deadline ({timeout_seconds:.3g}s)"
                        )
            return list(outcomes)

    def probe(self, timeout_seconds: float = 2.0) -> bool:
        """True if the target accepts a TCP connection (or cannot be probed statically)."""
        import socket

        scheme_host = self.url_template.split("/", 3)[:3]  # "http:", "", "host:port"
        authority = scheme_host[2] if len(scheme_host) == 3 else ""
        if "{" in authority:
            return True  # the host depends on the row: nothing to probe ahead of time
        parts = urlsplit("/".join(scheme_host))
        if not parts.hostname:
            return True
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout_seconds):
                return True
        except OSError:
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()


def from_settings(settings: Settings) -> HttpPublisher:
    """The ``http`` built-in (``relay.publisher = "http"``)."""
    return HttpPublisher.from_settings(settings)
