"""The engine thread's queue: priority 0 first in arrival order, then larger priorities smallest
first (prefill chunks by remaining tokens), aging, cancelled jobs skipped, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from libs.serving.compute_thread import ComputeThread
from tests.support.compute_thread import hold_thread, until_queued

pytestmark = pytest.mark.unit


def test_jobs_run_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        engine = ComputeThread("t", aging_per_s=0.0)
        gate = threading.Event()
        order: list[str] = []
        blocker = await hold_thread(engine, gate)  # holds the thread while jobs queue
        jobs = [
            engine.run_at(800, order.append, "image chunk 800"),
            engine.run_at(40, order.append, "text 40"),
            engine.run(order.append, "decode step A"),
            engine.run_at(300, order.append, "image chunk 300"),
            engine.run(order.append, "decode step B"),
        ]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        await until_queued(engine, 5)
        gate.set()
        await asyncio.gather(blocker, *tasks)
        engine.shutdown()
        return order

    assert asyncio.run(scenario()) == [
        "decode step A",
        "decode step B",
        "text 40",
        "image chunk 300",
        "image chunk 800",
    ]


def test_a_long_wait_ages_a_job_ahead() -> None:
    async def scenario() -> list[str]:
        engine = ComputeThread("t", aging_per_s=10_000.0)  # 10k tokens of priority per second waited
        gate = threading.Event()
        order: list[str] = []
        blocker = await hold_thread(engine, gate)
        old = asyncio.ensure_future(engine.run_at(1000, order.append, "old long"))
        await until_queued(engine, 1)
        await asyncio.sleep(0.3)  # at least 0.3 s older: aged by >= 3000, more than the 950 between them
        new = asyncio.ensure_future(engine.run_at(50, order.append, "new short"))
        await until_queued(engine, 2)
        gate.set()
        await asyncio.gather(blocker, old, new)
        engine.shutdown()
        return order

    assert asyncio.run(scenario()) == ["old long", "new short"]


def test_cancelled_jobs_are_skipped_and_errors_reach_the_caller() -> None:
    async def scenario() -> list[str]:
        engine = ComputeThread("t")
        gate = threading.Event()
        ran: list[str] = []
        blocker = await hold_thread(engine, gate)
        doomed = asyncio.ensure_future(engine.run(ran.append, "doomed"))
        await until_queued(engine, 1)
        doomed.cancel()
        gate.set()
        await blocker
        with pytest.raises(ZeroDivisionError):
            await engine.run(lambda: 1 / 0)
        await engine.run(ran.append, "after")
        engine.shutdown()
        return ran

    assert asyncio.run(scenario()) == ["after"]


def test_shutdown_cancels_what_has_not_started() -> None:
    async def scenario() -> None:
        engine = ComputeThread("t")
        gate = threading.Event()
        blocker = await hold_thread(engine, gate)
        pending = asyncio.ensure_future(engine.run(lambda: "never"))
        await until_queued(engine, 1)
        stopping = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))  # waits for the running job only
        await until_queued(engine, 0)  # shutdown has taken the queue (before the running job ends)
        gate.set()
        await stopping
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(RuntimeError):
            await engine.run(lambda: None)

    asyncio.run(scenario())
