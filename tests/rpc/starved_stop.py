"""Run a service whose event loop is starved just before its gRPC server stops, the moment a loaded
host makes likely: `python -m tests.rpc.starved_stop SECONDS MODULE [ARGS...]` runs `MODULE` (an
EPD service, unchanged) with `EpdServer.stop` blocking its event loop for SECONDS after the drain;
`python -m tests.rpc.starved_stop GATE MODULE [ARGS...]` (GATE a path) blocks it from then until
the file GATE exists, creating `GATE.held` first: the starvation lasts until the test has sent its
calls into it, on a fast host as on a slow one.

Calls that arrive meanwhile are accepted by grpc core (its I/O runs outside the Python loop) but
not handed to a handler, so the server's stop cancels them with a bare CANCELLED: the stop race of
libs/rpc/retry.py, on every stop instead of now and then. Only a test harness: nothing ships it.
"""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from libs.rpc.server import EpdServer

Drain = Callable[[float], Awaitable[None]]
GATE_LIMIT_S = 120.0  # a gate nobody opens (a failed test) ends the starvation after this


def held_marker(gate: Path) -> Path:
    """The file created once the event loop starves, waiting for `gate`."""
    return gate.with_name(gate.name + ".held")


def _wait_blocking(gate: Path) -> None:
    held_marker(gate).touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.005)  # deliberately blocking: no call reaches a handler meanwhile


def starve_before_stop(seconds: float | None, gate: Path | None = None) -> None:
    """Patch `EpdServer.stop`: after the service's drain, block the event loop for `seconds`, or
    until the file `gate` exists."""
    stop = EpdServer.stop

    async def starved_stop(self: EpdServer, grace_s: float | None = None, drain: Drain | None = None) -> None:
        async def drain_then_starve(grace: float) -> None:
            if drain is not None:
                await drain(grace)
            if gate is not None:
                _wait_blocking(gate)
            else:
                time.sleep(seconds or 0.0)  # deliberately blocking: no call reaches a handler meanwhile

        await stop(self, grace_s, drain_then_starve)

    EpdServer.stop = starved_stop  # type: ignore[method-assign]


if __name__ == "__main__":
    try:
        starve_before_stop(float(sys.argv[1]))
    except ValueError:
        starve_before_stop(None, Path(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
