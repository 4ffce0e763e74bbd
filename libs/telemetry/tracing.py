"""OpenTelemetry SDK set-up shared by every EPD process.

The resource names the service (`service.name`, `service.version`, `service.instance.id`);
the exporter is chosen by configuration: none, a local JSONL file (the embedded default used by
`make run`), OTLP/gRPC to any collector, or the console.

With no exporter nothing is recorded: spans cost what the API's no-op ones do, not the SDK's work
for spans that would be dropped at the end. The trace context still flows (log lines keep their
trace ids), marked not sampled, so the processes downstream record nothing for these requests
either: as everywhere in OpenTelemetry, the process where a request starts decides (head sampling).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON

EXPORTERS = ("none", "jsonl", "otlp", "console")
# How long a finished span may wait in its process before it is exported (the batch processor's
# schedule delay; the SDK's default is 5 s). Short, so a trace report run right after a request
# finds it: spans of a finished request are in the file within this delay (plus the write), while
# the span's end itself stays off the request's path (exports run on the processor's thread).
EXPORT_DELAY_S = 0.25


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (the OTel SDK's JSON span form)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self._path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n" for span in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class TracingHandle:
    """The configured provider; call `shutdown()` before exit to flush pending spans."""

    provider: TracerProvider
    instance_id: str

    def shutdown(self) -> None:
        self.provider.shutdown()


def make_exporter(kind: str, trace_file: Path | None = None, otlp_endpoint: str | None = None) -> SpanExporter | None:
    """The span exporter for `kind` (one of EXPORTERS); None for "none"."""
    if kind == "none":
        return None
    if kind == "jsonl":
        if trace_file is None:
            raise ValueError("trace_exporter=jsonl needs a trace file")
        return JsonlSpanExporter(trace_file)
    if kind == "otlp":
        # Imported lazily: the exporter pulls in protobuf/grpc modules most processes never need.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp_endpoint or "127.0.0.1:4317", insecure=True)
    if kind == "console":
        return ConsoleSpanExporter()
    raise ValueError(f"unknown trace exporter {kind!r}; expected one of {', '.join(EXPORTERS)}")


def configure_tracing(
    service_name: str,
    service_version: str,
    exporter: str = "none",
    trace_file: Path | None = None,
    otlp_endpoint: str | None = None,
    set_global: bool = True,
) -> TracingHandle:
    """Build a tracer provider for this process and (by default) install it globally."""
    instance_id = uuid.uuid4().hex
    resource = Resource.create(
        {"service.name": service_name, "service.version": service_version, "service.instance.id": instance_id}
    )
    span_exporter = make_exporter(exporter, trace_file, otlp_endpoint)
    provider = TracerProvider(resource=resource, sampler=DEFAULT_ON if span_exporter is not None else ALWAYS_OFF)
    if span_exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=int(EXPORT_DELAY_S * 1000)))
    if set_global:
        trace.set_tracer_provider(provider)
    return TracingHandle(provider=provider, instance_id=instance_id)


def configure_metrics(service_name: str, prometheus_port: int = 0, host: str = "127.0.0.1") -> None:
    """With `prometheus_port` > 0, install a meter provider and serve /metrics on host:port (the
    service's own listening address: loopback by default, the pod's address in Kubernetes); with
    none, the API's no-op instruments stay (nothing would read what they aggregate)."""
    if prometheus_port <= 0:
        return
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import start_http_server

    start_http_server(prometheus_port, addr=host)
    resource = Resource.create({"service.name": service_name})
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[PrometheusMetricReader()]))
