"""EngineSupervisor with a stand-in engine (its live counterparts: test_vllm_engine_life.py and the
engine-kill test in test_vllm_pd.py): the restart policy on a fake clock; a dead, a hung and a
slow-starting engine are reported NOT_SERVING, refused and failed with UNAVAILABLE
(ENGINE_RESTARTING), their processes ended, and replaced; past the restart bound the service is
told to end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from libs.backends.vllm.supervisor import (
    EngineGaveUp,
    EngineLife,
    EngineSupervisor,
    RestartPolicy,
)
from libs.contract.errors import Unavailable
from libs.contract.reasons import Reason

pytestmark = pytest.mark.unit


class FakeEngine:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.errored = False
        self.shut = False
        self.queued = 0
        self.answers = True  # the probe (an EngineCore utility call) is answered
        self.outputs: asyncio.Queue[object] = asyncio.Queue()

    def shutdown(self) -> None:
        self.shut = True

    def get_num_unfinished_requests(self) -> int:
        return self.queued

    async def is_sleeping(self) -> bool:
        if not self.answers:
            await asyncio.Event().wait()  # a hung engine loop never answers
        return False

    async def stream(self) -> AsyncIterator[object]:
        while True:
            yield await self.outputs.get()


class Harness:
    """Builds FakeEngines (each "spawns" one process id), records kills, health and fatal calls."""

    def __init__(self, life: EngineLife, *, slow_starts: int = 0) -> None:
        self.built: list[FakeEngine] = []
        self.health: list[bool] = []
        self.fatal: list[str] = []
        self.killed: list[int] = []
        self.spawned: set[int] = set()  # live "processes"
        self.starts = 0
        self.slow_starts = slow_starts  # the first N starts never finish (until released)
        self.release = threading.Event()
        self.service_queued = 0  # the service's requests handed to the engine
        self.supervisor = EngineSupervisor(
            self._build,
            life,
            poll_s=0.01,
            processes=lambda: set(self.spawned),
            kill=self._kill,
            queued=lambda: self.service_queued,
        )

    def _build(self) -> FakeEngine:
        pid = 1000 + self.starts
        self.starts += 1
        self.spawned.add(pid)  # its processes exist from the start on
        if self.starts <= self.slow_starts:
            self.release.wait(30)
            raise RuntimeError("engine core initialization failed (its process was killed)")
        self.built.append(FakeEngine(pid))
        return self.built[-1]

    def _kill(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.killed.append(pid)
            self.spawned.discard(pid)
            if self.slow_starts:
                self.release.set()  # vLLM's start fails once its EngineCore is gone

    async def serve(self) -> EngineSupervisor:
        await self.supervisor.start()

        async def setter(serving: bool) -> None:
            self.health.append(serving)

        self.supervisor.watch_health(setter)
        self.supervisor.watch_fatal(self.fatal.append)
        return self.supervisor


async def until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    """Until `condition()` (the watcher polls every 10 ms; a loaded host may delay its thread
    hops), bounded generously."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


FAST = EngineLife(start_timeout_s=5.0, hang_timeout_s=0.3, backoff_start_s=0.01, backoff_max_s=0.02)


def test_restart_policy_backs_off_exponentially_and_bounds_restarts_in_a_window() -> None:
    policy = RestartPolicy(EngineLife(max_restarts=3, restart_window_s=100.0, backoff_start_s=1.0, backoff_max_s=3.0))
    assert [policy.next_delay(t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]  # doubling, capped at the max
    assert policy.next_delay(3.0) is None  # a fourth restart within 100 s: give up
    assert policy.recent(99.9) == 3
    # Once the first restarts leave the window, restarts are allowed again, the backoff shorter.
    assert policy.recent(100.5) == 2 and policy.next_delay(100.5) == 3.0
    assert policy.recent(250.0) == 0 and policy.next_delay(250.0) == 1.0


def test_restart_policy_with_no_restarts_allowed_gives_up_at_once() -> None:
    assert RestartPolicy(EngineLife(max_restarts=0)).next_delay(0.0) is None


def test_a_dead_engine_is_refused_reported_and_replaced() -> None:
    async def scenario() -> None:
        harness = Harness(FAST)
        sup = await harness.serve()
        first = harness.built[0]
        assert sup.current() is first
        first.errored = True
        with pytest.raises(Unavailable) as refused:
            sup.current()
        assert refused.value.reason == Reason.ENGINE_RESTARTING
        await until(lambda: sup.restarts == 1, "restarted")
        assert sup.generation == 2 and sup.failures == ["died"]
        assert first.shut and first.pid in harness.killed  # a dead EngineCore may leave its worker
        assert sup.current() is harness.built[1]
        assert harness.health == [False, True]
        await sup.close()
        assert harness.built[1].shut

    asyncio.run(scenario())


@pytest.mark.parametrize("counted_by", ["vllm", "service"])
def test_a_hung_engine_fails_its_requests_is_killed_and_replaced(counted_by: str) -> None:
    """Work queued as vLLM counts it, or only as the service does (a request waiting on the
    engine before vLLM added it: its first call's supported-tasks query)."""

    async def scenario() -> None:
        harness = Harness(FAST)
        sup = await harness.serve()
        hung = harness.built[0]
        engine = sup.engine()
        stream = hung.stream()
        hung.outputs.put_nowait("token")
        assert await engine.next(stream, None) == "token"
        hung.answers = False  # work queued, no output, no probe answer
        if counted_by == "vllm":
            hung.queued = 1
        else:
            harness.service_queued = 1
        with pytest.raises(Unavailable) as failed:
            await engine.next(stream, None)  # in flight when the watchdog gives the engine up
        assert failed.value.reason == Reason.ENGINE_RESTARTING and "hung" in failed.value.message
        await until(lambda: sup.restarts == 1, "restarted")
        assert hung.pid in harness.killed and hung.shut
        assert sup.failures and sup.failures[0].startswith("hung: no progress")
        assert harness.health == [False, True] and sup.current() is harness.built[1]
        await sup.close()

    asyncio.run(scenario())


def test_an_engine_that_answers_its_probe_is_not_hung() -> None:
    """Work queued, no output (a request waiting on a remote KV read), but the engine loop turns."""

    async def scenario() -> None:
        harness = Harness(FAST)
        sup = await harness.serve()
        waiting = harness.built[0]
        waiting.queued = 1
        probes = 0
        original = waiting.is_sleeping

        async def counted() -> bool:
            nonlocal probes
            probes += 1
            return await original()

        waiting.is_sleeping = counted  # type: ignore[method-assign]
        # Past several hang timeouts' worth of probes, it is still the first engine.
        await until(lambda: probes >= 20, "probed")
        assert sup.restarts == 0 and sup.current() is waiting and harness.health == []
        await sup.close()

    asyncio.run(scenario())


def test_a_start_past_its_timeout_ends_the_processes_it_spawned_and_is_retried() -> None:
    async def scenario() -> None:
        harness = Harness(EngineLife(start_timeout_s=0.2, backoff_start_s=0.01, backoff_max_s=0.01), slow_starts=1)
        sup = await harness.serve()  # the first start times out, the second is up
        assert harness.killed == [1000]  # the timed-out start's process
        assert sup.generation == 1 and sup.current() is harness.built[0]
        assert "did not start within 0.2 s (engine_start_timeout_s)" in sup.failures[0]
        await sup.close()

    asyncio.run(scenario())


def test_a_first_start_past_the_bound_gives_up() -> None:
    async def scenario() -> None:
        harness = Harness(EngineLife(start_timeout_s=0.2, max_restarts=0), slow_starts=1)
        with pytest.raises(EngineGaveUp, match="engine_start_timeout_s"):
            await harness.supervisor.start()
        assert harness.killed == [1000]

    asyncio.run(scenario())


def test_failures_past_the_bound_end_the_service() -> None:
    async def scenario() -> None:
        life = EngineLife(max_restarts=1, restart_window_s=600.0, backoff_start_s=0.01, backoff_max_s=0.01)
        harness = Harness(life)
        sup = await harness.serve()
        harness.built[0].errored = True
        await until(lambda: sup.restarts == 1, "restarted once")
        harness.built[1].errored = True  # a second failure within the window: past the bound
        await until(lambda: bool(harness.fatal), "told to end")
        assert "after 1 restart(s) within 600 s" in harness.fatal[0] and "died" in harness.fatal[0]
        assert harness.health == [False, True, False]
        with pytest.raises(Unavailable):
            sup.current()
        await sup.close()

    asyncio.run(scenario())
