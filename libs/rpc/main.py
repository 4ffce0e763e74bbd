"""The `main` every EPD service process shares: settings, logging, tracing, one `EpdServer`, a
"<name> listening on HOST:PORT" line on stdout (what launchers wait for), drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from libs.config import ClientAuthSettings, CommonSettings
from libs.config.settings import main_settings
from libs.contract.epd.v1 import service_info_pb2
from libs.rpc import security
from libs.rpc.security import TlsMaterial
from libs.rpc.server import EpdServer, ServerOptions
from libs.telemetry import configure_logging, configure_tracing
from libs.telemetry.tracing import configure_metrics

S = TypeVar("S", bound=CommonSettings)

Register = Callable[[Any, Any], None]
# Sets every service of the server SERVING (True) or NOT_SERVING (False).
HealthSetter = Callable[[bool], Awaitable[None]]
# Settings never written to the log.
_SECRET = {"auth_tokens"}


@dataclasses.dataclass
class ServiceParts:
    """What a service contributes to its server."""

    servicers: list[tuple[Register, Any, str]]  # (generated add_*_to_server, servicer, full service name)
    info: Callable[[], service_info_pb2.ServiceInfo]
    close: Callable[[], Awaitable[None]] | None = None
    # Called with the bound address once the server listens (producers put it into handles).
    on_started: Callable[[str], None] | None = None
    # On shutdown, before the server stops: refuse new work and let held work finish (seconds given).
    drain: Callable[[float], Awaitable[None]] | None = None
    # Given the server's health setter once it serves: a service whose engine can die reports it.
    health: Callable[[HealthSetter], None] | None = None
    # Given a callable that ends the service with an error (exit non-zero): a service whose engine
    # cannot be brought back (past its restart bound) calls it with the reason.
    fatal: Callable[[Callable[[str], None]], None] | None = None
    # Serves clients (router, colocated) rather than peers: see libs/rpc/security.py.
    public: bool = False
    # Bearer tokens a public server accepts (empty: none needed).
    tokens: frozenset[str] = frozenset()
    # Awaited once the server listens and its line is out: a second listener of the process (the
    # router's OpenAI door), which prints its own "<name> listening on HOST:PORT" line. Raising
    # stops the service.
    after_listening: Callable[[], Awaitable[None]] | None = None


async def serve(name: str, settings: CommonSettings, parts: ServiceParts, grace_s: float) -> None:
    """Run one server until a signal, then drain and close the service's resources."""
    options = ServerOptions(
        host=settings.host,
        port=settings.port,
        grace_s=grace_s,
        tls=security.material(),
        public=parts.public,
        tokens=parts.tokens,
        health_port=settings.health_port,
    )
    server = EpdServer(options, parts.info)
    for register, servicer, full_name in parts.servicers:
        server.add(register, servicer, full_name)
    await server.start()
    if parts.on_started is not None:
        parts.on_started(server.address)
    if parts.health is not None:
        parts.health(server.set_serving)
    if parts.fatal is not None:
        parts.fatal(server.fail)
    print(f"{name} listening on {server.address}", flush=True)
    try:
        if parts.after_listening is not None:
            await parts.after_listening()
        await server.wait_for_termination(parts.drain)
    finally:
        if parts.close is not None:
            await parts.close()
    if server.failure:
        raise SystemExit(f"{name}: {server.failure}")  # exit status 1, the reason on stderr


def client_facing(parts: ServiceParts, settings: ClientAuthSettings) -> ServiceParts:
    """Mark a server as one clients call (router, colocated), with the bearer tokens it accepts."""
    try:
        tokens = security.load_tokens(settings.auth_tokens_file, settings.auth_tokens)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"client authentication: {exc}") from None
    return dataclasses.replace(parts, public=True, tokens=tokens)


def exit_with_parent() -> None:
    """Launched by a launcher (EPD_PARENT_PID): drain and exit if it dies without stopping us, so an
    aborted test run or a killed `epd up` leaves no orphans holding memory and ports."""
    parent = os.environ.get("EPD_PARENT_PID", "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def service_main(name: str, settings_cls: type[S], setup: Callable[[S], Awaitable[ServiceParts]]) -> None:
    """Entry point of `python -m services.<name>`."""
    settings = main_settings(settings_cls, prog=f"epd-{name}")
    configure_logging(name, settings.log_level, settings.log_format)
    tracing = configure_tracing(name, "0.1.0", settings.trace_exporter, settings.trace_file, settings.otlp_endpoint)
    configure_metrics(name, settings.metrics_port, settings.host)
    log = structlog.get_logger(name)
    exit_with_parent()
    log.info("starting", settings={k: str(v) for k, v in dataclasses.asdict(settings).items() if k not in _SECRET})
    try:
        security.configure(TlsMaterial.from_settings(settings.tls_ca, settings.tls_cert, settings.tls_key))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{name}: {exc}") from None

    async def run() -> None:
        parts = await setup(settings)
        await serve(name, settings, parts, float(getattr(settings, "grace_s", 10.0)))

    try:
        asyncio.run(run())
    finally:
        tracing.shutdown()
        log.info("exited")
