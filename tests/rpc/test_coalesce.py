"""A relay that merges what queued up while its reader lagged (libs/rpc/coalesce.py), and the
token-chunk merge it is used with (libs/contract/chunks.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from libs.contract.chunks import merge_chunks, merge_replies, merge_responses
from libs.contract.epd.v1 import generate_pb2, generation_pb2
from libs.rpc.coalesce import coalesced

pytestmark = pytest.mark.unit


def _chunk(*ids: int, finish: int = 0) -> generation_pb2.TokenChunk:
    chunk = generation_pb2.TokenChunk(token_ids=ids, text="".join(f"<{i}>" for i in ids), finish_reason=finish)
    for i in ids:
        chunk.logprobs.add().chosen.token_id = i
    return chunk


def _concat(a: list[int], b: list[int]) -> list[int]:
    return a + b


def test_merged_chunks_say_what_both_said_in_order() -> None:
    merged = merge_chunks(_chunk(1, 2), _chunk(3, finish=generation_pb2.FINISH_REASON_LENGTH))
    assert list(merged.token_ids) == [1, 2, 3]
    assert merged.text == "<1><2><3>"
    assert [e.chosen.token_id for e in merged.logprobs] == [1, 2, 3]
    assert merged.finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_usage_is_kept_from_whichever_carried_it() -> None:
    usage = generation_pb2.Usage(prompt_tokens=7, completion_tokens=3)
    assert merge_replies((_chunk(1), None), (_chunk(2), usage))[1] == usage
    assert merge_replies((_chunk(1), usage), (_chunk(2), None))[1] == usage
    last = generate_pb2.GenerateResponse(request_id="r", chunk=_chunk(2), usage=usage)
    merged = merge_responses(generate_pb2.GenerateResponse(request_id="r", chunk=_chunk(1)), last)
    assert merged.request_id == "r" and list(merged.chunk.token_ids) == [1, 2] and merged.usage == usage
    assert merge_responses(last, generate_pb2.GenerateResponse(request_id="r")).usage == usage


async def _burst(items: list[list[int]], go: asyncio.Event, produced: asyncio.Event) -> AsyncIterator[list[int]]:
    """The first item, then (once `go` is set) the rest at once; `produced` set after the last."""
    yield items[0]
    await go.wait()
    for item in items[1:]:
        yield item
    produced.set()


async def _lagging_read(items: list[list[int]], merge: Any) -> list[list[int]]:
    """The first item read at once; the rest read only after all of them were produced."""
    go, produced = asyncio.Event(), asyncio.Event()
    relay = coalesced(_burst(items, go, produced), merge)
    got = [await anext(relay)]
    go.set()
    await produced.wait()  # the reader lags: the rest queued up meanwhile
    return got + [item async for item in relay]


def test_a_reader_that_keeps_up_gets_every_item_as_it_came() -> None:
    async def scenario() -> list[list[int]]:
        gates = [asyncio.Event() for _ in range(3)]

        async def paced() -> AsyncIterator[list[int]]:
            for i, gate in enumerate(gates):
                await gate.wait()  # the next item only once the reader took the last one
                yield [i]

        got: list[list[int]] = []
        gates[0].set()
        async for item in coalesced(paced(), _concat):
            got.append(item)
            if len(got) < len(gates):
                gates[len(got)].set()
        return got

    assert asyncio.run(scenario()) == [[0], [1], [2]]


def test_a_lagging_reader_gets_what_queued_up_as_one_item() -> None:
    assert asyncio.run(_lagging_read([[1], [2], [3], [4]], _concat)) == [[1], [2, 3, 4]]


def test_items_that_must_stay_apart_are_not_merged_and_keep_their_order() -> None:
    def same_parity(a: list[int], b: list[int]) -> list[int] | None:
        return a + b if a[0] % 2 == b[0] % 2 else None

    got = asyncio.run(_lagging_read([[0], [2], [4], [1], [3], [6]], same_parity))
    assert got == [[0], [2, 4], [1, 3], [6]]


def test_a_failure_comes_after_the_items_before_it() -> None:
    async def failing() -> AsyncIterator[list[int]]:
        yield [1]
        yield [2]
        raise RuntimeError("stage failed")

    async def scenario() -> list[list[int]]:
        got: list[list[int]] = []
        with pytest.raises(RuntimeError, match="stage failed"):
            async for item in coalesced(failing(), _concat):
                got.append(item)
        return got

    assert [x for item in asyncio.run(scenario()) for x in item] == [1, 2]


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_leaving_the_relay_closes_its_source(how: str) -> None:
    async def scenario() -> list[str]:
        events: list[str] = []
        blocked = asyncio.Event()

        async def endless() -> AsyncIterator[list[int]]:
            try:
                yield [1]
                blocked.set()
                await asyncio.Event().wait()  # a stage that never answers again
                yield [2]
            finally:
                events.append("source closed")

        relay = coalesced(endless(), _concat)
        assert await anext(relay) == [1]
        if how == "closed":
            await blocked.wait()
            await relay.aclose()
        else:
            reader = asyncio.create_task(anext(relay))
            await blocked.wait()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        return events

    assert asyncio.run(scenario()) == ["source closed"]


def test_a_reader_that_stops_reading_stops_the_source_after_depth_items() -> None:
    async def scenario() -> int:
        pulled = 0

        async def counting() -> AsyncIterator[list[int]]:
            nonlocal pulled
            for i in range(1000):
                pulled += 1
                yield [i]

        relay = coalesced(counting(), _concat, depth=8)
        await anext(relay)
        for _ in range(50):  # let the reader task run as far as it can
            await asyncio.sleep(0)
        await relay.aclose()
        return pulled

    # Read: what the first item took with it (a full queue and one more), a queue full again, and
    # one waiting to be put; not the 1000 the source would give.
    assert asyncio.run(scenario()) <= 2 * 8 + 2
