"""Server reflection over a real loopback socket resolves every service a server lists, in both
protocols clients speak (grpc.reflection.v1, which current grpcurl asks first, and v1alpha):
`grpcurl describe` works on each, the reflection services included."""

from __future__ import annotations

import asyncio

import pytest

from libs.contract.epd.v1 import encoder_pb2_grpc, service_info_pb2
from libs.rpc.server import EpdServer, ServerOptions
from tests.support.reflection import PROTOCOLS, describe

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_listed_service_resolves(protocol: str) -> None:
    async def scenario() -> dict[str, list[str]]:
        server = EpdServer(ServerOptions(grace_s=1.0), service_info_pb2.ServiceInfo)
        server.add(
            encoder_pb2_grpc.add_EncoderServiceServicer_to_server,
            encoder_pb2_grpc.EncoderServiceServicer(),
            "epd.v1.EncoderService",
        )
        await server.start()
        try:
            return await asyncio.to_thread(describe, server.address, protocol)
        finally:
            await server.stop()

    services = asyncio.run(scenario())
    assert services["grpc.reflection.v1.ServerReflection"] == ["ServerReflectionInfo"]
    assert services["grpc.reflection.v1alpha.ServerReflection"] == ["ServerReflectionInfo"]
    assert {"Check", "Watch"} <= set(services["grpc.health.v1.Health"])
    assert services["epd.v1.EncoderService"] == ["Encode"]
    assert "GetServiceInfo" in services["epd.v1.ServiceInfoService"]
