"""Tracing bootstrap: resource attributes, the JSONL exporter, and OTLP/gRPC export to a real
receiver (opentelemetry-proto's collector service) on loopback."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry import propagate
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from libs.telemetry import configure_tracing
from libs.telemetry.tracing import EXPORT_DELAY_S

pytestmark = pytest.mark.unit


def test_jsonl_exporter_writes_spans_with_resource(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    handle = configure_tracing("prefill", "0.1.0", exporter="jsonl", trace_file=path, set_global=False)
    tracer = handle.provider.get_tracer("test")
    with tracer.start_as_current_span("prefill") as parent, tracer.start_as_current_span("compute") as child:
        child.set_attribute("epd.tokens", 12)
    handle.shutdown()

    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["compute", "prefill"]
    compute, prefill = spans
    assert compute["parent_id"] == prefill["context"]["span_id"]
    assert compute["context"]["trace_id"] == prefill["context"]["trace_id"]
    assert compute["attributes"]["epd.tokens"] == 12
    resource = prefill["resource"]["attributes"]
    assert resource["service.name"] == "prefill" and resource["service.version"] == "0.1.0"
    assert resource["service.instance.id"] == handle.instance_id
    assert parent.get_span_context().span_id == int(prefill["context"]["span_id"], 16)


def test_a_finished_span_reaches_the_file_without_a_flush(tmp_path: Path) -> None:
    """Spans are exported on the processor's schedule, EXPORT_DELAY_S after they end, not the SDK's
    5 s default: a report run right after a request finds it while the stack keeps running."""
    path = tmp_path / "spans.jsonl"
    handle = configure_tracing("router", "0.1.0", exporter="jsonl", trace_file=path, set_global=False)
    try:
        with handle.provider.get_tracer("test").start_as_current_span("GenerateService/Generate"):
            pass
        ended = time.monotonic()
        while not (path.exists() and path.read_text()):  # no force_flush, no shutdown: the schedule alone
            assert time.monotonic() - ended < 4.0, "the span was not exported within 4 s (the SDK's default is 5 s)"
            time.sleep(0.01)
        assert EXPORT_DELAY_S <= 1.0
    finally:
        handle.shutdown()


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_exporter_reaches_a_real_receiver() -> None:
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        handle = configure_tracing(
            "decode", "0.1.0", exporter="otlp", otlp_endpoint=f"127.0.0.1:{port}", set_global=False
        )
        with handle.provider.get_tracer("test").start_as_current_span("decode"):
            pass
        handle.shutdown()
        assert receiver.received.wait(10)
        (resource_spans,) = receiver.requests[0].resource_spans
        attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        assert attrs["service.name"] == "decode"
        assert [s.name for s in resource_spans.scope_spans[0].spans] == ["decode"]
    finally:
        server.stop(grace=None)


def test_without_an_exporter_nothing_is_recorded_and_the_context_flows_unsampled() -> None:
    """No exporter: no SDK span work for spans that would be dropped, yet log lines keep a trace id
    and the request reaches the next process marked not sampled (it records nothing either)."""
    handle = configure_tracing("router", "0.1.0", exporter="none", set_global=False)
    with handle.provider.get_tracer("test").start_as_current_span("Generate") as span:
        assert not span.is_recording()
        context = span.get_span_context()
        assert context.is_valid and not context.trace_flags.sampled
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    assert int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # W3C trace flags: not sampled
    handle.shutdown()


def test_unknown_exporter_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown trace exporter 'zipkin'"):
        configure_tracing("x", "0", exporter="zipkin", set_global=False)
