"""Traces of a real stack: the environment that makes a service export its spans to an in-process
OTLP/gRPC receiver, a call's own trace id, and that trace's spans once they have arrived."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from libs.telemetry.spans import OtlpReceiver, SpanRecord


def tracing_env(otlp: OtlpReceiver) -> dict[str, str]:
    """Environment that makes a service export its spans to `otlp` (batches every 200 ms)."""
    return {"EPD_TRACE_EXPORTER": "otlp", "EPD_OTLP_ENDPOINT": otlp.address, "OTEL_BSP_SCHEDULE_DELAY": "200"}


def traced() -> tuple[str, tuple[tuple[str, str], ...]]:
    """A fresh trace id and the call metadata that makes the callee's spans join that trace."""
    trace_id = os.urandom(16).hex()
    return trace_id, (("traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01"),)


def trace_spans(
    otlp: OtlpReceiver, trace_id: str, until: Callable[[list[SpanRecord]], bool], timeout_s: float = 30.0
) -> list[SpanRecord]:
    """The spans of one trace received so far, once `until(spans)` holds (spans arrive in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in otlp.snapshot() if s.trace_id == trace_id]
        if until(spans):
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"trace {trace_id}: condition not met after {timeout_s} s; spans: {spans}")
        time.sleep(0.05)
