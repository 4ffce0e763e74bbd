"""Log lines are JSON with service, level, request id, and the active span's trace/span ids."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider

from libs.telemetry import bind_request, configure_logging
from libs.telemetry.logging import LOG_FILE_ENV

pytestmark = pytest.mark.unit


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_request_and_trace_ids() -> None:
    stream = io.StringIO()
    configure_logging("encoder", level="info", stream=stream)
    log = structlog.get_logger("test")
    tracer = TracerProvider().get_tracer("test")
    with bind_request("req-7"), tracer.start_as_current_span("encode") as span:
        log.info("encoded", items=2)
    log.debug("hidden at info level")
    log.warning("after the request")

    first, second = _lines(stream)
    context = span.get_span_context()
    assert first["event"] == "encoded" and first["items"] == 2
    assert first["service"] == "encoder" and first["level"] == "info"
    assert first["request_id"] == "req-7"
    assert first["trace_id"] == format(context.trace_id, "032x")
    assert first["span_id"] == format(context.span_id, "016x")
    assert str(first["timestamp"]).endswith("Z")
    assert "request_id" not in second and "trace_id" not in second


def test_stdlib_loggers_share_the_format() -> None:
    stream = io.StringIO()
    configure_logging("router", level="warning", stream=stream)
    logging.getLogger("grpc.some.module").warning("peer %s gone", "127.0.0.1:1")
    logging.getLogger("grpc.some.module").info("dropped below level")
    (line,) = _lines(stream)
    assert line["event"] == "peer 127.0.0.1:1 gone"
    assert line["logger"] == "grpc.some.module" and line["service"] == "router"


def test_a_launched_service_logs_to_the_file_the_launcher_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EPD_LOG_FILE (set by libs/launch/process.py): JSON lines go to that file, appended, not stderr."""
    path = tmp_path / "logs" / "encoder.log"
    path.parent.mkdir()
    path.write_text('{"event": "an earlier incarnation"}\n')
    monkeypatch.setenv(LOG_FILE_ENV, str(path))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # configure_logging chains one; undone after
    configure_logging("encoder", level="info")
    structlog.get_logger("test").info("encoded", items=1)
    logging.getLogger("grpc").warning("from stdlib")
    logging.captureWarnings(False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["an earlier incarnation", "encoded", "from stdlib"]
