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
batch, no per-message work, no ``opentelemetry`` import. ``tracing_factory.make_tracing``
loads the OpenTelemetry implementation (``otel``) only when it is enabled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..core.batch_result import BatchResult
    from ..db.store import ClaimResult
    from ..model import Message, Outcome, SpanAttributes


class TracedTarget(Protocol):
    """What tracing asks of the publisher (``publishers.base.Publisher`` is one): the
    ``messaging.system`` name and the target's own attributes of a message's span."""

    @property
    def name(self) -> str: ...

    def span_attributes(self, message: Message) -> SpanAttributes: ...


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
