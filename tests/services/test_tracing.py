"""One trace per request across every service of a multi-process E/P/D stack, received by a real
OTLP/gRPC receiver (opentelemetry-proto's collector service): correct nesting, the router's phases
in order inside its span, which lies inside the client's own measurement of the call, a TTFT
attribution with every stage where it belongs (the attribution rule itself: tests/telemetry/
test_report.py), and no spans for health checks, reflection or service-info handshakes."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from libs.client.generate import GenerationResult, generate, open_channel
from libs.contract.epd.v1 import (
    generate_pb2_grpc,
    service_info_pb2,
    service_info_pb2_grpc,
    stats_pb2,
    stats_pb2_grpc,
)
from libs.launch.stack import Stack, StackSpec
from libs.telemetry.report import CATEGORIES, breakdowns
from libs.telemetry.spans import OtlpReceiver, SpanRecord, by_trace
from libs.telemetry.waterfall import render
from tests.support.golden import request_for
from tests.support.stacks import MIXES
from tests.support.tracing import trace_spans, traced

pytestmark = pytest.mark.stack

ROUTER_PHASES = {"router.queue", "epd.encode", "epd.prefill", "epd.decode"}


@dataclass
class Timed:
    """A client's result and the wall-clock instants (ns) just before the call and after its end."""

    result: GenerationResult
    sent_ns: int
    done_ns: int


async def _one_at_a_time(address: str) -> list[Timed]:
    """Each request alone (its timeline is its own), on one warm channel (no connection set-up in
    the client's measurement)."""
    async with open_channel(address) as channel:
        await channel.channel_ready()
        # First contact (handshakes, NIXL connections, lazy imports) happens once per stack; a warm-up
        # request takes it, so the checked requests show steady-state attribution.
        await generate(channel, request_for(MIXES["audio_image"], request_id="traced-warmup"))
        timed = []
        for name in sorted(MIXES):
            sent_ns = time.time_ns()
            result = await generate(channel, request_for(MIXES[name], max_tokens=64, request_id=f"traced-{name}"))
            timed.append(Timed(result, sent_ns, time.time_ns()))
        return timed


@pytest.fixture(scope="module")
def traced_run(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[Timed], list[SpanRecord]]]:
    receiver = OtlpReceiver().start()
    env = {"EPD_TRACE_EXPORTER": "otlp", "EPD_OTLP_ENDPOINT": receiver.address, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    # No encoder cache: mixes share media, and this run checks that every media request's time to first
    # token shows its encode (cached requests are traced in test_shared_store.py).
    no_cache = {f"encoder-{i}": ["--cache-mib", "0"] for i in range(2)}
    spec = StackSpec(
        layout="e/p/d", model=model_path, run_dir=tmp_path_factory.mktemp("traced"), env=env, extra_args=no_cache
    )
    stack = Stack(spec)
    try:
        stack.up()
        timed = asyncio.run(_one_at_a_time(stack.address))
    finally:
        stack.down()  # flushes every service's span processor
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        roots = [s for s in spans if s.name == "GenerateService/Generate" and not s.parent_id]
        if len(roots) >= len(timed) + 1:
            break
        time.sleep(0.2)
    receiver.stop()
    yield timed, receiver.snapshot()


@pytest.mark.timeout(300)
def test_one_trace_per_request_across_every_service(traced_run: tuple[list[Timed], list[SpanRecord]]) -> None:
    timed, spans = traced_run
    traces = by_trace(spans)
    for result in (t.result for t in timed):
        roots = [s for s in spans if not s.parent_id and s.attributes.get("epd.request_id") == result.request_id]
        assert len(roots) == 1, result.request_id
        trace = traces[roots[0].trace_id]
        services = {s.service for s in trace}
        media = result.request_id not in ("traced-text",)
        assert services == ({"router", "encoder", "prefill", "decode"} if media else {"router", "prefill", "decode"})
        by_id = {s.span_id: s for s in trace}
        for span in trace:  # every span hangs off the request's tree
            assert span is roots[0] or span.parent_id in by_id, (span.service, span.name)
        parent_name = {s.span_id: by_id[s.parent_id].name for s in trace if s.parent_id}
        for span in trace:
            if span.name == "EncoderService/Encode":
                assert parent_name[span.span_id] == "epd.encode.item"
            if span.name == "PrefillService/Prefill":
                assert parent_name[span.span_id] == "epd.prefill"
            if span.name == "DecodeService/Decode":
                assert parent_name[span.span_id] == "epd.decode"
            if span.name in ("embeddings.transfer", "prefill.compute", "kv.publish"):
                assert parent_name[span.span_id] == "PrefillService/Prefill"
            if span.name in ("kv.transfer", "decode.generate"):
                assert parent_name[span.span_id] == "DecodeService/Decode"
        transfers = [s for s in trace if s.name in ("embeddings.transfer", "kv.transfer")]
        assert all(s.attributes["epd.transfer.bytes"] > 0 for s in transfers)
        assert all(s.attributes["epd.transfer.transport"] == "nixl" for s in transfers)


@pytest.mark.timeout(300)
def test_router_phases_lie_in_order_inside_the_request(traced_run: tuple[list[Timed], list[SpanRecord]]) -> None:
    """Causal bounds only (no share of the time is promised: on a loaded host RPC hops and router
    bookkeeping stretch, and they show as `other`): the client's call contains the router's span,
    which contains its phases, one after another in request order."""
    timed, spans = traced_run
    for t in timed:
        result = t.result
        (root,) = [s for s in spans if not s.parent_id and s.attributes.get("epd.request_id") == result.request_id]
        # Same host clock: the router's span starts after the client sent and ends before it heard
        # the end (1 ms for the clock's granularity across processes).
        assert t.sent_ns - 1_000_000 <= root.start_ns <= root.end_ns <= t.done_ns + 1_000_000
        phases = sorted(
            (s for s in spans if s.parent_id == root.span_id and s.name in ROUTER_PHASES), key=lambda s: s.start_ns
        )
        order = ["router.queue", "epd.encode", "epd.prefill", "epd.decode"]
        if result.request_id == "traced-text":
            order.remove("epd.encode")
        assert [s.name for s in phases] == order
        assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(phases))  # sequential
        assert root.start_ns <= phases[0].start_ns and phases[-1].end_ns <= root.end_ns

    items = {b.request_id: b for b in breakdowns(spans)}
    for t in timed:
        result = t.result
        item = items[result.request_id]
        assert set(item.parts) == set(CATEGORIES)
        assert item.ttft_s <= result.ttft_s + 0.001  # the router's first token is inside the client's
        assert item.parts["prefill"] > 0 and item.parts["transfer"] > 0
        if result.request_id != "traced-text":
            assert item.parts["encode"] > 0 and item.parts["preprocess"] > 0
        assert item.parts["decode"] == 0  # decode starts after the first token


def test_waterfall_renders(traced_run: tuple[list[Timed], list[SpanRecord]], tmp_path: Path) -> None:
    _, spans = traced_run
    (trace_id, trace), *_ = [(t, s) for t, s in by_trace(spans).items() if len(s) > 10]
    render(trace, tmp_path / "w.html")
    render(trace, tmp_path / "w.png")
    page = (tmp_path / "w.html").read_text()
    assert trace_id in page and "PrefillService/Prefill" in page and "<svg" in page
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _never_traced(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
    """A health check, a reflection listing and a service-info handshake, each carrying `metadata`."""
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10
    )
    assert any(r.list_services_response.service for r in listing)
    info = service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
        service_info_pb2.GetServiceInfoRequest(), metadata=metadata, timeout=10
    )
    assert info.info.instance_id


@pytest.mark.timeout(180)
def test_health_reflection_and_service_info_are_not_traced(
    stacks: Callable[[str], Stack], receiver: OtlpReceiver
) -> None:
    """Every service of a live stack, called with a trace context: a traced call after the probes
    (the control) appears in its trace; the probes and the handshake appear nowhere, nor do the
    handshakes the router made with its backends at first contact (the control's request)."""
    stack = stacks("e/p/d")
    for name, process in stack.processes.items():
        silent, probe_metadata = traced()
        control, control_metadata = traced()
        with grpc.insecure_channel(process.address) as channel:
            _never_traced(channel, probe_metadata)
            if name == "router":  # the router serves no stats: a request is its control
                request = request_for(MIXES["audio_image"], request_id="untraced-control")
                for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                    request, metadata=control_metadata, timeout=60
                ):
                    pass
                traced_name = "GenerateService/Generate"
            else:
                stats_pb2_grpc.StatsServiceStub(channel).GetStats(
                    stats_pb2.GetStatsRequest(), metadata=control_metadata, timeout=10
                )
                traced_name = "StatsService/GetStats"
        # Spans are exported in the order they end: once the control's span is in, any span of the
        # calls before it would be too.
        trace_spans(receiver, control, lambda ss, n=traced_name: any(s.name == n for s in ss))
        assert [s.name for s in receiver.snapshot() if s.trace_id == silent] == [], name
    names = {s.name for s in receiver.snapshot()}
    assert not [n for n in names if n.startswith(("Health/", "ServerReflection/", "ServiceInfoService/"))]
