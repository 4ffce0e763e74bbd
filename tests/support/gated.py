"""Run an EPD service (unchanged) with gates a test opens, so that a moment lasts until the test has
seen what it waits for, on a fast host as on a slow one:

    python -m tests.support.gated [--streams PREFIX GATE] [--encodes PREFIX GATE] [--stop GATE]
        MODULE [ARGS...]

- `--streams PREFIX GATE`: the decode stream (`DecodeLoop.stream`: colocated, decode, the reference
  PD) of each request whose id starts with PREFIX waits, before its first decode step, until the
  file GATE exists. Prefill's first token has been streamed (colocated, PD); the request holds its
  admission slot meanwhile, so it is in flight, however fast the host, until the test creates GATE.
- `--encodes PREFIX GATE`: an encode job whose request id starts with PREFIX takes the encoder's
  compute thread and keeps it (a blocking wait, as a long tower run would) until GATE exists, then
  computes as usual.
- `--stop GATE`: after the service's drain, its event loop blocks (creating `GATE.held` first)
  until GATE exists. Calls that arrive meanwhile are accepted by grpc core (its I/O runs outside the
  Python loop) but not handed to a handler, so the server's stop cancels them with a bare CANCELLED:
  the stop race of libs/rpc/retry.py, lasting until the test has sent its calls into it.

Only a test harness: nothing ships it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import runpy
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

POLL_S = 0.01


async def _opened(gate: Path) -> None:
    while not gate.exists():
        await asyncio.sleep(POLL_S)


def _wait_blocking(gate: Path) -> None:
    while not gate.exists():
        time.sleep(POLL_S)


def hold_streams(prefix: str, gate: Path) -> None:
    """Patch `DecodeLoop.stream`: requests whose id starts with `prefix` wait for `gate` first."""
    from libs.serving.compute_thread import DecodeLoop

    stream = DecodeLoop.stream

    async def held(self: DecodeLoop, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if request_id.startswith(prefix):
            await _opened(gate)
        async with contextlib.aclosing(stream(self, request_id, *args, **kwargs)) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                yield chunk

    DecodeLoop.stream = held  # type: ignore[method-assign]


def hold_encodes(prefix: str, gate: Path) -> None:
    """Patch the encoder's compute: jobs whose request id starts with `prefix` hold the compute
    thread until `gate` exists."""
    import services.encoder.core as core
    from libs.serving.encoding import EncodeBatcher

    job: contextvars.ContextVar[str] = contextvars.ContextVar("gated_job", default="")
    encode, batched = core.EncoderCore.encode, EncodeBatcher.encode

    async def encode_job(self: Any, request: Any, *args: Any) -> Any:
        job.set(request.request_id)  # this task's context: the compute below runs in it
        return await encode(self, request, *args)

    async def held(self: EncodeBatcher, media: Any, *args: Any, **kwargs: Any) -> Any:
        if job.get().startswith(prefix):
            await self.thread.run(_wait_blocking, gate)
        return await batched(self, media, *args, **kwargs)

    core.EncoderCore.encode = encode_job  # type: ignore[method-assign]
    EncodeBatcher.encode = held  # type: ignore[method-assign]


def hold_stop(gate: Path) -> None:
    """Patch `EpdServer.stop`: after the service's drain, block its event loop until `gate` exists."""
    from libs.rpc.server import EpdServer

    stop = EpdServer.stop
    Drain = Callable[[float], Awaitable[None]]

    async def held_stop(self: EpdServer, grace_s: float | None = None, drain: Drain | None = None) -> None:
        async def drain_then_hold(grace: float) -> None:
            if drain is not None:
                await drain(grace)
            Path(f"{gate}.held").touch()
            _wait_blocking(gate)  # deliberately blocking: no call reaches a handler meanwhile

        await stop(self, grace_s, drain_then_hold)

    EpdServer.stop = held_stop  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    args = argv[1:]
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--streams":
            hold_streams(args.pop(0), Path(args.pop(0)))
        elif option == "--encodes":
            hold_encodes(args.pop(0), Path(args.pop(0)))
        elif option == "--stop":
            hold_stop(Path(args.pop(0)))
        else:
            raise SystemExit(f"unknown option {option}")
    module, *rest = args
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
