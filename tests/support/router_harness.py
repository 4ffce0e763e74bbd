"""The router core's stages as test doubles with the generated stubs' call shapes (encoders,
lease release, prefill, decode) and a `Harness` that wires them, with checks that pass every peer
(tests/support/router_checks.py), to a real `Router`; sample requests with distinct images. Used by
the router tests (tests/router)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from libs.cache.keys import wire_content_hash
from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    lease_pb2,
    prefill_pb2,
)
from services.router.core import Router
from services.router.encoders import EncoderPool
from services.router.stages import DECODE_IN_FLIGHT_ADVERTISED
from services.router.stubs import Stages, StageStubs
from tests.support import samples
from tests.support.router_checks import PassingChecks


def rpc_error(code: grpc.StatusCode, details: str = "boom") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Encoder:
    def __init__(self, address: str, log: list[tuple[str, int]], fail: grpc.StatusCode | None = None) -> None:
        self.address, self.log, self.fail = address, log, fail
        self.leases = 0
        self.requests: list[encoder_pb2.EncodeRequest] = []
        self.cached: set[str] = set()  # mm_hashes a CACHED_ONLY job finds; others answer NOT_FOUND

    async def Encode(self, request: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        self.log.extend((self.address, item.item_index) for item in request.items)
        self.requests.append(encoder_pb2.EncodeRequest.FromString(request.SerializeToString()))  # as sent
        await asyncio.sleep(0.01)
        for position, item in enumerate(request.items):
            if (
                request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY
                and wire_content_hash(item.media, item.media.data) not in self.cached
            ):
                raise rpc_error(
                    grpc.StatusCode.NOT_FOUND, f"items[{position}]: not in the encoder cache or the shared store"
                )
        if self.fail is not None:
            raise rpc_error(
                self.fail, "items[0].media.data: not an image" if self.fail.name == "INVALID_ARGUMENT" else "x"
            )
        response = encoder_pb2.EncodeResponse()
        for item in request.items:
            self.leases += 1
            encoded = samples.encoded_image(item.item_index)
            encoded.embeddings.lease_id = f"{self.address}/{self.leases}"
            encoded.embeddings.agent.producer_address = self.address
            response.items.append(encoded)
        return response


class Leases:
    def __init__(self) -> None:
        self.released: dict[str, set[str]] = {}

    def stub(self, address: str) -> Any:
        released = self.released

        class Stub:
            async def ReleaseLeases(self, request: lease_pb2.ReleaseLeasesRequest, timeout: float | None = None) -> Any:
                assert request.reason == lease_pb2.RELEASE_REASON_ABANDONED
                released.setdefault(address, set()).update(request.lease_ids)
                return lease_pb2.ReleaseLeasesResponse(released_count=len(request.lease_ids))

        return Stub()


class Prefill:
    def __init__(self, fail_first: grpc.StatusCode | None = None, first_tokens: Sequence[int] = (7,)) -> None:
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.fail_first = fail_first
        self.first_tokens = first_tokens  # the first token of each call, the last one repeated

    async def Prefill(self, request: prefill_pb2.PrefillRequest, timeout: float | None = None, **_: Any) -> Any:
        self.requests.append(request)
        if self.fail_first is not None and len(self.requests) == 1:
            raise rpc_error(self.fail_first, "embedding lease-0 not found")
        kv = samples.kv_cache(tokens=10)
        kv.handle.lease_id = f"kv-lease-{len(self.requests)}"
        token = self.first_tokens[min(len(self.requests), len(self.first_tokens)) - 1]
        if request.sampling.max_tokens == 1:  # finished at its first token, as a prefill service answers
            return prefill_pb2.PrefillResponse(
                first_chunk=generation_pb2.TokenChunk(
                    token_ids=[token], text="a", finish_reason=generation_pb2.FINISH_REASON_LENGTH
                ),
                decode_state=prefill_pb2.DecodeState(next_input_token_id=token, generated_tokens=1, prompt_tokens=10),
            )
        return prefill_pb2.PrefillResponse(
            first_chunk=generation_pb2.TokenChunk(token_ids=[token], text="a"),
            kv_cache=kv,
            decode_state=prefill_pb2.DecodeState(next_input_token_id=token, generated_tokens=1, prompt_tokens=10),
        )


class StreamCall:
    """What a grpc.aio unary-stream call gives the router: its responses, each after a turn of the
    event loop (as each of grpc's is a read of its own: a reader that keeps up gets them one by
    one; a read cancelled cancels the call), and `cancel()`, which (as in grpc) does nothing once
    the stream has ended."""

    def __init__(self, responses: AsyncIterator[Any]) -> None:
        self._responses = responses
        self.ended = False
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for response in self._responses:
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    self.cancel()  # as grpc.aio's: a read whose task is cancelled cancels the call
                    raise
                yield response
        finally:
            self.ended = not self.cancelled

    def cancel(self) -> bool:
        if self.ended:
            return False
        self.cancelled = True
        return True


class Decode:
    def __init__(self, fail_before: bool = False, fail_first: Sequence[grpc.StatusCode] = ()) -> None:
        self.fail_before = fail_before
        self.fail_first = list(fail_first)  # the first calls fail with these, before streaming
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.calls: list[StreamCall] = []
        self.gate: asyncio.Event | None = None  # set: every stream waits for it before its tokens

    def Decode(self, request: decode_pb2.DecodeRequest, timeout: float | None = None, **_: Any) -> StreamCall:
        self.requests.append(request)

        fail = self.fail_first.pop(0) if self.fail_first else None

        async def stream() -> AsyncIterator[Any]:
            if self.fail_before:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "decode lost its KV")
            if fail is not None:
                raise rpc_error(fail, f"lease {request.kv_cache.handle.lease_id} expired 10.6 s ago")
            if self.gate is not None:
                await self.gate.wait()
            for token in (8, 9):
                yield decode_pb2.DecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[token]))
            yield decode_pb2.DecodeResponse(
                chunk=generation_pb2.TokenChunk(finish_reason=generation_pb2.FINISH_REASON_LENGTH),
                usage=generation_pb2.Usage(prompt_tokens=10, completion_tokens=3),
            )

        self.calls.append(StreamCall(stream()))
        return self.calls[-1]


class Harness:
    def __init__(self, n_encoders: int = 2, fail: dict[str, grpc.StatusCode] | None = None, **kw: Any) -> None:
        self.log: list[tuple[str, int]] = []
        self.encoders = {
            f"enc{i}": Encoder(f"enc{i}", self.log, (fail or {}).get(f"enc{i}")) for i in range(n_encoders)
        }
        self.leases = Leases()
        self.prefill = Prefill(kw.get("prefill_fail_first"), kw.get("prefill_first_tokens", (7,)))
        self.decode = Decode(kw.get("decode_fail_before", False), kw.get("decode_fail_first", ()))
        self.checks = PassingChecks()
        if "encoder_cache" in kw:
            self.checks.cache_of = kw["encoder_cache"]
        self.stubs = stubs = StageStubs(
            encoder=self.encoders.__getitem__,
            lease=self.leases.stub,
            checks=self.checks,
            prefill=lambda address: self.prefill,
            decode=lambda address: self.decode,
        )
        self.pool = EncoderPool(list(self.encoders), slack=kw.get("slack", 0))
        self.stages = Stages.one_each(stubs)
        self.router = Router(
            stubs,
            self.pool,
            cache=kw.get("cache"),
            stages=self.stages,
            encode_in_flight=kw.get("encode_in_flight", 64),
            decode_in_flight=kw.get("decode_in_flight", DECODE_IN_FLIGHT_ADVERTISED),
            decode_queue_s=kw.get("decode_queue_s"),
        )

    async def tokens(self, request: generate_pb2.GenerateRequest) -> list[int]:
        out: list[int] = []
        async for response in self.router.generate(request):
            out.extend(response.chunk.token_ids)
        return out


def distinct_image(seed: int) -> Any:
    media = samples.media()
    media.data += seed.to_bytes(4, "big")  # distinct content: distinct cache keys
    return media


def image_request(images: int, text: str = "Describe.", same: bool = False) -> generate_pb2.GenerateRequest:
    parts = [chat_pb2.ContentPart(media=distinct_image(0 if same else i)) for i in range(images)]
    parts.append(chat_pb2.ContentPart(text=text))
    return generate_pb2.GenerateRequest(
        request_id="r1",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
        sampling=samples.sampling(),
    )
