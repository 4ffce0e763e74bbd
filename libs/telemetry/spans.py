"""Finished spans as plain records, from a JSONL span file or from a live OTLP/gRPC receiver."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    name: str
    service: str
    start_ns: int  # since the epoch
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _iso_ns(text: str) -> int:
    # The SDK writes microsecond ISO 8601 with a Z suffix.
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def _hex(text: str | None) -> str:
    return (text or "").removeprefix("0x")


def load_jsonl(path: Path) -> list[SpanRecord]:
    """Spans written by `JsonlSpanExporter` (one SDK JSON span per line); bad lines are skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
            records.append(
                SpanRecord(
                    trace_id=_hex(raw["context"]["trace_id"]),
                    span_id=_hex(raw["context"]["span_id"]),
                    parent_id=_hex(raw.get("parent_id")),
                    name=raw["name"],
                    service=raw["resource"]["attributes"].get("service.name", "?"),
                    start_ns=_iso_ns(raw["start_time"]),
                    end_ns=_iso_ns(raw["end_time"]),
                    attributes=dict(raw.get("attributes") or {}),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return records


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


def from_otlp(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    records = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        service=str(resource.get("service.name", "?")),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                    )
                )
    return records


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector (opentelemetry-proto's service) keeping spans in memory."""

    def __init__(self, address: str = "127.0.0.1:0") -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port(address)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        records = from_otlp(request)
        with self._lock:
            self.spans.extend(records)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)


def by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    out: dict[str, list[SpanRecord]] = {}
    for span in spans:
        out.setdefault(span.trace_id, []).append(span)
    return out
