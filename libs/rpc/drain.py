"""Graceful drain of a service, run on SIGTERM before its server stops (`ServiceParts.drain`).

1. Refuse new work: admission answers UNAVAILABLE ("draining"), which the router retries elsewhere
   or, for a singleton stage, again once the replacement is up.
2. Let admitted and waiting requests finish.
3. A producer then waits until every lease it holds is consumed (acked, released or expired): the
   request that owns it is still in flight downstream, and the memory must outlive it. The gRPC
   server keeps answering `GetServiceInfo` and `ReleaseLeases` meanwhile.
All of it within the grace period; whatever is left then is logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from libs.rpc.admission import Admission

_log = structlog.get_logger(__name__)


def drainer(*admissions: Admission, held_leases: Callable[[], int] = lambda: 0) -> Callable[[float], Awaitable[None]]:
    """The drain of a service with these admissions (one per lane of work); `held_leases` counts
    leases it holds as a producer."""

    async def drain(grace_s: float) -> None:
        deadline = time.monotonic() + grace_s * 0.9  # leave the server a moment to stop
        for admission in admissions:
            admission.close()
        idle = True
        for admission in admissions:
            idle = await admission.idle(max(0.0, deadline - time.monotonic())) and idle
        while held_leases() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        _log.info("drained", requests_finished=idle, leases_still_held=held_leases())

    return drain
