"""Chooses the relay's tracing: the no-op ``Tracing()`` or, with ``otel.enabled``, the
OpenTelemetry implementation. Kept apart from ``tracing`` so the hooks never import
``otel`` (which imports them): the optional extra is loaded only here, only when enabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .tracing import TracedTarget, Tracing

if TYPE_CHECKING:
    from ..config import Settings


def make_tracing(settings: Settings, publisher: TracedTarget | None = None) -> Tracing:
    """``otel.enabled`` -> the OpenTelemetry tracer, else the no-op ``Tracing()``.
    ``publisher`` names the messaging system and adds its own span attributes
    (``Publisher.name``, ``Publisher.span_attributes``).
    Raises ``ConfigError`` when tracing is enabled but OpenTelemetry is not installed."""
    if not settings.otel.enabled:
        return Tracing()
    try:
        from .otel import OtelTracing  # optional extra: imported only when tracing is enabled
    except ImportError as exc:
        raise ConfigError(
            f"otel.enabled is true but OpenTelemetry is not installed ({exc.name or exc}): "
            "pip install 'outbox-relay[otel]'"
        ) from None
    return OtelTracing.from_environment(settings, publisher=publisher)
