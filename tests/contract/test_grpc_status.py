"""Typed errors become gRPC statuses on a real server over a loopback socket; malformed wire bytes
stay gRPC's INTERNAL and never reach the handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from libs.contract import validation
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
    layout_pb2,
)
from libs.contract.errors import ResourceExhausted
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY, ErrorMappingInterceptor
from tests.support import samples

pytestmark = pytest.mark.unit


class Encoder(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        self.calls += 1
        validation.validate_encode_request(request)
        if request.request_id == "full":
            raise ResourceExhausted("encoder queue is full (8 of 8)")
        if request.request_id == "bug":
            raise KeyError("secret internal detail")
        return encoder_pb2.EncodeResponse(items=[layout_pb2.EncodedMedia()])


class Generate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        yield generate_pb2.GenerateResponse(request_id="r", chunk=generation_pb2.TokenChunk(token_ids=[1]))
        validation.validate_generate_request(request)  # fails after the first chunk for bad requests
        yield generate_pb2.GenerateResponse(request_id="r", chunk=generation_pb2.TokenChunk(token_ids=[2]))


async def _serve(encoder: Encoder) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(encoder, server)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(Generate(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_statuses_over_a_real_socket() -> None:
    async def scenario() -> None:
        encoder = Encoder()
        server, port = await _serve(encoder)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = encoder_pb2_grpc.EncoderServiceStub(channel)
                ok = await stub.Encode(samples.encode_request(), timeout=10)
                assert len(ok.items) == 1

                bad = samples.encode_request()
                bad.items[1].item_index = 0
                call = stub.Encode(bad, timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "items[1].item_index: duplicate item_index 0" in (caught.value.details() or "")
                trailers = dict(await call.trailing_metadata() or ())
                assert trailers[ERROR_FIELD_METADATA_KEY] == "items[1].item_index"

                full = samples.encode_request()
                full.request_id = "full"
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Encode(full, timeout=10)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                buggy = samples.encode_request()
                buggy.request_id = "bug"
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Encode(buggy, timeout=10)
                assert caught.value.code() == grpc.StatusCode.INTERNAL
                assert "secret" not in (caught.value.details() or "")

                # Malformed wire bytes: gRPC rejects them before our handler runs.
                calls_before = encoder.calls
                raw = channel.unary_unary(
                    "/epd.v1.EncoderService/Encode",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await raw(b"\xff\xff\xff\xff\x0f", timeout=10)
                assert caught.value.code() == grpc.StatusCode.INTERNAL
                assert encoder.calls == calls_before

                # A streaming handler failing mid-stream: the chunks sent stay delivered.
                gen = generate_pb2_grpc.GenerateServiceStub(channel)
                request = samples.generate_request()
                request.sampling.top_k = -3
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for response in gen.Generate(request, timeout=10):
                        received.append(list(response.chunk.token_ids))
                assert received == [[1]]
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (caught.value.details() or "").startswith("sampling.top_k")

                # The server is still healthy afterwards.
                again = await stub.Encode(samples.encode_request(), timeout=10)
                assert len(again.items) == 1
        finally:
            await server.stop(grace=None)

    asyncio.run(scenario())
