"""The router's core: turns a client `GenerateRequest` into encoder jobs, a metadata-only prefill
request, and a token stream, with retries and lease clean-up. No sockets here: backends are the
generated gRPC stubs (or test doubles with the same methods), picked by `EncoderPool`.

Flow per request:
1. validate; assign a request id when the client gave none;
2. one `Encode` job per media item, on the encoder `EncoderPool` picks (the one already holding
   or encoding the item, else a load-bounded rendezvous choice); an item found in the shared store
   (`CacheLookup`) goes as a CACHED_ONLY job, so no encoder computes it. An encoder that fails with
   UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL is retried once on another encoder;
3. replace each `media` part by its `encoded` part, in place (the metadata-only request);
4. E/P/D: `Prefill` then `Decode`; E+PD: `PrefillDecode`. If prefill reports an embedding gone
   (NOT_FOUND / UNAVAILABLE) before any token was streamed, re-encode once and retry. If decode
   finds the KV gone before it streamed anything (its lease expired while decode restarted, or
   the slot was reclaimed), recompute once: encode, prefill again, and continue with decode when
   the recomputed first token is the one already streamed (greedy or seeded sampling);
5. whatever happens (error, cancel, deadline), release every lease the request still holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from opentelemetry import trace

from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    layout_pb2,
    lease_pb2,
    media_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    sampling_pb2,
    service_info_pb2,
    tensor_pb2,
)
from libs.contract.errors import DeadlineExceeded, EpdError, FailedPrecondition, InvalidArgument, Unavailable
from libs.contract.validation import Limits, validate_generate_request
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.retry import stopping
from libs.telemetry.stages import ATTRIBUTION, calls_under, phase, start_phase
from services.router.cache_lookup import CacheLookup, item_hash
from services.router.encoders import EncoderPool
from services.router.pool import MemberPool
from services.router.transcribe import speech_item, transcribe

_log = structlog.get_logger(__name__)

# Encoder failures worth another encoder; anything else (bad media) goes back to the client.
# CANCELLED: the encoder stopped before handling the job (libs/rpc/retry.py).
_RETRYABLE_ENCODE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}
# How long, at most, one call waits out a draining or stopping stage before giving up (seconds):
# a grace period plus a replacement's start-up.
_DRAIN_WAIT_S = 60.0
# Prefill failures meaning "an embedding is gone" (expired, encoder restarted or dead, slot reclaimed
# and reused): re-encode once before any token was streamed.
_EMBEDDING_GONE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
# Decode failures, before it streamed anything, meaning "the KV it was handed is gone" (lease
# expired, e.g. while the router waited out a decode restart; slot reclaimed): recompute once.
_KV_GONE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS}
# A prefill, decode or PD member's refusals before its first token that another member may not
# share (it drains, stopped, or cannot be reached): retried on another member while one is left.
_MEMBER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
# How long a member that refused so is passed over while another is left (seconds); a draining one
# until membership drops it (`MemberPool.draining`'s default).
_UNREACHABLE_AVOID_S = 5.0


class RpcFailed(EpdError):
    """A backend answered with a non-OK status; re-raised to the client with the same code."""

    def __init__(self, stage: str, code: grpc.StatusCode, details: str, kv_unread: bool = False) -> None:
        super().__init__(f"{stage}: {details}")
        self.code = code  # type: ignore[misc]  # instance-level code: mirrors the backend's status
        self.stage = stage
        self.kv_unread = kv_unread  # decode failed before streaming anything: the KV is unused


def _kv_lost(exc: RpcFailed) -> bool:
    return exc.stage == "decode" and exc.kv_unread and exc.code in _KV_GONE


@dataclass
class Backends:
    """How the router reaches each stage: address -> stub, for any member of that stage's pool.
    `lease(address)` reaches any producer's LeaseService."""

    encoder: Callable[[str], Any]  # address -> EncoderServiceStub
    lease: Callable[[str], Any]  # address -> LeaseServiceStub
    prefill: Callable[[str], Any] | None = None  # address -> PrefillServiceStub (E/P/D)
    decode: Callable[[str], Any] | None = None  # address -> DecodeServiceStub (E/P/D)
    prefill_decode: Callable[[str], Any] | None = None  # address -> PrefillDecodeServiceStub (E+PD)
    # First-contact check of an encoder (address, instance id or None); raises FailedPrecondition.
    check_encoder: Callable[[str, str | None], Awaitable[None]] | None = None
    # First-contact check of the prefill/decode (or PD) side as a whole; raises FailedPrecondition.
    check_backends: Callable[[], Awaitable[object]] | None = None
    # First-contact check of one prefill (or PD) member, and of one decode member for the KV of a
    # given prefill (decode address, prefill address); raise FailedPrecondition.
    check_prefill: Callable[[str], Awaitable[None]] | None = None
    check_decode: Callable[[str, str], Awaitable[None]] | None = None
    # Whether the peer at an address advertises a capability (features are negotiated this way).
    honors: Callable[[str, str], bool] | None = None
    # The (checked) encoder's cache, as advertised in its ServiceInfo; None when it keeps none.
    encoder_cache: Callable[[str], service_info_pb2.EncoderCacheInfo | None] = lambda address: None

    def priority_for(self, address: str, priority: int) -> int:
        """The request's priority for a peer that honors it (contract 1.1), else the default."""
        return priority if self.honors is not None and self.honors(address, ADMISSION_PRIORITY) else 0


@dataclass
class Stages:
    """The members of the prefill, decode and PD stages (services/router/pool.py); a stage whose
    stub is not in `Backends` has none."""

    prefill: MemberPool | None = None
    decode: MemberPool | None = None
    pd: MemberPool | None = None

    @classmethod
    def single(cls, backends: Backends) -> Stages:
        """One member per stage the backends reach, named after the stage (tests)."""

        def one(stage: str, stub: object) -> MemberPool | None:
            return None if stub is None else MemberPool([stage], stage=stage)

        return cls(one("prefill", backends.prefill), one("decode", backends.decode), one("pd", backends.prefill_decode))


@dataclass
class RequestState:
    """What one request holds: leases to release, whether tokens were streamed."""

    request_id: str
    priority: int = 0
    leases: dict[str, set[str]] = field(default_factory=dict)  # producer address -> lease ids
    streamed: bool = False

    def hold(self, handle: tensor_pb2.TensorHandle) -> None:
        self.leases.setdefault(handle.agent.producer_address, set()).add(handle.lease_id)


# Backend calls get the request's deadline less this margin: when a stage is down (calls wait for
# its replacement) or slow, the router still answers, with a status naming the stage, before the
# client's own deadline passes - the client never waits for an answer that cannot come.
_ANSWER_MARGIN_S = 0.5


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic() - _ANSWER_MARGIN_S
    if left <= 0:
        raise DeadlineExceeded("request deadline passed in the router")
    return left


class DrainWait:
    """Waiting out a stage that refused a call because it is draining for a restart or stopping
    (`libs.rpc.retry.stopping`): pause (the replacement comes up; calls use wait_for_ready) and try
    again, within the request's deadline and `_DRAIN_WAIT_S`."""

    def __init__(self, deadline: float | None, pause_s: float = 0.1) -> None:
        self._deadline = deadline
        self._pause_s = pause_s
        self._give_up = time.monotonic() + _DRAIN_WAIT_S

    async def again(self, exc: grpc.aio.AioRpcError) -> bool:
        """Whether to retry the call that failed with `exc` (after the pause)."""
        if not stopping(exc.code(), exc.details()):
            return False
        return await self.pause()

    async def pause(self) -> bool:
        """Pause, when the deadlines leave time for another try after it; whether it paused."""
        end = self._give_up if self._deadline is None else min(self._give_up, self._deadline - _ANSWER_MARGIN_S)
        if end - time.monotonic() <= self._pause_s:
            return False
        await asyncio.sleep(self._pause_s)
        return True


class Attempts:
    """The members of one stage that one call tries, in order: the least loaded member (round robin
    on ties) that passes its first-contact check; after a refusal before the first token
    (UNAVAILABLE, or CANCELLED by a stopping member), another member not tried yet; when none is
    left, the drain wait (`DrainWait`) for a stage that is draining or stopping. With one member
    this is the drain wait alone, and calls wait for a restarting member (`wait_for_ready`); with
    several, a member that cannot be reached fails fast and the next one is tried."""

    def __init__(
        self, pool: MemberPool, check: Callable[[str], Awaitable[None]] | None, deadline: float | None
    ) -> None:
        self.pool = pool
        self._check = check
        self._drain = DrainWait(deadline)
        self._tried: set[str] = set()

    @property
    def wait_for_ready(self) -> bool:
        return self.pool.size <= 1

    async def next(self) -> str:
        """The member for the next try (checked); raises when no compatible member is left. A stage
        with no member now (a discovered pool between its last pod leaving and the next ready one)
        is waited for, within the drain wait."""
        while not self.pool.size and await self._drain.pause():
            pass
        while True:
            address = self.pool.pick(exclude=self._tried)
            self._tried.add(address)
            if self._check is None:
                return address
            try:
                await self._check(address)
                return address
            except (FailedPrecondition, Unavailable) as exc:
                if not self.pool.untried(self._tried):
                    raise
                _log.warning(f"{self.pool.stage} not usable; trying another", member=address, error=str(exc)[:200])

    async def again(self, address: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether to try again after `address` refused the call with `exc` before its first token."""
        if stopping(exc.code(), exc.details()):
            self.pool.draining(address)  # leaving: other members take its work
        if exc.code() in _MEMBER_GONE and self.pool.untried(self._tried):
            # Unreachable (exited, not yet out of the members) fails fast, so it would look the
            # least loaded and draw every pick: avoid it a while too.
            self.pool.draining(address, for_s=_UNREACHABLE_AVOID_S)
            _log.warning(f"{self.pool.stage} refused; trying another", member=address, code=exc.code().name)
            return True
        if await self._drain.again(exc):
            self._tried.clear()  # every member we may try is draining or stopping: wait for one
            return True
        return False


def _rpc_error(stage: str, exc: grpc.aio.AioRpcError) -> RpcFailed:
    return RpcFailed(stage, exc.code(), exc.details() or exc.code().name)


class Router:
    """Serves `Generate` over an encoder pool and pools of prefill and decode (or PD) members."""

    def __init__(
        self,
        backends: Backends,
        encoders: EncoderPool,
        limits: Limits | None = None,
        cache: CacheLookup | None = None,
        forward_media: bool = False,
        stages: Stages | None = None,
    ) -> None:
        if backends.prefill_decode is None and (backends.prefill is None or backends.decode is None):
            raise ValueError("need prefill and decode stubs (E/P/D) or a prefill-decode stub (E+PD)")
        self._backends = backends
        self._stages = stages or Stages.single(backends)
        self._encoders = encoders
        self._limits = limits or Limits()
        self._cache = cache or CacheLookup(None)
        # P4 benchmark baseline only: raw media after each encoded part (libs/serving/raw_media.py).
        self._forward_media = forward_media

    async def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None = None
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Stream the reply to `request`; `deadline` is a `time.monotonic()` instant."""
        validate_generate_request(request, self._limits)
        state = RequestState(request.request_id or uuid.uuid4().hex, request.priority)
        root = trace.get_current_span()  # the server span of this Generate call
        root.set_attributes(
            {
                ATTRIBUTION: "router",  # its own time, outside calls and stages: router bookkeeping
                "epd.request_id": state.request_id,
                "gen_ai.operation.name": "chat",
                "gen_ai.request.max_tokens": request.sampling.max_tokens,
                "gen_ai.request.temperature": request.sampling.temperature,
            }
        )
        started_ns = getattr(root, "start_time", None) or time.time_ns()
        first_token = True
        try:
            async for chunk, usage in self._run(request, state, deadline):
                if chunk.token_ids and first_token:
                    root.set_attribute("epd.ttft_s", (time.time_ns() - started_ns) / 1e9)
                    first_token = False
                state.streamed = True
                response = generate_pb2.GenerateResponse(request_id=state.request_id, chunk=chunk)
                if usage is not None:
                    response.usage.CopyFrom(usage)
                    root.set_attributes(
                        {
                            "gen_ai.usage.input_tokens": usage.prompt_tokens,
                            "gen_ai.usage.output_tokens": usage.completion_tokens,
                        }
                    )
                yield response
        finally:
            # Normal completion leaves nothing (consumers acked); failure and cancel may.
            await asyncio.shield(self._release_all(state))

    async def _run(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> AsyncIterator[tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]]:
        backend = await self._backends.check_backends() if self._backends.check_backends is not None else None
        audio = speech_item(request)
        if (
            audio is not None
            and isinstance(backend, service_info_pb2.ServiceInfo)
            and backend.HasField("transcription")
        ):
            async for reply in transcribe(self, request, audio, backend.transcription, state, deadline):
                yield reply
            return
        reencoded = recomputed = False
        first: generation_pb2.TokenChunk | None = None  # prefill's chunk, once streamed
        while True:
            messages = await self._encode_all(request, state, deadline)
            replay = first  # after a recompute: prefill's chunk again, already streamed
            try:
                async for chunk, usage in self._prefill_and_decode(messages, request, state, deadline):
                    if replay is not None:
                        if list(chunk.token_ids) != list(replay.token_ids):
                            raise RpcFailed(
                                "decode",
                                grpc.StatusCode.DATA_LOSS,
                                "the KV was lost and the recomputed first token differs from the one streamed "
                                "(sampling without a seed)",
                            )
                        replay = None
                        continue
                    if first is None:
                        first = chunk
                    yield chunk, usage
                return
            except RpcFailed as exc:
                if not reencoded and exc.stage == "prefill" and exc.code in _EMBEDDING_GONE and not state.streamed:
                    _log.warning("embedding gone before prefill; re-encoding", request_id=state.request_id)
                    reencoded = True
                elif not recomputed and _kv_lost(exc):
                    _log.warning("KV gone before decode read it; recomputing", request_id=state.request_id)
                    recomputed = True
                else:
                    raise
                await self._release_all(state)

    async def _encode_all(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> list[chat_pb2.ChatMessage]:
        messages = [chat_pb2.ChatMessage() for _ in request.messages]
        jobs: list[tuple[chat_pb2.ContentPart, Any]] = []
        index = 0
        for src, dst in zip(request.messages, messages, strict=True):
            dst.role = src.role
            for part in src.parts:
                out = dst.parts.add()
                if part.WhichOneof("kind") == "media":
                    jobs.append((out, self._encode_one(state, index, part, deadline)))
                    index += 1
                else:
                    out.CopyFrom(part)
        if jobs:
            with phase("epd.encode", **{"epd.items": len(jobs)}):
                results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
            for item in results:
                if isinstance(item, layout_pb2.EncodedMedia):
                    state.hold(item.embeddings)
            for item in results:
                if isinstance(item, BaseException):
                    raise item
            for (out, _), item in zip(jobs, results, strict=True):
                assert isinstance(item, layout_pb2.EncodedMedia)
                out.encoded.CopyFrom(item)
        if self._forward_media:
            self._append_raw_media(request, messages)
        return messages

    @staticmethod
    def _append_raw_media(request: generate_pb2.GenerateRequest, messages: list[chat_pb2.ChatMessage]) -> None:
        for src, dst in zip(request.messages, messages, strict=True):
            rebuilt = chat_pb2.ChatMessage(role=dst.role)
            for original, part in zip(src.parts, dst.parts, strict=True):
                rebuilt.parts.add().CopyFrom(part)
                if original.WhichOneof("kind") == "media":
                    rebuilt.parts.add().media.CopyFrom(original.media)
            dst.CopyFrom(rebuilt)

    async def _encode_one(
        self, state: RequestState, index: int, part: chat_pb2.ContentPart, deadline: float | None
    ) -> layout_pb2.EncodedMedia:
        job = encoder_pb2.EncodeRequest(
            request_id=state.request_id, accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL]
        )
        # CopyFrom into the added item, not `EncodeItem(media=...)` in the constructor: upb copies
        # 0.5 MB of media in 0.015 ms this way and in 0.44 ms that way.
        job.items.add(item_index=index).media.CopyFrom(part.media)
        priority = state.priority
        # The content hash serves the shared-store lookup and placement among encoders: with
        # neither, hashing (~3 ms per 0.5 MB image here) is pure router overhead.
        needed = self._cache.store is not None or self._encoders.size > 1
        key = await item_hash(part.media, self._limits.max_inline_media_bytes) if needed else None
        tried: set[str] = set()
        compute = False  # an encoder had no entry for a CACHED_ONLY job: compute from then on
        check = self._backends.check_encoder
        drain = DrainWait(deadline)

        def once_more_elsewhere() -> bool:
            # One retry on a member not tried: counted among the members *now*, since the one
            # that failed may have left them meanwhile (drained, exited, dropped from the list).
            return len(tried) < 2 and self._encoders.untried(tried)

        while True:
            address = self._encoders.pick(exclude=tried, key=key)
            tried.add(address)
            if key is not None:
                self._encoders.remember(key, address)  # concurrent requests for the item follow it here
            self._encoders.begin(address)
            try:
                with phase(
                    "epd.encode.item",
                    **{
                        ATTRIBUTION: "rpc",
                        "epd.item_index": index,
                        "epd.modality": media_pb2.Modality.Name(part.media.modality),
                        "epd.encoder": address,
                    },
                ) as span:
                    if check is not None:
                        await check(address, None)
                    job.priority = self._backends.priority_for(address, priority)
                    job.cache_policy = encoder_pb2.CACHE_POLICY_UNSPECIFIED
                    if not compute and await self._in_shared_store(address, key):
                        job.cache_policy = encoder_pb2.CACHE_POLICY_CACHED_ONLY
                    span.set_attribute("epd.cache.policy", encoder_pb2.CachePolicy.Name(job.cache_policy))
                    reply = await self._backends.encoder(address).Encode(job, timeout=_remaining(deadline))
            except FailedPrecondition:
                if self._encoders.untried(tried):
                    continue  # an incompatible encoder: try a compatible one
                raise
            except Unavailable:
                if once_more_elsewhere():
                    continue  # unreachable at first contact: one retry elsewhere, as for Encode
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and job.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY:
                    # Evicted, rejected as invalid or unreachable since our lookup: the same encoder
                    # computes it (its single-flight still joins concurrent requests).
                    _log.info("cached item gone before its load; computing", encoder=address)
                    compute = True
                    tried.discard(address)
                    continue
                if stopping(exc.code(), exc.details()):
                    self._encoders.draining(address)  # leaving: other encoders take its work
                if exc.code() in _RETRYABLE_ENCODE and once_more_elsewhere():
                    _log.warning("encoder failed; retrying elsewhere", encoder=address, code=exc.code().name)
                    continue
                if await drain.again(exc):
                    # Every encoder we may try is draining or stopping (a rolling restart): wait
                    # for one to take work again.
                    tried.clear()
                    continue
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # The encoder names the field within its own request: items[0].media.X.
                    details = exc.details() or ""
                    raise InvalidArgument(f"media item {index}", details) from None
                raise _rpc_error("encode", exc) from None
            finally:
                self._encoders.end(address)
            if len(reply.items) != 1 or reply.items[0].layout.item_index != index:
                raise RpcFailed("encode", grpc.StatusCode.INTERNAL, f"encoder {address} answered for other items")
            encoded: layout_pb2.EncodedMedia = reply.items[0]
            if check is not None and encoded.embeddings.agent.instance_id:
                try:  # the encoder may have restarted since we checked it
                    await check(address, encoded.embeddings.agent.instance_id)
                except FailedPrecondition:
                    await self._release_one(address, encoded.embeddings.lease_id)
                    raise
                except Unavailable:
                    # Gone since it answered (killed, restarting): the embedding went with it, so
                    # this is an encode that failed, retried elsewhere like one.
                    await self._release_one(address, encoded.embeddings.lease_id)
                    if once_more_elsewhere():
                        _log.warning("encoder gone after answering; encoding elsewhere", encoder=address)
                        continue
                    raise
            return encoded

    async def warm_up(self, addresses: Sequence[str], image: bytes, timeout_s: float = 30.0) -> int:
        """One tiny image request per encoder in `addresses`, through prefill and decode (E/P/D) or
        PD, outside any client trace (services/router/warmup.py), and as many more (encoders in
        turn) as every prefill, decode or PD member needs to see one (the pools pick each member in
        turn); returns the requests that succeeded."""
        warmed = 0
        media = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=image)
        stages = [p.size for p in (self._stages.prefill, self._stages.decode, self._stages.pd) if p is not None]
        rounds = max([len(addresses), *stages]) if addresses else 0
        for address in (addresses[i % len(addresses)] for i in range(rounds)):
            state = RequestState(f"warm-up-{uuid.uuid4().hex[:8]}")
            deadline = time.monotonic() + timeout_s
            try:
                with phase("router.warm_up", **{"epd.encoder": address}):
                    if self._backends.check_backends is not None:
                        await self._backends.check_backends()
                    if self._backends.check_encoder is not None:
                        await self._backends.check_encoder(address, None)
                    job = encoder_pb2.EncodeRequest(
                        request_id=state.request_id,
                        items=[encoder_pb2.EncodeItem(item_index=0, media=media)],
                        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                    )
                    reply = await self._backends.encoder(address).Encode(job, timeout=_remaining(deadline))
                    state.hold(reply.items[0].embeddings)
                    parts = [chat_pb2.ContentPart(encoded=reply.items[0]), chat_pb2.ContentPart(text="warm-up")]
                    request = generate_pb2.GenerateRequest(
                        request_id=state.request_id,
                        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
                        sampling=sampling_pb2.SamplingParams(max_tokens=2),
                    )
                    async for _ in self._prefill_and_decode(list(request.messages), request, state, deadline):
                        pass
                warmed += 1
            except (EpdError, grpc.aio.AioRpcError, IndexError) as exc:
                _log.warning("warm-up failed; first contact waits for traffic", encoder=address, error=str(exc)[:200])
            finally:
                await self._release_all(state)
        return warmed

    async def _in_shared_store(self, address: str, key: str | None) -> bool:
        """Whether the item is in the shared store of an encoder that can serve it from there."""
        if key is None:
            return False
        info = self._backends.encoder_cache(address)
        if info is None or not info.shared_store:
            return False
        return await self._cache.cached(f"{info.key_prefix}/{key}")

    async def _prefill_and_decode(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
    ) -> AsyncIterator[tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]]:
        b = self._backends
        if b.prefill_decode is not None:
            pd_pool = self._stages.pd
            assert pd_pool is not None
            pd_request = prefill_decode_pb2.PrefillDecodeRequest(
                request_id=state.request_id, messages=messages, sampling=request.sampling
            )
            span = start_phase("epd.prefill_decode", **{ATTRIBUTION: "rpc"})
            pd_call = None
            pd_attempts = Attempts(pd_pool, b.check_prefill, deadline)
            try:
                while True:
                    address = await pd_attempts.next()
                    pd_request.priority = b.priority_for(address, request.priority)
                    pd_pool.begin(address)
                    try:
                        with calls_under(span):
                            pd_call = b.prefill_decode(address).PrefillDecode(
                                pd_request, timeout=_remaining(deadline), wait_for_ready=pd_attempts.wait_for_ready
                            )
                        try:
                            async for reply in pd_call:
                                state.leases.clear()  # PD read and acked the embeddings once it streams
                                state.streamed = True
                                yield reply.chunk, (reply.usage if reply.HasField("usage") else None)
                            break
                        except grpc.aio.AioRpcError as exc:
                            # Refused before its first token: the embeddings are still held.
                            if state.streamed or not await pd_attempts.again(address, exc):
                                raise
                    finally:
                        pd_pool.end(address)
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error("prefill" if not state.streamed else "decode", exc) from None
            finally:
                if pd_call is not None:
                    # Our consumer went away (client cancel): this generator is closed at its yield,
                    # where nothing cancels the call; PD would generate on to max_tokens.
                    pd_call.cancel()
                span.end()
            return

        prefill_pool, decode_pool = self._stages.prefill, self._stages.decode
        assert b.prefill is not None and b.decode is not None and prefill_pool is not None and decode_pool is not None
        prefill_request = prefill_pb2.PrefillRequest(
            request_id=state.request_id,
            messages=messages,
            sampling=request.sampling,
            accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
        )
        attempts = Attempts(prefill_pool, b.check_prefill, deadline)
        try:
            with phase("epd.prefill", **{ATTRIBUTION: "rpc"}) as prefill_span:
                while True:
                    prefill_address = await attempts.next()
                    prefill_span.set_attribute("epd.prefill", prefill_address)
                    prefill_request.priority = b.priority_for(prefill_address, request.priority)
                    prefill_pool.begin(prefill_address)
                    try:
                        first = await b.prefill(prefill_address).Prefill(
                            prefill_request, timeout=_remaining(deadline), wait_for_ready=attempts.wait_for_ready
                        )
                        break
                    except grpc.aio.AioRpcError as exc:
                        if not await attempts.again(prefill_address, exc):
                            raise
                    finally:
                        prefill_pool.end(prefill_address)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("prefill", exc) from None
        state.leases.clear()  # prefill acked every embedding it read
        if not first.HasField("kv_cache"):  # finished at the first token
            usage = generation_pb2.Usage(prompt_tokens=first.decode_state.prompt_tokens, completion_tokens=1)
            yield first.first_chunk, usage
            return
        if first.kv_cache.HasField("paged"):  # contract 1.3: the KV stays in prefill's engine, a lease of its own
            paged = first.kv_cache.paged
            state.leases.setdefault(paged.producer_address, set()).add(paged.lease_id)
        else:
            state.hold(first.kv_cache.handle)  # held at the prefill that produced it (the handle names it)
        yield first.first_chunk, None
        decode_request = decode_pb2.DecodeRequest(
            request_id=state.request_id,
            kv_cache=first.kv_cache,
            decode_state=first.decode_state,
            sampling=request.sampling,
        )
        span = start_phase("epd.decode", **{ATTRIBUTION: "rpc"})
        replies = 0
        check_decode = b.check_decode
        attempts = Attempts(
            decode_pool,
            None if check_decode is None else lambda address: check_decode(address, prefill_address),
            deadline,
        )
        call = None
        try:
            while True:
                address = await attempts.next()
                span.set_attribute("epd.decode", address)
                decode_request.priority = b.priority_for(address, request.priority)
                decode_pool.begin(address)
                try:
                    with calls_under(span):
                        call = b.decode(address).Decode(
                            decode_request, timeout=_remaining(deadline), wait_for_ready=attempts.wait_for_ready
                        )
                    try:
                        async for reply in call:
                            replies += 1
                            state.leases.clear()  # decode acked the KV before streaming
                            yield reply.chunk, (reply.usage if reply.HasField("usage") else None)
                        break
                    except grpc.aio.AioRpcError as exc:
                        # A decode that refused us before reading anything: the KV is still held,
                        # and any other decode can read it.
                        if replies or not await attempts.again(address, exc):
                            raise
                finally:
                    decode_pool.end(address)
        except grpc.aio.AioRpcError as exc:
            raise RpcFailed("decode", exc.code(), exc.details() or exc.code().name, kv_unread=not replies) from None
        finally:
            if call is not None:
                call.cancel()  # as for PD: a consumer gone mid-stream must stop decode (no-op when done)
            span.end()

    # ---- what a transcription (services/router/transcribe.py) runs per window ----
    async def encode_item(
        self, state: RequestState, part: chat_pb2.ContentPart, deadline: float | None
    ) -> layout_pb2.EncodedMedia:
        """Encode one media part (item 0 of its request), its embedding held by `state`."""
        with phase("epd.encode", **{"epd.items": 1}):
            encoded = await self._encode_one(state, 0, part, deadline)
        state.hold(encoded.embeddings)
        return encoded

    def prefill_and_decode(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> AsyncIterator[tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]]:
        """Prefill and decode a request whose media parts are all encoded."""
        return self._prefill_and_decode(list(request.messages), request, state, deadline)

    @staticmethod
    def embedding_gone(exc: BaseException) -> bool:
        """Whether prefill failed because an embedding it should read was gone (encode again)."""
        return isinstance(exc, RpcFailed) and exc.stage == "prefill" and exc.code in _EMBEDDING_GONE

    async def release_all(self, state: RequestState) -> None:
        await self._release_all(state)

    async def _release_one(self, address: str, lease_id: str) -> None:
        held = RequestState("")
        held.leases[address] = {lease_id}
        await self._release_all(held)

    async def _release_all(self, state: RequestState) -> None:
        held, state.leases = state.leases, {}
        for address, lease_ids in held.items():
            try:
                await self._backends.lease(address).ReleaseLeases(
                    lease_pb2.ReleaseLeasesRequest(
                        lease_ids=sorted(lease_ids), reason=lease_pb2.RELEASE_REASON_ABANDONED
                    ),
                    timeout=2.0,
                )
            except grpc.aio.AioRpcError as exc:
                # The producer is gone (its memory with it) or will reclaim on lease expiry.
                _log.warning("lease release failed", producer=address, code=exc.code().name)
