"""Single-flight: concurrent callers for the same key share one in-progress computation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Per event loop. The work runs as its own task, so a caller that is cancelled (its client went
    away) neither cancels it for the others nor leaves them waiting; errors reach every waiter and
    nothing is remembered once the flight lands."""

    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Task[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """The result of `work()` for `key`, and whether this caller joined someone else's flight."""
        task = self._flights.get(key)
        joined = task is not None
        if task is None:
            task = asyncio.ensure_future(work())
            self._flights[key] = task
            task.add_done_callback(lambda t: self._land(key, t))
        return await asyncio.shield(task), joined

    def _land(self, key: str, task: asyncio.Task[T]) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: a flight whose callers all left must not warn
