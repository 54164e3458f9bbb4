"""Tracing hooks of the relay loop, with a no-op default.

The worker reports each batch's life to a ``BatchTrace`` obtained from
``Tracing.batch()``, the way it reports counts to ``RelayMetrics``:

    trace = tracing.batch(worker)    # before the claim
    trace.claimed(claim_result)      # the claim's rows are known
    trace.publishing(messages)       # messages built, about to be submitted
    trace.published(outcomes)        # their outcomes are known (one per message)
    trace.finalizing()               # the fenced finalize starts
    trace.finalized(batch_result)    # every row's decision and whether it was written

This module imports nothing of OpenTelemetry: with ``otel.enabled = false`` (the
default) the relay uses ``Tracing()`` — one shared do-nothing ``BatchTrace`` per
batch, no per-message work, no ``opentelemetry`` import. ``make_tracing`` loads the
OpenTelemetry implementation (``outbox_relay.otel``) only when it is enabled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Settings
    from ..db.store import ClaimResult
    from ..publishers.base import Message, Outcome, Publisher
    from ..runtime.finalizer import BatchResult


class BatchTrace:
    """One batch's tracing; every hook does nothing here."""

    def claimed(self, result: ClaimResult) -> None:
        """The claim returned (called for empty claims too)."""

    def publishing(self, messages: Sequence[Message]) -> None:
        """About to submit ``messages``. An implementation may replace their trace
        context headers (``traceparent``, ``tracestate``)."""

    def published(self, outcomes: Sequence[Outcome]) -> None:
        """The publisher returned ``outcomes``, one per message of ``publishing``."""

    def finalizing(self) -> None:
        """The fenced finalize of the batch starts."""

    def finalized(self, result: BatchResult) -> None:
        """The batch is finalized: ``result`` holds each row's decision and whether it was written."""


NO_TRACE = BatchTrace()


class Tracing:
    """The relay's tracer. This default traces nothing."""

    enabled: bool = False

    def batch(self, worker: str = "") -> BatchTrace:
        """The hooks for one batch of ``worker`` (its lease owner name)."""
        return NO_TRACE

    def close(self) -> None:
        """Flush and release (called once at shutdown)."""


def make_tracing(settings: Settings, publisher: Publisher | None = None) -> Tracing:
    """``otel.enabled`` -> the OpenTelemetry tracer, else the no-op ``Tracing()``.
    ``publisher`` names the messaging system and adds its own span attributes
    (``Publisher.name``, ``Publisher.span_attributes``).
    Raises ``ConfigError`` when tracing is enabled but OpenTelemetry is not installed."""
    if not settings.otel.enabled:
        return Tracing()
    try:
        from .otel import OtelTracing
    except ImportError as exc:
        raise ConfigError(f"otel.enabled is true but OpenTelemetry is not installed ({exc.name or exc}): "
                          "pip install 'outbox-relay[otel]'") from None
    return OtelTracing.from_environment(settings, publisher=publisher)
