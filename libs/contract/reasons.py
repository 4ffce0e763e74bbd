"""Why a call failed, as a typed reason a caller can act on, not a substring of the message.

A service that refuses or fails a call for one of these reasons says so on the wire (contract 1.5,
`proto/epd/v1/error_reason.proto`): the status carries a `google.rpc.Status` (same code and
message) in the standard `grpc-status-details-bin` trailing metadata, whose `details` hold one
`google.rpc.ErrorInfo` with domain `epd.v1` and `reason` one of `Reason`'s values. Servers put it
there from `EpdError.reason` (`libs.contract.grpc_status.end_with`); callers read it with
`reason_of`. The router's failover policy is a table keyed by reason.

A peer of an older minor contract version sends no reason, and neither does grpc core for the
statuses it makes itself (a server stopping cancels queued calls, an unreachable peer is
UNAVAILABLE): `reason_of` is then None and the caller falls back to what the status code alone
meant before. A reason this build does not know (a newer peer's) is None as well.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

# The ErrorInfo domain of EPD's reasons, and the trailing metadata key gRPC defines for a rich status.
DOMAIN = "epd.v1"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class Reason(enum.StrEnum):
    """Failure reasons (the `reason` of a `google.rpc.ErrorInfo` in domain `epd.v1`; the names of
    `epd.v1.ErrorReason` without their `ERROR_REASON_` prefix)."""

    DRAINING = "DRAINING"  # the service drains for shutdown: retry on another member
    SERVER_STOPPED = "SERVER_STOPPED"  # the server stopped before or while handling the call
    EMBEDDING_GONE = "EMBEDDING_GONE"  # an embedding a request references is gone: re-encode
    KV_GONE = "KV_GONE"  # the KV cache a decode was handed is gone: recompute
    ENGINE_RESTARTING = "ENGINE_RESTARTING"  # the service's engine died and is restarting
    OVERLOADED = "OVERLOADED"  # a bounded queue or pool is full: back off
    EMBEDDING_NEEDED = "EMBEDDING_NEEDED"  # a held item is not in the member's prefix cache: encode it


# Codes a failed read of data another process holds (embeddings, KV) answers when the data is no
# longer there: lease expired or released (NOT_FOUND), holder gone (UNAVAILABLE), slot reclaimed
# and reused (DATA_LOSS).
GONE_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


def reason_if_gone(code: grpc.StatusCode, reason: Reason) -> Reason | None:
    """`reason` (EMBEDDING_GONE, KV_GONE) when a read failed with a code of `GONE_CODES`."""
    return reason if code in GONE_CODES else None


def status_details(code: grpc.StatusCode, message: str, reason: Reason) -> bytes:
    """The `grpc-status-details-bin` value of a status with this code, message and reason (the
    ErrorInfo's metadata stay empty: contract 1.5 defines none)."""
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN))
    return status.SerializeToString()


def error_info_in(trailing_metadata: Iterable[Any] | None, code: grpc.StatusCode) -> error_details_pb2.ErrorInfo | None:
    """The `epd.v1` ErrorInfo of a status with `code` and these trailers, if it carries one.

    A rich status whose code is not the call's (a proxy rewrote the code and passed the trailers
    on) says nothing about this status and is ignored; so are undecodable bytes."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
            if status.code != code.value[0]:
                return None
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == DOMAIN:  # Unpack: False for another type
                    return info
        except DecodeError:
            return None
    return None


def reason_in(trailing_metadata: Iterable[Any] | None, code: grpc.StatusCode) -> Reason | None:
    """The reason a status with `code` and these trailing metadata carries; None without one."""
    info = error_info_in(trailing_metadata, code)
    if info is None:
        return None
    try:
        return Reason(info.reason)
    except ValueError:  # a newer peer's reason: this build falls back to the code
        return None


def reason_of(error: grpc.aio.AioRpcError) -> Reason | None:
    """The reason a failed call carries; None when it carries none (a peer of an older minor
    version, grpc core's own statuses) or one this build does not know."""
    return reason_in(error.trailing_metadata(), error.code())
