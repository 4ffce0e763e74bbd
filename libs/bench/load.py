"""Drive a stack with planned requests: open loop (Poisson arrivals, sent whatever the server does)
or closed loop (N clients, each sending its next request when the last finished). A run is bounded
by a request count, a duration, or both (whichever comes first; `LoadRun.ended_by` says which);
warm-up requests go first, one at a time, and are not recorded.

Requests come from a `RequestSource`: a list prepared before the run (`Prepared`: media building
costs CPU the stack should have while it is measured), or, for a duration-bounded closed loop that
cannot know how many it will send, `MadeAhead`, which builds them in a worker thread a few ahead of
those sent and counts the times a client had to wait for one.

The transport is a `Send` callable, so the scheduling logic runs without sockets in tests;
`grpc_sender` is the real one (streams `Generate`, timing every token chunk).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import grpc
from opentelemetry import trace

from libs.bench.arrivals import poisson_arrivals
from libs.bench.mix import PlannedRequest
from libs.bench.stats import RequestRecord

T = TypeVar("T")
_tracer = trace.get_tracer("epd.bench")
# Sends one request, filling `record` (ttft, gaps, tokens, e2e or error) as the reply streams.
Send = Callable[[PlannedRequest, RequestRecord], Awaitable[None]]
# (seconds since the run's start, requests finished, of them failed, in flight): called every
# `LoadConfig.progress_s` while the run goes.
Progress = Callable[[float, int, int, int], None]
ENDED_BY_DURATION = "duration"
ENDED_BY_REQUESTS = "requests"


@dataclass(frozen=True)
class LoadConfig:
    mode: Literal["open", "closed"] = "closed"
    rate_per_s: float = 1.0  # open loop
    concurrency: int = 1  # closed loop
    duration_s: float = 60.0  # no request starts after this (math.inf: no bound)
    max_requests: int | None = 1000  # and no more than this many are sent (None: no bound)
    warmup_requests: int = 0  # sent first, one at a time, not recorded
    drain_s: float = 300.0  # longest wait for requests still running at the end
    seed: int = 0
    progress_s: float = 5.0  # between two progress calls


class RequestSource(Protocol):
    async def take(self) -> PlannedRequest | None:
        """The next request to send; None when there are no more."""
        ...


class Prepared:
    """Requests built before the run."""

    def __init__(self, plan: Sequence[PlannedRequest]) -> None:
        self._left = deque(plan)

    async def take(self) -> PlannedRequest | None:
        return self._left.popleft() if self._left else None


@dataclass
class MadeAhead:
    """Requests built while the run goes, in a worker thread, up to `ahead` of those sent."""

    requests: Iterator[PlannedRequest]
    ahead: int = 8
    waits: int = 0  # times a client found no request ready
    waited_s: float = 0.0
    _ready: asyncio.Queue[PlannedRequest | None] | None = field(default=None, init=False, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    async def take(self) -> PlannedRequest | None:
        if self._ready is None:
            self._ready = asyncio.Queue(maxsize=max(1, self.ahead))
            self._task = asyncio.create_task(self._fill())
        if self._ready.empty():
            self.waits += 1
            started = time.perf_counter()
            item = await self._ready.get()
            self.waited_s += time.perf_counter() - started
        else:
            item = self._ready.get_nowait()
        if item is None:
            self._ready.put_nowait(None)  # for the other clients
        return item

    async def _fill(self) -> None:
        assert self._ready is not None
        while (item := await asyncio.to_thread(next, self.requests, None)) is not None:
            await self._ready.put(item)
        await self._ready.put(None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass
class LoadRun:
    records: list[RequestRecord]  # the measured requests, in start order
    ended_by: str  # ENDED_BY_DURATION or ENDED_BY_REQUESTS: the bound that ended the run


async def _one(send: Send, planned: PlannedRequest, t0: float, clock: Callable[[], float]) -> RequestRecord:
    record = RequestRecord(kind=planned.kind, start_s=clock() - t0, request_id=planned.request.request_id)
    started = clock()
    try:
        await send(planned, record)
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"[:300]
    except Exception as exc:  # a failed request is a result, not a crash of the run
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    if math.isnan(record.e2e_s):
        record.e2e_s = clock() - started
    return record


async def run_load(
    send: Send,
    plan: Sequence[PlannedRequest],
    config: LoadConfig,
    clock: Callable[[], float] = time.perf_counter,
) -> list[RequestRecord]:
    """Run `plan` (warm-up first) under `config`; records of the measured requests, in start order."""
    return (await run(send, Prepared(plan), config, clock)).records


async def run(
    send: Send,
    source: RequestSource,
    config: LoadConfig,
    clock: Callable[[], float] = time.perf_counter,
    on_progress: Progress | None = None,
) -> LoadRun:
    """Run the requests of `source` (warm-up first) under `config`, and say what ended the run."""
    for _ in range(config.warmup_requests):
        planned = await source.take()
        if planned is None:
            return LoadRun([], ENDED_BY_REQUESTS)
        await _one(send, planned, clock(), clock)
    limited = _Limited(source, config.max_requests)
    t0 = clock()
    records: list[RequestRecord] = []
    in_flight = [0]
    reporter = asyncio.create_task(_report(on_progress, config, t0, clock, records, in_flight)) if on_progress else None
    try:
        if config.mode == "open":
            ended_by = await _open_loop(send, limited, config, t0, clock, records, in_flight)
        else:
            ended_by = await _closed_loop(send, limited, config, t0, clock, records, in_flight)
    finally:
        if reporter is not None:
            reporter.cancel()
    return LoadRun(sorted(records, key=lambda r: r.start_s), ended_by)


class _Limited:
    """At most `limit` requests of `source` (None: all)."""

    def __init__(self, source: RequestSource, limit: int | None) -> None:
        self._source, self.left = source, limit
        self.exhausted = False

    async def take(self) -> PlannedRequest | None:
        if self.left is not None and self.left <= 0:
            self.exhausted = True
            return None
        planned = await self._source.take()
        if planned is None:
            self.exhausted = True
        elif self.left is not None:
            self.left -= 1
        return planned


async def _report(
    on_progress: Progress,
    config: LoadConfig,
    t0: float,
    clock: Callable[[], float],
    records: list[RequestRecord],
    in_flight: list[int],
) -> None:
    while True:
        await asyncio.sleep(config.progress_s)
        on_progress(clock() - t0, len(records), sum(1 for r in records if r.error), in_flight[0])


async def _timed(
    send: Send,
    planned: PlannedRequest,
    t0: float,
    clock: Callable[[], float],
    records: list[RequestRecord],
    in_flight: list[int],
) -> None:
    in_flight[0] += 1
    try:
        records.append(await _one(send, planned, t0, clock))
    finally:
        in_flight[0] -= 1


async def _open_loop(
    send: Send,
    source: _Limited,
    config: LoadConfig,
    t0: float,
    clock: Callable[[], float],
    records: list[RequestRecord],
    in_flight: list[int],
) -> str:
    count = config.max_requests if config.max_requests is not None else 10**9
    if math.isinf(config.duration_s) and config.max_requests is None:
        raise ValueError("an open loop needs a request count or a duration")
    arrivals = poisson_arrivals(config.rate_per_s, count=count, duration_s=config.duration_s, seed=config.seed)
    tasks = []
    for at in arrivals:
        delay = at - (clock() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        planned = await source.take()
        if planned is None:
            break
        tasks.append(asyncio.create_task(_timed(send, planned, t0, clock, records, in_flight)))
    await _gather_bounded(tasks, config.drain_s)
    return ENDED_BY_REQUESTS if source.exhausted or len(arrivals) == count else ENDED_BY_DURATION


async def _closed_loop(
    send: Send,
    source: _Limited,
    config: LoadConfig,
    t0: float,
    clock: Callable[[], float],
    records: list[RequestRecord],
    in_flight: list[int],
) -> str:
    async def client() -> None:
        while clock() - t0 < config.duration_s and (planned := await source.take()) is not None:
            await _timed(send, planned, t0, clock, records, in_flight)

    workers = [asyncio.create_task(client()) for _ in range(max(1, config.concurrency))]
    await _gather_bounded(workers, config.duration_s + config.drain_s)
    return ENDED_BY_REQUESTS if source.exhausted else ENDED_BY_DURATION


async def _gather_bounded(tasks: list[asyncio.Task[T]], limit_s: float) -> list[T]:
    """Wait for `tasks` at most `limit_s`; the rest are cancelled (bounded runs end by themselves)."""
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=None if math.isinf(limit_s) else limit_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done if not t.cancelled() and t.exception() is None]


def grpc_sender(channel: grpc.aio.Channel, timeout_s: float = 300.0) -> Send:
    """A `Send` that calls `GenerateService.Generate` on `channel` and times each token chunk."""
    from libs.contract.epd.v1 import generate_pb2_grpc

    stub = generate_pb2_grpc.GenerateServiceStub(channel)

    async def send(planned: PlannedRequest, record: RequestRecord) -> None:
        # A client span, when a tracer provider is installed: its context rides in the call's
        # metadata, so the servers' spans of this request join a trace whose id we know.
        with _tracer.start_as_current_span("bench.request") as span:
            context = span.get_span_context()
            if context.is_valid:
                record.trace_id = format(context.trace_id, "032x")
            await _stream(planned, record)

    async def _stream(planned: PlannedRequest, record: RequestRecord) -> None:
        started = time.perf_counter()
        last = None
        async for response in stub.Generate(planned.request, timeout=timeout_s):
            if not response.chunk.token_ids and not response.chunk.finish_reason:
                continue  # a first token that is the end of text arrives as a bare finish
            now = time.perf_counter()
            if last is None:
                record.ttft_s = now - started
            else:
                record.token_gaps_s.append(now - last)
            last = now
            record.tokens += len(response.chunk.token_ids)
        record.e2e_s = time.perf_counter() - started

    return send
