"""Admission control without a socket: bounded running and waiting, deadlines while waiting, and the
reasons its refusals carry (OVERLOADED when full, DRAINING once closed)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable

import pytest

from libs.contract.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from libs.contract.reasons import Reason
from libs.rpc.admission import Admission, deadline_of

pytestmark = pytest.mark.unit


async def _until(condition: Callable[[], bool]) -> None:
    """Until `condition` holds: the tasks it waits for run on this loop's next turns (bounded)."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), 30)


def test_bounds_running_and_waiting_then_returns_to_empty() -> None:
    async def scenario() -> None:
        admission = Admission("prefill", max_running=2, max_waiting=1)
        release = asyncio.Event()
        peak = 0

        async def work() -> None:
            nonlocal peak
            async with admission.slot():
                peak = max(peak, admission.running)
                await release.wait()

        tasks = [asyncio.ensure_future(work()) for _ in range(3)]
        await _until(lambda: admission.running + admission.waiting == 3)
        assert (admission.running, admission.waiting) == (2, 1)
        with pytest.raises(ResourceExhausted, match="prefill is full: 2 running, 1 waiting") as refused:
            async with admission.slot():
                pass
        assert refused.value.reason == Reason.OVERLOADED
        release.set()
        await asyncio.gather(*tasks)
        assert peak == 2
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


async def _acquire(admission: Admission, deadline: float | None) -> None:
    async with admission.slot(deadline=deadline):
        pass


def test_deadline_while_waiting() -> None:
    async def scenario() -> None:
        admission = Admission("decode", max_running=1, max_waiting=4)
        async with admission.slot():
            # Only the deadline can end this wait (the slot is ours until after it); the bound
            # turns a deadline never honoured into a failure instead of a hang.
            with pytest.raises(DeadlineExceeded, match="waiting for decode"):
                await asyncio.wait_for(_acquire(admission, deadline_of(0.1)), 30)
        assert (admission.running, admission.waiting) == (0, 0)
        async with admission.slot(deadline=deadline_of(1.0)):
            assert admission.running == 1

    asyncio.run(scenario())


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        admission = Admission("decode", max_running=1, max_waiting=8)
        order: list[str] = []
        release = asyncio.Event()

        async def work(name: str, priority: int) -> None:
            async with admission.slot(priority=priority):
                order.append(name)
                if name == "first":
                    await release.wait()

        first = asyncio.ensure_future(work("first", 0))
        await _until(lambda: order == ["first"])  # it holds the one slot
        rest = [asyncio.ensure_future(work(n, p)) for n, p in [("low", -5), ("a", 0), ("high", 9), ("b", 0)]]
        await _until(lambda: admission.waiting == 4)
        release.set()
        await asyncio.gather(first, *rest)
        assert (admission.running, admission.waiting) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["first", "high", "a", "b", "low"]


def test_draining_refuses_new_work_but_finishes_admitted() -> None:
    async def scenario() -> None:
        admission = Admission("prefill", max_running=1, max_waiting=4)
        async with admission.slot():
            admission.close()
            # The reason for 1.5 callers, the word for older ones (libs/rpc/retry.py's fallback).
            with pytest.raises(Unavailable, match="draining") as refused:
                async with admission.slot():
                    pass
            assert refused.value.reason == Reason.DRAINING
        assert await admission.idle(1.0)

    asyncio.run(scenario())


def test_memory_released_after_the_calls_end_is_reclaimed_by_the_second_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large call's bytes held in a reference cycle by something that lets go only after the
    call's done callback ran: the first pass cannot free them, the deferred one does, and calls
    ending together share one deferred pass."""
    from libs.rpc import admission

    class Held:
        def __init__(self) -> None:
            self.payload = bytearray(8 << 20)
            self.cycle = self  # only the cyclic collector frees it

    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    async def scenario() -> None:
        late_holder = [Held()]
        held = weakref.ref(late_holder[0])
        admission._give_back(None)  # the call ends while the request is still referenced
        admission._give_back(None)  # a second call ends within the same window
        assert held() is not None and len(collections) == 2
        late_holder.clear()  # ... then the last reference goes (garbage, but in a cycle)
        await _until(lambda: held() is None)
        assert len(collections) == 3  # one deferred pass for both calls, and it freed the bytes

    monkeypatch.setattr(admission, "SECOND_PASS_S", 0.01)
    gc.disable()  # only the passes collect
    gc.callbacks.append(count)
    try:
        asyncio.run(scenario())
    finally:
        gc.callbacks.remove(count)
        gc.enable()
