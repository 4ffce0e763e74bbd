"""The door in the router's process (`--openai-port`): the door's application over the router
core's `generate`, with no gRPC hop and no second process between them.

Behind the door a request meets what a `Generate` call meets in the router's gRPC server: the
same admission (one bound for both doors), a deadline (`max_request_s`), a
`GenerateService/Generate` span (the root `epd trace report` reads, a child of the door's HTTP
span), request ids on log lines, and typed errors answered as the OpenAI errors their gRPC statuses
become (the span records the status the call would have had: `rpc.grpc.status_code`). Bearer
tokens are the door's to check (the router's own). The door's instruments join the process's
Prometheus registry, so the router's metrics port serves them beside the router's.

The router reaches this module, never the reverse: it hands over its core (`RouterCore`), its
admission and its settings, and gets its server parts back with the door beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Protocol

import grpc
import prometheus_client
import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from libs.contract.epd.v1 import generate_pb2
from libs.contract.errors import EpdError
from libs.door.calls import GenerateCall
from libs.door.gate import Gate
from libs.door.openai.errors import ApiError, from_error
from libs.door.server import DoorHttpSettings, DoorServer
from libs.rpc.admission import Admission
from libs.rpc.main import ServiceParts
from libs.telemetry.logging import bind_request
from libs.telemetry.stages import ATTRIBUTION

SPAN = "GenerateService/Generate"  # the name the gRPC server's span has (libs/telemetry/propagation.py)
_tracer = trace.get_tracer("epd.router")
_log = structlog.get_logger("router")


class RouterCore(Protocol):
    """What the door calls in the router's process (services/router/core.py's `Router`): the reply
    to one request, by `deadline` (a `time.monotonic()` instant); `coalesce=False`: one response
    per chunk, for a reader that merges what queued up itself."""

    def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None = None, coalesce: bool = True
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]: ...


def in_process(router: RouterCore, admission: Admission, max_request_s: float) -> GenerateCall:
    """`Generate` as the door calls it, straight into the router."""

    async def call(
        request: generate_pb2.GenerateRequest, token: str | None
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        deadline = time.monotonic() + max_request_s
        with _tracer.start_as_current_span(SPAN, attributes={ATTRIBUTION: "service"}) as span:
            try:
                with bind_request(request.request_id or "-"):
                    async with admission.slot(deadline, request.priority):
                        # The door relays what queues up merged (libs/door/app.py): no second relay.
                        async for response in router.generate(request, deadline, coalesce=False):
                            yield response
            except EpdError as exc:
                _ended(span, exc.code)
                raise from_error(exc) from None
            except (GeneratorExit, asyncio.CancelledError):  # the client left (the door closed the call)
                _ended(span, grpc.StatusCode.CANCELLED)
                raise
            except Exception:  # details to the log, not to the client (as gRPC's INTERNAL)
                _log.exception("unhandled error in Generate (OpenAI door)")
                _ended(span, grpc.StatusCode.INTERNAL)
                raise ApiError(500, "internal error in Generate", code="internal") from None

    return call


@dataclasses.dataclass(frozen=True)
class Listener:
    """Where the door listens in the router's process, and how it stops: the router's own host,
    certificate and drain, the router's request deadline."""

    host: str
    port: int  # 0: a free one
    tls_cert: Path | None
    tls_key: Path | None
    grace_s: float
    max_request_s: float


def with_door(
    parts: ServiceParts, settings: DoorHttpSettings, listener: Listener, router: RouterCore, admission: Admission
) -> ServiceParts:
    """The router's server parts with the door beside them: it opens once the gRPC server listens
    (its own "openai_door listening on HOST:PORT" line follows the router's), takes no new
    connections once the router drains (its open requests finish within the drain, in the same
    admission), and stops before the router's resources close."""
    door = DoorServer(
        settings,
        in_process(router, admission, listener.max_request_s),
        lambda: _serving(admission),
        tokens=parts.tokens,
        tls_cert=listener.tls_cert,
        tls_key=listener.tls_key,
        grace_s=listener.grace_s,
        gate=Gate.of_admission(admission),  # a request the router would refuse is refused at its arrival
    )
    drain, close = parts.drain, parts.close

    async def open_door() -> None:
        prometheus_client.REGISTRY.register(door.metrics)
        address = await door.start(listener.host, listener.port)
        print(f"openai_door listening on {address}", flush=True)

    async def closing(grace_s: float) -> None:
        door.shutdown()
        if drain is not None:
            await drain(grace_s)

    async def closed() -> None:
        try:
            await door.stop()
        finally:
            with contextlib.suppress(KeyError):  # never registered: the door did not open
                prometheus_client.REGISTRY.unregister(door.metrics)
            if close is not None:
                await close()

    return dataclasses.replace(parts, after_listening=open_door, drain=closing, close=closed)


def _ended(span: trace.Span, code: grpc.StatusCode) -> None:
    """The status the call would have ended with over gRPC, as the gRPC server's span records it."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, code.name))


async def _serving(admission: Admission) -> bool:
    return not admission.closed  # the door's /health: 503 once the router drains
