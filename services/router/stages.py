"""The router's stage clients: one `Encode` on a chosen encoder, and a metadata-only request through
`Prefill` then `Decode` (E/P/D) or `PrefillDecode` (E+PD), each over its stage's members through
`Failover` (services/router/failover.py).

- `encode_on`: the job on one encoder, CACHED_ONLY when the item is in the store the encoder
  loads from. At most `encode_in_flight` jobs go to one encoder at once; more wait here (a queue
  stage), bounded by the router's own admission: requests it admitted are not refused by an
  encoder queue they overflow (several items per request at high concurrency).
- `prefill_and_decode`: the request's messages (media parts already replaced by their `encoded`
  parts) go to prefill; its KV cache goes to any decode. At most as many requests as the decode
  members run at once (what each advertises, contract 1.7; or `decode_in_flight` per member) are
  between the start of their prefill and the end of their decode: the others wait before prefill,
  in their time to first token, not between their first and second tokens in the decode's queue
  (SGLang's decode pre-allocates for the same reason); a one-token request never decodes and takes
  no such place. The request's `RequestState` holds the embeddings until prefill (or PD) acks them,
  and the KV until decode acks it. A prefill, decode or PD member that refuses before its first
  token is replaced as the policy says; a consumer gone mid-stream cancels the member's call (it
  would generate on to max_tokens). A failure leaves as `RpcFailed` naming the stage; a decode that
  streamed nothing says so (`kv_unread`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    media_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    tensor_pb2,
)
from libs.contract.errors import DeadlineExceeded, ResourceExhausted
from libs.contract.reasons import Reason
from libs.telemetry.stages import ATTRIBUTION, calls_under, phase, stage, start_phase
from services.router.affinity import conversation_key
from services.router.failover import Check, Failover, remaining
from services.router.held import HeldItems, HeldMemberLeft, HeldPlan
from services.router.leases import RequestState
from services.router.policy import MEMBER_RETRIES, RpcFailed, Stage
from services.router.pool import MemberPool
from services.router.stubs import Stages, StageStubs

_log = structlog.get_logger(__name__)
Reply = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]
DECODE_IN_FLIGHT_ADVERTISED = -1  # `decode_in_flight`: each decode member's own bound, as it advertises it
_UNBOUNDED = 1 << 30


class Slots:
    """At most `capacity()` holders at once (read at each acquire), waiting in arrival order;
    `what` names a slot in the error of a wait the deadline ends. A wait longer than `max_wait_s`
    (None: none but the deadline) is refused, RESOURCE_EXHAUSTED (OVERLOADED) naming the slots held
    and the queue's length: a caller told at once rather than after a silent minute."""

    def __init__(self, capacity: Callable[[], int], what: str, max_wait_s: float | None = None) -> None:
        self._capacity = capacity
        self._what = what
        self._max_wait_s = max_wait_s
        self._held = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for granted in self._waiting if not granted.done())

    @property
    def in_use(self) -> int:
        return self._held

    @contextlib.asynccontextmanager
    async def held(self, queue_stage: str, deadline: float | None) -> AsyncGenerator[None, None]:
        """One slot for the body; a wait is a `queue_stage` span, bounded by `deadline` and `max_wait_s`."""
        if self._held < self._capacity() and not self._waiting:
            self._held += 1
        else:
            with stage(queue_stage, "queue"):
                await self._wait(deadline)
        try:
            yield
        finally:
            self._held -= 1
            self._wake()

    async def _wait(self, deadline: float | None) -> None:
        left = remaining(deadline)  # raises when the deadline has passed: before joining the queue
        patience = left if self._max_wait_s is None else min(self._max_wait_s, left or self._max_wait_s)
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(granted)
        try:
            async with asyncio.timeout(patience):
                await asyncio.shield(granted)
        except BaseException as exc:
            queue = self.waiting  # this one included
            if granted.done() and not granted.cancelled():
                self._held -= 1  # granted just as the wait ended: pass the slot on
                self._wake()
            else:
                granted.cancel()
            if isinstance(exc, TimeoutError):
                if patience == left:
                    raise DeadlineExceeded(f"request deadline passed waiting for {self._what}") from None
                raise ResourceExhausted(
                    f"no {self._what.removeprefix('a ')} free within {self._max_wait_s:g} s: {self._held} of "
                    f"{self._capacity()} held, {queue} waiting (this request included); retry later or elsewhere",
                    reason=Reason.OVERLOADED,
                ) from None
            raise

    def _wake(self) -> None:
        while self._waiting and self._held < self._capacity():
            granted = self._waiting.popleft()
            if not granted.done():  # skip those that gave up
                self._held += 1
                granted.set_result(None)


def _planned(plan: HeldPlan, otherwise: Callable[[set[str]], str], tried: set[str]) -> str:
    """The planned member for the first try (and after a drain wait); after it, the usual pick, or
    none when the request's held items are there only."""
    assert plan.member is not None
    if plan.member not in tried:
        return plan.member
    if plan:
        raise HeldMemberLeft(plan.member)
    return otherwise(tried)


def _usage(reply: Any) -> generation_pb2.Usage | None:
    return reply.usage if reply.HasField("usage") else None


class StageClients:
    """Calls to the encoders and to the prefill/decode (or PD) members."""

    def __init__(
        self,
        stubs: StageStubs,
        stages: Stages,
        *,
        encode_in_flight: int = 64,
        decode_in_flight: int = DECODE_IN_FLIGHT_ADVERTISED,
        held: HeldItems | None = None,
        decode_queue_s: float | None = None,
    ) -> None:
        if encode_in_flight < 1:
            raise ValueError("encode_in_flight must be >= 1")
        if decode_in_flight < DECODE_IN_FLIGHT_ADVERTISED:
            raise ValueError("decode_in_flight must be >= -1 (-1: as the decode members advertise, 0: no bound)")
        if decode_queue_s is not None and decode_queue_s <= 0:
            raise ValueError("decode_queue_s must be > 0 (None: only the request's deadline bounds the wait)")
        self.stubs = stubs
        self.stages = stages
        self.held = held  # what members' prefix caches hold, learnt from the calls here
        self.encode_in_flight = encode_in_flight
        self._encode_slots: dict[str, asyncio.Semaphore] = {}
        self._decode_in_flight = decode_in_flight
        self._decode_slots = (
            Slots(self._decode_capacity, "a decode slot", max_wait_s=decode_queue_s) if decode_in_flight else None
        )
        self._slot_holders: set[int] = set()  # the states (by id) of requests holding a decode slot

    def _decode_capacity(self) -> int:
        """Requests that may be between the start of their prefill and the end of their decode, read
        at each request (a discovered decode pool grows and shrinks): `decode_in_flight` per member,
        or the sum of what the members advertise. A member not contacted yet counts as the largest
        advertised; one that advertises nothing (before contract 1.7) lifts the bound."""
        members = list(self.stages.decode.outstanding) if self.stages.decode is not None else []
        if self._decode_in_flight > 0:
            return self._decode_in_flight * max(1, len(members))
        advertised = [self.stubs.checks.max_running(address) for address in members]
        known = [n for n in advertised if n is not None]
        if not known or 0 in known:
            return _UNBOUNDED
        return sum(max(known) if n is None else n for n in advertised)

    def _needs_decode_slot(self, request: generate_pb2.GenerateRequest) -> bool:
        return (
            self._decode_slots is not None
            and self.stubs.prefill_decode is None  # E+PD: the PD's own admission bounds it
            and request.sampling.max_tokens != 1  # prefill's token is all of it: never decodes
        )

    @contextlib.asynccontextmanager
    async def decode_slot(
        self, request: generate_pb2.GenerateRequest, state: RequestState, deadline: float | None
    ) -> AsyncGenerator[None, None]:
        """The request's decode slot for the body, taken before its media are encoded (encode just
        in time: a request waiting for a slot holds no embedding whose lease could expire meanwhile);
        its prefill and decode then take no other. Nothing for a request that will not decode."""
        if not self._needs_decode_slot(request) or id(state) in self._slot_holders:
            yield
            return
        assert self._decode_slots is not None
        async with self._decode_slots.held("router.decode_queue", deadline):
            self._slot_holders.add(id(state))
            try:
                yield
            finally:
                self._slot_holders.discard(id(state))

    @contextlib.asynccontextmanager
    async def _encode_slot(self, address: str, deadline: float | None) -> AsyncGenerator[None, None]:
        """One of `address`'s `encode_in_flight` slots, waited for under `deadline`."""
        slots = self._encode_slots.setdefault(address, asyncio.Semaphore(self.encode_in_flight))
        if slots.locked():
            with stage("router.encode_queue", "queue", **{"epd.encoder": address}):
                try:
                    # A timeout inside acquire(), not wait_for's wrapper: a slot granted as it expires is
                    # handed on by the semaphore, never lost.
                    async with asyncio.timeout(remaining(deadline)):
                        await slots.acquire()
                except TimeoutError:
                    raise DeadlineExceeded("request deadline passed waiting for an encoder slot") from None
        else:
            await slots.acquire()
        try:
            yield
        finally:
            slots.release()

    async def encode_on(
        self,
        address: str,
        job: encoder_pb2.EncodeRequest,
        priority: int,
        cached: Callable[[], Awaitable[bool]],
        deadline: float | None,
    ) -> encoder_pb2.EncodeResponse:
        """`job` (one item, or a request's items placed together) on the encoder at `address` once
        it passed its first-contact check, at the request's `priority` where the encoder honors it;
        CACHED_ONLY when `cached()` says the encoder can load it from the store. One
        `epd.encode.item` span per try, check included (its first item's index and modality)."""
        item = job.items[0]
        with phase(
            "epd.encode.item",
            **{
                ATTRIBUTION: "rpc",
                "epd.item_index": item.item_index,
                "epd.items": len(job.items),
                "epd.modality": media_pb2.Modality.Name(item.media.modality),
                "epd.encoder": address,
            },
        ) as span:
            await self.stubs.checks.encoder(address, None)
            job.priority = self.stubs.priority_for(address, priority)
            policy = encoder_pb2.CACHE_POLICY_CACHED_ONLY if await cached() else encoder_pb2.CACHE_POLICY_UNSPECIFIED
            job.cache_policy = policy
            span.set_attribute("epd.cache.policy", encoder_pb2.CachePolicy.Name(job.cache_policy))
            async with self._encode_slot(address, deadline):
                reply: encoder_pb2.EncodeResponse = await self.stubs.encoder(address).Encode(
                    job, timeout=remaining(deadline)
                )
            return reply

    def prefill_and_decode(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        held: HeldPlan | None = None,
    ) -> AsyncGenerator[Reply, None]:
        """The reply to a request whose media parts are all encoded or `held` by `held.member`
        (`messages`), with the usage on the last chunk; `request` gives the sampling and the
        priority. The request goes to `held.member` first (chosen before its encodes), and only
        there when some of its parts are held (`HeldMemberLeft` when it cannot take it)."""
        if self.stubs.prefill_decode is not None:
            return self._prefill_decode(messages, request, state, deadline, held)
        return self._split(messages, request, state, deadline, held)

    def prefill_pool(self) -> MemberPool | None:
        """The members a request's prefill goes to: PD members (E+PD) or prefill members."""
        return self.stages.pd if self.stubs.prefill_decode is not None else self.stages.prefill

    def _failover(
        self,
        pool: MemberPool | None,
        stage: Stage,
        deadline: float | None,
        check: Check,
        affinity: bytes = b"",
        planned: HeldPlan | None = None,
    ) -> Failover:
        """The tries of one call; with `affinity` (a conversation's key), the member it belongs to
        first (`MemberPool.pick_affine`); with `planned`, the member chosen before the encodes first,
        and no other when it holds some of the request's items."""
        assert pool is not None, f"no {stage} pool for the stubs' layout"
        pick = (lambda tried: pool.pick_affine(affinity, tried)) if affinity else (lambda tried: pool.pick(tried))
        if planned is not None and planned.member is not None:
            pick = functools.partial(_planned, planned, pick)
        return Failover(pool, stage, MEMBER_RETRIES, deadline, check, pick)

    def _remember(
        self, address: str, request: generate_pb2.GenerateRequest, messages: list[chat_pb2.ChatMessage]
    ) -> None:
        if self.held is not None:
            self.held.remember(address, request.cache_salt, messages)

    async def _prefill_decode(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        planned: HeldPlan | None = None,
    ) -> AsyncGenerator[Reply, None]:
        b = self.stubs
        assert b.prefill_decode is not None
        stub = b.prefill_decode
        pd_request = prefill_decode_pb2.PrefillDecodeRequest(
            request_id=state.request_id, messages=messages, sampling=request.sampling, cache_salt=request.cache_salt
        )
        members = self._failover(self.stages.pd, "pd", deadline, b.checks.prefill, conversation_key(request), planned)
        span = start_phase("epd.prefill_decode", **{ATTRIBUTION: "rpc"})

        async def on(address: str) -> AsyncGenerator[prefill_decode_pb2.PrefillDecodeResponse, None]:
            span.set_attribute("epd.pd", address)  # the member that served it (as epd.prefill, epd.decode)
            b.check_sampling(address, "prefill-decode", request.sampling)
            b.check_prompt(address, "prefill-decode", request.messages)
            pd_request.priority = b.priority_for(address, request.priority)
            with calls_under(span):
                call = stub(address).PrefillDecode(
                    pd_request, timeout=remaining(deadline), wait_for_ready=members.wait_for_ready
                )
            try:
                first = True
                async for reply in call:
                    if first:
                        first = False
                        self._remember(address, request, messages)
                    yield reply
            finally:
                call.cancel()  # a consumer gone mid-stream must stop PD (a no-op once it ended)

        try:
            async with contextlib.aclosing(members.stream(on)) as replies:
                async for reply in replies:
                    state.acked()  # PD read and acked the embeddings once it streams
                    state.streamed = True
                    yield reply.chunk, _usage(reply)
        except grpc.aio.AioRpcError as exc:
            raise RpcFailed.of("prefill" if not state.streamed else "decode", exc) from None
        finally:
            span.end()

    async def _split(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        planned: HeldPlan | None = None,
    ) -> AsyncGenerator[Reply, None]:
        # Unless the request took its slot before its encode (`decode_slot`): e.g. a speech window.
        async with (
            self.decode_slot(request, state, deadline),
            contextlib.aclosing(self._prefill_then_decode(messages, request, state, deadline, planned)) as replies,
        ):
            async for reply in replies:
                yield reply

    async def _prefill_then_decode(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        planned: HeldPlan | None = None,
    ) -> AsyncGenerator[Reply, None]:
        first, prefill_address = await self._prefill(messages, request, state, deadline, planned)
        state.acked()  # prefill acked every embedding it read
        if not first.HasField("kv_cache"):  # finished at the first token
            usage = generation_pb2.Usage(
                prompt_tokens=first.decode_state.prompt_tokens,
                completion_tokens=1,
                cached_prompt_tokens=first.decode_state.cached_prompt_tokens,
            )
            yield first.first_chunk, usage
            return
        state.hold_kv(first.kv_cache)
        yield first.first_chunk, None
        async with contextlib.aclosing(self._decode(first, prefill_address, request, state, deadline)) as replies:
            async for reply in replies:
                yield reply

    async def _prefill(
        self,
        messages: list[chat_pb2.ChatMessage],
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        planned: HeldPlan | None = None,
    ) -> tuple[prefill_pb2.PrefillResponse, str]:
        b = self.stubs
        assert b.prefill is not None
        stub = b.prefill
        prefill_request = prefill_pb2.PrefillRequest(
            request_id=state.request_id,
            messages=messages,
            sampling=request.sampling,
            accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
            cache_salt=request.cache_salt,
        )
        members = self._failover(
            self.stages.prefill, "prefill", deadline, b.checks.prefill, conversation_key(request), planned
        )
        try:
            with phase("epd.prefill", **{ATTRIBUTION: "rpc"}) as span:

                async def on(address: str) -> tuple[prefill_pb2.PrefillResponse, str]:
                    span.set_attribute("epd.prefill", address)
                    b.check_sampling(address, "prefill", request.sampling)
                    b.check_prompt(address, "prefill", request.messages)
                    prefill_request.priority = b.priority_for(address, request.priority)
                    response = await stub(address).Prefill(
                        prefill_request, timeout=remaining(deadline), wait_for_ready=members.wait_for_ready
                    )
                    self._remember(address, request, messages)
                    return response, address

                return await members.unary(on)
        except grpc.aio.AioRpcError as exc:
            raise RpcFailed.of("prefill", exc) from None

    async def _decode(
        self,
        first: prefill_pb2.PrefillResponse,
        prefill_address: str,
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
    ) -> AsyncGenerator[Reply, None]:
        b = self.stubs
        assert b.decode is not None
        stub = b.decode
        decode_request = decode_pb2.DecodeRequest(
            request_id=state.request_id,
            kv_cache=first.kv_cache,
            decode_state=first.decode_state,
            sampling=request.sampling,
        )

        async def check(address: str) -> None:
            await b.checks.decode(address, prefill_address)  # it must read this prefill's KV

        members = self._failover(self.stages.decode, "decode", deadline, check)
        span = start_phase("epd.decode", **{ATTRIBUTION: "rpc"})

        async def on(address: str) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
            span.set_attribute("epd.decode", address)
            b.check_sampling(address, "decode", request.sampling)
            decode_request.priority = b.priority_for(address, request.priority)
            with calls_under(span):
                call = stub(address).Decode(
                    decode_request, timeout=remaining(deadline), wait_for_ready=members.wait_for_ready
                )
            try:
                async for reply in call:
                    yield reply
            finally:
                call.cancel()  # as for PD: a consumer gone mid-stream must stop decode

        streamed = 0
        try:
            async with contextlib.aclosing(members.stream(on)) as replies:
                async for reply in replies:
                    streamed += 1
                    state.acked()  # decode acked the KV before streaming
                    yield reply.chunk, _usage(reply)
        except grpc.aio.AioRpcError as exc:
            raise RpcFailed.of("decode", exc, kv_unread=not streamed) from None
        finally:
            span.end()
