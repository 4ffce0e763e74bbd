"""The `Generate` calls behind one OpenAI request: one per choice, run together, cancelled
together (a client that disconnects, or one failed choice, ends them all: no lease outlives the
request).

The door reaches the router through a `GenerateCall`: over gRPC (`over_grpc`, the door as a
process of its own) or in the router's own process (`in_process.in_process`). Either raises
`ApiError` for a failed call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

import grpc

from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc
from libs.door.openai.errors import ApiError, from_rpc


class GenerateCall(Protocol):
    """One `Generate` of the router: its responses as they come; `token` is the bearer token the
    client presented (None: none), for a router that checks it. Raises `ApiError`."""

    def __call__(
        self, request: generate_pb2.GenerateRequest, token: str | None
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]: ...


def over_grpc(stub: generate_pb2_grpc.GenerateServiceStub, timeout_s: float) -> GenerateCall:
    """`Generate` on the router at the other end of `stub`'s channel, with a `timeout_s` deadline."""

    async def call(
        request: generate_pb2.GenerateRequest, token: str | None
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        rpc: Any = stub.Generate(request, timeout=timeout_s, metadata=metadata)  # its stubs type it an iterator
        try:
            async for response in rpc:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc) from None
        finally:
            rpc.cancel()  # left early (a client gone, another choice failed): the router stops too

    return call


async def responses(
    generate: GenerateCall, requests: Sequence[generate_pb2.GenerateRequest], token: str | None
) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    """(choice index, response) as each choice's stream delivers them; a failed call raises its
    `ApiError` (the others are cancelled). Leaving the iteration early cancels every call."""
    if len(requests) == 1:  # one choice (the usual request): its stream as it is, no relay task
        async with contextlib.aclosing(generate(requests[0], token)) as only:
            async for response in only:
                yield 0, response
        return
    queue: asyncio.Queue[tuple[int, generate_pb2.GenerateResponse | ApiError | None]] = asyncio.Queue(
        maxsize=64
    )  # backpressure: a slow client slows the reads

    async def pump(index: int, request: generate_pb2.GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(generate(request, token)) as stream:
                async for response in stream:
                    await queue.put((index, response))
            await queue.put((index, None))
        except ApiError as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
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
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
