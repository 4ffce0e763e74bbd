"""The door as a process of its own (placement process): settings, the router channel, the door's
server (libs/door/server.py) on a socket it binds (port 0 by default, like every EPD service, then
`openai_door listening on HOST:PORT`). The default placement serves the same component from the
router's process instead (the router's `--openai-port`, libs/door/in_process.py); this one scales
the HTTP side apart from the router and fronts the colocated service, which has no door of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import signal

import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.config import ClientAuthSettings, CommonSettings, setting
from libs.config.settings import main_settings
from libs.contract.epd.v1 import generate_pb2_grpc
from libs.door.calls import over_grpc
from libs.door.server import DoorHttpSettings, DoorServer
from libs.rpc import security
from libs.rpc import server as rpc_server
from libs.rpc.main import exit_with_parent
from libs.rpc.security import TlsMaterial
from libs.telemetry import configure_logging, configure_tracing

NAME = "openai_door"


@dataclasses.dataclass(frozen=True)
class DoorSettings(DoorHttpSettings, ClientAuthSettings, CommonSettings):
    """OpenAI-compatible HTTP API in front of the router (`tls_*`: HTTPS with this certificate, and
    mutual TLS to the router; tokens: what clients present, passed on to the router)."""

    router: str = setting("", "the router's address, HOST:PORT (required)")
    request_timeout_s: float = setting(600.0, "deadline of each Generate call, in seconds")
    grace_s: float = setting(10.0, "seconds open requests get on shutdown")


async def router_health(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
    except Exception:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def serve(settings: DoorSettings) -> None:
    if not settings.router:
        raise SystemExit(f"{NAME}: --router is required")
    try:
        tokens = security.load_tokens(settings.auth_tokens_file, settings.auth_tokens)
        tls = TlsMaterial.from_settings(settings.tls_ca, settings.tls_cert, settings.tls_key)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{NAME}: {exc}") from None
    if tokens and tls is None:
        raise SystemExit(f"{NAME}: bearer tokens need TLS (--tls-ca, --tls-cert, --tls-key): they would cross in clear")
    security.configure(tls)  # the router channel: mutual TLS with this process's certificate
    channel = rpc_server.open_channel(settings.router)
    health_stub = health_pb2_grpc.HealthStub(channel)
    door = DoorServer(
        settings,
        over_grpc(generate_pb2_grpc.GenerateServiceStub(channel), settings.request_timeout_s),
        lambda: router_health(health_stub),
        tokens=tokens,
        tls_cert=settings.tls_cert,
        tls_key=settings.tls_key,
        grace_s=settings.grace_s,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, door.shutdown)
    try:
        address = await door.start(settings.host, settings.port)
        structlog.get_logger(NAME).info("serving", url=door.url, router=settings.router)
        print(f"{NAME} listening on {address}", flush=True)
        await door.wait()
    finally:
        await door.stop()
        await channel.close(None)


def main() -> None:
    settings = main_settings(DoorSettings, prog=f"epd-{NAME}")
    configure_logging(NAME, settings.log_level, settings.log_format)
    tracing = configure_tracing(NAME, "0.1.0", settings.trace_exporter, settings.trace_file, settings.otlp_endpoint)
    exit_with_parent()
    try:
        asyncio.run(serve(settings))
    finally:
        tracing.shutdown()
