"""Typed errors of the tensor transport, each bound to the gRPC status a service should answer with.

Every failure the transport can meet (full pool, dead or unknown peer, stale or malformed handle,
deadline) surfaces as one of these, raised quickly: never a hang, never a process abort, never a raw
NIXL exception. `grpc_code` is what a servicer passes to `context.abort` (or what a shared error
base maps it to).
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class TransferError(Exception):
    """Base of all transport errors; `grpc_code` is the status it maps to."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PoolExhausted(TransferError):
    """No free slot is large enough; nothing was overwritten. Retry later or elsewhere."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InlineTooLarge(TransferError):
    """Tensors too large for the INLINE transport's bound."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InlineRefused(TransferError):
    """An INLINE handle (tensor bytes inside the request) from a caller this consumer does not
    accept them from: they would let any caller inject embeddings or KV."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class TransferTimeout(TransferError):
    """A READ did not complete before our deadline; it was cancelled and its slot quarantined."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class PeerUnavailable(TransferError):
    """The producer's agent is gone, unreachable, or its metadata could not be obtained."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class StaleHandle(TransferError):
    """The handle names memory that is no longer held for us: its lease expired or was released,
    or the producer incarnation it names has been replaced."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class BadDescriptor(TransferError):
    """A handle that is malformed or inconsistent (spec vs bytes, unknown dtype, ...).
    `field` is the path of the offending field, as `InvalidArgument` names it."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class DescriptorOutOfBounds(BadDescriptor):
    """A region lies outside the producer's registered memory (NIXL refused to build the READ)."""


class SpecMismatch(TransferError):
    """A well-formed tensor that is not what this consumer expects (shape, dtype, memory kind)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ChecksumMismatch(TransferError):
    """The bytes read do not match the producer's checksum."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class TransferFailed(TransferError):
    """NIXL reported an error that is none of the above."""

    grpc_code = grpc.StatusCode.INTERNAL


class AgentClosed(TransferError):
    """The process's transfer agent was closed (shutting down)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
