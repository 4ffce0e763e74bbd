"""Failure isolation with real processes: deadlines and cancels release every buffer, stale handles
and bad media get typed statuses, an encoder killed under load costs only its own requests, and
prefill and decode keep serving throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.cache.keys import wire_content_hash
from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    media_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
    tensor_pb2,
)
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY
from libs.contract.reasons import Reason, reason_of
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints import ensure_checkpoint
from libs.model.media import synthetic
from libs.telemetry.spans import OtlpReceiver, SpanRecord
from services.router.encoders import _weight as rendezvous_weight
from tests.support.golden import request_for
from tests.support.stacks import MIXES, layout_slug, pool_stats, run_requests, wait_for, wait_pools_empty
from tests.support.tracing import trace_spans, traced, tracing_env

pytestmark = pytest.mark.stack

# Greedy decoding of this prompt on the tiny checkpoint runs to max_tokens without an EOS.
ENDLESS = "Count forever."
LAYOUTS = ["colocated", "e+pd", "e/p/d"]
# The service whose batch decodes a layout's requests.
DECODER = {"colocated": "colocated", "e+pd": "pd", "e/p/d": "decode"}


def _endless(max_tokens: int = 4096, request_id: str = "") -> generate_pb2.GenerateRequest:
    return build_request(ENDLESS, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens), request_id=request_id)


async def _stream_until(
    address: str,
    request: object,
    *,
    timeout_s: float | None,
    cancel_after: int | None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[int, grpc.StatusCode | None]:
    """Tokens received and the status the server ended the stream with; None when we cancelled it
    ourselves after `cancel_after` tokens (what the services did then is for the caller to check)."""
    received = 0
    async with open_channel(address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=timeout_s, metadata=metadata)
        try:
            async for response in call:
                received += len(response.chunk.token_ids)
                if cancel_after is not None and received >= cancel_after:
                    call.cancel()
                    return received, None
        except grpc.aio.AioRpcError as exc:
            return received, exc.code()
    return received, grpc.StatusCode.OK


def _healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_deadline_expiring_during_decode_releases_everything(
    layout: str, stacks: Callable[[str], Stack], receiver: OtlpReceiver
) -> None:
    stack = stacks(layout)
    # The deadline must pass mid-decode: after the first token, before the 4096th. Whatever the
    # host's speed, a deadline that passed before the first token is doubled and one the whole
    # stream beat is halved, until one lands in between (the first, 2 s, does on this project's hosts).
    deadline_s = 2.0
    for attempt in range(6):
        trace_id, metadata = traced()
        request = _endless(request_id=f"deadline-{layout_slug(layout)}-{attempt}")
        received, code = asyncio.run(
            _stream_until(stack.address, request, timeout_s=deadline_s, cancel_after=None, metadata=metadata)
        )
        if received == 0 and code == grpc.StatusCode.DEADLINE_EXCEEDED:
            deadline_s *= 2
        elif code == grpc.StatusCode.OK:
            deadline_s /= 2
        else:
            break
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, received, deadline_s)
    assert 0 < received < 4096  # it failed mid-decode, after tokens were streamed
    # The stage that was decoding stopped then too (its span ends with its stream), not at max_tokens.
    (decoding,) = _decode_spans(receiver, trace_id)
    assert decoding.attributes["epd.decode.tokens"] < 4095
    stats = wait_pools_empty(stack)
    assert stats[DECODER[layout]].active_sequences == 0  # the sequence left the decode batch
    assert _healthy(stack.processes[DECODER[layout]].address)


def _decode_spans(receiver: OtlpReceiver, trace_id: str) -> list[SpanRecord]:
    spans = trace_spans(receiver, trace_id, lambda ss: any(s.name == "decode.generate" for s in ss), timeout_s=60)
    return [s for s in spans if s.name == "decode.generate"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_client_cancel_mid_stream_releases_everything(
    layout: str, stacks: Callable[[str], Stack], receiver: OtlpReceiver
) -> None:
    stack = stacks(layout)
    trace_id, metadata = traced()
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=9))
    request = build_request(
        ENDLESS,
        [image],
        sampling=sampling_pb2.SamplingParams(max_tokens=4096),
        request_id=f"cancel-{layout_slug(layout)}",
    )
    received, code = asyncio.run(
        _stream_until(stack.address, request, timeout_s=60, cancel_after=20, metadata=metadata)
    )
    assert code is None and received >= 20
    # The cancel reached the stage that was decoding: its stream, and so its span, ended there, far
    # short of the 4096 tokens it would otherwise have generated (and its span would only end then).
    (decoding,) = _decode_spans(receiver, trace_id)
    assert received - 1 <= decoding.attributes["epd.decode.tokens"] < 4095
    stats = wait_pools_empty(stack)
    assert stats[DECODER[layout]].active_sequences == 0  # the sequence left the decode batch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupt_media_is_invalid_argument_naming_the_item(
    layout: str, stacks: Callable[[str], Stack], receiver: OtlpReceiver
) -> None:
    stack = stacks(layout)
    trace_id, metadata = traced()
    good = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=1))
    bad = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"\x89PNG\r\n\x1a\n not really a png")

    async def call() -> grpc.aio.AioRpcError:
        async with open_channel(stack.address) as channel:
            stream = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                build_request("what", [good, bad]), timeout=30, metadata=metadata
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stream:
                    pass
            assert dict(await stream.trailing_metadata() or ())[ERROR_FIELD_METADATA_KEY] == "media item 1"
            return caught.value

    error = asyncio.run(call())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "media item 1" in (error.details() or "")
    wait_pools_empty(stack)  # the good item's embedding was released, not leaked
    # Server spans carry the status their call ended with: the entry's Generate and, split off, the
    # Encode that refused the item.
    refused = {"GenerateService/Generate"} | ({"EncoderService/Encode"} if layout != "colocated" else set())

    def statuses(spans: list[SpanRecord]) -> dict[str, object]:
        return {s.name: s.attributes["rpc.grpc.status_code"] for s in spans if "rpc.grpc.status_code" in s.attributes}

    spans = trace_spans(receiver, trace_id, lambda ss: refused <= set(statuses(ss)))
    assert statuses(spans) == dict.fromkeys(refused, grpc.StatusCode.INVALID_ARGUMENT.value[0])


@pytest.mark.timeout(120)
def test_stale_embedding_handle_fails_cleanly_at_prefill(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")
    encoder = stack.processes["encoder-0"].address
    prefill = stack.processes["prefill"].address
    with grpc.insecure_channel(encoder) as channel:
        image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=2))
        encoded = (
            encoder_pb2_grpc.EncoderServiceStub(channel)
            .Encode(
                encoder_pb2.EncodeRequest(
                    request_id="stale-1",
                    items=[encoder_pb2.EncodeItem(item_index=0, media=image)],
                    accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                ),
                timeout=30,
            )
            .items[0]
        )
        released = lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(
            lease_pb2.ReleaseLeasesRequest(
                lease_ids=[encoded.embeddings.lease_id], reason=lease_pb2.RELEASE_REASON_ABANDONED
            ),
            timeout=5,
        )
        assert released.released_count == 1
    request = request_for(MIXES["image"])
    metadata_only = prefill_pb2.PrefillRequest(
        request_id="stale-1", sampling=request.sampling, accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL]
    )
    metadata_only.messages.add(role=request.messages[0].role)
    metadata_only.messages[0].parts.add(text="what is in this image")
    metadata_only.messages[0].parts.add(encoded=encoded)
    with grpc.insecure_channel(prefill) as channel, pytest.raises(grpc.RpcError) as caught:
        prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(metadata_only, timeout=30)
    # The released slot was poisoned, so the read fails its checksum instead of serving stale bytes.
    assert caught.value.code() in {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS}
    assert reason_of(caught.value) == Reason.EMBEDDING_GONE  # what the router re-encodes for
    assert _healthy(prefill)
    # Prefill keeps serving: a normal request through the router still works.
    (result,) = run_requests(stack.address, [request_for(MIXES["image"])])
    assert result.token_ids
    wait_pools_empty(stack)


@pytest.fixture(scope="module")
def vl_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """An encoder serving another checkpoint (Qwen2.5-VL) than the session stacks (Qwen2.5-Omni)."""
    other = ServiceProcess(
        "vl-encoder",
        "services.encoder",
        ["--model", str(ensure_checkpoint("qwen2_5_vl", "tiny"))],
        log_path=tmp_path_factory.mktemp("vl-encoder") / "vl-encoder.log",
    )
    other.start()
    try:
        other.wait_ready(120)
        yield other
    finally:
        assert other.stop() == 0


def _router(stack: Stack, encoders: list[str], log: Path, env: dict[str, str] | None = None) -> ServiceProcess:
    """A router of our own over `encoders` and the stack's prefill and decode (started, ready)."""
    router = ServiceProcess(
        "router",
        "services.router",
        [
            "--encoders", ",".join(encoders),
            "--prefill", stack.processes["prefill"].address,
            "--decode", stack.processes["decode"].address,
        ],
        log_path=log,
        env=env or {},
    )  # fmt: skip
    router.start()
    try:
        router.wait_ready(60)
    except BaseException:
        router.stop()
        raise
    return router


@pytest.mark.timeout(180)
def test_encoder_of_another_model_is_refused_at_first_contact(
    stacks: Callable[[str], Stack], vl_encoder: ServiceProcess, tmp_path: Path
) -> None:
    stack = stacks("e/p/d")
    router = _router(stack, [vl_encoder.address], tmp_path / "router.log")
    try:
        image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=1))
        received, code = asyncio.run(
            _stream_until(router.address, build_request("what", [image]), timeout_s=30, cancel_after=None)
        )
        assert (received, code) == (0, grpc.StatusCode.FAILED_PRECONDITION)
        error = _last_error(router.address)
        assert error.startswith("FAILED_PRECONDITION: peer ") and "serves qwen2_5_vl-tiny@local" in error
        assert "this service serves qwen2_5_omni-tiny@local" in error
        # Text-only requests never touch an encoder and still work through this router.
        (result,) = run_requests(router.address, [build_request("hello there")])
        assert result.token_ids
    finally:
        assert router.stop() == 0
    wait_pools_empty(stack)


def _images_preferring(address: str, addresses: list[str], count: int) -> list[media_pb2.MediaItem]:
    """Images whose content hash ranks `address` first among `addresses`: the encoder a router's
    rendezvous placement sends them to when no encoder is busier than another."""
    found = []
    for seed in range(1000, 1200):
        image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(48, 64, seed=seed))
        key = wire_content_hash(image, image.data)
        if max(addresses, key=lambda a: rendezvous_weight(a, key)) == address:
            found.append(image)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} images prefer {address}")


@pytest.mark.timeout(180)
def test_mixed_pool_skips_the_incompatible_encoder_live(
    stacks: Callable[[str], Stack], vl_encoder: ServiceProcess, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """One encoder of another model among two good ones: every media request succeeds, with the
    tokens the stack's own router gives; items placed on the bad encoder first are moved on at
    first contact, and it never encodes anything."""
    stack = stacks("e/p/d")
    pool = [vl_encoder.address, stack.processes["encoder-0"].address, stack.processes["encoder-1"].address]
    images = _images_preferring(vl_encoder.address, pool, 3)
    requests = [
        build_request(
            "what is this", [image], sampling=sampling_pb2.SamplingParams(max_tokens=8), request_id=f"mixed-{i}"
        )
        for i, image in enumerate(images)
    ]
    router = _router(stack, pool, tmp_path / "router.log", env=tracing_env(receiver))
    try:
        # One at a time (equal load: each item goes to its preferred encoder first), then together.
        got = [run_requests(router.address, [r])[0] for r in requests]
        again = run_requests(router.address, [_renamed(r, "again") for r in requests])
    finally:
        assert router.stop() == 0
    want = run_requests(stack.address, [_renamed(r, "reference") for r in requests])
    assert [r.token_ids for r in got] == [r.token_ids for r in again] == [r.token_ids for r in want]
    touched = _encoders_per_item(receiver, {r.request_id for r in requests}, len(requests))
    for request in requests:  # tried on the bad encoder, served by a good one
        (addresses,) = [a for (rid, _), a in touched.items() if rid == request.request_id]
        assert vl_encoder.address in addresses and len(addresses) == 2, addresses
    vl = pool_stats(vl_encoder.address).pool
    assert (vl.acked_leases, vl.released_leases, vl.expired_leases, vl.active_leases) == (0, 0, 0, 0)
    wait_pools_empty(stack)


def _renamed(request: generate_pb2.GenerateRequest, prefix: str) -> generate_pb2.GenerateRequest:
    copy = generate_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = f"{prefix}-{request.request_id}"
    return copy


def _last_error(address: str) -> str:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=1))
    with grpc.insecure_channel(address) as channel:
        try:
            for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                build_request("what", [image]), timeout=30
            ):
                pass
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return "OK"


@pytest.fixture(scope="module", params=["e/p/d", "e+pd"])
def doomed_stack(
    request: pytest.FixtureRequest,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    receiver: OtlpReceiver,
) -> Iterator[Stack]:
    """A stack of its own per layout with two encoders, one of which this module's test kills:
    encoder-0 holds the tower work of the test's requests (ids "kill-...") at a gate that never
    opens (tests/support/gated.py), so they are in flight there until it dies."""
    run_dir = tmp_path_factory.mktemp("doomed")
    spec = StackSpec(
        layout=request.param,
        encoders=2,
        model=model_path,
        run_dir=run_dir,
        env=tracing_env(receiver),
        run_through={"encoder-0": ["tests.support.gated", "--encodes", "kill-", str(run_dir / "never")]},
    )
    stack = Stack(spec)
    stack.up()
    yield stack
    stack.down()


@pytest.mark.slow  # a stack of its own
@pytest.mark.timeout(300)
def test_encoder_killed_mid_load(doomed_stack: Stack, expected: dict[str, list[int]], receiver: OtlpReceiver) -> None:
    """SIGKILL one of two encoders while it holds work (E/P/D and E+PD). The design's bound: a
    request whose items the dead encoder held is retried on the other encoder before its first
    token, and a request that never touched it is not affected; so every request completes, with
    the model's own tokens. The kill provably costs work on any host: encoder-0 holds each of
    these requests' encodes until it dies, two images whose placement ranks it first go out
    before the rest, and it is killed once it holds one."""
    stack = doomed_stack
    victim = stack.processes["encoder-0"]
    slug = layout_slug(stack.spec.layout)  # request ids of their own: both layouts' spans reach one receiver
    encoders = [victim.address, stack.processes["encoder-1"].address]
    sampling = sampling_pb2.SamplingParams(max_tokens=8)
    placed = [
        build_request("what is this", [image], sampling=sampling, request_id=f"kill-{slug}-placed-{i}")
        for i, image in enumerate(_images_preferring(victim.address, encoders, 2))
    ]
    plan = ["two_images", "image", "video", "audio_image"] * 6
    requests = [request_for(MIXES[name], request_id=f"kill-{slug}-{i}") for i, name in enumerate(plan)]

    def holds_work() -> bool:
        return pool_stats(victim.address).requests_in_flight > 0

    async def load() -> list[GenerationResult | str]:
        async def one(request: generate_pb2.GenerateRequest) -> GenerationResult | str:
            async with open_channel(stack.address) as channel:
                try:
                    return await generate(channel, request, timeout_s=120)
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"

        first = [asyncio.ensure_future(one(r)) for r in placed]
        # Once it holds an encode (polled off the event loop the requests run on), the rest of the
        # load joins, and the encoder is killed.
        await asyncio.to_thread(wait_for, holds_work, 60, "encoder-0 to hold an encode", 0.01)
        rest = [asyncio.ensure_future(one(r)) for r in requests]
        victim.kill()  # SIGKILL: no drain, its memory is gone
        return list(await asyncio.gather(*first, *rest))

    outcomes = asyncio.run(load())
    failed = {r.request_id: o for r, o in zip([*placed, *requests], outcomes, strict=True) if isinstance(o, str)}
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed}"
    served = [o for o in outcomes if isinstance(o, GenerationResult)]
    wrong = {i: plan[i] for i, r in enumerate(served[len(placed) :]) if r.token_ids != expected[plan[i]]}
    assert not wrong
    # The placed images' tokens are those the stack gives them undisturbed (encoder-1 alone now).
    again = run_requests(stack.address, [_renamed(r, "again") for r in placed])
    assert [r.token_ids for r in served[: len(placed)]] == [r.token_ids for r in again]
    # The kill cost requests something: every item sent to encoder-0 was held there, so each of
    # them (at least the placed ones') had to be encoded by encoder-1 after the kill.
    touched = _encoders_per_item(receiver, {r.request_id for r in [*placed, *requests]}, len(outcomes))
    sent_to_victim = {key: addresses for key, addresses in touched.items() if victim.address in addresses}
    assert sent_to_victim, f"no item was sent to the killed encoder: {touched}"
    assert all(len(addresses) > 1 for addresses in sent_to_victim.values()), sent_to_victim
    survivors = [name for name in stack.processes if name != "encoder-0"]  # prefill and decode, or PD
    assert {"encoder-1", "router"} < set(survivors)
    for name in survivors:
        assert stack.processes[name].alive() and _healthy(stack.processes[name].address)
    # After the kill every request succeeds on the surviving encoder (retried there if needed).
    after = run_requests(stack.address, [request_for(MIXES["two_images"]) for _ in range(4)])
    assert all(r.token_ids == expected["two_images"] for r in after)
    wait_pools_empty(stack, allow_quarantine=True)


def _encoders_per_item(receiver: OtlpReceiver, request_ids: set[str], roots: int) -> dict[tuple[str, int], set[str]]:
    """(request id, item index) -> the encoders the router sent that item to, from its spans."""

    def by_request(spans: list[SpanRecord]) -> dict[str, str]:
        return {
            s.trace_id: str(s.attributes["epd.request_id"])
            for s in spans
            if s.name == "GenerateService/Generate" and s.attributes.get("epd.request_id") in request_ids
        }

    wait_for(lambda: len(by_request(receiver.snapshot())) >= roots, 30, "the router's spans of every request")
    spans = receiver.snapshot()
    request_of = by_request(spans)
    touched: dict[tuple[str, int], set[str]] = {}
    for span in spans:
        if span.name == "epd.encode.item" and span.trace_id in request_of:
            key = (request_of[span.trace_id], int(span.attributes["epd.item_index"]))
            touched.setdefault(key, set()).add(str(span.attributes["epd.encoder"]))
    return touched
