"""The door's process: settings, the router channel, the media fetcher, uvicorn on a socket we bind
(port 0 by default, like every EPD service, then `openai_door listening on HOST:PORT`)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
from pathlib import Path

import structlog
import uvicorn
from grpc_health.v1 import health_pb2_grpc

from libs.config import ClientAuthSettings, CommonSettings, setting
from libs.config.settings import main_settings
from libs.contract.epd.v1 import generate_pb2_grpc
from libs.fetch import FetchClient, FetchLimits
from libs.rpc import security
from libs.rpc import server as rpc_server
from libs.rpc.main import exit_with_parent
from libs.rpc.security import TlsMaterial
from libs.telemetry import configure_logging, configure_tracing
from services.openai_door.app import DoorConfig, create_app, router_health, whisper_vocab
from services.openai_door.calls import Caller

NAME = "openai_door"


@dataclasses.dataclass(frozen=True)
class DoorSettings(ClientAuthSettings, CommonSettings):
    """OpenAI-compatible HTTP API in front of the router (`tls_*`: HTTPS with this certificate, and
    mutual TLS to the router; tokens: what clients present, passed on to the router)."""

    router: str = setting("", "the router's address, HOST:PORT (required)")
    model: Path = setting(Path("var/models/qwen2_5_omni-tiny"), "the checkpoint the stack serves (/v1/models root)")
    served_model_name: str = setting(
        "", "the model id clients send and /v1/models lists; empty: the model directory's name"
    )
    request_timeout_s: float = setting(600.0, "deadline of each Generate call, in seconds")
    default_temperature: float = setting(1.0, "temperature of requests that send none (OpenAI's default is 1)")
    max_body_mib: int = setting(64, "largest request body accepted, in MiB (413 beyond)")
    fetch_max_mib: int = setting(
        20, "largest media item fetched from a URL or decoded from a data URL, in MiB (413 beyond)"
    )
    fetch_timeout_s: float = setting(10.0, "longest a media URL fetch may take, in seconds")
    fetch_max_redirects: int = setting(3, "redirects followed per media URL")
    fetch_allow_private: bool = setting(
        False, "allow media URLs on loopback, link-local and private addresses (off: SSRF protection)"
    )
    grace_s: float = setting(10.0, "seconds open requests get on shutdown")


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a keep-alive connection's small SSE writes wait
    # for the client's delayed ACK and a whole stream arrives at once (TTFT ~ end-to-end time).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


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
    caller = Caller(generate_pb2_grpc.GenerateServiceStub(channel), settings.request_timeout_s)
    health_stub = health_pb2_grpc.HealthStub(channel)
    limits = FetchLimits(
        max_bytes=settings.fetch_max_mib << 20,
        timeout_s=settings.fetch_timeout_s,
        max_redirects=settings.fetch_max_redirects,
        allow_private=settings.fetch_allow_private,
    )
    fetch = FetchClient(limits)
    config = DoorConfig(
        served_model=settings.served_model_name or settings.model.name,
        model_root=settings.model.resolve(),
        default_temperature=settings.default_temperature,
        max_body_bytes=settings.max_body_mib << 20,
        tokens=tokens,
        speech=whisper_vocab(settings.model),
    )
    app = create_app(config, caller, fetch, lambda: router_health(health_stub))
    sock = _bind(settings.host, settings.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(settings.grace_s),
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sock.getsockname()[:2]
        scheme = "https" if tls else "http"
        structlog.get_logger(NAME).info("serving", url=f"{scheme}://{host}:{port}/v1", router=settings.router)
        print(f"{NAME} listening on {host}:{port}", flush=True)
    try:
        await serving
    finally:
        await fetch.close()
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
