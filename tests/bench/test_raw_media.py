"""The P4 baseline's wrapper (tests/benchmarks/raw_media.py) without services: the router's prefill
calls gain each item's raw media after its encoded part, prefill's servicer takes them out
before serving, and the derived layout must agree with the encoder's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from libs.contract.epd.v1 import chat_pb2, generate_pb2, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from libs.contract.errors import InvalidArgument
from tests.benchmarks import raw_media
from tests.support import samples

pytestmark = pytest.mark.unit


def _client(images: int) -> generate_pb2.GenerateRequest:
    parts = [chat_pb2.ContentPart(media=samples.media()) for _ in range(images)]
    parts.append(chat_pb2.ContentPart(text="Describe."))
    return generate_pb2.GenerateRequest(messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)])


def _metadata_only(images: int) -> prefill_pb2.PrefillRequest:
    parts = [chat_pb2.ContentPart(encoded=samples.encoded_image(i)) for i in range(images)]
    parts.append(chat_pb2.ContentPart(text="Describe."))
    return prefill_pb2.PrefillRequest(
        request_id="r1", messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)]
    )


def _kinds(request: prefill_pb2.PrefillRequest) -> list[str | None]:
    return [p.WhichOneof("kind") for p in request.messages[0].parts]


def test_the_router_side_appends_raw_media_to_a_copy() -> None:
    sent = _metadata_only(2)
    forwarded = raw_media.with_raw_media(_client(2), sent)
    assert _kinds(forwarded) == ["encoded", "media", "encoded", "media", "text"]
    assert forwarded.messages[0].parts[1].media == samples.media()
    assert _kinds(sent) == ["encoded", "encoded", "text"]  # the router's request (retried as is) unchanged
    other = _metadata_only(1)  # not the client's messages part for part (e.g. a warm-up)
    assert raw_media.with_raw_media(_client(2), other) is other


def test_the_prefill_side_takes_them_out_with_the_encoders_counts() -> None:
    forwarded = raw_media.with_raw_media(_client(2), _metadata_only(2))
    taken = raw_media.take_raw_media(forwarded.messages)
    assert _kinds(forwarded) == ["encoded", "encoded", "text"]  # what prefill validates and serves
    count = samples.encoded_image(0).layout.placeholder_token_count
    assert [c for _, c in taken] == [count, count] and all(item == samples.media() for item, _ in taken)


def test_a_derived_layout_that_disagrees_with_the_encoder_is_invalid() -> None:
    def adapter(tokens: int) -> Any:
        layout = SimpleNamespace(placeholder_token_count=tokens)
        return SimpleNamespace(preprocess=lambda media, text, limits: SimpleNamespace(layout=layout))

    raw_media.derive_layouts(adapter(4), [(samples.media(), 4), (samples.media(), -1)])
    with pytest.raises(InvalidArgument, match="derives 5 tokens; encoder said 4"):
        raw_media.derive_layouts(adapter(5), [(samples.media(), 4)])


class _Channel:
    """What a stub needs of a channel: one callable per method, recording the requests."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        def call(request: Any, *a: Any, **kw: Any) -> Any:
            self.sent.append(request)
            return "answer"

        return call


def test_the_router_wrapper_forwards_the_served_clients_media(monkeypatch: pytest.MonkeyPatch) -> None:
    # Restored after the test: the wrapper replaces them for the process it runs.
    monkeypatch.setattr(prefill_pb2_grpc, "PrefillServiceStub", prefill_pb2_grpc.PrefillServiceStub)
    monkeypatch.setattr(
        generate_pb2_grpc, "add_GenerateServiceServicer_to_server", lambda servicer, server: server.append(servicer)
    )
    raw_media.forward_from_router()
    registered: list[Any] = []
    channel = _Channel()

    class Router:
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[str]:
            # The router's prefill call, made while it serves the client's request.
            yield prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(_metadata_only(1), timeout=1.0)

    generate_pb2_grpc.add_GenerateServiceServicer_to_server(Router(), registered)  # type: ignore[arg-type]

    async def serve() -> list[str]:
        return [r async for r in registered[0].Generate(_client(1), None)]

    assert asyncio.run(serve()) == ["answer"]
    (sent,) = channel.sent
    assert _kinds(sent) == ["encoded", "media", "text"]
    prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(_metadata_only(1))  # outside a Generate: as is
    assert _kinds(channel.sent[-1]) == ["encoded", "text"]


def test_the_prefill_wrapper_preprocesses_on_the_compute_thread_before_the_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import libs.serving.generation as generation

    fetched: list[Any] = []

    async def fetch(engine: Any, runner: Any, transport: Any, messages: Any, *args: Any) -> str:
        fetched.append([p.WhichOneof("kind") for p in messages[0].parts])
        return "prefilled"

    monkeypatch.setattr(generation, "fetch_and_prefill", fetch)
    monkeypatch.setattr(
        prefill_pb2_grpc, "add_PrefillServiceServicer_to_server", lambda servicer, server: server.append(servicer)
    )
    raw_media.take_at_prefill()
    on_thread: list[str] = []

    class ComputeThread:
        async def run(self, fn: Any, *args: Any) -> Any:
            on_thread.append(fn.__name__)
            return fn(*args)

    preprocessed: list[Any] = []
    layout = SimpleNamespace(placeholder_token_count=samples.encoded_image(0).layout.placeholder_token_count)
    adapter = SimpleNamespace(
        preprocess=lambda media, text, limits: preprocessed.append(media) or SimpleNamespace(layout=layout)
    )
    runner = SimpleNamespace(runtime=SimpleNamespace(adapter=adapter))

    class Prefill:
        async def Prefill(self, request: Any, context: Any) -> Any:
            assert _kinds(request) == ["encoded", "text"]  # taken out before admission and validation
            return await generation.fetch_and_prefill(ComputeThread(), runner, None, request.messages, None, None)

    registered: list[Any] = []
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Prefill(), registered)  # type: ignore[arg-type]
    forwarded = raw_media.with_raw_media(_client(1), _metadata_only(1))
    assert asyncio.run(registered[0].Prefill(forwarded, None)) == "prefilled"
    assert on_thread == ["derive_layouts"] and len(preprocessed) == 1
    assert fetched == [["encoded", "text"]]
