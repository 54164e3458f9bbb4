"""One exception tree for the whole project.

Driver errors (psycopg, confluent-kafka) are mapped to these types at the module
that talks to the driver (``raise DatabaseUnavailable(...) from exc``), so callers
never need to know a driver's exception classes.
"""

from __future__ import annotations


class OutboxRelayError(Exception):
    """Base of every error raised by outbox-relay."""


class ConfigError(OutboxRelayError):
    """A setting or a command-line argument is invalid. The message is one readable line."""


class DatabaseError(OutboxRelayError):
    """A database operation failed."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (connection refused, terminated, timed out)."""


class SchemaMissing(DatabaseError):
    """The outbox table does not exist: run `outbox-relay migrate`."""


class CommitOutcomeUnknown(DatabaseError):
    """The connection broke during COMMIT: the transaction may or may not have committed.

    After a claim this means: do not publish, since the rows may not be ours. If the claim did commit,
    its lease expires and another claim recovers the rows.
    """


class BrokerUnavailable(OutboxRelayError):
    """The message broker cannot be reached at all."""


class DependencyRefused(OutboxRelayError):
    """A dependency answered but refuses the relay in a way waiting cannot fix: wrong
    password, a certificate that does not verify, an unknown role or database. The
    relay does not wait for it (exit 1); the message names the side, never the secret."""


class DatabaseRefused(DependencyRefused, DatabaseError):
    """The database refused the connection (authentication, TLS, role or database)."""


class BrokerRefused(DependencyRefused, BrokerUnavailable):
    """The broker refused the connection (SASL authentication, TLS)."""


class PublisherLoadError(ConfigError):
    """`relay.publisher` does not name a loadable Publisher."""
