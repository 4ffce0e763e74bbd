"""The one helper every stage call runs through (services/router/failover.py), on a bare member
pool: the member retry, its budget per stage, tries made again, streams that fail after their
first item, and waiting for a discovered stage that has no member yet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import grpc
import pytest

from libs.contract.errors import Unavailable
from services.router.failover import Failover, MemberGone, TryAgain
from services.router.policy import ENCODE_RETRIES, MEMBER_RETRIES
from services.router.pool import MemberPool
from tests.support.router_harness import rpc_error

pytestmark = pytest.mark.unit


async def _passes(address: str) -> None:
    return None


def test_a_member_gone_after_answering_moves_once_for_encodes_then_raises_the_cause() -> None:
    pool = MemberPool(["a", "b", "c"], stage="encoder")
    tried: list[str] = []

    async def gone(address: str) -> str:
        tried.append(address)
        try:
            raise Unavailable(f"peer {address} unreachable")
        except Unavailable as exc:
            raise MemberGone from exc

    with pytest.raises(Unavailable, match="unreachable"):
        asyncio.run(Failover(pool, "encode", ENCODE_RETRIES, None, _passes).unary(gone))
    assert len(tried) == 2 and len(set(tried)) == 2  # one other encoder, not every one
    assert pool.outstanding == {"a": 0, "b": 0, "c": 0}


def test_a_try_made_again_may_go_to_the_same_member() -> None:
    pool = MemberPool(["only"], stage="encoder")
    tries: list[str] = []

    async def once_more(address: str) -> str:
        tries.append(address)
        if len(tries) == 1:
            raise TryAgain
        return "done"

    assert asyncio.run(Failover(pool, "encode", ENCODE_RETRIES, None, _passes).unary(once_more)) == "done"
    assert tries == ["only", "only"]


def test_a_stream_that_fails_after_its_first_item_is_not_moved() -> None:
    pool = MemberPool(["a", "b"], stage="decode")
    calls: list[str] = []

    async def stream(address: str) -> AsyncGenerator[int, None]:
        calls.append(address)
        yield 1
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")

    async def run() -> list[int]:
        return [item async for item in Failover(pool, "decode", MEMBER_RETRIES, None, _passes).stream(stream)]

    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(run())
    assert len(calls) == 1 and pool.outstanding == {"a": 0, "b": 0}


def test_a_discovered_member_stage_with_no_member_is_waited_for_an_encoder_stage_is_not() -> None:
    async def run() -> str:
        pool = MemberPool([], stage="prefill", dynamic=True)

        async def answer(address: str) -> str:
            return address

        # Runs once the call has found no member and paused (the coroutine runs until it suspends).
        asyncio.get_running_loop().call_soon(pool.update, ["p:1"])
        return await Failover(pool, "prefill", MEMBER_RETRIES, time.monotonic() + 10, _passes).unary(answer)

    assert asyncio.run(run()) == "p:1"
    empty = MemberPool([], stage="encoder", dynamic=True)

    async def never(address: str) -> str:
        raise AssertionError("no member to call")

    with pytest.raises(Unavailable, match="no encoder"):
        asyncio.run(Failover(empty, "encode", ENCODE_RETRIES, time.monotonic() + 10, _passes).unary(never))
