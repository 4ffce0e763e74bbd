"""structlog set-up shared by every EPD process.

One JSON object per line with: timestamp (ISO 8601, UTC), level, logger, event, the service name,
the request id bound for the current task (`bind_request`), and the trace and span ids of the
active OpenTelemetry span, so log lines join the request's trace.

Where the lines go: the stream given, else the file named by `EPD_LOG_FILE` (what the launcher
sets, libs/launch/process.py), else stderr. With a file, that file holds JSON lines only, so `jq`
reads every line of it: the process's stderr and stdout stay for what does not come through this
logger (native libraries writing to fd 2 such as Mooncake's glog or UCX, vLLM's own log lines, the
"listening on" line launchers wait for), which the launcher sends to a separate file. Python
warnings and an uncaught exception's traceback become JSON lines of the file too.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import structlog
from opentelemetry import trace

# The file a launched service writes its JSON log lines to (append), set by the launcher.
LOG_FILE_ENV = "EPD_LOG_FILE"


def _add_trace_context(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = format(context.trace_id, "032x")
        event["span_id"] = format(context.span_id, "016x")
    return event


def _log_file() -> TextIO | None:
    path = os.environ.get(LOG_FILE_ENV, "")
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Line-buffered: a line is in the file once logged, however the process ends afterwards.
    return open(path, "a", buffering=1, encoding="utf-8")  # lives as long as the process


def _into_the_file() -> None:
    """What Python would print to stderr as bare text goes to the log file as JSON lines too:
    warnings, and an uncaught exception (its traceback still also printed to stderr)."""
    logging.captureWarnings(True)
    log = structlog.get_logger("uncaught")
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            log.critical("uncaught exception", exc_info=(kind, value, tb))
        previous(kind, value, tb)

    sys.excepthook = hook


def configure_logging(service_name: str, level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging (and Python warnings) to `stream`, else the file named by
    EPD_LOG_FILE, else stderr, as JSON (or console) lines."""
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")
    log_file = _log_file() if stream is None else None
    out = stream or log_file or sys.stderr
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
        # The message and its newline in one write, as the stdlib handler below writes its lines
        # (print writes them apart): another thread's line cannot land between the two.
        logger_factory=structlog.WriteLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    # Libraries logging through stdlib (grpc, opentelemetry) get the same format.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)
    if log_file is not None:
        _into_the_file()


@contextmanager
def bind_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Adds `request_id` (and `fields`) to every log line of the current task until exit."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **fields)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
