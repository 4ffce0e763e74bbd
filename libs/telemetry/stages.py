"""Stage spans and stage metrics: the vocabulary of latency attribution (docs/tracing.md).

Every span that accounts for time carries `epd.stage`, one of `STAGES`; `epd trace report`
attributes a request's time to stages from these spans alone. The same durations feed the
`epd.stage.duration` histogram (seconds, by stage and span name), and transfers add their bytes to
`epd.transfer.bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Span

STAGES = ("queue", "preprocess", "encode", "cache_load", "transfer", "prefill", "decode")
# Where time outside every stage span goes (`epd trace report`): spans carrying `ATTRIBUTION` say
# which of these their own time (not covered by a stage or an inner such span) is. "rpc": a
# caller's span around one call, outside the callee's server span (the hop: serialisation, HTTP/2,
# deserialisation, the callee's interceptors); "service": a backend's server span outside its
# stage spans (validation, request bookkeeping); "router": the router's own request span outside
# its calls (validation, hashing, building the metadata-only request, streaming the reply).
ATTRIBUTION = "epd.attribution"
HOPS = ("rpc", "service", "router")

_tracer = trace.get_tracer("epd")
_meter = metrics.get_meter("epd")
_duration = _meter.create_histogram("epd.stage.duration", unit="s", description="Time spent in one stage")
_bytes = _meter.create_counter("epd.transfer.bytes", unit="By", description="Tensor bytes moved between services")
_prompt = _meter.create_counter(
    "epd.prefill.prompt_tokens",
    unit="{token}",
    description="Prompt tokens prefilled, by whether a cached prefix held them",
)
_reused = _meter.create_counter(
    "epd.prefill.reused_items", unit="{item}", description="Media items whose every row came from a cached prefix"
)


@contextmanager
def stage(name: str, kind: str, **attributes: Any) -> Iterator[Span]:
    """A span of stage `kind` around the body, recorded in the stage histogram."""
    assert kind in STAGES, kind
    started = time.perf_counter()
    with _tracer.start_as_current_span(name, attributes={"epd.stage": kind, **attributes}) as span:
        yield span
    _duration.record(time.perf_counter() - started, {"epd.stage": kind, "epd.span": name})


def record_stage(name: str, kind: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished stage span with explicit times (measured elsewhere, e.g. on the engine thread),
    as a child of the current span."""
    assert kind in STAGES, kind
    span = _tracer.start_span(name, start_time=start_ns, attributes={"epd.stage": kind, **attributes})
    span.end(end_time=end_ns)
    _duration.record((end_ns - start_ns) / 1e9, {"epd.stage": kind, "epd.span": name})


def record_duration(name: str, kind: str, seconds: float) -> None:
    """A stage duration for a span managed by hand (`start_phase`)."""
    _duration.record(seconds, {"epd.stage": kind, "epd.span": name})


def record_prompt(span: Span, *, prompt_tokens: int, cached_tokens: int, reused_items: dict[str, int]) -> None:
    """What a prefill reused from its engine's prefix cache: on its span and in the counters
    (`reused_items`: per modality, items wholly inside the reused prefix)."""
    span.set_attributes({"epd.prompt_tokens": prompt_tokens, "epd.prompt_cached_tokens": cached_tokens})
    for modality, count in reused_items.items():
        span.set_attribute(f"epd.prompt_reused_{modality}_items", count)
        _reused.add(count, {"epd.modality": modality})
    _prompt.add(cached_tokens, {"epd.cached": True})
    _prompt.add(prompt_tokens - cached_tokens, {"epd.cached": False})


def record_transfer(span: Span, *, nbytes: int, seconds: float, transport: str, peers: int, direction: str) -> None:
    """Transfer attributes on a transfer span, and the byte counter."""
    span.set_attributes(
        {
            "epd.transfer.bytes": nbytes,
            "epd.transfer.seconds": seconds,
            "epd.transfer.gib_per_s": nbytes / seconds / (1 << 30) if seconds > 0 else 0.0,
            "epd.transfer.transport": transport,
            "epd.transfer.remote_agents": peers,
        }
    )
    _bytes.add(nbytes, {"epd.transfer.direction": direction, "epd.transfer.transport": transport})


def phase(name: str, **attributes: Any) -> Any:
    """A plain (non-stage) span grouping stages, e.g. one encode item at the router."""
    return _tracer.start_as_current_span(name, attributes=attributes)


def start_phase(name: str, **attributes: Any) -> Span:
    """A span for a stream (child of the current span, not made current: streams outlive any `with`)."""
    return _tracer.start_span(name, attributes=attributes)


@contextmanager
def calls_under(span: Span) -> Iterator[None]:
    """Make `span` current while a gRPC call is created, so its trace context is the one sent."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)
