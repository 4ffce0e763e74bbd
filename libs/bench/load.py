"""Drive a stack with planned requests: open loop (Poisson arrivals, sent whatever the server does)
or closed loop (N clients, each sending its next request when the last finished). Both are bounded
by a request count and a duration; warm-up requests go first, one at a time, and are not recorded.

The transport is a `Send` callable, so the scheduling logic runs without sockets in tests;
`grpc_sender` is the real one (streams `Generate`, timing every token chunk).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import grpc
from opentelemetry import trace

from libs.bench.arrivals import poisson_arrivals
from libs.bench.mix import PlannedRequest
from libs.bench.stats import RequestRecord

T = TypeVar("T")
_tracer = trace.get_tracer("epd.bench")
# Sends one request, filling `record` (ttft, gaps, tokens, e2e or error) as the reply streams.
Send = Callable[[PlannedRequest, RequestRecord], Awaitable[None]]


@dataclass(frozen=True)
class LoadConfig:
    mode: Literal["open", "closed"] = "closed"
    rate_per_s: float = 1.0  # open loop
    concurrency: int = 1  # closed loop
    duration_s: float = 60.0  # no request starts after this
    max_requests: int = 1000  # and no more than this many are sent
    warmup_requests: int = 0  # sent first, one at a time, not recorded
    drain_s: float = 300.0  # longest wait for requests still running at the end
    seed: int = 0


async def _one(send: Send, planned: PlannedRequest, t0: float, clock: Callable[[], float]) -> RequestRecord:
    record = RequestRecord(kind=planned.kind, start_s=clock() - t0, request_id=planned.request.request_id)
    started = clock()
    try:
        await send(planned, record)
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
    for planned in plan[: config.warmup_requests]:
        await _one(send, planned, clock(), clock)
    measured = list(plan[config.warmup_requests :])[: config.max_requests]
    t0 = clock()
    if config.mode == "open":
        records = await _open_loop(send, measured, config, t0, clock)
    else:
        records = await _closed_loop(send, measured, config, t0, clock)
    return sorted(records, key=lambda r: r.start_s)


async def _open_loop(
    send: Send, plan: list[PlannedRequest], config: LoadConfig, t0: float, clock: Callable[[], float]
) -> list[RequestRecord]:
    arrivals = poisson_arrivals(config.rate_per_s, count=len(plan), duration_s=config.duration_s, seed=config.seed)
    tasks = []
    for at, planned in zip(arrivals, plan, strict=False):
        delay = at - (clock() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(send, planned, t0, clock)))
    return await _gather_bounded(tasks, config.drain_s)


async def _closed_loop(
    send: Send, plan: list[PlannedRequest], config: LoadConfig, t0: float, clock: Callable[[], float]
) -> list[RequestRecord]:
    queue = list(reversed(plan))
    records: list[RequestRecord] = []

    async def client() -> None:
        while queue and clock() - t0 < config.duration_s:
            records.append(await _one(send, queue.pop(), t0, clock))

    workers = [asyncio.create_task(client()) for _ in range(max(1, config.concurrency))]
    await _gather_bounded(workers, config.duration_s + config.drain_s)
    return records


async def _gather_bounded(tasks: list[asyncio.Task[T]], limit_s: float) -> list[T]:
    """Wait for `tasks` at most `limit_s`; the rest are cancelled (bounded runs end by themselves)."""
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=limit_s)
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
