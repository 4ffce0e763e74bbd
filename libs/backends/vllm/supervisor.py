"""The service owns its vLLM engine's life: start it, notice when it dies, restart it.

vLLM's `AsyncLLM` runs the model in spawned processes (EngineCore, Worker). When they die (a bad
input that got past validation, a kill, an OOM) every request in flight fails with
`EngineDeadError` and the object is unusable. The supervisor then:

- reports NOT_SERVING on the gRPC health service and fails new requests with UNAVAILABLE
  ("engine restarting"), so routers and clients go elsewhere or retry;
- shuts the dead engine down and starts a fresh one (30-50 s on 2 cores), then SERVING again.

Nothing waits on a dead engine: `current()` raises at once, in-flight streams end with
UNAVAILABLE when vLLM reports the death, and the watcher polls the engine's state twice a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from libs.contract.errors import Unavailable
from libs.contract.reasons import Reason

_log = structlog.get_logger(__name__)

HealthSetter = Callable[[bool], Awaitable[None]]


class EngineSupervisor:
    """Holds one live engine built by `build` (blocking; run on a thread) and replaces it on death."""

    def __init__(self, build: Callable[[], Any], *, poll_s: float = 0.5) -> None:
        self._build = build
        self._poll_s = poll_s
        self._llm: Any = None
        self._health: HealthSetter | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closing = False
        self.generation = 0  # incremented at every (re)start
        self.restarts = 0

    async def start(self) -> None:
        self._llm = await asyncio.to_thread(self._build)
        self.generation += 1
        self._watch = asyncio.create_task(self._watch_loop(), name="vllm-engine-watch")

    def watch_health(self, setter: HealthSetter) -> None:
        """Given by the server once it serves (libs/rpc/main.py)."""
        self._health = setter

    def current(self) -> Any:
        """The live engine, or UNAVAILABLE while it restarts."""
        llm = self._llm
        if llm is None or llm.errored:
            raise Unavailable(
                "vLLM engine is restarting after a failure; retry shortly", reason=Reason.ENGINE_RESTARTING
            )
        return llm

    @property
    def alive(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def _watch_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._poll_s)
            llm = self._llm
            if llm is None or not llm.errored or self._closing:
                continue
            _log.error("vLLM engine died; restarting", generation=self.generation)
            await self._set_health(False)
            self._llm = None
            await asyncio.to_thread(_shutdown, llm)
            while not self._closing:
                try:
                    self._llm = await asyncio.to_thread(self._build)
                    break
                except Exception:
                    _log.exception("vLLM engine restart failed; trying again")
                    await asyncio.sleep(5.0)
            if self._closing:
                return
            self.generation += 1
            self.restarts += 1
            _log.info("vLLM engine restarted", generation=self.generation)
            await self._set_health(True)

    async def _set_health(self, serving: bool) -> None:
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health(serving)

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(_shutdown, llm)


def _shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.shutdown()
