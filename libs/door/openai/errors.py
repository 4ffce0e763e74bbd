"""OpenAI error objects and the HTTP status each gRPC status becomes.

OpenAI's clients read `{"error": {"message", "type", "param", "code"}}` with the HTTP status; the
openai Python client raises `BadRequestError` for 400, `AuthenticationError` for 401,
`RateLimitError` for 429 (honouring `Retry-After`), `InternalServerError` for 5xx.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from libs.contract.errors import EpdError, InvalidArgument
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY
from libs.contract.reasons import Reason, reason_of

# How much of a client's input an error quotes: enough to recognise it, never the input itself (a
# 2 MB model name is not answered with a 2 MB error).
EXCERPT_CHARS = 64
# Bounds on any error's text, whatever built it (a router's message, a fetch error quoting a URL).
_MESSAGE_CHARS = 1024
_PARAM_CHARS = 256
# Seconds a client told to back off (429, 503 while draining) waits before retrying.
RETRY_AFTER_S = 1
# gRPC refuses a message over its size bound with RESOURCE_EXHAUSTED and this text: that is a
# request too large (413), not an overload (429).
_TOO_LARGE_MARKERS = ("larger than max", "message larger", "exceeds")

_HTTP_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE_BY_HTTP = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass
class ApiError(Exception):
    """An error answered as an OpenAI error object; `param` names the request field at fault."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        kind = _TYPE_BY_HTTP.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        message = excerpt(self.message, _MESSAGE_CHARS)
        param = excerpt(self.param, _PARAM_CHARS) if self.param is not None else None
        return {"error": {"message": message, "type": kind, "param": param, "code": self.code}}


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` (a client's, or quoting one) as an error may carry it: its first `limit` characters
    and an ellipsis, lone surrogates escaped (`\\ud800`) so the error itself can be encoded."""
    short = text if len(text) <= limit else text[:limit] + "..."
    return short.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def too_large(param: str, message: str) -> ApiError:
    return ApiError(413, f"{param}: {message}", param=param, code="request_too_large")


def from_rpc(exc: grpc.aio.AioRpcError) -> ApiError:
    """The OpenAI error for a failed `Generate` call; the field the server named (trailer
    `epd-error-field`) becomes `param`, prefixed `epd.` because it is a path in the gRPC request."""
    code = exc.code()
    trailers: Iterable[Any] = exc.trailing_metadata() or ()
    field = next((str(v) for k, v in trailers if k == ERROR_FIELD_METADATA_KEY and isinstance(v, str)), None)
    return _from_status(code, exc.details() or code.name, field, reason_of(exc))


def from_error(exc: EpdError) -> ApiError:
    """The OpenAI error for a typed error raised by the router in the door's own process: what
    `from_rpc` makes of the status the router's gRPC server would have answered with it."""
    field = exc.field if isinstance(exc, InvalidArgument) else None
    return _from_status(exc.code, exc.message, field, exc.reason)


def _from_status(code: grpc.StatusCode, message: str, field: str | None, reason: Reason | None) -> ApiError:
    status = _HTTP_BY_CODE.get(code, 500)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and any(m in message for m in _TOO_LARGE_MARKERS):
        status = 413
    headers = {}
    if status == 429 or (status == 503 and reason in (Reason.DRAINING, Reason.ENGINE_RESTARTING, Reason.OVERLOADED)):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return ApiError(
        status,
        message,
        param=f"epd.{field}" if field else None,
        code=reason.value.lower() if reason is not None else code.name.lower(),
        headers=headers,
    )


_MEDIA_ITEM = re.compile(r"^epd\.media item (\d+)$")


def relocate(error: ApiError, media_fields: Sequence[str]) -> ApiError:
    """A router error about its media item i named by the field of the request's i-th media part
    (`messages[0].content[1].image_url.url`): the field the client sent."""
    match = _MEDIA_ITEM.match(error.param or "")
    if match is None or int(match.group(1)) >= len(media_fields):
        return error
    return dataclasses.replace(error, param=media_fields[int(match.group(1))])
