"""gRPC adapter of the router: `GenerateService` over `Router`, plus the process entry point."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Literal

import structlog

from libs.config import CommonSettings, setting
from libs.config.settings import main_settings
from libs.contract import version
from libs.contract.epd.v1 import (
    decode_pb2_grpc,
    encoder_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    lease_pb2_grpc,
    prefill_decode_pb2_grpc,
    prefill_pb2_grpc,
    service_info_pb2,
)
from libs.rpc.admission import Admission, deadline_of
from libs.rpc.peers import PeerDirectory
from libs.rpc.server import EpdServer, ServerOptions
from libs.telemetry import bind_request, configure_logging, configure_tracing
from services.router.core import Backends, EncoderPool, Router

SERVICE_NAME = "epd-router"


@dataclasses.dataclass(frozen=True)
class RouterSettings(CommonSettings):
    """Router: client-facing Generate over encoders and prefill/decode (E/P/D) or PD (E+PD)."""

    layout: Literal["e/p/d", "e+pd"] = setting("e/p/d", "deployment layout behind the router")
    encoders: tuple[str, ...] = setting((), "encoder addresses, comma-separated")
    prefill: str = setting("", "prefill address (e/p/d)")
    decode: str = setting("", "decode address (e/p/d)")
    pd: str = setting("", "prefill-decode address (e+pd)")
    max_running: int = setting(64, "requests generating at once")
    max_waiting: int = setting(256, "requests waiting for a slot before RESOURCE_EXHAUSTED")
    grace_s: float = setting(10.0, "seconds in-flight requests get on shutdown")


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, router: Router, admission: Admission) -> None:
        self._router = router
        self._admission = admission

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        deadline = deadline_of(context.time_remaining())
        with bind_request(request.request_id or "-"):
            async with self._admission.slot(deadline):
                async for response in self._router.generate(request, deadline):
                    yield response


def build(settings: RouterSettings, peers: PeerDirectory) -> tuple[EpdServer, Router]:
    """Wire the router's server from settings (channels are shared through `peers`)."""
    if not settings.encoders:
        raise SystemExit("router: --encoders is required")
    if settings.layout == "e/p/d":
        if not (settings.prefill and settings.decode):
            raise SystemExit("router: --prefill and --decode are required for layout e/p/d")
        backends = Backends(
            encoder=lambda a: encoder_pb2_grpc.EncoderServiceStub(peers.channel(a)),
            lease=lambda a: lease_pb2_grpc.LeaseServiceStub(peers.channel(a)),
            prefill=prefill_pb2_grpc.PrefillServiceStub(peers.channel(settings.prefill)),
            decode=decode_pb2_grpc.DecodeServiceStub(peers.channel(settings.decode)),
        )
    else:
        if not settings.pd:
            raise SystemExit("router: --pd is required for layout e+pd")
        backends = Backends(
            encoder=lambda a: encoder_pb2_grpc.EncoderServiceStub(peers.channel(a)),
            lease=lambda a: lease_pb2_grpc.LeaseServiceStub(peers.channel(a)),
            prefill_decode=prefill_decode_pb2_grpc.PrefillDecodeServiceStub(peers.channel(settings.pd)),
        )
    router = Router(backends, EncoderPool(settings.encoders))

    def info() -> service_info_pb2.ServiceInfo:
        return service_info_pb2.ServiceInfo(
            contract_version=version.current(),
            role=service_info_pb2.SERVICE_ROLE_ROUTER,
            software_version="epd 0.1.0",
        )

    server = EpdServer(ServerOptions(host=settings.host, port=settings.port, grace_s=settings.grace_s), info)
    admission = Admission("router", settings.max_running, settings.max_waiting)
    server.add(
        generate_pb2_grpc.add_GenerateServiceServicer_to_server,
        GenerateServicer(router, admission),
        "epd.v1.GenerateService",
    )
    return server, router


async def _main(settings: RouterSettings) -> None:
    peers = PeerDirectory(roles=[])
    server, _ = build(settings, peers)
    await server.start()
    print(f"router listening on {server.address}", flush=True)
    await server.wait_for_termination()
    await peers.close()


def main() -> None:
    settings = main_settings(RouterSettings, prog="epd-router")
    configure_logging(SERVICE_NAME, settings.log_level, settings.log_format)
    tracing = configure_tracing(
        SERVICE_NAME, "0.1.0", settings.trace_exporter, settings.trace_file, settings.otlp_endpoint
    )
    structlog.get_logger(__name__).info("starting", settings=dataclasses.asdict(settings))
    try:
        asyncio.run(_main(settings))
    finally:
        tracing.shutdown()
