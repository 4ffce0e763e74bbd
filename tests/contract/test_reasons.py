"""Failure reasons on the wire (contract 1.5): a typed error's reason reaches the caller as a
`google.rpc.ErrorInfo` in `grpc-status-details-bin` over a real loopback server, beside the
`epd-error-field` key and with code and message unchanged; `reason_of` reads it, and gives None for
a status without one, for one it cannot trust, and for a reason this build does not know."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    error_reason_pb2,
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
)
from libs.contract.errors import InvalidArgument, NotFound, Unavailable
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY, ErrorMappingInterceptor
from libs.contract.reasons import (
    DOMAIN,
    STATUS_DETAILS_KEY,
    Reason,
    reason_in,
    reason_of,
    status_details,
)
from tests.support import samples

pytestmark = pytest.mark.unit

DRAINING_MESSAGE = "encoder is draining for shutdown; retry elsewhere or later"


def test_the_reasons_are_the_contracts_error_reason_names() -> None:
    names = {name.removeprefix("ERROR_REASON_") for name in error_reason_pb2.ErrorReason.DESCRIPTOR.values_by_name}
    assert names - {"UNSPECIFIED"} == {reason.value for reason in Reason}


class Encoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Fails each call as its request id says."""

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        if request.request_id == "draining":
            raise Unavailable(DRAINING_MESSAGE, reason=Reason.DRAINING)
        if request.request_id == "field":  # no raise site pairs these: the two keys are independent
            raise InvalidArgument("items[0].media", "embedding gone", reason=Reason.EMBEDDING_GONE)
        raise NotFound("items[0]: not in the encoder cache")  # no reason


class Generate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        yield generate_pb2.GenerateResponse(request_id="r", chunk=generation_pb2.TokenChunk(token_ids=[1]))
        raise NotFound("kv_cache: lease expired", reason=Reason.KV_GONE)


async def _with_server(use: Callable[[grpc.aio.Channel], Awaitable[None]]) -> None:
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(Encoder(), server)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(Generate(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await use(channel)
    finally:
        await server.stop(None)


async def _encode_error(channel: grpc.aio.Channel, request_id: str) -> grpc.aio.AioRpcError:
    request = samples.encode_request()
    request.request_id = request_id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(request, timeout=10)
    return caught.value


def test_a_reason_round_trips_over_a_real_socket() -> None:
    async def use(channel: grpc.aio.Channel) -> None:
        draining = await _encode_error(channel, "draining")
        assert draining.code() == grpc.StatusCode.UNAVAILABLE
        assert draining.details() == DRAINING_MESSAGE
        assert reason_of(draining) == Reason.DRAINING
        # The standard rich status: code and message repeated, one ErrorInfo in its details.
        trailers = dict(draining.trailing_metadata())
        status = status_pb2.Status.FromString(trailers[STATUS_DETAILS_KEY])
        assert (status.code, status.message) == (grpc.StatusCode.UNAVAILABLE.value[0], DRAINING_MESSAGE)
        (detail,) = status.details
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info) and (info.domain, info.reason) == (DOMAIN, "DRAINING")

        # Field key and reason side by side.
        field = await _encode_error(channel, "field")
        assert field.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field.details() == "items[0].media: embedding gone"
        assert dict(field.trailing_metadata())[ERROR_FIELD_METADATA_KEY] == "items[0].media"
        assert reason_of(field) == Reason.EMBEDDING_GONE

        # An error without a reason sends no rich status.
        plain = await _encode_error(channel, "plain")
        assert plain.code() == grpc.StatusCode.NOT_FOUND
        assert STATUS_DETAILS_KEY not in dict(plain.trailing_metadata())
        assert reason_of(plain) is None

        # A stream failing after its first chunk: the chunk stays delivered, the reason arrives.
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            stream = generate_pb2_grpc.GenerateServiceStub(channel).Generate(samples.generate_request(), timeout=10)
            async for response in stream:
                received.append(list(response.chunk.token_ids))
        assert received == [[1]]
        assert (caught.value.code(), reason_of(caught.value)) == (grpc.StatusCode.NOT_FOUND, Reason.KV_GONE)

    asyncio.run(_with_server(use))


def test_grpc_cores_own_statuses_carry_no_reason() -> None:
    async def use(channel: grpc.aio.Channel) -> None:
        unimplemented = channel.unary_unary("/epd.v1.Nothing/Here")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await unimplemented(b"", timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED and reason_of(caught.value) is None

    asyncio.run(_with_server(use))

    async def unreachable() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/epd.v1.EncoderService/Encode")(b"", timeout=10)
            return caught.value

    error = asyncio.run(unreachable())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and reason_of(error) is None


def _error(code: grpc.StatusCode, *trailers: tuple[str, str | bytes]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details="x")


def _rich(code: int, *infos: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> bytes:
    status = status_pb2.Status(code=code, message="x")
    for info in infos:
        status.details.add().Pack(info)
    return status.SerializeToString()


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
DRAINING_INFO = error_details_pb2.ErrorInfo(domain=DOMAIN, reason="DRAINING")

# Trailers `reason_of` reads as no reason, and why.
NO_REASON = {
    "old-style status (1.4 peer: code and message only)": (),
    "only the field key": ((ERROR_FIELD_METADATA_KEY, "items[0]"),),
    "undecodable bytes": ((STATUS_DETAILS_KEY, b"\xff\xff\xff"),),
    "rich status of another code (a proxy rewrote the code)": (
        (STATUS_DETAILS_KEY, _rich(grpc.StatusCode.INTERNAL.value[0], DRAINING_INFO)),
    ),
    "another domain's ErrorInfo": (
        (STATUS_DETAILS_KEY, _rich(UNAVAILABLE, error_details_pb2.ErrorInfo(domain="other", reason="DRAINING"))),
    ),
    "a reason this build does not know (a newer peer's)": (
        (STATUS_DETAILS_KEY, _rich(UNAVAILABLE, error_details_pb2.ErrorInfo(domain=DOMAIN, reason="NEWER"))),
    ),
    "no details at all": ((STATUS_DETAILS_KEY, _rich(UNAVAILABLE)),),
}


@pytest.mark.parametrize("trailers", NO_REASON.values(), ids=NO_REASON.keys())
def test_a_status_without_a_trusted_known_reason_gives_none(trailers: tuple[tuple[str, str | bytes], ...]) -> None:
    assert reason_of(_error(grpc.StatusCode.UNAVAILABLE, *trailers)) is None


def test_the_epd_error_info_is_found_among_other_details() -> None:
    other = error_details_pb2.RetryInfo()
    other.retry_delay.FromMilliseconds(500)
    trailers = ((ERROR_FIELD_METADATA_KEY, "items[0]"), (STATUS_DETAILS_KEY, _rich(UNAVAILABLE, other, DRAINING_INFO)))
    assert reason_of(_error(grpc.StatusCode.UNAVAILABLE, *trailers)) == Reason.DRAINING


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_encodes_and_decodes(reason: Reason) -> None:
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = ((STATUS_DETAILS_KEY, status_details(code, "m", reason)),)
    assert reason_in(trailers, code) == reason
    assert reason_in(trailers, grpc.StatusCode.UNAVAILABLE) is None  # the code must match
