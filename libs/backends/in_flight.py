"""The calls a backend has in flight, by request id, so one request can be aborted.

A call registers the task it runs in (the gRPC handler's: an async generator's body runs in the
task that consumes it) for its duration. `cancel(request_id)` cancels those tasks: the call
unwinds exactly as on a client's cancel, giving back what it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class InFlight:
    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[object]]] = {}

    @contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        task = asyncio.current_task()
        if task is None:  # not in a task (a direct call from synchronous code): nothing to cancel
            yield
            return
        tasks = self._tasks.setdefault(request_id, set())
        tasks.add(task)
        try:
            yield
        finally:
            tasks.discard(task)
            if not tasks:
                self._tasks.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Cancel the calls in flight for `request_id`; False when there were none."""
        tasks = self._tasks.get(request_id, set())
        for task in tasks:
            task.cancel()
        return bool(tasks)

    def __len__(self) -> int:
        return sum(len(tasks) for tasks in self._tasks.values())
