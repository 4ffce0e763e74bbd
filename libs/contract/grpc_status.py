"""Maps typed `EpdError`s raised by servicer code to gRPC statuses, for every EPD server.

Install `ErrorMappingInterceptor` on a `grpc.aio.server`: handlers then simply raise. An
`InvalidArgument` also names its field in the trailing metadata key `epd-error-field`, so clients
can react without parsing the message; an error with a `reason` carries it as a `google.rpc.Status`
with an `ErrorInfo` in `grpc-status-details-bin` (contract 1.5, libs/contract/reasons.py), next
to the field key when both apply. Any other exception becomes INTERNAL with a generic message
(the details go to the log, not to the client). Request bytes that do not parse also end as
INTERNAL (grpc-python alone would answer UNKNOWN), and the handler never runs.

Calls end with `end_call` (status set, handler returns), never `context.abort`: grpc-python's aio
server keeps the last aborted calls' requests alive (measured, grpcio 1.85: two 64 MiB requests
held until the server stops), so every refused large request would pin its bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
import structlog

from libs.contract.errors import EpdError, InvalidArgument
from libs.contract.reasons import STATUS_DETAILS_KEY, status_details

ERROR_FIELD_METADATA_KEY = "epd-error-field"

_log = structlog.get_logger(__name__)


def end_call(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str) -> None:
    """Sets the status the RPC ends with once its handler returns (a unary handler then returns
    None: grpc discards the response of a call whose status is not OK)."""
    context.set_code(code)
    context.set_details(message)


def end_with(context: grpc.aio.ServicerContext[Any, Any], error: EpdError) -> None:
    """`end_call` with the status `error` maps to, and its field and reason in the trailers."""
    trailers: list[tuple[str, str | bytes]] = []
    if isinstance(error, InvalidArgument):
        trailers.append((ERROR_FIELD_METADATA_KEY, error.field))
    if error.reason is not None:
        trailers.append((STATUS_DETAILS_KEY, status_details(error.code, error.message, error.reason)))
    if trailers:
        context.set_trailing_metadata(tuple(trailers))
    end_call(context, error.code, error.message)


class _Malformed:
    """Stands in for a request whose wire bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    real = deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return real(data)
        except Exception as exc:  # DecodeError and friends: the peer sent bytes that are not the message
            return _Malformed(exc)

    return deserialize


def _refused_malformed(context: grpc.aio.ServicerContext[Any, Any], method: str, request: Any) -> bool:
    if isinstance(request, _Malformed):
        end_call(context, grpc.StatusCode.INTERNAL, f"malformed request for {method}: {request.error}")
        return True
    return False


def _fail(context: grpc.aio.ServicerContext[Any, Any], method: str, exc: BaseException) -> None:
    if isinstance(exc, EpdError):
        end_with(context, exc)
        return
    _log.exception("unhandled error in handler", method=method)
    end_call(context, grpc.StatusCode.INTERNAL, f"internal error in {method}")


def _wrap_unary(
    method: str, fn: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if _refused_malformed(context, method, request):
            return None
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError, GeneratorExit):
            raise
        except Exception as exc:
            _fail(context, method, exc)
            return None

    return handler


def _wrap_stream(
    method: str, fn: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        if _refused_malformed(context, method, request):
            return
        try:
            async for response in fn(request, context):
                yield response
        except (grpc.aio.AbortError, grpc.aio.UsageError, GeneratorExit):
            raise
        except Exception as exc:
            _fail(context, method, exc)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in stubs
    """Wraps unary-unary and unary-stream handlers so typed errors become gRPC statuses."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(method, cast(Any, handler.unary_unary)),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, cast(Any, handler.unary_stream)),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler
