"""The capacity planner's simulation on hand-made profiles (no spans, no sockets): queueing it
must show, the SRPT order of prefill chunks, and recommendations that grow with the load."""

from __future__ import annotations

import pytest

from libs.plan.profile import Profile, RequestProfile
from libs.plan.simulate import Layout, Workload, recommend, simulate

pytestmark = pytest.mark.unit


def _req(kind: str, encode: tuple[float, ...], prefill_s: float, tokens: int) -> RequestProfile:
    return RequestProfile(kind, len(encode), encode, prefill_s, tokens, 1, 0.0, 0.01, 0.0)


PROFILE = Profile(
    "e+pd",
    [_req("text", (), 0.05, 50)] * 10 + [_req("image", (0.4,), 0.8, 800)] * 10,
)


def test_at_low_load_ttft_is_the_service_times() -> None:
    result = simulate(PROFILE, Layout("e+pd", 1, 1), Workload({"text": 1.0}, clients=1, duration_s=60))
    assert result.p90("text") == pytest.approx(0.05 + 0.01, rel=0.01)
    result = simulate(PROFILE, Layout("e+pd", 1, 1), Workload({"image": 1.0}, clients=1, duration_s=60))
    assert result.p90("image") == pytest.approx(0.4 + 0.8 + 0.01, rel=0.01)


def test_queueing_grows_with_load_and_instances_relieve_it() -> None:
    mix = {"text": 0.5, "image": 0.5}
    light = simulate(PROFILE, Layout("e+pd", 1, 1), Workload(mix, rate_per_s=0.3, duration_s=2000))
    heavy = simulate(PROFILE, Layout("e+pd", 1, 1), Workload(mix, rate_per_s=1.1, duration_s=2000))
    wider = simulate(PROFILE, Layout("e+pd", 2, 2), Workload(mix, rate_per_s=1.1, duration_s=2000))
    assert light.p90() < heavy.p90()
    assert wider.p90() < heavy.p90()


def test_text_prefill_overtakes_long_chunked_prefills() -> None:
    """Shortest remaining first: under image load, text waits for one 256-token chunk at most."""
    mix = {"text": 0.3, "image": 0.7}
    result = simulate(PROFILE, Layout("e+pd", 4, 1), Workload(mix, clients=6, duration_s=600))
    chunk_s = 0.8 / 4  # 800 tokens in 4 chunks
    assert result.p90("text") <= 0.05 + 0.01 + chunk_s + 1e-6
    assert result.p90("image") > 1.5  # the images queue behind each other instead


def test_recommendations_grow_with_the_rate() -> None:
    mix = {"text": 0.5, "image": 0.5}
    small = recommend(PROFILE, "e+pd", Workload(mix, rate_per_s=0.2, duration_s=600), slo_ttft_s=2.0)
    large = recommend(PROFILE, "e+pd", Workload(mix, rate_per_s=2.0, duration_s=600), slo_ttft_s=2.0)
    assert small is not None and large is not None
    assert small[0].total() < large[0].total()
    assert large[1].p90() <= 2.0
    assert recommend(PROFILE, "e+pd", Workload(mix, rate_per_s=50.0, duration_s=60), 2.0, max_instances=4) is None


def _decoding(step_engine_s: float, batch_mean: float) -> RequestProfile:
    return RequestProfile("text", 0, (), 0.05, 50, 9, 0.0, 0.01, 0.0, 8, step_engine_s, batch_mean)


def test_decode_step_cost_is_fitted_to_the_measured_batch_sizes() -> None:
    # Steps measured at batches 1..4 on a line: 20 ms + 10 ms per sequence.
    requests = [_decoding(0.02 + 0.01 * b, b) for b in (1, 2, 3, 4) for _ in range(3)]
    base, per_sequence = Profile("e+pd", requests).step_cost() or (0.0, 0.0)
    assert base == pytest.approx(0.02) and per_sequence == pytest.approx(0.01)
    assert Profile("e+pd", [_decoding(0.03, 1.0)] * 4).step_cost() is None  # one batch size: no slope


def test_a_costlier_batch_lengthens_the_queue_behind_decode() -> None:
    """The same prefills; steps that cost more per sequence leave the engine less time for them."""
    cheap = Profile("e+pd", [_decoding(0.02 + 0.001 * b, b) for b in (1, 4)])
    costly = Profile("e+pd", [_decoding(0.02 + 0.03 * b, b) for b in (1, 4)])
    workload = Workload({"text": 1.0}, clients=6, duration_s=300, max_tokens=9)
    fast = simulate(cheap, Layout("e+pd", 1, 1), workload)
    slow = simulate(costly, Layout("e+pd", 1, 1), workload)
    assert slow.p90("text") > 1.5 * fast.p90("text")


def test_prefill_chunks_follow_the_measured_services() -> None:
    """A text prefill waits for the image chunk in progress: one of 64 tokens, not of 256."""
    images = [_req("image", (0.01,), 0.8, 256)] * 10
    mix = {"text": 0.5, "image": 0.5}
    coarse = simulate(
        Profile("e+pd", [*PROFILE.of_kind("text"), *images], chunk_tokens=256),
        Layout("e+pd", 4, 1),
        Workload(mix, clients=6, duration_s=600),
    )
    fine = simulate(
        Profile("e+pd", [*PROFILE.of_kind("text"), *images], chunk_tokens=64),
        Layout("e+pd", 4, 1),
        Workload(mix, clients=6, duration_s=600),
    )
    assert fine.p90("text") <= 0.05 + 0.01 + 0.8 / 4 + 1e-6 < coarse.p90("text")


def test_a_profile_counts_the_items_of_shared_encode_calls() -> None:
    """One `epd.encode.item` span per Encode call: a call of three items counts three items and one
    encoder job (its engine time), as the router sends a request's items placed on one encoder."""
    from libs.plan.profile import profile
    from libs.telemetry.spans import SpanRecord

    ms = 1_000_000
    trace = "ab" * 16

    def span(sid: str, parent: str, name: str, service: str, start: int, end: int, **attrs: object) -> SpanRecord:
        return SpanRecord(trace, sid * 16, parent * 16 if parent else "", name, service, start * ms, end * ms, attrs)

    spans = [
        span("1", "", "GenerateService/Generate", "router", 0, 40, **{"epd.ttft_s": 0.02, "epd.request_id": "r"}),
        span("2", "1", "epd.encode.item", "router", 1, 10, **{"epd.items": 3, "epd.modality": "MODALITY_IMAGE"}),
        span("3", "2", "EncoderService/Encode", "encoder", 2, 9),
        span("4", "3", "encoder.preprocess", "encoder", 2, 4),
        span("5", "3", "encoder.compute", "encoder", 4, 8),
        span("6", "1", "prefill.compute", "pd", 11, 18),
    ]
    (request,) = profile(spans).requests
    assert (request.kind, request.items) == ("image", 3)
    assert request.encode_s == pytest.approx((0.006,))
