"""One way to run an EPD gRPC server.

`EpdServer` wires what every service needs around its own servicers: the status-mapping
interceptor, access control (mutual TLS and bearer tokens, `libs/rpc/security.py`), standard health
checking (`grpc.health.v1`), server reflection, `ServiceInfoService`, bounded message sizes, and a
graceful stop that flips health to NOT_SERVING, refuses new RPCs and lets in-flight ones finish
within a grace period.

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
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from libs.contract import version
from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.contract.grpc_status import ErrorMappingInterceptor
from libs.contract.validation import validate_get_service_info_request
from libs.rpc import security
from libs.rpc.security import AccessInterceptor, AccessPolicy, TlsMaterial
from libs.telemetry.propagation import TracingServerInterceptor, client_interceptors

_log = structlog.get_logger(__name__)
# After `fail`: seconds the RPCs still in flight get (they are failing already: the engine is gone).
_FAIL_GRACE_S = 1.0

# grpcio-reflection ships only v1alpha, but current clients (grpcurl, Postman, grpc_cli) ask for
# grpc.reflection.v1 first. The two protocols' messages are field-for-field identical (v1 renamed
# the package), so the same servicer answers both, and v1's schema is v1alpha's under v1's names.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_V1_PACKAGE = "grpc.reflection.v1"


def _register_reflection_v1_schema() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default descriptor pool (what reflection
    answers from), so a client can resolve the v1 service it is listed as: built from v1alpha's
    file with the package renamed."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = name, _V1_PACKAGE
    proto.ClearField("options")  # v1alpha's options name v1alpha's Java and Go packages, and deprecate it
    for message in proto.message_type:
        for message_field in message.field:
            if message_field.HasField("type_name"):  # message and enum fields only
                message_field.type_name = message_field.type_name.replace(old, f".{_V1_PACKAGE}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, f".{_V1_PACKAGE}.")
        method.output_type = method.output_type.replace(old, f".{_V1_PACKAGE}.")
    pool.AddSerializedFile(proto.SerializeToString())


def _add_reflection_v1(server: grpc.aio.Server, service_names: list[str]) -> None:
    _register_reflection_v1_schema()
    servicer = reflection.aio.ReflectionServicer(service_names)  # type: ignore[attr-defined]  # missing from __all__
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


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
    # TLS material (None: plaintext). Internal servers then require a CA-signed service certificate.
    tls: TlsMaterial | None = None
    # Serves clients (router, colocated): TLS without client certificates, bearer tokens instead.
    public: bool = False
    # Bearer tokens a public server accepts for Generate (empty: no token needed). Needs TLS.
    tokens: frozenset[str] = frozenset()
    # A second, plaintext port serving grpc.health.v1 alone (same status as the main port), for
    # probes that cannot speak TLS (Kubernetes' gRPC probes); 0: none.
    health_port: int = 0


def channel_options(max_message_bytes: int = 80 << 20) -> list[tuple[str, Any]]:
    """Client channel options matching `ServerOptions` bounds."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(address: str) -> grpc.aio.Channel:
    """A channel to a peer service: message bounds, the trace context on every call, and this
    process's TLS certificate when TLS is configured (`libs.rpc.security.configure`)."""
    tls = security.material()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=channel_options(), interceptors=client_interceptors())
    return grpc.aio.secure_channel(
        address, security.channel_credentials(tls), options=channel_options(), interceptors=client_interceptors()
    )


def sync_channel(address: str) -> grpc.Channel:
    """`open_channel` for blocking callers (transfer threads)."""
    tls = security.material()
    if tls is None:
        return grpc.insecure_channel(address, options=channel_options())
    return grpc.secure_channel(address, security.channel_credentials(tls), options=channel_options())


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
        if options.tokens and options.tls is None:
            raise ValueError("bearer tokens need TLS (--tls-ca/--tls-cert/--tls-key): they would cross in clear")
        self.options = options
        policy = AccessPolicy(public=options.public, tls=options.tls is not None, tokens=options.tokens)
        self._server = grpc.aio.server(
            # Tracing outermost, so the server span also covers refusals and the status mapping.
            interceptors=[TracingServerInterceptor(), AccessInterceptor(policy), ErrorMappingInterceptor()],
            options=[
                *channel_options(options.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=options.max_concurrent_rpcs,
        )
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # missing from its stubs
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1]
        self.add(
            service_info_pb2_grpc.add_ServiceInfoServiceServicer_to_server,
            _ServiceInfoServicer(info),
            "epd.v1.ServiceInfoService",
        )
        self.port = 0
        self._stopping: asyncio.Event | None = None
        self._stop_requested: asyncio.Event | None = None
        self.failure = ""  # why the service ends with an error (`fail`); empty: it did not
        self._health_server: grpc.aio.Server | None = None
        if options.health_port:
            # Health and nothing else: status only, so it needs no TLS and no token.
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=64)
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str) -> None:
        """Register a servicer (with its generated `add_*_to_server`) under its full service name."""
        register(servicer, self._server)
        self._service_names.append(full_name)

    async def start(self) -> int:
        """Bind, start serving, mark every service SERVING; returns the bound port."""
        reflection.enable_server_reflection(self._service_names, self._server)
        _add_reflection_v1(self._server, self._service_names)
        address = f"{self.options.host}:{self.options.port}"
        tls = self.options.tls
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            credentials = security.server_credentials(tls, require_client_cert=not self.options.public)
            self.port = self._server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        await self._server.start()
        if self._health_server is not None:
            health_address = f"{self.options.host}:{self.options.health_port}"
            if self._health_server.add_insecure_port(health_address) == 0:
                raise OSError(f"cannot bind the health port {health_address}")
            await self._health_server.start()
        for name in ["", *self._service_names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._stopping = asyncio.Event()
        self._stop_requested = asyncio.Event()
        _log.info(
            "serving",
            address=f"{self.options.host}:{self.port}",
            services=self._service_names,
            tls=tls is not None,
            client_tokens=len(self.options.tokens),
        )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Health of every service: SERVING, or NOT_SERVING while the service cannot work (its
        engine died and restarts). No-op once stopping (health stays NOT_SERVING)."""
        if self._stopping is None or self._stopping.is_set():
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            await self._health.set(name, status)

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
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._stopping is not None:
            self._stopping.set()
        _log.info("stopped", address=self.address)

    def fail(self, message: str) -> None:
        """End the service with an error (its engine cannot be brought back): `wait_for_termination`
        stops the server at once, without a drain (nothing can be served), and `failure` says why."""
        if not self.failure:
            self.failure = message
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def wait_for_termination(self, drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then drain within the grace period; or until `fail`."""
        loop = asyncio.get_running_loop()
        stop_requested = self._stop_requested or asyncio.Event()
        self._stop_requested = stop_requested
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        if not self.failure:
            await stop_requested.wait()
        if self.failure:
            _log.error("service failed; stopping", error=self.failure)
            await self.stop(grace_s=_FAIL_GRACE_S)
            return
        _log.info("signal received; draining", grace_s=self.options.grace_s)
        await self.stop(drain=drain)
