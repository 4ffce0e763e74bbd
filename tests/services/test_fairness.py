"""A short request under long generations on a real E/P/D stack (issue 65, item 5): with the
defaults, a 16-token request completes while 8 streams of 4,096 tokens (`ignore_eos`) are still
decoding: it does not wait for one of them to end (it did, 71 s, when decode ran 8 at once and
the router held the 9th before prefill). Checked by the streams' state, in the order the readers
saw events, not by timing; the long streams are cancelled after and every pool comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from libs.client.generate import open_channel
from libs.contract.epd.v1 import chat_pb2, generate_pb2, generate_pb2_grpc, generation_pb2, sampling_pb2
from libs.launch.stack import Stack
from tests.support.stacks import wait_pools_empty

LONG_STREAMS = 8
LONG_TOKENS = 4096
SHORT_TOKENS = 16


def _text(text: str, max_tokens: int, *, ignore_eos: bool) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(text=text)])],
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
    )


@pytest.mark.stack
def test_a_short_request_completes_while_long_streams_decode(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")

    async def run() -> tuple[list[str], int]:
        events: list[str] = []  # in the order the readers saw them
        decoding: list[asyncio.Event] = [asyncio.Event() for _ in range(LONG_STREAMS)]
        async with open_channel(stack.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            calls = [
                stub.Generate(_text(f"long {i}", LONG_TOKENS, ignore_eos=True), timeout=600)
                for i in range(LONG_STREAMS)
            ]

            async def read_long(i: int, call: grpc.aio.UnaryStreamCall[Any, Any]) -> None:
                tokens = 0
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    async for response in call:
                        tokens += len(response.chunk.token_ids)
                        if tokens >= 2:  # past prefill's token: decoding, holding a decode slot
                            decoding[i].set()
                        if response.chunk.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                            events.append(f"long {i} finished")

            readers = [asyncio.create_task(read_long(i, call)) for i, call in enumerate(calls)]
            async with asyncio.timeout(300):
                for each in decoding:
                    await each.wait()
                short: list[int] = []
                finish = generation_pb2.FINISH_REASON_UNSPECIFIED
                async for response in stub.Generate(_text("short", SHORT_TOKENS, ignore_eos=True), timeout=300):
                    short.extend(response.chunk.token_ids)
                    finish = response.chunk.finish_reason or finish
                events.append("short finished")
            for call in calls:
                call.cancel()
            await asyncio.gather(*readers)
            assert finish == generation_pb2.FINISH_REASON_LENGTH
            return events, len(short)

    events, short_tokens = asyncio.run(run())
    assert short_tokens == SHORT_TOKENS
    assert events[0] == "short finished", events  # no long stream had ended
    wait_pools_empty(stack, timeout_s=60)
