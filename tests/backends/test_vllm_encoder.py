"""E+PD with every stage on vLLM: the encoder service runs vLLM encoder-only (`--engine vllm`: its
worker writes the tower's outputs into the encoder's shared pool, libs/backends/vllm/ec_producer.py)
and the PD service runs vLLM reading them over NIXL (the project's EC consumer). One stack for the
module, Qwen2.5-VL tiny (vLLM's own tower runs it; the Omni one crashes vLLM's CPU worker).

Tokens equal the reference runtime's for every mix of the family; the vLLM encoder's embeddings
equal the reference encoder's within float32 rounding; bad media is INVALID_ARGUMENT and the
engine keeps serving; every lease is released and the encoder pool ends empty; the encoder
advertises engine vllm and the reference encoder's embedding specs. Last, the encoder's engine
life: a hung engine (SIGSTOPped) and a killed one are each restarted, their Encode calls fail
UNAVAILABLE (ENGINE_RESTARTING), health is NOT_SERVING until the engine is back, and the same
tokens come through the router after."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from libs.backends.engines import engine_of
from libs.backends.vllm.encoder import QUARANTINE_S
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    media_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
    tensor_pb2,
)
from libs.contract.reasons import Reason, reason_of
from libs.launch.stack import Stack, StackSpec
from libs.model import types as eng
from libs.model.checkpoints import ensure_checkpoint
from libs.model.media import synthetic
from libs.rpc.server import open_channel
from libs.runtime.encoder_runner import EncoderRunner
from libs.serving import convert
from libs.telemetry.spans import by_trace, load_jsonl
from tests.support.vllm_stack import (
    call,
    engine_processes,
    frozen_engine,
    mixes,
    reference_tokens,
    request,
    run,
    stats,
    until_health,
    until_in_flight,
)
from tests.support.vllm_unsplit import AGREEING_MIXES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FAMILY = "qwen2_5_vl"
MIXES = {mix.name: mix for mix in mixes(FAMILY)}
IMAGE = synthetic.png_bytes(112, 84, seed=1)
# vLLM's tower and the reference tower compute in float32 from the same weights and the same
# pixels (the vLLM encoder hands vLLM the project's resized pixels; vLLM only rescales and
# normalizes them, as the project does); they differ
# only in kernels (vLLM's SDPA attention, fused ops), i.e. float32 rounding: measured 2e-6 max abs
# difference on values of order 1. 1e-4 leaves room for other CPUs' kernels, and is far below a
# real difference (another image, another layout: order 1).
ATOL = 1e-4
HANG_S = 5.0  # the encoder's watchdog timeout in this module
SPANS = "spans.jsonl"  # every service's spans, in the stack's run folder
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_checkpoint(FAMILY, "tiny")


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = StackSpec(
        layout="e+pd",
        encoders=1,
        model=model,
        run_dir=(run_dir := tmp_path_factory.mktemp("vllm-encoder")),
        engine="vllm",
        encoder_engine="vllm",
        # The engine-life tests: a stopped engine with an Encode queued is given up after HANG_S.
        extra_args={"encoder-0": ["--engine-hang-timeout-s", str(HANG_S), "--engine-backoff-start-s", "0.5"]},
        ready_timeout_s=420.0,
        env={"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(run_dir / SPANS)},
    )
    with Stack(spec).running() as running:
        yield running


def _encoder(stack: Stack) -> str:
    return stack.processes["encoder-0"].address


async def _encode_inline(
    address: str, modality: media_pb2.Modality.ValueType, data: bytes, max_pixels: int | None = None
) -> encoder_pb2.EncodeResponse:
    media = media_pb2.MediaItem(modality=modality, data=data)
    if max_pixels is not None:
        media.processor_options.max_pixels = max_pixels
    return await _encode_items(address, [media])


async def _encode_items(address: str, media: list[media_pb2.MediaItem]) -> encoder_pb2.EncodeResponse:
    """One Encode call for `media`, the embeddings inline."""
    async with open_channel(address) as channel:
        reply: encoder_pb2.EncodeResponse = await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
            encoder_pb2.EncodeRequest(
                request_id=f"direct-{time.monotonic_ns()}",
                items=[encoder_pb2.EncodeItem(item_index=i, media=m) for i, m in enumerate(media)],
                accepted_transports=[tensor_pb2.TRANSPORT_KIND_INLINE],
            ),
            timeout=60,
        )
        return reply


async def _info(address: str) -> service_info_pb2.ServiceInfo:
    async with open_channel(address) as channel:
        reply = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        )
        info: service_info_pb2.ServiceInfo = reply.info
        return info


def _wait_empty(stack: Stack, timeout_s: float = 20.0) -> None:
    """The encoder's pool back to empty (no slot, no lease, nothing quarantined), PD idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        encoder = run(stats, _encoder(stack))
        pd = run(stats, stack.processes["pd"].address)
        busy = [encoder.pool.slots_in_use, encoder.pool.active_leases, encoder.pool.quarantined_slots]
        if not any(busy) and not pd.active_sequences:
            return
        assert time.monotonic() < deadline, f"still held: {busy}, pd {pd.active_sequences}"
        time.sleep(0.2)  # polls the stats the services publish; each poll is an event check


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, list[int]]:
    return {name: reference_tokens(model, mix) for name, mix in MIXES.items()}


@pytest.mark.parametrize("mix", list(MIXES))
def test_tokens_equal_the_reference_runtime(stack: Stack, expected: dict[str, list[int]], mix: str) -> None:
    result = call(stack.address, request(MIXES[mix]))
    assert result.token_ids == expected[mix]
    _wait_empty(stack)


def test_the_encoders_preprocessing_is_a_stage_of_its_own(stack: Stack, expected: dict[str, list[int]]) -> None:
    """Decoding and resizing the call's items are the encoder's `preprocess` stage in the trace
    (untraced, the trace report would count them as the service's bookkeeping): one
    `encoder.preprocess` span per Encode call, naming its items, ended before vLLM's compute starts."""
    result = call(stack.address, request(MIXES["two_images"], request_id="traced-two-images"))
    assert result.token_ids == expected["two_images"]
    spans_file = stack.spec.run_dir / SPANS
    items = len(MIXES["two_images"].media)
    # The services export their spans in batches (every 5 s), each in the order they ended: an
    # Encode server span after its stages. Wait for the Encode calls of all the request's items.
    deadline = time.monotonic() + 60
    while True:
        traces = by_trace(load_jsonl(spans_file)) if spans_file.exists() else {}
        trace = next((t for t in traces.values()
                      if any(s.attributes.get("epd.request_id") == "traced-two-images" for s in t)), [])  # fmt: skip
        encodes = [s for s in trace if s.name == "EncoderService/Encode"]
        calls = {s.span_id for s in encodes}
        prepared = sum(
            int(s.attributes["items"]) for s in trace if s.name == "encoder.preprocess" and s.parent_id in calls
        )
        if prepared >= items or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # polls the file the services append to
    assert prepared == items, f"{prepared} of the request's {items} items in encoder.preprocess spans"
    for server in encodes:
        children = {s.name: s for s in trace if s.parent_id == server.span_id}
        preprocess, compute = children["encoder.preprocess"], children["encoder.compute"]
        assert preprocess.attributes["epd.stage"] == "preprocess"
        assert preprocess.end_ns <= compute.start_ns
    _wait_empty(stack)


@pytest.mark.parametrize("mix", sorted(AGREEING_MIXES & set(MIXES)))
def test_tokens_equal_vllms_own_unsplit_run(
    stack: Stack,
    model: Path,
    vllm_unsplit: Callable[[Path, str], dict[str, list[int] | str]],
    mix: str,
) -> None:
    """vLLM alone, given the raw media (tests/support/vllm_unsplit.py), where its preprocessing is
    the project's: the same tokens."""
    result = call(stack.address, request(MIXES[mix]))
    assert result.token_ids == vllm_unsplit(model, FAMILY)[mix]


@pytest.mark.parametrize(
    ("image", "max_pixels"),
    [
        (IMAGE, None),  # already on the patch grid: no resize
        (synthetic.png_bytes(150, 97, seed=5), 2 * 56 * 56),  # resized under the request's pixel bound
    ],
    ids=["as-is", "resized-max-pixels"],
)
def test_embeddings_equal_the_reference_encoder(
    stack: Stack, model: Path, image: bytes, max_pixels: int | None
) -> None:
    reply = run(_encode_inline, _encoder(stack), media_pb2.MODALITY_IMAGE, image, max_pixels)
    (item,) = reply.items
    (tensor,) = item.embeddings.tensors
    got = torch.frombuffer(bytearray(tensor.inline_data), dtype=torch.float32).view(*tensor.spec.shape)
    options = eng.ProcessorOptions(max_pixels=max_pixels)
    (ref,) = EncoderRunner(model).encode([eng.MediaInput(eng.Modality.IMAGE, image, item_index=0, options=options)])
    assert item.layout == convert.item_layout_to_wire(ref.layout)  # the same layout metadata, field for field
    assert got.shape == ref.embeddings.shape
    assert torch.allclose(got, ref.embeddings, atol=ATOL, rtol=0), (got - ref.embeddings).abs().max().item()
    _wait_empty(stack)


def test_one_call_with_images_and_a_video_gives_each_item_its_own_embeddings(stack: Stack, model: Path) -> None:
    """The call's items go to vLLM as one request (libs/backends/vllm/encoder.py), the modalities
    interleaved: each item gets its own rows, in the call's order, equal to the reference encoder's
    for that item alone."""
    mix = MIXES["two_images"].media + MIXES["video"].media
    media = [media_pb2.MediaItem(modality=m, data=d) for m, d in (mix[0], mix[2], mix[1])]
    reply = run(_encode_items, _encoder(stack), media)
    assert len(reply.items) == 3
    for i, (item, sent) in enumerate(zip(reply.items, media, strict=True)):
        (tensor,) = item.embeddings.tensors
        got = torch.frombuffer(bytearray(tensor.inline_data), dtype=torch.float32).view(*tensor.spec.shape)
        (ref,) = EncoderRunner(model).encode([convert.media_input(sent, i, sent.data)])
        assert item.layout == convert.item_layout_to_wire(ref.layout), i
        assert got.shape == ref.embeddings.shape, i
        assert torch.allclose(got, ref.embeddings, atol=ATOL, rtol=0), (i, (got - ref.embeddings).abs().max().item())
    _wait_empty(stack)


def test_bad_media_is_invalid_argument_and_the_engine_lives(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        run(_encode_inline, _encoder(stack), media_pb2.MODALITY_IMAGE, b"\x89PNG not an image")
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].media" in (bad.value.details() or "")
    reply = run(_encode_inline, _encoder(stack), media_pb2.MODALITY_IMAGE, IMAGE)
    assert reply.items[0].layout.placeholder_token_count > 0
    _wait_empty(stack)


def test_service_info_advertises_engine_vllm_and_the_reference_specs(stack: Stack, model: Path) -> None:
    info = run(_info, _encoder(stack))
    assert engine_of(info) == "vllm"
    reference = EncoderRunner(model)
    want = {s.modality: s for s in (convert.embedding_spec_to_wire(spec) for spec in reference.specs.values())}
    got = {s.modality: s for s in info.embedding_specs}
    assert got == want


def _engine_fault(stack: Stack, expected: dict[str, list[int]], fault: str) -> None:
    """`fault` ("hang": the engine's processes stopped; "kill": its EngineCore SIGKILLed) while an
    Encode is queued: the call fails UNAVAILABLE with ENGINE_RESTARTING, health goes NOT_SERVING
    until the replacement serves, and the router's image request gives the same tokens after."""
    encoder = stack.processes["encoder-0"]

    async def scenario() -> grpc.aio.AioRpcError:
        with frozen_engine(encoder) as thaw:
            pending = asyncio.ensure_future(
                _encode_inline(encoder.address, media_pb2.MODALITY_IMAGE, synthetic.png_bytes(84, 56, seed=3))
            )
            await until_in_flight(encoder.address, 1)  # queued in the stopped engine: it cannot finish
            if fault == "kill":
                for core in [p for p in engine_processes(encoder) if "EngineCore" in p.name() + " ".join(p.cmdline())]:
                    core.send_signal(signal.SIGKILL)
                thaw()  # the rest of the engine sees its EngineCore gone
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await pending
        # Down once the supervisor saw the failure (a killed EngineCore may fail the call first),
        # while the replacement starts; then back.
        await until_health(encoder.address, NOT_SERVING, 60)
        await until_health(encoder.address, SERVING, 300)
        return failed.value

    error = run(scenario)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert reason_of(error) == Reason.ENGINE_RESTARTING, error.details()
    assert call(stack.address, request(MIXES["image"])).token_ids == expected["image"]
    # The failed Encode's slot stays quarantined for QUARANTINE_S after the failure (vLLM's worker
    # may still write it); an engine that restarts in less time is serving again before that.
    _wait_empty(stack, timeout_s=QUARANTINE_S + 20)
    log = encoder.log_tail(400)
    assert "vLLM engine restarted" in log, log


def test_a_hung_vllm_encoder_is_restarted(stack: Stack, expected: dict[str, list[int]]) -> None:
    _engine_fault(stack, expected, "hang")
    assert "hung: no progress for" in stack.processes["encoder-0"].log_tail(400)


def test_a_killed_vllm_encoder_is_restarted(stack: Stack, expected: dict[str, list[int]]) -> None:
    _engine_fault(stack, expected, "kill")
