"""The load generator's logic without sockets: arrivals, mix sampling, histogram percentiles,
goodput, open/closed loop bounds (a fake `send` sleeps instead of calling a server)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from libs.bench.arrivals import poisson_arrivals
from libs.bench.histogram import LatencyHistogram
from libs.bench.load import LoadConfig, run_load
from libs.bench.mix import MixSpec, PlannedRequest, plan_requests, sample_kind
from libs.bench.stats import RequestRecord, Slo, summarize
from libs.contract.epd.v1 import generate_pb2

pytestmark = pytest.mark.unit


def test_poisson_arrivals_have_the_rate_and_respect_both_bounds() -> None:
    times = poisson_arrivals(5.0, count=100_000, duration_s=1000.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.02)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.03)
    assert times == sorted(times) and times[-1] < 1000.0
    assert len(poisson_arrivals(5.0, count=7, duration_s=1000.0)) == 7
    assert max(poisson_arrivals(100.0, count=10**6, duration_s=2.0)) < 2.0
    assert poisson_arrivals(5.0, count=10, duration_s=10, seed=3) == poisson_arrivals(
        5.0, count=10, duration_s=10, seed=3
    )


def test_mix_spec_parses_and_normalises() -> None:
    spec = MixSpec.parse("text=1,image=3,images=4,max_tokens=8")
    assert spec.shares() == {"text": 0.25, "image": 0.75, "video": 0.0, "audio": 0.0}
    assert (spec.images, spec.max_tokens) == (4, 8)
    assert MixSpec.parse("audio=1").shares()["audio"] == 1.0
    assert MixSpec.parse("images=2").shares()["image"] == 1.0  # sizes only: default image mix
    # Built directly, the same rule: the kinds not named get none (P3's "text" plan was half images).
    assert MixSpec(text=1, max_tokens=2).shares() == {"text": 1.0, "image": 0.0, "video": 0.0, "audio": 0.0}
    assert MixSpec(audio=1).shares()["audio"] == 1.0 and MixSpec(images=2).shares()["image"] == 1.0
    for bad in ("text=0", "pixels=3", "image", "images=0", "text=-1,image=2"):
        with pytest.raises(ValueError):
            MixSpec.parse(bad)


def test_sampled_kinds_follow_the_shares() -> None:
    spec = MixSpec(text=0.5, image=0.3, audio=0.2)
    rng = random.Random(0)
    kinds = [sample_kind(spec, rng) for _ in range(20_000)]
    for kind, share in (("text", 0.5), ("image", 0.3), ("audio", 0.2), ("video", 0.0)):
        assert kinds.count(kind) / len(kinds) == pytest.approx(share, abs=0.015)


def test_planned_requests_carry_distinct_media_unless_repeats_are_asked() -> None:
    spec = MixSpec(text=1, image=1, images=3, max_tokens=5, image_w=32, image_h=32)
    plan = plan_requests(spec, 20, seed=2)
    images = [p for p in plan if p.kind == "image"]
    texts = [p for p in plan if p.kind == "text"]
    assert images and texts
    assert all(len(p.request.messages[0].parts) == 4 for p in images)  # 3 images + the prompt
    assert all(len(p.request.messages[0].parts) == 1 for p in texts)
    data = [part.media.data for p in images for part in p.request.messages[0].parts if part.HasField("media")]
    assert len(set(data)) == len(data)
    assert {p.request.sampling.max_tokens for p in plan} == {5}
    repeated = plan_requests(MixSpec(image=1, images=2, repeat=0.9, image_w=32, image_h=32), 10, seed=2)
    data = [part.media.data for p in repeated for part in p.request.messages[0].parts if part.HasField("media")]
    assert len(set(data)) < len(data) / 2


def test_histogram_percentiles_within_its_precision() -> None:
    rng = random.Random(5)
    values = [rng.lognormvariate(-3, 1) for _ in range(50_000)]
    hist = LatencyHistogram().record_all(values)
    exact = sorted(values)
    for q in (50, 90, 99, 99.9):
        truth = exact[math.ceil(q / 100 * len(exact)) - 1]
        assert hist.percentile(q) == pytest.approx(truth, rel=1 / 2**7)
    assert hist.percentile(100) == max(values) and hist.percentile(0) == min(values)
    assert hist.total == len(values) and hist.mean_s == pytest.approx(statistics.fmean(values))
    assert len(hist.counts) < 3000  # bounded memory
    small = LatencyHistogram().record_all([0.000001, 0.000002, 0.000003])
    assert small.percentile(50) == pytest.approx(0.000002)
    assert math.isnan(LatencyHistogram().percentile(50))
    with pytest.raises(ValueError):
        LatencyHistogram().record(-1.0)


def _record(kind: str, start: float, ttft: float, gaps: list[float], error: str = "") -> RequestRecord:
    return RequestRecord(
        kind, start, ttft, ttft + sum(gaps), list(gaps), tokens=0 if error else len(gaps) + 1, error=error
    )


def test_goodput_counts_requests_that_meet_both_limits() -> None:
    records = [
        _record("text", 0.0, 0.1, [0.02, 0.02]),  # good
        _record("text", 1.0, 0.5, [0.02]),  # TTFT too long
        _record("image", 2.0, 0.1, [0.2, 0.2]),  # ITL too long
        _record("image", 3.0, 0.1, [0.05, 0.01]),  # good: the mean gap 0.03 counts, not the max
        _record("image", 4.0, 0.1, [], error="UNAVAILABLE"),
        _record("text", 9.0, 0.2, [0.0]),  # good; ends at 9.2
    ]
    out = summarize(records, Slo(ttft_s=0.3, itl_s=0.05))
    assert out["window_s"] == pytest.approx(9.2)
    assert out["count"] == 6 and out["errors"] == 1
    assert out["goodput_rps"] == pytest.approx(3 / 9.2)
    assert out["throughput_rps"] == pytest.approx(5 / 9.2)
    assert out["slo_attainment"] == pytest.approx(3 / 6)
    assert out["ttft"]["count"] == 5
    unlimited = summarize(records, Slo())
    assert unlimited["goodput_rps"] == unlimited["throughput_rps"]


class FakeServer:
    """A `Send` whose requests take `service_s` each, `servers` at a time; counts concurrency."""

    def __init__(self, service_s: float, servers: int = 1000) -> None:
        self.service_s = service_s
        self.running = 0
        self.peak = 0
        self.sent: list[str] = []
        self._slots = asyncio.Semaphore(servers)

    async def __call__(self, planned: PlannedRequest, record: RequestRecord) -> None:
        self.sent.append(planned.request.request_id)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            async with self._slots:
                await asyncio.sleep(self.service_s)
                record.ttft_s = self.service_s
                record.tokens = 1
        finally:
            self.running -= 1


def _plan(n: int) -> list[PlannedRequest]:
    return [PlannedRequest("text", generate_pb2.GenerateRequest(request_id=str(i))) for i in range(n)]


def test_closed_loop_keeps_n_in_flight_and_stops_at_the_count() -> None:
    server = FakeServer(0.01)
    records = asyncio.run(run_load(server, _plan(23), LoadConfig(mode="closed", concurrency=4, warmup_requests=3)))
    assert len(records) == 20 and server.peak == 4
    assert server.sent[:3] == ["0", "1", "2"]  # warm-up first, not recorded
    assert {r.request_id for r in records} == {str(i) for i in range(3, 23)}


def test_closed_loop_stops_at_the_duration() -> None:
    # The run's clock is moved by the work served, not by the host: each request takes 0.05 s of it,
    # two at a time (2 clients), so the 0.3 s duration is what the requests done make it.
    served = 0

    async def send(planned: PlannedRequest, record: RequestRecord) -> None:
        nonlocal served
        await asyncio.sleep(0)  # the other client's turn
        served += 1
        record.tokens = 1

    config = LoadConfig(mode="closed", concurrency=2, duration_s=0.3)
    records = asyncio.run(run_load(send, _plan(1000), config, clock=lambda: served * 0.05 / 2))
    # 2 clients x 0.3 s / 0.05 s = 12 served within the duration, plus the other client's request
    # started at 0.275 s; a run that ignored the duration would send the whole plan (1000).
    assert len(records) == 13 and all(r.start_s < 0.3 for r in records)


def test_open_loop_sends_on_schedule_whatever_the_server_does() -> None:
    server = FakeServer(0.2, servers=1)  # slower than arrivals: an open loop still sends them all
    config = LoadConfig(mode="open", rate_per_s=100.0, duration_s=0.2, max_requests=1000, seed=4)
    expected = len(poisson_arrivals(100.0, count=1000, duration_s=0.2, seed=4))
    sent: list[str] = []
    all_sent = asyncio.Event()

    async def held(planned: PlannedRequest, record: RequestRecord) -> None:
        # No request is answered before the last one is sent: a loop whose sends waited for the
        # server would never send it (bounded below), whatever the host's speed.
        sent.append(planned.request.request_id)
        if len(sent) == expected:
            all_sent.set()
        await all_sent.wait()
        await server(planned, record)

    records = asyncio.run(asyncio.wait_for(run_load(held, _plan(1000), config), 120))
    assert len(records) == expected and server.peak == expected  # all in flight at once
    starts = [r.start_s for r in records]
    assert expected >= 10 and starts == sorted(starts)  # sent in schedule order
    ttfts = [r.e2e_s for r in records]
    assert max(ttfts) > 1.0  # they queued at the one server: latency grows, as it should


def test_failed_requests_are_recorded_not_raised() -> None:
    async def failing(planned: PlannedRequest, record: RequestRecord) -> None:
        raise RuntimeError("boom")

    records = asyncio.run(run_load(failing, _plan(3), LoadConfig(mode="closed")))
    assert [r.error for r in records] == ["RuntimeError: boom"] * 3 and not any(r.ok for r in records)
