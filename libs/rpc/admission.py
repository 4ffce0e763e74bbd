"""Admission control: a bound on work running and waiting in one service.

A request first waits for one of `max_running` slots; at most `max_waiting` may wait. A request
arriving when the waiting room is full is refused at once (RESOURCE_EXHAUSTED), and one whose
deadline passes while waiting is refused with DEADLINE_EXCEEDED, so a slow stage sheds load instead
of queueing without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from libs.contract.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from libs.telemetry.stages import stage


class Admission:
    """Bounded running + waiting counts for one service (use from one event loop)."""

    def __init__(self, name: str, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.name = name
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self.closed = False

    @asynccontextmanager
    async def slot(self, deadline: float | None = None) -> AsyncIterator[None]:
        """Hold a running slot for the body. `deadline` is a `time.monotonic()` instant."""
        if self.closed:
            raise Unavailable(f"{self.name} is draining for shutdown; retry elsewhere or later")
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"{self.name} is full: {self.running} running, {self.waiting} waiting (limit {self.max_waiting})"
            )
        self.waiting += 1
        try:
            with stage(f"{self.name}.queue", "queue"):
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(self._slots.acquire(), timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed while waiting for {self.name}") from None
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    def close(self) -> None:
        """Refuse new work (UNAVAILABLE); admitted and waiting requests carry on."""
        self.closed = True

    async def idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs or waits; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.running or self.waiting:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def deadline_of(time_remaining: float | None) -> float | None:
    """A monotonic deadline from gRPC's `context.time_remaining()` (None: no deadline)."""
    return None if time_remaining is None else time.monotonic() + time_remaining
