"""Running the (blocking, torch) engine under asyncio services.

`EngineThread` is the one thread a process runs model code on: encode, prefill and decode steps
are serialized there, so the event loop stays responsive and compute never oversubscribes the
cores. `DecodeLoop` drives a `DecodeRunner` on that thread: while any sequence is active it runs
batched steps and routes each sequence's chunks to its stream; a stream that ends early (client
cancel, deadline) removes its sequence from the batch.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from libs.engine.decode_runner import DecodeRunner
from libs.engine.types import DecodeState, KvCache, SamplingParams, TokenChunk

T = TypeVar("T")
_log = structlog.get_logger(__name__)


class EngineThread:
    """A single worker thread for model code."""

    def __init__(self, name: str = "engine") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class DecodeLoop:
    """Batched decoding for many concurrent streams (use from one event loop)."""

    def __init__(self, runner: DecodeRunner, engine: EngineThread) -> None:
        self.runner = runner
        self._engine = engine
        self._queues: dict[str, asyncio.Queue[TokenChunk | BaseException]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Sequences in the runner's batch (what `GetStats` reports): one whose stream ended early
        counts until the runner has dropped it, so a leak shows."""
        return len(self.runner.active_ids)

    async def stream(
        self, request_id: str, kv: KvCache, state: DecodeState, sampling: SamplingParams
    ) -> AsyncIterator[TokenChunk]:
        """Decode one sequence from `kv`; yields chunks until one carries a finish reason."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-loop")
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        await self._engine.run(self.runner.add, request_id, kv, state, sampling)  # raises typed engine errors
        self._queues[request_id] = queue
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await asyncio.shield(self._engine.run(self.runner.cancel, request_id))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.runner.active_ids:
                try:
                    results = await self._engine.run(self.runner.step)
                except Exception as exc:  # a bug in a step fails the streams of this batch, not the service
                    _log.exception("decode step failed")
                    for request_id in self.runner.active_ids:
                        if request_id in self._queues:
                            self._queues[request_id].put_nowait(exc)
                        await self._engine.run(self.runner.cancel, request_id)
                    break
                for request_id, (chunk, _) in results.items():
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
