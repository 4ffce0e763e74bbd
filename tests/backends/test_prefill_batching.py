"""Prefill batching (libs/backends/prefill_batching.py): requests arriving while others run go into
the engine together once per window of engine steps; never held while nothing runs; a held
request's deadline and cancel leave nothing counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from libs.backends.prefill_batching import PrefillBatching, Ticket
from libs.contract.errors import DeadlineExceeded

pytestmark = pytest.mark.unit


def _run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(scenario(), 10)  # a request held forever fails, not hangs

    return asyncio.run(bounded())


async def _settled() -> None:
    for _ in range(5):  # a released turn resumes its waiter through wait_for and shield
        await asyncio.sleep(0)


def test_a_request_goes_in_at_once_while_nothing_runs() -> None:
    async def scenario() -> None:
        batching = PrefillBatching(4)
        first = await batching.enter()
        assert not first.held and batching.running == 1
        first.leave()
        again = await batching.enter()
        assert not again.held and batching.running == 1

    _run(scenario)


def test_arrivals_mid_window_go_in_together_at_its_end() -> None:
    async def scenario() -> None:
        batching = PrefillBatching(4)
        running = await batching.enter()
        arrivals = [asyncio.create_task(batching.enter()) for _ in range(2)]
        await _settled()
        assert batching.held == 2 and batching.running == 1
        for _ in range(3):
            running.stepped()
        await _settled()
        assert not any(task.done() for task in arrivals)  # three steps into a window of four
        running.stepped()
        tickets = await asyncio.gather(*arrivals)
        assert all(ticket.held for ticket in tickets)
        assert batching.held == 0 and batching.running == 3
        for ticket in [running, *tickets]:
            ticket.leave()
        assert batching.running == 0

    _run(scenario)


def test_steps_count_from_the_last_round_not_from_each_requests_start() -> None:
    """After a round goes in, the next window counts again from zero for everyone: an old request's
    earlier outputs do not let a new arrival in early."""

    async def scenario() -> None:
        batching = PrefillBatching(3)
        old = await batching.enter()
        for _ in range(5):
            old.stepped()  # a window passed with nothing held
        late = await batching.enter()  # goes in at once: the window is over
        assert not late.held
        waiting = asyncio.create_task(batching.enter())
        await _settled()
        old.stepped()
        late.stepped()
        await _settled()
        assert not waiting.done()  # one step into the new window
        old.stepped()
        old.stepped()
        assert (await waiting).held

    _run(scenario)


def test_the_held_go_in_when_the_running_leave() -> None:
    async def scenario() -> None:
        batching = PrefillBatching(100)
        running = await batching.enter()
        waiting = asyncio.create_task(batching.enter())
        await _settled()
        assert not waiting.done()
        running.leave()  # finished (or failed) long before the window's end
        ticket = await waiting
        assert ticket.held and batching.running == 1

    _run(scenario)


def test_only_a_full_batch_holds_and_a_freed_slot_lets_the_held_in() -> None:
    """While the engine's batch has a free slot a request goes in at once; once it is full arrivals
    wait, and a slot freeing lets them all in (one that came later never passes one held)."""

    async def scenario() -> None:
        batching = PrefillBatching(100, batch=2)
        first, second = await batching.enter(), await batching.enter()
        assert not first.held and not second.held and batching.running == 2
        arrivals = [asyncio.create_task(batching.enter()) for _ in range(2)]
        await _settled()
        assert batching.held == 2
        first.leave()
        tickets = await asyncio.gather(*arrivals)
        assert all(ticket.held for ticket in tickets) and batching.running == 3
        late = asyncio.create_task(batching.enter())  # still full, the window just began
        await _settled()
        assert not late.done()
        second.leave()
        await _settled()
        assert not late.done() and batching.held == 1  # two still run: the batch is full
        tickets[0].leave()
        assert (await late).held and batching.running == 2

    _run(scenario)


def test_zero_steps_holds_nothing() -> None:
    async def scenario() -> list[Ticket]:
        batching = PrefillBatching(0)
        return [await batching.enter() for _ in range(3)]

    assert [ticket.held for ticket in _run(scenario)] == [False, False, False]


def test_a_held_request_past_its_deadline_fails_and_is_forgotten() -> None:
    async def scenario() -> PrefillBatching:
        batching = PrefillBatching(4)
        running = await batching.enter()
        with pytest.raises(DeadlineExceeded, match="waiting to be prefilled"):
            await batching.enter(deadline=time.monotonic() + 0.01)
        assert batching.held == 0 and batching.running == 1
        running.leave()
        return batching

    assert _run(scenario).running == 0


def test_a_cancel_while_held_or_just_let_in_leaves_nothing_counted() -> None:
    async def scenario() -> None:
        batching = PrefillBatching(2)
        running = await batching.enter()
        cancelled = asyncio.create_task(batching.enter())
        await _settled()
        cancelled.cancel()
        await _settled()
        assert cancelled.cancelled() and batching.held == 0 and batching.running == 1
        # Let in and cancelled before it resumed: its place is given back.
        raced = asyncio.create_task(batching.enter())
        await _settled()
        running.stepped()
        running.stepped()  # the window ends: `raced` is let in ...
        raced.cancel()  # ... and cancelled before it runs again
        await _settled()
        assert raced.cancelled() and batching.running == 1
        running.leave()
        assert batching.running == 0

    _run(scenario)
