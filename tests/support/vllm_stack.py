"""Shared parts of the vLLM engine tests: request mixes, the reference runtime's tokens for them,
and calls through a running stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import (
    decode_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    generate_pb2_grpc,
    layout_pb2,
    lease_pb2,
    lease_pb2_grpc,
    media_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
    stats_pb2,
    stats_pb2_grpc,
    tensor_pb2,
)
from libs.launch.process import ServiceProcess
from libs.model import types as eng
from libs.model.media import synthetic
from libs.rpc.server import open_channel as service_channel
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner

TOKENS = 8
# vLLM's step budget (--max-num-batched-tokens) of the stacks' prefilling engines: below every
# multimodal prompt of the tests, so vLLM prefills each in chunks, a lone request too.
CHUNKED_PREFILL_TOKENS = 32
PROMPT = "Describe what you see and hear."


@dataclass(frozen=True)
class Mix:
    name: str
    media: tuple[tuple[media_pb2.Modality.ValueType, bytes], ...]
    video_fps: float | None = None  # the items' processor option (unset: the checkpoint's 2 fps)


def mixes(family: str) -> list[Mix]:
    image = (media_pb2.MODALITY_IMAGE, synthetic.png_bytes(112, 84, seed=1))
    other = (media_pb2.MODALITY_IMAGE, synthetic.png_bytes(56, 84, seed=2))
    video = (media_pb2.MODALITY_VIDEO, synthetic.video_bytes(112, 84, frames=8, fps=4, seed=3))
    audio = (media_pb2.MODALITY_AUDIO, synthetic.wav_bytes(2.0, seed=4))
    out = [Mix("text", ()), Mix("image", (image,)), Mix("two_images", (image, other)), Mix("video", (video,))]
    # Sampled at 4 fps, a temporal patch spans 0.5 s, not the 1.0 s vLLM assumes without the
    # layout's `seconds_per_grid` (Qwen2.5-VL and Omni M-RoPE; Qwen3-VL: its timestamps).
    out.append(Mix("video_4fps", (video,), video_fps=4.0))
    if family == "qwen2_5_omni":
        out.append(Mix("audio", (audio,)))
    return out


def request(mix: Mix, *, max_tokens: int = TOKENS, request_id: str = "") -> object:
    items = [media_pb2.MediaItem(modality=modality, data=data) for modality, data in mix.media]
    if mix.video_fps is not None:
        for item in items:
            item.processor_options.video_fps = mix.video_fps
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens)
    return build_request(PROMPT, items, sampling=sampling, request_id=request_id)


def reference_tokens(model: Path, mix: Mix, max_tokens: int = TOKENS) -> list[int]:
    """The reference runtime's greedy tokens for `mix` (staged, in this process)."""
    tokens, _ = reference_result(model, mix, eng.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return tokens


def reference_result(model: Path, mix: Mix, sampling: eng.SamplingParams) -> tuple[list[int], list[eng.TokenLogprobs]]:
    """The reference runtime's tokens for `mix` under `sampling` (staged: prefill, then decode from
    its KV, in this process), with their log-probabilities when `sampling` asks for them."""
    encoder = EncoderRunner(model)
    runtime = LanguageModelRuntime(model)
    modality = {media_pb2.MODALITY_IMAGE: eng.Modality.IMAGE, media_pb2.MODALITY_VIDEO: eng.Modality.VIDEO,
                media_pb2.MODALITY_AUDIO: eng.Modality.AUDIO}  # fmt: skip
    options = eng.ProcessorOptions(video_fps=mix.video_fps)
    media = [eng.MediaInput(modality[m], data, item_index=i, options=options) for i, (m, data) in enumerate(mix.media)]
    items = encoder.encode(media) if media else []
    parts = (*(eng.EncodedPart(item) for item in items), eng.TextPart(PROMPT))
    result = PrefillRunner(runtime).prefill([eng.ChatMessage(eng.ChatRole.USER, parts)], sampling)
    tokens = list(result.first_chunk.token_ids)
    logprobs = list(result.first_chunk.logprobs or ())
    if result.kv_cache is not None:
        decode = DecodeRunner(runtime, max_batch=1)
        decode.add("r", result.kv_cache, result.decode_state, sampling)
        while decode.active_ids:
            for chunk, _ in decode.step().values():
                tokens += chunk.token_ids
                logprobs += chunk.logprobs or ()
    return tokens, logprobs


def call(address: str, req: object, timeout_s: float = 120.0) -> GenerationResult:
    async def run() -> GenerationResult:
        async with open_channel(address) as channel:
            return await generate(channel, req, timeout_s=timeout_s)  # type: ignore[arg-type]

    return asyncio.run(run())


def sampled_tokens(address: str, mix: Mix, seed: int | None) -> list[int]:
    """`mix` sampled at temperature 1 (with `seed`, or none: a P/D split seeds it from the request
    id), its tokens. Past the end-of-sequence token: an unseeded draw may sample it early, and
    every answer is then as long as asked."""
    req: Any = request(mix)
    req.sampling.temperature = 1.0
    req.sampling.ignore_eos = True
    if seed is not None:
        req.sampling.seed = seed
    result = call(address, req)
    assert len(result.token_ids) == TOKENS
    return list(result.token_ids)


def run(coro_fn: Callable[..., Any], *args: Any) -> Any:
    return asyncio.run(coro_fn(*args))


async def cancel_after_chunks(router: str, req: object, chunks: int) -> int:
    """Stream `req` through the router and cancel once `chunks` chunks arrived; how many did."""
    async with open_channel(router) as channel:
        stream = generate_pb2_grpc.GenerateServiceStub(channel).Generate(req, timeout=120)
        received = 0
        async for _ in stream:
            received += 1
            if received == chunks:
                stream.cancel()
                break
        return received


async def encode_image(address: str, data: bytes) -> layout_pb2.EncodedMedia:
    """One image encoded directly by an encoder (the caller holds its lease)."""
    async with service_channel(address) as channel:
        reply = await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
            encoder_pb2.EncodeRequest(
                request_id="direct",
                items=[
                    encoder_pb2.EncodeItem(
                        item_index=0, media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data)
                    )
                ],
                accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
            ),
            timeout=60,
        )
    encoded: layout_pb2.EncodedMedia = reply.items[0]
    return encoded


async def call_prefill(address: str, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
    """One Prefill call straight to a prefill service (E/P/D on vLLM)."""
    async with open_channel(address) as channel:
        reply: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
            req, timeout=120
        )
        return reply


def handoff(req: prefill_pb2.PrefillRequest, first: prefill_pb2.PrefillResponse) -> decode_pb2.DecodeRequest:
    """The Decode request continuing `req` from prefill's answer (its KV handoff and state)."""
    return decode_pb2.DecodeRequest(
        request_id=req.request_id, kv_cache=first.kv_cache, decode_state=first.decode_state, sampling=req.sampling
    )


async def release(address: str, lease_ids: list[str]) -> int:
    async with service_channel(address) as channel:
        reply = await lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(
            lease_pb2.ReleaseLeasesRequest(lease_ids=lease_ids, reason=lease_pb2.RELEASE_REASON_ABANDONED), timeout=10
        )
        return int(reply.released_count)


async def stats(address: str) -> stats_pb2.GetStatsResponse:
    async with service_channel(address) as channel:
        reply: stats_pb2.GetStatsResponse = await stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=10
        )
        return reply


async def health(address: str) -> int:
    async with service_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(reply.status)


class TokenStream:
    """A streaming call's tokens as they arrive (Generate, PrefillDecode and Decode replies all
    carry a `chunk`); `first` is set at the first token."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.tokens: list[int] = []
        self.finish_reason = 0
        self.first = asyncio.Event()

    async def run(self) -> list[int]:
        async for reply in self.call:
            self.tokens += reply.chunk.token_ids
            self.finish_reason = reply.chunk.finish_reason or self.finish_reason
            if self.tokens:
                self.first.set()
        return self.tokens


async def until_health(address: str, status: int, timeout_s: float) -> list[int]:
    """Poll health until `status` (bounded); every distinct status seen, in order."""
    seen: list[int] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            now = await health(address)
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"{address} stopped answering health: {exc.code().name}") from None
        if not seen or seen[-1] != now:
            seen.append(now)
        if now == status:
            return seen
        assert asyncio.get_running_loop().time() < deadline, f"{address}: health {seen}, never {status}"
        await asyncio.sleep(0.05)


async def until_draining(address: str, timeout_s: float = 30.0) -> None:
    """Until the service's health is NOT_SERVING: it got its signal and drains (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            if await health(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
        except grpc.aio.AioRpcError as exc:  # stopped already: it had nothing left to wait for
            raise AssertionError(f"{address} stopped instead of draining: {exc.code().name}") from None
        assert asyncio.get_running_loop().time() < deadline, f"{address} never started draining"
        await asyncio.sleep(0.05)


async def probe_until_refused(probe: Callable[[], Awaitable[Any]], attempts: int = 100) -> list[str]:
    """Call `probe` until it fails; every outcome ("OK" or "CODE: details"). A service that got
    its signal refuses within moments, so a few calls are enough (bounded)."""
    outcomes: list[str] = []
    for _ in range(attempts):
        try:
            await probe()
            outcomes.append("OK")
        except grpc.aio.AioRpcError as exc:
            outcomes.append(f"{exc.code().name}: {exc.details()}")
            break
        await asyncio.sleep(0.02)
    return outcomes


def stage_kinds(metrics: str) -> set[str]:
    """The `epd.stage` values the stage histogram has samples for."""
    return {line.split('epd_stage="')[1].split('"')[0] for line in metrics.splitlines() if 'epd_stage="' in line}


def engine_processes(service: ServiceProcess) -> list[psutil.Process]:
    """The vLLM engine's processes under a service: its EngineCore processes and their children."""
    children = psutil.Process(service.pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert cores, f"no EngineCore process under {service.name}"
    return [*cores, *(child for core in cores for child in core.children(recursive=True))]


def _stopped(pid: int) -> bool:
    """Every thread of `pid` stopped (SIGSTOP is delivered to each thread in its own time)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        except FileNotFoundError:
            pass  # the thread exited
    return True


@contextlib.contextmanager
def frozen_engine(service: ServiceProcess) -> Iterator[Callable[[], None]]:
    """The service's vLLM engine stopped (SIGSTOP) while the service itself runs on: it admits,
    answers health and stats, drains, but no request it admitted can advance, let alone finish,
    until the engine is thawed (the callable given, or leaving the block): a request in flight
    stays in flight for as long as the test needs, however fast the host."""
    with frozen(engine_processes(service), service.name) as thaw:
        yield thaw


@contextlib.contextmanager
def frozen(processes: list[psutil.Process], name: str) -> Iterator[Callable[[], None]]:
    """`processes` stopped (SIGSTOP, every thread), until thawed (the callable given, or leaving
    the block)."""
    for process in processes:
        process.suspend()
    deadline = time.monotonic() + 30
    while not all(_stopped(p.pid) for p in processes):
        assert time.monotonic() < deadline, f"{name}: did not stop"
        time.sleep(0.001)
    thawed = False

    def thaw() -> None:
        nonlocal thawed
        if not thawed:
            thawed = True
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.resume()

    try:
        yield thaw
    finally:
        thaw()


async def until_in_flight(address: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the service reports `count` requests in flight (GetStats: admitted, running or
    waiting), bounded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (got := (await stats(address)).requests_in_flight) != count:
        assert asyncio.get_running_loop().time() < deadline, f"{address}: {got} requests in flight, never {count}"
        await asyncio.sleep(0.01)
