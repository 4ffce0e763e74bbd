"""Running the (blocking, torch) engine under asyncio services.

`ComputeThread` is the one thread a process runs model code on: encode, prefill and decode steps
are serialized there, so the event loop stays responsive and compute never oversubscribes the
cores; a priority queue decides the order (decode steps first, then the shortest prefill).
`DecodeLoop` drives a `DecodeRunner` on that thread: while any sequence is active it runs batched
steps and routes each sequence's chunks to its stream; a stream that ends early (client cancel,
deadline) removes its sequence from the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from libs.model.types import DecodeState, KvCache, SamplingParams, TokenChunk
from libs.runtime.decode_runner import DecodeRunner

T = TypeVar("T")
_log = structlog.get_logger(__name__)


@dataclass
class _Job:
    priority: float
    seq: int
    queued_at: float
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ComputeThread:
    """A single worker thread for model code, with a priority queue in front of it.

    `run` jobs (priority 0: decode steps, encodes, bookkeeping) go first, in arrival order; `run_at`
    jobs with a larger priority (prefill chunks: their remaining prompt tokens) wait behind them, the
    smallest first, so a short text prefill is not queued behind a long multimodal one (shortest
    remaining first). A waiting job's priority falls by `aging_per_s` per second waited, so long
    prefills are not starved. A job whose caller was cancelled before it started is skipped.
    """

    def __init__(self, name: str = "engine", *, aging_per_s: float = 100.0) -> None:
        self._aging_per_s = aging_per_s
        self._cv = threading.Condition()
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"{name}_0", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self.run_at(0.0, fn, *args, **kwargs)

    async def run_at(self, priority: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the engine thread once no job of a smaller (aged) priority waits."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        job = _Job(priority, next(self._seq), time.monotonic(), functools.partial(fn, *args, **kwargs), loop, future)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine thread shut down")
            self._queue.append(job)
            self._cv.notify()
        return await future

    def queued(self) -> int:
        with self._cv:
            return len(self._queue)

    def _next(self) -> _Job:
        now = time.monotonic()
        job = min(self._queue, key=lambda j: (j.priority - self._aging_per_s * (now - j.queued_at), j.seq))
        self._queue.remove(job)
        return job

    def _take(self) -> _Job | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            return self._next() if self._queue else None

    def _work(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            if not job.future.cancelled():
                self._execute(job)
            del job  # hold nothing of a finished job while idle: its arguments (media, tensors)

    @staticmethod
    def _execute(job: _Job) -> None:
        result, error = None, None
        try:
            result = job.fn()
        except BaseException as exc:  # delivered to the caller, as an executor would
            error = exc
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)

    def shutdown(self) -> None:
        """Cancel what has not started, let the running job finish, stop the thread."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        for job in pending:
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(job.future.cancel)
        if threading.current_thread() is not self._thread:
            self._thread.join()


@dataclass
class StepStats:
    """The decode steps one sequence took part in (for capacity planning: a step's cost grows with
    its batch): how many, their engine-thread seconds and their batch sizes, summed."""

    steps: int = 0
    engine_s: float = 0.0
    batch_sum: int = 0


class DecodeLoop:
    """Batched decoding for many concurrent streams (use from one event loop)."""

    def __init__(self, runner: DecodeRunner, thread: ComputeThread) -> None:
        self.runner = runner
        self._compute = thread
        self._queues: dict[str, asyncio.Queue[TokenChunk | BaseException]] = {}
        self._stats: dict[str, StepStats] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Sequences in the runner's batch (what `GetStats` reports): one whose stream ended early
        counts until the runner has dropped it, so a leak shows."""
        return len(self.runner.active_ids)

    async def stream(
        self,
        request_id: str,
        kv: KvCache,
        state: DecodeState,
        sampling: SamplingParams,
        stats: StepStats | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Decode one sequence from `kv`; yields chunks until one carries a finish reason. `stats`,
        if given, counts the steps the sequence takes part in."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-loop")
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        await self._compute.run(self.runner.add, request_id, kv, state, sampling)  # raises typed engine errors
        self._queues[request_id] = queue
        if stats is not None:
            self._stats[request_id] = stats
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
            self._stats.pop(request_id, None)
            if not finished:
                await asyncio.shield(self._compute.run(self.runner.cancel, request_id))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.runner.active_ids:
                try:
                    results, seconds = await self._compute.run(self._timed_step)
                except Exception as exc:  # a bug in a step fails the streams of this batch, not the service
                    _log.exception("decode step failed")
                    for request_id in self.runner.active_ids:
                        if request_id in self._queues:
                            self._queues[request_id].put_nowait(exc)
                        await self._compute.run(self.runner.cancel, request_id)
                    break
                for request_id, (chunk, _) in results.items():
                    stats = self._stats.get(request_id)
                    if stats is not None:
                        stats.steps += 1
                        stats.engine_s += seconds
                        stats.batch_sum += len(results)
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)

    def _timed_step(self) -> tuple[dict[str, tuple[TokenChunk, Any]], float]:
        started = time.perf_counter()  # on the engine thread: the step's compute, not its wait
        results = self.runner.step()
        return results, time.perf_counter() - started
