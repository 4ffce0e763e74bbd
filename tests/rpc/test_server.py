"""EpdServer over a real loopback socket: health, reflection, service info, status mapping, and a
graceful stop that lets in-flight RPCs finish while refusing new ones."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from libs.contract import version
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    service_info_pb2,
    service_info_pb2_grpc,
)
from libs.contract.validation import validate_encode_request
from libs.rpc.server import EpdServer, ServerOptions, channel_options
from tests.support import samples

pytestmark = pytest.mark.unit


class SlowEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Answers at once, except a request "held", which waits for `release` (after `started`)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        validate_encode_request(request)
        if request.request_id == "held":
            self.started.set()
            await self.release.wait()
        return encoder_pb2.EncodeResponse()


def _request(request_id: str = "quick") -> encoder_pb2.EncodeRequest:
    request = samples.encode_request()
    request.request_id = request_id
    return request


def test_standard_services_and_graceful_stop() -> None:
    async def scenario() -> None:
        encoder = SlowEncoder()
        server = EpdServer(ServerOptions(grace_s=30.0), samples.service_info)
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, encoder, "epd.v1.EncoderService")
        port = await server.start()
        assert port > 0 and server.address == f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(server.address, options=channel_options()) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "epd.v1.EncoderService", "epd.v1.ServiceInfoService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

            info = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                service_info_pb2.GetServiceInfoRequest(caller_contract_version=version.current()), timeout=5
            )
            assert info.info.role == service_info_pb2.SERVICE_ROLE_ENCODER
            assert (info.info.contract_version.major, info.info.contract_version.minor) == (1, version.CONTRACT_MINOR)

            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            services: set[str] = set()
            async for reply in reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            ):
                services = {s.name for s in reply.list_services_response.service}
            assert {"epd.v1.EncoderService", "epd.v1.ServiceInfoService", "grpc.health.v1.Health"} <= services
            # grpc.reflection.v1, what current grpcurl asks first: the same messages under another name.
            v1 = channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            replies = [
                reply
                async for reply in v1(
                    iter(
                        [
                            reflection_pb2.ServerReflectionRequest(list_services=""),
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="epd.v1.EncoderService"),
                        ]
                    ),
                    timeout=5,
                )
            ]
            listed = {s.name for s in replies[0].list_services_response.service}
            assert {"grpc.reflection.v1.ServerReflection", "epd.v1.EncoderService"} <= listed
            assert replies[1].file_descriptor_response.file_descriptor_proto  # the schema, for grpcurl describe

            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            bad = _request()
            bad.ClearField("accepted_transports")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Encode(bad, timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            in_flight = asyncio.ensure_future(stub.Encode(_request("held"), timeout=60))
            await asyncio.wait_for(encoder.started.wait(), 30)
            refusing = asyncio.Event()

            async def drain(_grace: float) -> None:
                refusing.set()  # the server refuses new calls from the moment this returns

            stopping = asyncio.ensure_future(server.stop(drain=drain))
            await asyncio.wait_for(refusing.wait(), 30)  # resumed once the stop refuses, not before
            # ... and once this client knows (the server's GOAWAY: its connection is no longer used
            # for new calls). A call sent before that crosses the shutdown: CANCELLED, the stop race
            # of libs/rpc/retry.py, not the refusal this checks.
            while channel.get_state() == grpc.ChannelConnectivity.READY:
                await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 30)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Encode(_request(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not in_flight.done()  # still held by the handler, across the refusal
            encoder.release.set()
            assert isinstance(await in_flight, encoder_pb2.EncodeResponse)  # finished within the grace period
            await stopping

    asyncio.run(scenario())


def test_a_service_told_to_fail_stops_without_a_drain_and_exits_with_the_reason() -> None:
    """What a vLLM service past its engine-restart bound does (libs/backends/vllm/supervisor.py):
    `serve` stops the server, closes the service's resources, and raises SystemExit(reason)."""
    from libs.config import CommonSettings
    from libs.rpc.main import ServiceParts, serve

    closed: list[bool] = []
    drained: list[float] = []

    async def close() -> None:
        closed.append(True)

    async def drain(grace: float) -> None:
        drained.append(grace)

    def fatal(fail: Any) -> None:
        asyncio.get_running_loop().call_soon(fail, "vLLM engine failed again after 1 restart(s)")

    parts = ServiceParts(servicers=[], info=samples.service_info, close=close, drain=drain, fatal=fatal)

    async def scenario() -> SystemExit:
        try:
            async with asyncio.timeout(30):  # not wait_for: a SystemExit out of a task stops the loop
                await serve("pd", CommonSettings(), parts, grace_s=30.0)
        except SystemExit as exc:
            return exc
        raise AssertionError("serve returned instead of ending the service with an error")

    ended = asyncio.run(scenario())
    assert ended.code == "pd: vLLM engine failed again after 1 restart(s)"  # exit status 1
    assert closed == [True] and drained == []
