"""Which failed calls mean "the server is going away", not "the request is bad".

A service under a rolling restart refuses new work while it drains (UNAVAILABLE, "draining"), and
when its gRPC server finally stops, grpc core cancels the calls it had received but not yet handed
to a handler, and those that crossed its shutdown notice, with a bare CANCELLED. Neither says
anything about the request: a caller that has seen no reply yet retries it (after a pause; the
channel waits for the replacement with `wait_for_ready`). With grpc.aio a caller's own
cancellation raises `asyncio.CancelledError`, never an `AioRpcError`, so a CANCELLED status always
comes from the other side.

Used by the client library (`libs.client.generate`) and the router (its calls to every stage).
"""

from __future__ import annotations

import grpc

# Substring of the admission's refusal while a service drains (libs/rpc/admission.py).
DRAINING = "draining"


def stopping(code: grpc.StatusCode, details: str | None) -> bool:
    """The server refused the call because it is draining, or cancelled it because it stopped."""
    if code == grpc.StatusCode.CANCELLED:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and DRAINING in (details or "")


def went_away(code: grpc.StatusCode) -> bool:
    """`stopping`, or the server is unreachable (restarting): what a client of the router retries
    before its first token. The router itself is stricter (`stopping`), because UNAVAILABLE from
    prefill also means "an embedding's encoder is gone", which it handles by re-encoding."""
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
