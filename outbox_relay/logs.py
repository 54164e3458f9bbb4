"""structlog set-up: JSON lines off a terminal, readable console output on one.

A processor scrubs known secrets (DSN password, SASL password) from every event,
whatever field they would have ended up in.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            scrub,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # librdkafka and psycopg_pool log through the stdlib: keep them quiet unless asked,
    # and scrub the same secrets from their lines.
    logging.basicConfig(level=logging.WARNING if level.upper() != "DEBUG" else logging.DEBUG, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    class _Scrub(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if any(secret in message for secret in secret_values):
                for secret in secret_values:
                    message = message.replace(secret, "***")
                record.msg, record.args = message, None
            return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(_Scrub())
