"""Typed errors shared by every service, each bound to the gRPC status it maps to.

Semantic problems are ours (INVALID_ARGUMENT naming the field, FAILED_PRECONDITION for version or
spec mismatches, UNAVAILABLE when a peer is gone, RESOURCE_EXHAUSTED when a bounded queue or pool
is full, DEADLINE_EXCEEDED when the deadline passes). Malformed wire bytes never reach our code:
gRPC fails them itself with INTERNAL.

An error may also carry a `Reason` (libs/contract/reasons.py): why, in terms a caller acts on
(DRAINING, EMBEDDING_GONE, ...). Servers send it with the status (contract 1.5); raise sites set
it where they know the meaning.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from libs.contract.reasons import Reason


class EpdError(Exception):
    """Base of all typed EPD errors; `code` is the gRPC status the error maps to, `reason` (when
    known) why, for the caller."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class InvalidArgument(EpdError):
    """A request field is semantically invalid; `field` is its path, e.g. `items[0].media.data`."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str, *, reason: Reason | None = None) -> None:
        super().__init__(f"{field}: {problem}", reason=reason)
        self.field = field
        self.problem = problem


class FailedPrecondition(EpdError):
    """The request is well-formed but the system is not in a state to serve it (version or spec
    mismatch between peers, a KV cache from another model, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(EpdError):
    """A referenced entity (lease, cached embedding) does not exist (any more)."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(EpdError):
    """A bounded resource (queue, memory pool, cache) is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EpdError):
    """A peer is gone or not reachable; the caller may retry elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(EpdError):
    """The caller is known but may not do this (e.g. send tensor bytes inside a request without TLS)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(EpdError):
    """The request's deadline passed while we waited on our side."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(EpdError):
    """Transferred bytes do not match their checksum (e.g. a read of a reclaimed, reused slot)."""

    code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[EpdError]] = {
    cls.code: cls
    for cls in (
        FailedPrecondition,
        NotFound,
        ResourceExhausted,
        Unavailable,
        PermissionDenied,
        DeadlineExceeded,
        DataLoss,
    )
}


def error_for(code: grpc.StatusCode, message: str, field: str = "request", *, reason: Reason | None = None) -> EpdError:
    """The typed error for a status code (e.g. one a lower layer or a peer reported)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(field, message, reason=reason)
    cls = _BY_CODE.get(code)
    return cls(message, reason=reason) if cls is not None else EpdError(message, reason=reason)
