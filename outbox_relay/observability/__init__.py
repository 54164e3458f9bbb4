"""What the relay tells the outside: Prometheus metrics and the health server, structured
logs, tracing (OpenTelemetry when enabled)."""
