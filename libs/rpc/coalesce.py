"""A relay that writes what queued up as one message when its reader lags.

A stream relayed hop by hop (decode -> router -> OpenAI door -> client) costs each hop a read, a
write and a wakeup per message. While a hop's writes keep up, `coalesced` changes nothing: each
item goes out as it comes, the first one at once. When they do not (a busy host, a slow client),
the items that arrived meanwhile go out merged into one, so a lagging hop catches up instead of
falling further behind one message at a time: what vLLM's own server does with a lagging
consumer (its output collector merges deltas).

The source is read by a task of its own into a bounded queue (backpressure: a reader that stops
stops the source after `depth` items). Its failure is raised after the items before it; closing
or cancelling the relay cancels the task and closes the source (its `finally` blocks run).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Failed:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class _End:
    pass


class _Held(Generic[T]):
    """An item taken from the queue that could not join the one being merged."""

    def __init__(self, item: T | _Failed | _End) -> None:
        self.item = item


async def coalesced(
    source: AsyncIterator[T], merge: Callable[[T, T], T | None], depth: int = 64
) -> AsyncGenerator[T, None]:
    """`source`'s items, each queued run of them merged by `merge(earlier, later)` (None: the two
    stay apart, e.g. two choices' chunks)."""
    queue: asyncio.Queue[T | _Failed | _End] = asyncio.Queue(maxsize=depth)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put(item)
        except Exception as exc:  # the relay's reader raises it, in order
            await queue.put(_Failed(exc))
            return
        finally:
            # Cancelled while waiting to put: the source waits at its `yield`, its `finally` blocks
            # not run yet. Closed here, by the only task that ever iterates it.
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()
        await queue.put(_End())

    task = asyncio.create_task(pump())
    held: _Held[T] | None = None
    try:
        while True:
            item = held.item if held is not None else await queue.get()
            held = None
            if isinstance(item, _End):
                return
            if isinstance(item, _Failed):
                raise item.exc
            while not queue.empty():
                later = queue.get_nowait()
                merged = None if isinstance(later, _Failed | _End) else merge(item, later)
                if merged is None:
                    held = _Held(later)
                    break
                item = merged
            yield item
    finally:
        task.cancel()
        await asyncio.wait({task})  # its end, without taking a cancellation meant for this task
