"""The `Generate` calls behind one OpenAI request: one per choice, run together, cancelled
together (a client that disconnects, or one failed choice, ends them all: no lease outlives the
request)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from libs.client.openai.errors import ApiError, from_rpc
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc


@dataclass(frozen=True)
class Caller:
    """How the door calls the router: the stub, the deadline and the caller's bearer token."""

    stub: generate_pb2_grpc.GenerateServiceStub
    timeout_s: float
    token: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


async def responses(
    caller: Caller, requests: Sequence[generate_pb2.GenerateRequest]
) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    """(choice index, response) as each choice's stream delivers them; a failed call raises its
    `ApiError` (the others are cancelled). Leaving the iteration early cancels every call."""
    queue: asyncio.Queue[tuple[int, generate_pb2.GenerateResponse | ApiError | None]] = asyncio.Queue(
        maxsize=64
    )  # backpressure: a slow client slows the reads
    calls: list[Any] = [caller.stub.Generate(r, timeout=caller.timeout_s, metadata=caller.metadata()) for r in requests]

    async def pump(index: int, call: Any) -> None:  # grpc.aio.UnaryStreamCall; its stubs type it as an iterator
        try:
            async for response in call:
                await queue.put((index, response))
            await queue.put((index, None))
        except grpc.aio.AioRpcError as exc:
            await queue.put((index, from_rpc(exc)))

    tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    open_streams = len(tasks)
    try:
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield index, item
    finally:
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
