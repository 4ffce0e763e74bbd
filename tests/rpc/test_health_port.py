"""The plaintext health port (`--health-port`): what Kubernetes' gRPC probes call, since they cannot
speak TLS. On a mutual-TLS server it answers grpc.health.v1 without a certificate, serves nothing
else, and follows the main port's status (NOT_SERVING once the server drains)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.launch.process import free_port
from libs.rpc.certs import LocalCa
from libs.rpc.server import EpdServer, ServerOptions
from tests.support import samples

pytestmark = pytest.mark.unit


def test_health_port_answers_plaintext_beside_a_tls_server() -> None:
    ca = LocalCa.create("cluster CA")

    async def scenario() -> None:
        health_port = free_port()
        server = EpdServer(
            ServerOptions(tls=ca.issue("encoder"), health_port=health_port, grace_s=2.0), samples.service_info
        )
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Nothing but health on that port: not even the open ServiceInfo.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                    service_info_pb2.GetServiceInfoRequest(), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The main port still refuses a plaintext caller.
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        async def drain(_grace: float) -> None:
            # While draining, the probe port already reports NOT_SERVING (readiness fails).
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            statuses.append(reply.status)

        statuses: list[int] = []
        await server.stop(drain=drain)
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)

    asyncio.run(scenario())


def test_no_health_port_by_default() -> None:
    async def scenario() -> None:
        server = EpdServer(ServerOptions(), samples.service_info)
        await server.start()
        assert server._health_server is None
        await server.stop(grace_s=0.5)

    asyncio.run(scenario())
