"""One way to run an EPD gRPC server.

`EpdServer` wires what every service needs around its own servicers: the status-mapping
interceptor, standard health checking (`grpc.health.v1`), server reflection, `ServiceInfoService`,
bounded message sizes, and a graceful stop that flips health to NOT_SERVING, refuses new RPCs and
lets in-flight ones finish within a grace period.

Called by each service's `main` (one server per process).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from libs.contract import version
from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.contract.grpc_status import ErrorMappingInterceptor
from libs.contract.validation import validate_get_service_info_request
from libs.telemetry.propagation import TracingServerInterceptor, client_interceptors

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """Listening address and resource bounds of a server."""

    host: str = "127.0.0.1"
    port: int = 0
    # Bounds every message; media ride inline up to validation's 64 MiB per item.
    max_message_bytes: int = 80 << 20
    # Concurrent RPCs beyond which gRPC itself answers RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 1024
    # Seconds in-flight RPCs get to finish on stop.
    grace_s: float = 10.0


def channel_options(max_message_bytes: int = 80 << 20) -> list[tuple[str, Any]]:
    """Client channel options matching `ServerOptions` bounds."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(address: str) -> grpc.aio.Channel:
    """An EPD client channel: message bounds, and the trace context on every call."""
    return grpc.aio.insecure_channel(address, options=channel_options(), interceptors=client_interceptors())


class _ServiceInfoServicer(service_info_pb2_grpc.ServiceInfoServiceServicer):
    def __init__(self, info: Callable[[], service_info_pb2.ServiceInfo]) -> None:
        self._info = info

    async def GetServiceInfo(
        self, request: service_info_pb2.GetServiceInfoRequest, context: Any
    ) -> service_info_pb2.GetServiceInfoResponse:
        validate_get_service_info_request(request)
        if request.HasField("caller_contract_version"):
            problem = version.incompatibility(request.caller_contract_version)
            if problem:
                _log.warning("incompatible caller", reason=problem)
        return service_info_pb2.GetServiceInfoResponse(info=self._info())


class EpdServer:
    """A `grpc.aio` server with EPD's standard services. Add servicers, then `start()`."""

    def __init__(self, options: ServerOptions, info: Callable[[], service_info_pb2.ServiceInfo]) -> None:
        self.options = options
        self._server = grpc.aio.server(
            # Tracing outermost, so the server span also covers the status mapping.
            interceptors=[TracingServerInterceptor(), ErrorMappingInterceptor()],
            options=[
                *channel_options(options.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=options.max_concurrent_rpcs,
        )
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # missing from its stubs
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.add(
            service_info_pb2_grpc.add_ServiceInfoServiceServicer_to_server,
            _ServiceInfoServicer(info),
            "epd.v1.ServiceInfoService",
        )
        self.port = 0
        self._stopping: asyncio.Event | None = None

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str) -> None:
        """Register a servicer (with its generated `add_*_to_server`) under its full service name."""
        register(servicer, self._server)
        self._service_names.append(full_name)

    async def start(self) -> int:
        """Bind, start serving, mark every service SERVING; returns the bound port."""
        reflection.enable_server_reflection(self._service_names, self._server)
        address = f"{self.options.host}:{self.options.port}"
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        await self._server.start()
        for name in ["", *self._service_names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._stopping = asyncio.Event()
        _log.info("serving", address=f"{self.options.host}:{self.port}", services=self._service_names)
        return self.port

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def stop(self, grace_s: float | None = None, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        """Drain: health NOT_SERVING; `drain(seconds)` (the service refusing new work while what it
        holds for others is consumed, the server still answering handshakes and lease releases);
        then refuse every RPC and give in-flight ones the rest of the grace period."""
        grace = self.options.grace_s if grace_s is None else grace_s
        started = time.monotonic()
        await self._health.enter_graceful_shutdown()
        if drain is not None:
            await drain(grace)
        await self._server.stop(max(0.0, grace - (time.monotonic() - started)))
        if self._stopping is not None:
            self._stopping.set()
        _log.info("stopped", address=self.address)

    async def wait_for_termination(self, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then drain within the grace period."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        await stop_requested.wait()
        _log.info("signal received; draining", grace_s=self.options.grace_s)
        await self.stop(drain=drain)
