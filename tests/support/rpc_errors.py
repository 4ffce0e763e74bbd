"""Failed-call errors as a grpc.aio caller sees them, for tests of code that decides from one:
`rpc_error(code, details, reason)` carries `reason` exactly as a contract 1.5 server sends it
(libs/contract/reasons.py); without a reason it is a 1.4 peer's, or grpc core's own, status."""

from __future__ import annotations

import grpc

from libs.contract.reasons import STATUS_DETAILS_KEY, Reason, status_details


def rpc_error(code: grpc.StatusCode, details: str = "boom", reason: Reason | None = None) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata()
    if reason is not None:
        trailers.add(STATUS_DETAILS_KEY, status_details(code, details, reason))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=details)
