"""Logging: every line the process writes is one structured line in one format.

- structlog renders JSON lines when stderr is not a terminal and readable console
  output when it is (``log.format``).
- The standard library's loggers (psycopg, psycopg-pool, httpx, uvicorn, Python
  warnings) are rendered by the same processors through
  ``structlog.stdlib.ProcessorFormatter``, so a JSON log pipeline can parse every line.
- librdkafka's own log lines reach the ``outbox_relay.librdkafka`` logger (the
  producer's ``logger`` property) with their facility and syslog level, rate-limited
  per facility so a broker outage does not flood the log.
- A processor scrubs known secrets (DSN password, SASL password) from every event,
  whatever field they would have ended up in.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

LIBRDKAFKA_LOGGER = "outbox_relay.librdkafka"
# librdkafka's syslog levels -> stdlib levels (confluent-kafka passes them as is).
SYSLOG_TO_STDLIB = {
    0: logging.CRITICAL,
    1: logging.CRITICAL,
    2: logging.CRITICAL,
    3: logging.ERROR,
    4: logging.WARNING,
    5: logging.INFO,
    6: logging.INFO,
    7: logging.DEBUG,
}


class RateLimiter:
    """At most one line per key and interval; counts what it suppressed meanwhile."""

    def __init__(self, interval_seconds: float) -> None:
        self._interval = interval_seconds
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str) -> tuple[bool, int]:
        """(emit this one?, how many were suppressed since the last one emitted)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            return True, self._suppressed.pop(key, 0)


class _LibrdkafkaFilter(logging.Filter):
    """Turns confluent-kafka's ``log(level, "%s [%s] %s", facility, client, text)``
    records into structured ones, and rate-limits them per facility."""

    def __init__(self, interval_seconds: float = 10.0) -> None:
        super().__init__()
        self._limiter = RateLimiter(interval_seconds)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 3:
            facility, client, text = (str(a) for a in args)
            allowed, suppressed = self._limiter.allow(facility)
            if not allowed:
                return False
            record.msg, record.args = text, None
            record.librdkafka_facility = facility
            record.librdkafka_client = client
            record.librdkafka_level = record.levelno
            if suppressed:
                record.suppressed = suppressed
        record.levelno = SYSLOG_TO_STDLIB.get(record.levelno, record.levelno)
        record.levelname = logging.getLevelName(record.levelno)
        return True


_librdkafka_filter = _LibrdkafkaFilter()


def librdkafka_logger() -> logging.Logger:
    """The logger a producer's ``logger`` property points at."""
    logger = logging.getLogger(LIBRDKAFKA_LOGGER)
    if _librdkafka_filter not in logger.filters:
        logger.addFilter(_librdkafka_filter)
    return logger


def configure_logging(level: str = "INFO", fmt: str = "auto", secrets: list[str] | None = None) -> None:
    secret_values = [s for s in (secrets or []) if s and len(s) >= 3]

    def scrub(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if not secret_values:
            return event
        for key, value in event.items():
            if isinstance(value, str):
                for secret in secret_values:
                    if secret in value:
                        value = value.replace(secret, "***")
                event[key] = value
        return event

    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = structlog.dev.ConsoleRenderer(colors=True) if use_console else structlog.processors.JSONRenderer()
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.format_exc_info,
            scrub,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        # One write() per line (message and newline together), so lines written by
        # different threads, or by this and the stdlib handler, never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # The standard library's records: same processors, same renderer, same stream.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
            structlog.stdlib.ExtraAdder(),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            scrub,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    # psycopg, psycopg-pool, httpx, uvicorn: warnings and errors unless asked for more.
    root.setLevel(logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING)
    logging.captureWarnings(True)
    librdkafka_logger()
