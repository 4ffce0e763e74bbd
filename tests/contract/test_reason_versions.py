"""Failure reasons across contract minors, over real loopback servers: a 1.4 peer sends none and a
1.5 caller still tells its draining refusal from its other failures (by the message, the
documented fallback of libs/rpc/retry.py); a 1.5 server's refusal reads to a 1.4 caller exactly as
a 1.4 server's did (same code, message with "draining", field key), the rich status beside it
ignored. The 1.4 side runs the v1.4 snapshot's generated stubs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc
from libs.contract.errors import InvalidArgument
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY, ErrorMappingInterceptor
from libs.contract.reasons import STATUS_DETAILS_KEY, Reason, reason_of
from libs.contract.snapshots.v1_4.epd.v1 import encoder_pb2 as encoder_v1_4
from libs.contract.snapshots.v1_4.epd.v1 import encoder_pb2_grpc as encoder_grpc_v1_4
from libs.rpc.admission import Admission
from libs.rpc.retry import going_away, went_away

pytestmark = pytest.mark.unit


def _stopping_at_1_4(code: grpc.StatusCode, details: str | None) -> bool:
    """What a contract 1.4 router decided (libs/rpc/retry.py `stopping` as released with 1.4)."""
    if code == grpc.StatusCode.CANCELLED:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and "draining" in (details or "")


# Failures of a 1.4 encoder: the code and message it sent.
FAILURES_1_4 = {
    "draining": (grpc.StatusCode.UNAVAILABLE, "encoder is draining for shutdown; retry elsewhere or later"),
    "gone": (grpc.StatusCode.UNAVAILABLE, "producer 127.0.0.1:9 unreachable: UNAVAILABLE"),
    "full": (grpc.StatusCode.RESOURCE_EXHAUSTED, "encoder is full: 2 running, 4 waiting (limit 4)"),
}


class Encoder14(encoder_grpc_v1_4.EncoderServiceServicer):
    """A 1.4 encoder: ends failed calls with code and message only, and the field key
    (libs/contract/grpc_status.py at 1.4), with the messages a 1.4 service sent."""

    async def Encode(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        code, message = FAILURES_1_4[request.request_id]
        context.set_code(code)
        context.set_details(message)
        return None


class Encoder15(encoder_pb2_grpc.EncoderServiceServicer):
    """A 1.5 encoder: its admission (draining) and error mapping, the current generated code."""

    def __init__(self) -> None:
        self.admission = Admission("encoder", max_running=1, max_waiting=1)
        self.admission.close()  # draining

    async def Encode(self, request: Any, context: Any) -> Any:
        if request.request_id == "field":  # no raise site pairs these: the two keys are independent
            raise InvalidArgument("items[0].item_index", "duplicate", reason=Reason.EMBEDDING_GONE)
        async with self.admission.slot():
            return encoder_pb2.EncodeResponse()


async def _call(servicer: Any, request_id: str, check: Callable[[grpc.aio.AioRpcError], Awaitable[None]]) -> None:
    """`Encode` on `servicer` from a caller of the other minor (each side its own generated code)."""
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    old_server = isinstance(servicer, Encoder14)
    (encoder_grpc_v1_4 if old_server else encoder_pb2_grpc).add_EncoderServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request: Any = (encoder_pb2 if old_server else encoder_v1_4).EncodeRequest(request_id=request_id)
            stub: Any = (encoder_pb2_grpc if old_server else encoder_grpc_v1_4).EncoderServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Encode(request, timeout=10)
            await check(caught.value)
    finally:
        await server.stop(None)


# What a 1.5 caller makes of each 1.4 failure: (going away, what the router waits out / retries
# elsewhere; went away, what a client retries before its first token).
FROM_1_4 = {"draining": (True, True), "gone": (False, True), "full": (False, False)}


@pytest.mark.parametrize("failure", sorted(FROM_1_4))
def test_a_1_5_caller_reads_a_1_4_peer_by_code_and_message(failure: str) -> None:
    async def check(error: grpc.aio.AioRpcError) -> None:
        assert reason_of(error) is None
        assert (going_away(error), went_away(error)) == FROM_1_4[failure]

    asyncio.run(_call(Encoder14(), failure, check))


def test_a_1_4_caller_reads_a_1_5_draining_refusal_as_before() -> None:
    async def check(error: grpc.aio.AioRpcError) -> None:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert _stopping_at_1_4(error.code(), error.details())  # the message still says "draining"
        assert STATUS_DETAILS_KEY in dict(error.trailing_metadata())  # beside it, for 1.5 callers
        assert reason_of(error) == Reason.DRAINING and going_away(error)

    asyncio.run(_call(Encoder15(), "draining", check))


def test_a_1_4_caller_still_finds_the_field_key_beside_the_reason() -> None:
    async def check(error: grpc.aio.AioRpcError) -> None:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "items[0].item_index: duplicate"
        assert dict(error.trailing_metadata())[ERROR_FIELD_METADATA_KEY] == "items[0].item_index"
        assert reason_of(error) == Reason.EMBEDDING_GONE

    asyncio.run(_call(Encoder15(), "field", check))
