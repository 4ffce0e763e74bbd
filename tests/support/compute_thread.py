"""Holding a `ComputeThread` from a test: a job that keeps the thread until a gate opens, and a
wait until a number of jobs queue behind it (events, not sleeps: a loaded host may take a while to
schedule the thread)."""

from __future__ import annotations

import asyncio
import threading

from libs.serving.compute_thread import ComputeThread


async def hold_thread(engine: ComputeThread, gate: threading.Event) -> asyncio.Future[object]:
    """A job that holds the engine thread until `gate` is set, once the thread is running it (an
    event, not a sleep: a loaded host may take a while to schedule the thread)."""
    running = threading.Event()

    def hold() -> None:
        running.set()
        gate.wait()

    blocker = asyncio.ensure_future(engine.run(hold))
    assert await asyncio.to_thread(running.wait, 30), "the engine thread never took the first job"
    return blocker


async def until_queued(engine: ComputeThread, count: int) -> None:
    """Until `count` jobs wait in the queue (the submitting tasks run on this loop's next turns)."""
    for _ in range(3000):  # bounded: 30 s
        if engine.queued() == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {count} jobs queued (now {engine.queued()})")
