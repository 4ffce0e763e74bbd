"""Process-wide observability bootstraps: structured JSON logs and OpenTelemetry tracing."""

from libs.telemetry.logging import bind_request, configure_logging
from libs.telemetry.tracing import TracingHandle, configure_tracing

__all__ = ["TracingHandle", "bind_request", "configure_logging", "configure_tracing"]
