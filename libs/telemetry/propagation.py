"""W3C trace context on every gRPC hop.

`TracingServerInterceptor` (every `EpdServer`) extracts `traceparent` / `tracestate` from the
request metadata and runs the handler inside a SERVER span named after the method, so each
service's spans join the caller's trace. `TracingClientInterceptor` (every channel EPD opens)
injects the current context into outgoing metadata.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from libs.telemetry.stages import ATTRIBUTION

_tracer = trace.get_tracer("epd.rpc")


def _span_name(method: str) -> str:
    # "/epd.v1.EncoderService/Encode" -> "EncoderService/Encode"
    service, _, rpc = method.lstrip("/").partition("/")
    return f"{service.rsplit('.', 1)[-1]}/{rpc}"


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, rpc = method.lstrip("/").partition("/")
    # A server span's own time is the service's bookkeeping (the router re-marks its root "router").
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc, ATTRIBUTION: "service"}


class TracingServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in stubs
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if method.startswith(("/grpc.health", "/grpc.reflection", "/epd.v1.ServiceInfoService")):
            return handler  # probes and handshakes would flood traces with root spans of their own
        carrier = {k: v for k, v in (handler_call_details.invocation_metadata or ()) if isinstance(v, str)}
        name, attributes = _span_name(method), _rpc_attributes(method)

        def span() -> Any:
            return _tracer.start_as_current_span(
                name, context=propagate.extract(carrier), kind=SpanKind.SERVER, attributes=attributes
            )

        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                with span() as current:
                    try:
                        return await inner_unary(request, context)
                    except BaseException as exc:
                        _record_exception(current, exc)
                        raise
                    finally:
                        _record_status(current, context)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                with span() as current:
                    try:
                        async for response in inner_stream(request, context):
                            yield response
                    except BaseException as exc:
                        _record_exception(current, exc)
                        raise
                    finally:
                        _record_status(current, context)

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _record_exception(span: Any, exc: BaseException) -> None:
    """A handler ended by an exception: ERROR; one cancelled (the caller went away or its deadline
    passed) also records CANCELLED as its status code, which the handler never got to set."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


def _record_status(span: Any, context: Any) -> None:
    """The status a handler set (`end_call`): `rpc.grpc.status_code`, and ERROR unless OK."""
    code = context.code()
    if (
        code is not None
        and code != grpc.StatusCode.OK
        and "rpc.grpc.status_code" not in getattr(span, "attributes", {})
    ):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_status(Status(StatusCode.ERROR, code.name))


def _with_context(details: Any) -> Any:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *carrier.items()))


class TracingUnaryClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Adds the current trace context to every outgoing unary call's metadata."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_context(client_call_details), request)


class TracingStreamClientInterceptor(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    """Adds the current trace context to every outgoing server-streaming call's metadata."""

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_context(client_call_details), request)


def client_interceptors() -> list[Any]:
    """One per call type: grpc.aio files an interceptor under the first type it matches only."""
    return [TracingUnaryClientInterceptor(), TracingStreamClientInterceptor()]
