"""EngineSupervisor with a stand-in engine (its live counterpart: the engine-kill test in
test_vllm_pd.py): a dead engine is reported NOT_SERVING, refused with UNAVAILABLE, replaced."""

from __future__ import annotations

import asyncio

import pytest

from libs.backends.vllm.supervisor import EngineSupervisor
from libs.contract.errors import Unavailable
from libs.contract.reasons import Reason

pytestmark = pytest.mark.unit


class FakeEngine:
    def __init__(self) -> None:
        self.errored = False
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True


def test_a_dead_engine_is_refused_reported_and_replaced() -> None:
    built: list[FakeEngine] = []
    health: list[bool] = []

    def build() -> FakeEngine:
        built.append(FakeEngine())
        return built[-1]

    async def scenario() -> None:
        sup = EngineSupervisor(build, poll_s=0.01)
        await sup.start()

        async def setter(serving: bool) -> None:
            health.append(serving)

        sup.watch_health(setter)
        assert sup.current() is built[0]
        built[0].errored = True
        with pytest.raises(Unavailable) as refused:
            sup.current()
        assert refused.value.reason == Reason.ENGINE_RESTARTING
        # Until the watcher (polling every 10 ms) replaced it: two thread hops (shut down, build),
        # which a loaded host may delay; bounded generously.
        deadline = asyncio.get_running_loop().time() + 30
        while not sup.restarts and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert sup.restarts == 1 and sup.generation == 2
        assert built[0].shut and sup.current() is built[1]
        assert health == [False, True]
        await sup.close()
        assert built[1].shut

    asyncio.run(scenario())
