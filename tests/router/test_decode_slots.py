"""The router's decode slots under long generations (issue 65, item 5): a request waiting for a
slot holds no embedding (it is encoded once it has one, so no lease expires while it waits), a wait
longer than `decode_queue_s` is refused OVERLOADED naming the queue, and a speech request's windows
take no second slot. Stage doubles from tests/support/router_harness.py; every wait is on state
(calls made, slots waited for), never on a clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from libs.contract.errors import DeadlineExceeded, ResourceExhausted
from libs.contract.reasons import Reason
from services.router.failover import ANSWER_MARGIN_S
from services.router.stages import Slots
from tests.support.router_harness import Harness, image_request

pytestmark = pytest.mark.unit


async def _until(condition: Callable[[], object]) -> None:
    while not condition():
        await asyncio.sleep(0)


def _slots(h: Harness) -> Slots:
    slots = h.router._clients._decode_slots
    assert slots is not None
    return slots


def test_a_request_waiting_for_a_decode_slot_is_encoded_only_once_it_has_one() -> None:
    """Encode just in time: while every decode slot is held, a new request waits before its encode,
    so it holds no embedding lease (issue 65: one expired while its request waited, and the work
    was redone); once a slot frees it is encoded, prefilled and decoded."""
    h = Harness(decode_in_flight=1)
    slots = _slots(h)

    async def run() -> tuple[list[int], list[int], int, int]:
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            first = asyncio.create_task(h.tokens(image_request(1)))
            await _until(lambda: h.decode.requests)  # the first holds the one slot, decoding
            second = asyncio.create_task(h.tokens(image_request(1)))
            await _until(lambda: slots.waiting)
            encoded_while_waiting = len(h.log)
            leases_while_waiting = sum(e.leases for e in h.encoders.values())
            h.decode.gate.set()
            return await first, await second, encoded_while_waiting, leases_while_waiting

    first, second, encoded_while_waiting, leases_while_waiting = asyncio.run(run())
    assert first == second == [7, 8, 9]
    assert encoded_while_waiting == 1 and leases_while_waiting == 1  # the first request's item only
    assert len(h.log) == 2 and slots.waiting == 0 and slots.in_use == 0


def test_a_wait_past_decode_queue_s_is_refused_overloaded_with_the_queue() -> None:
    """Every slot held by a generation that will not end soon: a request that waited
    `decode_queue_s` is refused RESOURCE_EXHAUSTED (OVERLOADED: the door's 429 with Retry-After),
    the message naming the slots and the queue; it was never encoded, and the held stream goes on."""
    h = Harness(decode_in_flight=1, decode_queue_s=0.05)
    slots = _slots(h)

    async def run() -> tuple[ResourceExhausted, list[int]]:
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            long = asyncio.create_task(h.tokens(image_request(1)))
            await _until(lambda: h.decode.requests)
            with pytest.raises(ResourceExhausted) as refused:
                await h.tokens(image_request(1))
            assert not long.done()  # the held stream is untouched
            h.decode.gate.set()
            return refused.value, await long

    refused, tokens = asyncio.run(run())
    assert refused.reason is Reason.OVERLOADED
    assert "no decode slot free within 0.05 s: 1 of 1 held, 1 waiting" in refused.message
    assert tokens == [7, 8, 9]
    assert len(h.log) == 1 and len(h.prefill.requests) == 1  # the refused one cost no encode, no prefill
    assert slots.waiting == 0 and slots.in_use == 0


def test_the_deadline_still_ends_a_wait_shorter_than_decode_queue_s() -> None:
    """`decode_queue_s` longer than what is left of the request's deadline: the deadline ends the
    wait, as before (DEADLINE_EXCEEDED, not an overload)."""
    h = Harness(decode_in_flight=1, decode_queue_s=3600)

    async def run() -> None:
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            long = asyncio.create_task(h.tokens(image_request(1)))
            await _until(lambda: h.decode.requests)
            with pytest.raises(DeadlineExceeded, match="a decode slot"):
                async for _ in h.router.generate(image_request(1), time.monotonic() + ANSWER_MARGIN_S + 0.05):
                    pass
            h.decode.gate.set()
            await long

    asyncio.run(run())


def test_a_request_with_its_slot_takes_no_second_one_in_prefill_and_decode() -> None:
    """The slot taken before the encode is the one prefill and decode run in: with one slot, one
    request goes through (it would wait for itself forever if its decode took another)."""
    h = Harness(decode_in_flight=1)

    async def run() -> list[int]:
        async with asyncio.timeout(30):
            return await h.tokens(image_request(2))

    assert asyncio.run(run()) == [7, 8, 9]
    assert _slots(h).in_use == 0


def test_many_requests_through_few_slots_all_complete_in_turn() -> None:
    """Eight requests through two slots: each waits its turn (none encoded before it has a slot),
    all complete, every slot comes back."""
    h = Harness(decode_in_flight=2)
    slots = _slots(h)
    most_encoded_ahead = 0

    async def run() -> list[list[int]]:
        nonlocal most_encoded_ahead
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            tasks = [asyncio.create_task(h.tokens(image_request(1))) for _ in range(8)]
            await _until(lambda: len(h.decode.requests) == 2 and slots.waiting == 6)
            most_encoded_ahead = len(h.log)
            h.decode.gate.set()
            return list(await asyncio.gather(*tasks))

    assert asyncio.run(run()) == [[7, 8, 9]] * 8
    assert most_encoded_ahead == 2  # only the two holding slots were encoded
    assert slots.in_use == 0 and slots.waiting == 0


def test_a_wait_whose_deadline_already_passed_joins_no_queue() -> None:
    """Every slot held and the request's deadline already past: DEADLINE_EXCEEDED at once, nothing
    left in the queue (a waiter left there would later be granted a slot nobody releases)."""

    async def run() -> None:
        slots = Slots(lambda: 1, "a decode slot", max_wait_s=10)
        release = asyncio.Event()

        async def hold() -> None:
            async with slots.held("router.decode_queue", None):
                await release.wait()

        holder = asyncio.create_task(hold())
        await _until(lambda: slots.in_use == 1)
        with pytest.raises(DeadlineExceeded):
            async with slots.held("router.decode_queue", time.monotonic()):
                pass
        assert slots.waiting == 0
        release.set()
        await holder
        async with asyncio.timeout(10), slots.held("router.decode_queue", None):
            assert slots.in_use == 1
        assert slots.in_use == 0

    asyncio.run(run())
