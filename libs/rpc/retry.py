"""Which failed calls mean "the server is going away", not "the request is bad".

A service under a rolling restart refuses new work while it drains (UNAVAILABLE, reason
DRAINING), and when its gRPC server finally stops, grpc core cancels the calls it had received but
not yet handed to a handler, and those that crossed its shutdown notice, with a bare CANCELLED.
Neither says anything about the request: a caller that has seen no reply yet retries it (after a
pause; the channel waits for the replacement with `wait_for_ready`). With grpc.aio a caller's own
cancellation raises `asyncio.CancelledError`, never an `AioRpcError`, so a CANCELLED status always
comes from the other side.

Decisions go by the failure's reason (contract 1.5, `libs.contract.reasons`). A status without one
falls back to its code: grpc core's own statuses never carry one (CANCELLED at a server's stop, an
unreachable peer's UNAVAILABLE), and neither does a peer of contract 1.4 or older, whose draining
refusal is told apart from other UNAVAILABLEs only by the `DRAINING` substring of its message.
That fallback is the one place the substring is still read; a peer that sends a reason is never
judged by its message.

Used by the client library (`libs.client.generate`) and the router (its calls to every stage).
"""

from __future__ import annotations

import grpc

from libs.contract.reasons import Reason, reason_of

# Substring of a contract 1.4 (or older) admission's refusal while its service drains
# (libs/rpc/admission.py still says it): the fallback for a peer that sends no reason.
DRAINING = "draining"

# Reasons that mean the server is going away: the same call succeeds on another member, or on the
# same address once the replacement is up.
GOING_AWAY = frozenset({Reason.DRAINING, Reason.SERVER_STOPPED})

# What a client of the router does with a failure of each reason before its first token arrived.
# Every reason is listed, so a new one forces a decision here (tests/rpc/test_retry.py).
CLIENT_RETRIES: dict[Reason, bool] = {
    Reason.DRAINING: True,  # another router, or the replacement, takes the call
    Reason.SERVER_STOPPED: True,
    Reason.ENGINE_RESTARTING: True,  # the engine is back within about a minute
    Reason.EMBEDDING_GONE: True,  # the router's own re-encode failed too; a new call encodes anew
    Reason.KV_GONE: True,  # likewise: a new call prefills anew
    Reason.EMBEDDING_NEEDED: True,  # the router encodes and retries itself; a new call would too
    Reason.OVERLOADED: False,  # the service sheds load: the caller backs off (RESOURCE_EXHAUSTED)
}


def stopping(code: grpc.StatusCode, details: str | None, reason: Reason | None = None) -> bool:
    """The server refused the call because it is draining, or cancelled it because it stopped.

    `reason` decides when the status carried one; without (None), CANCELLED does, and so does an
    UNAVAILABLE whose message says "draining" (a 1.4 peer)."""
    if reason is not None:
        return reason in GOING_AWAY
    if code == grpc.StatusCode.CANCELLED:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and DRAINING in (details or "")


def going_away(error: grpc.aio.AioRpcError) -> bool:
    """`stopping`, for a failed call: its code, message and reason."""
    return stopping(error.code(), error.details(), reason_of(error))


def went_away(error: grpc.aio.AioRpcError) -> bool:
    """What a client of the router retries before its first token: a reason `CLIENT_RETRIES`
    marks, or, without a reason, UNAVAILABLE (draining, restarting, unreachable) or CANCELLED (a
    server stopping). The router itself is stricter (`stopping`), because UNAVAILABLE from prefill
    also means "an embedding's encoder is gone", which it handles by re-encoding."""
    reason = reason_of(error)
    if reason is not None:
        return CLIENT_RETRIES[reason]
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
