"""A conversation's later turn, its image held by the member that served the earlier one (contract
1.9, services/router/held.py): the router sends that member the image's layout alone
(`prefix_held`) and calls no encoder; within the tenant only, only to a member advertising
`prefix.held_items`; a member that answers EMBEDDING_NEEDED gets the image encoded on a retry,
before anything reached the client; a member that cannot take the request at all is replaced
by any other, with the image encoded."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from libs.cache.keys import wire_content_hash
from libs.contract.epd.v1 import chat_pb2, encoder_pb2, generate_pb2
from libs.contract.reasons import STATUS_DETAILS_KEY, Reason, status_details
from libs.contract.validation import HELD_ITEMS_CAPABILITY
from services.router.pool import MemberPool
from tests.support import samples
from tests.support.router_harness import Encoder, Harness

pytestmark = pytest.mark.unit


def _harness(*, honors: bool = True) -> Harness:
    harness = Harness(n_encoders=1)
    harness.checks.honoring = lambda address, capability: honors and capability == HELD_ITEMS_CAPABILITY
    _hash_like_an_encoder(harness.encoders["enc0"])
    return harness


def _hash_like_an_encoder(encoder: Encoder) -> None:
    """The double's layouts carry the items' content hashes, as a real encoder's do."""
    encode = encoder.Encode

    async def hashed(request: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        response = await encode(request, timeout)
        for item, answer in zip(request.items, response.items, strict=True):
            answer.layout.mm_hash = wire_content_hash(item.media, item.media.data)
        return response

    encoder.Encode = hashed  # type: ignore[method-assign]


def _turn(salt: str, answers: int) -> generate_pb2.GenerateRequest:
    """The conversation after `answers` answers, as a chat client resends it, in tenant `salt`."""
    user = chat_pb2.CHAT_ROLE_USER
    messages = [
        chat_pb2.ChatMessage(
            role=user, parts=[chat_pb2.ContentPart(media=samples.media()), chat_pb2.ContentPart(text="What is it?")]
        )
    ]
    for i in range(answers):
        messages.append(
            chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_ASSISTANT, parts=[chat_pb2.ContentPart(text=f"answer {i}")])
        )
        messages.append(chat_pb2.ChatMessage(role=user, parts=[chat_pb2.ContentPart(text=f"question {i}")]))
    return generate_pb2.GenerateRequest(messages=messages, sampling=samples.sampling(), cache_salt=salt)


def _sent_items(harness: Harness) -> list[Any]:
    """The media parts of the last prefill request."""
    last = harness.prefill.requests[-1]
    return [part.encoded for message in last.messages for part in message.parts if part.HasField("encoded")]


def _embedding_needed() -> grpc.aio.AioRpcError:
    code, message = grpc.StatusCode.FAILED_PRECONDITION, "items[0] was sent as held in the prefix cache"
    trailers = grpc.aio.Metadata((STATUS_DETAILS_KEY, status_details(code, message, Reason.EMBEDDING_NEEDED)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=message)


def test_a_later_turn_sends_the_held_image_as_its_layout_and_encodes_nothing() -> None:
    asyncio.run(_later_turn())


async def _later_turn() -> None:
    harness = _harness()
    assert await harness.tokens(_turn("tenant-a", 0)) == [7, 8, 9]
    (encoded,) = _sent_items(harness)
    assert not encoded.prefix_held and encoded.HasField("embeddings")
    calls = len(harness.log)
    assert await harness.tokens(_turn("tenant-a", 1)) == [7, 8, 9]
    assert len(harness.log) == calls, "the later turn called an encoder"
    (held,) = _sent_items(harness)
    assert held.prefix_held and not held.HasField("embeddings")
    assert held.layout == encoded.layout  # the layout its first encode gave, at its index
    assert harness.leases.released == {}, "nothing was held, nothing to release"


@pytest.mark.parametrize("honors", [True, False])
def test_another_tenant_or_a_member_without_the_capability_gets_the_image_encoded(honors: bool) -> None:
    asyncio.run(_not_held(honors))


async def _not_held(honors: bool) -> None:
    harness = _harness(honors=honors)
    await harness.tokens(_turn("tenant-a", 0))
    calls = len(harness.log)
    await harness.tokens(_turn("tenant-b" if honors else "tenant-a", 1))
    assert len(harness.log) == calls + 1
    (encoded,) = _sent_items(harness)
    assert not encoded.prefix_held and encoded.HasField("embeddings")


def test_a_member_that_no_longer_holds_it_gets_it_encoded_before_any_token() -> None:
    asyncio.run(_evicted())


async def _evicted() -> None:
    harness = _harness()
    await harness.tokens(_turn("tenant-a", 0))
    calls = len(harness.log)
    prefill = harness.prefill.Prefill

    async def evicted(request: Any, timeout: float | None = None, **kw: Any) -> Any:
        if any(part.encoded.prefix_held for message in request.messages for part in message.parts):
            harness.prefill.requests.append(request)
            raise _embedding_needed()
        return await prefill(request, timeout, **kw)

    harness.prefill.Prefill = evicted  # type: ignore[method-assign]
    assert await harness.tokens(_turn("tenant-a", 1)) == [7, 8, 9]
    assert len(harness.log) == calls + 1, "the retry did not encode the image"
    held, retried = harness.prefill.requests[-2:]
    assert held.messages[0].parts[0].encoded.prefix_held
    assert retried.messages[0].parts[0].encoded.HasField("embeddings")


def test_when_its_member_cannot_take_the_turn_another_gets_it_encoded() -> None:
    asyncio.run(_member_leaves())


async def _member_leaves() -> None:
    harness = _harness()
    members = MemberPool(["prefill-a", "prefill-b"], stage="prefill")
    harness.stages.prefill = members
    await harness.tokens(_turn("tenant-a", 0))
    calls = len(harness.log)
    prefill = harness.prefill.Prefill
    draining: list[str] = []

    def stub(address: str) -> Any:
        class Stub:
            async def Prefill(self, request: Any, timeout: float | None = None, **kw: Any) -> Any:
                if any(part.encoded.prefix_held for message in request.messages for part in message.parts):
                    draining.append(address)
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="draining"
                    )
                return await prefill(request, timeout, **kw)

        return Stub()

    harness.stubs.prefill = stub
    assert await harness.tokens(_turn("tenant-a", 1)) == [7, 8, 9]
    assert len(draining) == 1 and len(harness.log) == calls + 1
    (encoded,) = _sent_items(harness)
    assert encoded.HasField("embeddings")
