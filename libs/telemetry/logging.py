"""structlog set-up shared by every EPD process.

One JSON object per line on stderr with: timestamp (ISO 8601, UTC), level, logger, event, the
service name, the request id bound for the current task (`bind_request`), and the trace and span
ids of the active OpenTelemetry span, so log lines join the request's trace.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

import structlog
from opentelemetry import trace


def _add_trace_context(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


def configure_logging(service_name: str, level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to `stream` (default stderr) as JSON (or console) lines."""
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_context,
        lambda _, __, event: {"service": service_name, **event},
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries logging through stdlib (grpc, opentelemetry) get the same format.
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)


@contextmanager
def bind_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Adds `request_id` (and `fields`) to every log line of the current task until exit."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **fields)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
