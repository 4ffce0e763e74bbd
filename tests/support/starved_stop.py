"""Run a service whose event loop is starved just before its gRPC server stops, the moment a loaded
host makes likely: `python -m tests.support.starved_stop SECONDS MODULE [ARGS...]` runs `MODULE` (an
EPD service, unchanged) with `EpdServer.stop` blocking its event loop for SECONDS after the drain.

Calls that arrive meanwhile are accepted by grpc core (its I/O runs outside the Python loop) but
not handed to a handler, so the server's stop cancels them with a bare CANCELLED: the stop race of
libs/rpc/retry.py, on every stop instead of now and then. Only a test harness: nothing ships it.
"""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Awaitable, Callable

from libs.rpc.server import EpdServer

Drain = Callable[[float], Awaitable[None]]


def starve_before_stop(seconds: float) -> None:
    """Patch `EpdServer.stop`: after the service's drain, block the event loop for `seconds`."""
    stop = EpdServer.stop

    async def starved_stop(self: EpdServer, grace_s: float | None = None, drain: Drain | None = None) -> None:
        async def drain_then_starve(grace: float) -> None:
            if drain is not None:
                await drain(grace)
            time.sleep(seconds)  # deliberately blocking: no call reaches a handler meanwhile

        await stop(self, grace_s, drain_then_starve)

    EpdServer.stop = starved_stop  # type: ignore[method-assign]


if __name__ == "__main__":
    starve_before_stop(float(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
