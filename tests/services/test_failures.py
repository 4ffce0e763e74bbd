"""Failure isolation with real processes: deadlines and cancels release every buffer, stale handles
and bad media get typed statuses, an encoder killed under load costs only its own requests, and
prefill and decode keep serving throughout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.client.generate import build_request, open_channel
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
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
from libs.engine.checkpoints import ensure_checkpoint
from libs.engine.media import synthetic
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack, StackSpec
from tests.services.conftest import MIXES, run_requests, wait_pools_empty
from tests.services.golden import request_for

# Greedy decoding of this prompt on the tiny checkpoint runs to max_tokens without an EOS.
ENDLESS = "Count forever."


def _endless(max_tokens: int = 4096) -> object:
    return build_request(ENDLESS, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens))


async def _stream_until(
    address: str, request: object, *, timeout_s: float | None, cancel_after: int | None
) -> tuple[int, grpc.StatusCode]:
    """Tokens received and the final status of one Generate stream."""
    received = 0
    async with open_channel(address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=timeout_s)
        try:
            async for response in call:
                received += len(response.chunk.token_ids)
                if cancel_after is not None and received >= cancel_after:
                    call.cancel()
                    return received, grpc.StatusCode.CANCELLED
        except grpc.aio.AioRpcError as exc:
            return received, exc.code()
    return received, grpc.StatusCode.OK


def _healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(120)
def test_deadline_expiring_during_decode_releases_everything(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")
    received, code = asyncio.run(_stream_until(stack.address, _endless(), timeout_s=1.0, cancel_after=None))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 1 < received < 4096  # it failed mid-decode, after tokens were streamed
    wait_pools_empty(stack)
    assert _healthy(stack.processes["decode"].address)


@pytest.mark.timeout(120)
def test_client_cancel_mid_stream_releases_everything(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=9))
    request = build_request(ENDLESS, [image], sampling=sampling_pb2.SamplingParams(max_tokens=4096))
    received, code = asyncio.run(_stream_until(stack.address, request, timeout_s=60, cancel_after=20))
    assert code == grpc.StatusCode.CANCELLED and received >= 20
    stats = wait_pools_empty(stack)
    assert stats["decode"].active_sequences == 0


@pytest.mark.timeout(120)
def test_corrupt_media_is_invalid_argument_naming_the_item(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")
    good = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=1))
    bad = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"\x89PNG\r\n\x1a\n not really a png")

    async def call() -> grpc.aio.AioRpcError:
        async with open_channel(stack.address) as channel:
            stream = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                build_request("what", [good, bad]), timeout=30
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
    assert _healthy(prefill)
    # Prefill keeps serving: a normal request through the router still works.
    (result,) = run_requests(stack.address, [request_for(MIXES["image"])])
    assert result.token_ids
    wait_pools_empty(stack)


@pytest.mark.timeout(180)
def test_encoder_of_another_model_is_refused_at_first_contact(stacks: Callable[[str], Stack], tmp_path: Path) -> None:
    stack = stacks("e/p/d")
    other = ServiceProcess(
        "vl-encoder",
        "services.encoder",
        ["--model", str(ensure_checkpoint("qwen2_5_vl", "tiny"))],
        log_path=tmp_path / "vl-encoder.log",
    )
    other.start()
    router = None
    try:
        other.wait_ready(120)
        router = ServiceProcess(
            "router",
            "services.router",
            [
                "--encoders", other.address,
                "--prefill", stack.processes["prefill"].address,
                "--decode", stack.processes["decode"].address,
            ],
            log_path=tmp_path / "router.log",
        )  # fmt: skip
        router.start()
        router.wait_ready(60)
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
        if router is not None:
            router.stop()
        other.stop()
    wait_pools_empty(stack)


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


@pytest.fixture(scope="module")
def doomed_stack(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own: this module's tests kill one of its encoders."""
    stack = Stack(StackSpec(layout="e/p/d", encoders=2, model=model_path, run_dir=tmp_path_factory.mktemp("doomed")))
    stack.up()
    yield stack
    stack.down()


@pytest.mark.timeout(300)
def test_encoder_killed_mid_load(doomed_stack: Stack, expected: dict[str, list[int]]) -> None:
    stack = doomed_stack
    plan = ["two_images", "image", "video", "audio_image"] * 6
    requests = [request_for(MIXES[name], request_id=f"kill-{i}") for i, name in enumerate(plan)]

    async def load() -> list[object]:
        async def one(request: object) -> object:
            from libs.client.generate import generate

            async with open_channel(stack.address) as channel:
                try:
                    return await generate(channel, request, timeout_s=120)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        await asyncio.sleep(0.3)
        stack.processes["encoder-0"].kill()  # SIGKILL: no drain, its memory is gone
        return list(await asyncio.gather(*tasks))

    started = time.monotonic()
    outcomes = asyncio.run(load())
    assert time.monotonic() - started < 120
    ok = [(plan[i], o) for i, o in enumerate(outcomes) if not isinstance(o, grpc.StatusCode)]
    failed = [o for o in outcomes if isinstance(o, grpc.StatusCode)]
    assert ok, "the surviving encoder must carry the load"
    assert all(result.token_ids == expected[name] for name, result in ok)  # type: ignore[attr-defined]
    assert set(failed) <= {grpc.StatusCode.UNAVAILABLE}  # typed, never a hang or INTERNAL
    for name in ("prefill", "decode", "encoder-1", "router"):
        assert stack.processes[name].alive() and _healthy(stack.processes[name].address)
    # After the kill every request succeeds on the surviving encoder (retried there if needed).
    after = run_requests(stack.address, [request_for(MIXES["two_images"]) for _ in range(4)])
    assert all(r.token_ids == expected["two_images"] for r in after)
    wait_pools_empty(stack, allow_quarantine=True)
