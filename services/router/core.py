"""The router's orchestration: a client `GenerateRequest` -> encoder jobs -> a metadata-only
prefill request -> a token stream, with recovery and lease clean-up. No sockets here: the stage
stubs (services/router/stubs.py) are the generated gRPC stubs (or test doubles with the same methods).

Flow per request, and where each part lives:
1. validate; assign a request id when the client gave none;
2. a transcription (one audio item, to a stack whose prefill advertises a `TranscriptionSpec`)
   goes window by window (services/router/transcribe.py); anything else:
3. each media item placed on an encoder, the items placed on one encoder in one `Encode` call (one
   per item with a shared store), run by `EncodeDispatch` (services/router/dispatch.py), and each
   `media` part replaced by its `encoded` part;
4. `Prefill` then `Decode` (E/P/D) or `PrefillDecode` (E+PD), by the stage clients
   (services/router/stages.py); every stage call moves between members through `Failover`
   (services/router/failover.py) as the policy says (services/router/policy.py);
5. a later turn of a conversation whose member holds its prefix: the items that member holds go
   as layouts only (`prefix_held`, services/router/held.py) to that member, no encoder runs; if
   it no longer holds them (EMBEDDING_NEEDED) or cannot take the request, encode and go on as
   usual;
6. recovery, here: if prefill found an embedding gone before any token was streamed, re-encode
   once and retry; if decode found the KV gone before it streamed anything (its lease expired
   while decode restarted, or the slot was reclaimed), recompute once: encode, prefill again, and
   continue with decode when the recomputed first token is the one already streamed (greedy or
   seeded sampling);
7. whatever happens (error, cancel, deadline), release every lease the request still holds
   (services/router/leases.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Sequence

import grpc
import structlog
from opentelemetry import trace

from libs.contract.chunks import merge_replies
from libs.contract.epd.v1 import chat_pb2, generate_pb2, generation_pb2
from libs.contract.errors import Unavailable
from libs.contract.validation import Limits, validate_generate_request
from libs.rpc.coalesce import coalesced
from libs.telemetry.stages import ATTRIBUTION
from services.router.affinity import conversation_key
from services.router.cache_lookup import CacheLookup
from services.router.dispatch import EncodeDispatch
from services.router.encoders import EncoderPool
from services.router.held import HeldItems, HeldMemberLeft, HeldPlan
from services.router.leases import Leases, RequestState
from services.router.policy import RpcFailed
from services.router.stages import DECODE_IN_FLIGHT_ADVERTISED, Reply, StageClients
from services.router.stubs import Stages, StageStubs
from services.router.transcribe import Transcriber, speech_item
from services.router.warmup import warm_up

_log = structlog.get_logger(__name__)


class Router:
    """Serves `Generate` over an encoder pool and pools of prefill and decode (or PD) members."""

    def __init__(
        self,
        stubs: StageStubs,
        encoders: EncoderPool,
        limits: Limits | None = None,
        cache: CacheLookup | None = None,
        stages: Stages | None = None,
        encode_in_flight: int = 64,
        decode_in_flight: int = DECODE_IN_FLIGHT_ADVERTISED,
        decode_queue_s: float | None = None,
    ) -> None:
        self._limits = limits or Limits()
        self._leases = Leases(stubs.lease)
        self._held = HeldItems(stubs.checks)
        self._clients = StageClients(
            stubs,
            stages or Stages.one_each(stubs),
            encode_in_flight=encode_in_flight,
            decode_in_flight=decode_in_flight,
            held=self._held,
            decode_queue_s=decode_queue_s,
        )
        self._dispatch = EncodeDispatch(self._clients, encoders, self._leases, cache or CacheLookup(None), self._limits)
        self._transcriber = Transcriber(self._dispatch, self._clients, self._leases)
        self._checks = stubs.checks

    async def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None = None, coalesce: bool = True
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        """Stream the reply to `request`; `deadline` is a `time.monotonic()` instant. With `coalesce`,
        a reader that lags gets what queued up meanwhile as one response (a gRPC client); without,
        one response per chunk, for a reader that relays them merged itself (the door in this
        process: one relay task per request, not two)."""
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
            run = self._in_decode_slot(request, state, deadline)
            async with contextlib.aclosing(coalesced(run, merge_replies) if coalesce else run) as replies:
                async for chunk, usage in replies:
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
                                "epd.usage.cached_input_tokens": usage.cached_prompt_tokens,
                            }
                        )
                    yield response
        finally:
            # Normal completion leaves nothing (consumers acked); failure and cancel may.
            await asyncio.shield(self._leases.release_all(state))

    async def _held_plan(self, request: generate_pb2.GenerateRequest) -> HeldPlan:
        """The media items that the member this conversation's last turn went to holds
        (services/router/held.py), when the request goes there again: that member is then chosen
        now, before the encodes (`MemberPool.pick_affine`, as at the call), so that what is not
        encoded is what it holds. Otherwise the member is chosen at the call, as for any request
        (chosen before encodes that take a while, many would pick by loads that no longer hold)."""
        pool = self._clients.prefill_pool()
        media = [part for message in request.messages for part in message.parts if part.HasField("media")]
        # A later turn only (an answer follows the media): its earlier turn's prompt and answer fill
        # the cache blocks past its media. A repeated first turn may be shorter than one block, which
        # no engine caches: its items would miss and cost a second call.
        later = any(message.role == chat_pb2.CHAT_ROLE_ASSISTANT for message in request.messages)
        key = conversation_key(request)
        owner = None if pool is None or not media or not later else pool.last(key)
        plan = await self._held.plan(owner, request.cache_salt, media, self._limits.max_inline_media_bytes)
        if not plan:
            return HeldPlan()
        assert pool is not None
        try:
            return plan if pool.pick_affine(key) == owner else HeldPlan()
        except Unavailable:
            return HeldPlan()  # no member now: the stage call waits for one, or says so

    async def warm_up(self, addresses: Sequence[str], image: bytes, timeout_s: float = 30.0) -> int:
        """First contact before traffic (services/router/warmup.py); the requests that succeeded."""
        return await warm_up(self._clients, self._leases, addresses, image, timeout_s)

    async def _in_decode_slot(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> AsyncGenerator[Reply, None]:
        """`_run` in the request's decode slot (E/P/D), taken before any encode: a request waiting
        for one holds no embedding lease (services/router/stages.py, `decode_slot`). First contact
        with the model side comes first: it learns the decode members' bound the slots are read from."""
        await self._checks.backend()
        async with (
            self._clients.decode_slot(request, state, deadline),
            contextlib.aclosing(self._run(request, state, deadline)) as replies,
        ):
            async for reply in replies:
                yield reply

    async def _run(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> AsyncGenerator[Reply, None]:
        backend = await self._checks.backend()  # first contact with the model side, before any encode
        audio = speech_item(request)
        if audio is not None and backend.HasField("transcription"):
            async for reply in self._transcriber.transcribe(request, audio, backend.transcription, state, deadline):
                yield reply
            return
        reencoded = recomputed = False
        may_hold = True  # until a member said it no longer holds what we thought
        first: generation_pb2.TokenChunk | None = None  # prefill's chunk, once streamed
        while True:
            held = await self._held_plan(request) if may_hold else HeldPlan()
            messages = await self._dispatch.encode_all(request, state, deadline, held)
            replay = first  # after a recompute: prefill's chunk again, already streamed
            try:
                async with contextlib.aclosing(
                    self._clients.prefill_and_decode(messages, request, state, deadline, held)
                ) as replies:
                    async for chunk, usage in replies:
                        if replay is not None:
                            if list(chunk.token_ids) != list(replay.token_ids):
                                raise RpcFailed.here(
                                    "decode",
                                    grpc.StatusCode.DATA_LOSS,
                                    "the KV was lost and the recomputed first token differs from the one "
                                    "streamed (sampling without a seed)",
                                )
                            replay = None
                            continue
                        if first is None:
                            first = chunk
                        yield chunk, usage
                return
            except HeldMemberLeft as exc:
                _log.info("member holding the prefix left; encoding", member=str(exc), request_id=state.request_id)
                may_hold = False
                await self._leases.release_all(state)
            except RpcFailed as exc:
                if held and exc.held_miss and not state.streamed:
                    _log.info("prefix no longer held; encoding", member=held.member, request_id=state.request_id)
                    assert held.member is not None
                    self._held.forget(held.member, request.cache_salt, list(held.layouts.values()))
                    may_hold = False
                elif not reencoded and exc.embedding_gone and not state.streamed:
                    _log.warning("embedding gone before prefill; re-encoding", request_id=state.request_id)
                    reencoded = True
                elif not recomputed and exc.kv_gone:
                    _log.warning("KV gone before decode read it; recomputing", request_id=state.request_id)
                    recomputed = True
                else:
                    raise
                await self._leases.release_all(state)
