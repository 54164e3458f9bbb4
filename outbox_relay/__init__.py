"""outbox-relay: deliver a PostgreSQL transactional outbox to Kafka, at least once.

Public API:

- ``enqueue(conn, *, aggregate_type, aggregate_id, event_type, payload, ...)`` — the
  write side, inside the caller's transaction.
- ``Publisher``, ``SimplePublisher``, ``Message`` and the outcome exceptions
  ``RetryableError``, ``PermanentError``, ``Defer`` — for custom publishers.
- ``Settings`` / ``load_settings`` and ``Relay`` — to embed the relay in a process.
"""

from .api import EnqueueResult, enqueue
from .config import Settings, load_settings
from .errors import (
    BrokerUnavailable,
    CommitOutcomeUnknown,
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    OutboxRelayError,
    SchemaMissing,
)
from .model import Defer, Message, PermanentError, RetryableError
from .publishers.base import Publisher, SimplePublisher

__all__ = [
    "BrokerUnavailable",
    "CommitOutcomeUnknown",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "Defer",
    "EnqueueResult",
    "Message",
    "OutboxRelayError",
    "PermanentError",
    "Publisher",
    "RetryableError",
    "SchemaMissing",
    "Settings",
    "SimplePublisher",
    "enqueue",
    "load_settings",
]

from ._version import __version__ as __version__
