"""One trace per request across every service of a multi-process E/P/D stack, received by a real
OTLP/gRPC receiver (opentelemetry-proto's collector service): correct nesting, stage spans that
add up to the client-measured end-to-end time, and a TTFT attribution that partitions TTFT."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.client.generate import GenerationResult, generate, open_channel
from libs.launch.stack import Stack, StackSpec
from libs.telemetry.report import CATEGORIES, breakdowns
from libs.telemetry.spans import OtlpReceiver, SpanRecord, by_trace
from libs.telemetry.waterfall import render
from tests.services.conftest import MIXES
from tests.services.golden import request_for

ROUTER_PHASES = {"router.queue", "epd.encode", "epd.prefill", "epd.decode"}


async def _one_at_a_time(address: str) -> list[GenerationResult]:
    """Each request alone (its timeline is its own), on one warm channel (no connection set-up in
    the client's measurement); 256 tokens, so per-request fixed costs are small next to the whole."""
    async with open_channel(address) as channel:
        await channel.channel_ready()
        # First contact (handshakes, NIXL connections, lazy imports) happens once per stack; a warm-up
        # request takes it, so the checked requests show steady-state attribution.
        await generate(channel, request_for(MIXES["audio_image"], request_id="traced-warmup"))
        return [
            await generate(channel, request_for(MIXES[name], max_tokens=256, request_id=f"traced-{name}"))
            for name in sorted(MIXES)
        ]


@pytest.fixture(scope="module")
def traced_run(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[GenerationResult], list[SpanRecord]]]:
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
        results = asyncio.run(_one_at_a_time(stack.address))
    finally:
        stack.down()  # flushes every service's span processor
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        roots = [s for s in spans if s.name == "GenerateService/Generate" and not s.parent_id]
        if len(roots) >= len(results):
            break
        time.sleep(0.2)
    receiver.stop()
    yield results, receiver.snapshot()


@pytest.mark.timeout(300)
def test_one_trace_per_request_across_every_service(
    traced_run: tuple[list[GenerationResult], list[SpanRecord]],
) -> None:
    results, spans = traced_run
    traces = by_trace(spans)
    for result in results:
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
def test_stage_spans_add_up_to_the_end_to_end_time(traced_run: tuple[list[GenerationResult], list[SpanRecord]]) -> None:
    results, spans = traced_run
    for result in results:
        (root,) = [s for s in spans if not s.parent_id and s.attributes.get("epd.request_id") == result.request_id]
        phases = [s for s in spans if s.parent_id == root.span_id and s.name in ROUTER_PHASES]
        # The router's phases do not overlap ...
        ordered = sorted(phases, key=lambda s: s.start_ns)
        assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(ordered))
        # ... and add up to what the client measured, within 5%.
        total = sum(s.duration_s for s in phases)
        assert abs(total - result.total_s) <= 0.05 * result.total_s, (result.request_id, total, result.total_s)

    items = {b.request_id: b for b in breakdowns(spans)}
    for result in results:
        item = items[result.request_id]
        assert sum(item.parts.values()) == pytest.approx(item.ttft_s, rel=1e-6)  # a partition of TTFT
        assert item.ttft_s <= result.ttft_s * 1.05 + 0.002
        assert item.parts["prefill"] > 0 and item.parts["transfer"] > 0
        if result.request_id != "traced-text":
            assert item.parts["encode"] > 0 and item.parts["preprocess"] > 0
        assert set(item.parts) == set(CATEGORIES)


def test_waterfall_renders(traced_run: tuple[list[GenerationResult], list[SpanRecord]], tmp_path: Path) -> None:
    _, spans = traced_run
    (trace_id, trace), *_ = [(t, s) for t, s in by_trace(spans).items() if len(s) > 10]
    render(trace, tmp_path / "w.html")
    render(trace, tmp_path / "w.png")
    page = (tmp_path / "w.html").read_text()
    assert trace_id in page and "PrefillService/Prefill" in page and "<svg" in page
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
