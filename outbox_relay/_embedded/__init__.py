"""Embedded PostgreSQL and broker for `outbox-relay demo` and the tests (the ``embedded`` extra)."""
