"""One call to a stage, moved between that stage's members as its failures allow: the one helper
every stage call (encode, prefill, decode, PD) runs through.

`Failover` picks the member for each try (the pool's pick: least loaded, or placement for
encoders), passes it through its first-contact check (or leaves that to the try, inside its
span: encodes), counts the call as outstanding while it runs, and after a failure before the
first reply asks the policy (services/router/policy.py) what it means: pass the member over,
try another member not tried yet (within the stage's `Retries`), or, when every member we may
try is draining or stopping, wait (`DrainWait`) within the request's deadline and
`DRAIN_WAIT_S`, and try them again. With one member this is the drain wait alone, and calls wait
for a restarting member (`wait_for_ready`); with several, a member that cannot be reached fails
fast and the next one is tried. From the first reply on, a failure is the caller's.

Backend calls get the request's deadline less `ANSWER_MARGIN_S` (`remaining`): when a stage is down
(calls wait for its replacement) or slow, the router still answers, with a status naming the
stage, before the client's own deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from libs.contract.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from services.router.policy import Retries, Stage, meaning
from services.router.pool import MemberPool

_log = structlog.get_logger(__name__)
T = TypeVar("T")

# How long, at most, one call waits out a draining or stopping stage before giving up (seconds):
# a grace period plus a replacement's start-up.
DRAIN_WAIT_S = 60.0
# The client never waits for an answer that cannot come: the router answers this much before it.
ANSWER_MARGIN_S = 0.5


def remaining(deadline: float | None) -> float | None:
    """The timeout of a backend call under a request `deadline` (a `time.monotonic()` instant)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic() - ANSWER_MARGIN_S
    if left <= 0:
        raise DeadlineExceeded("request deadline passed in the router")
    return left


class DrainWait:
    """Waiting out a stage whose members are draining for a restart or stopping: pause (the
    replacement comes up; calls use wait_for_ready) while the deadlines leave time for a try."""

    def __init__(self, deadline: float | None, pause_s: float = 0.1) -> None:
        self._deadline = deadline
        self._pause_s = pause_s
        self._give_up = time.monotonic() + DRAIN_WAIT_S

    async def pause(self) -> bool:
        """Pause, when the deadlines leave time for another try after it; whether it paused."""
        end = self._give_up if self._deadline is None else min(self._give_up, self._deadline - ANSWER_MARGIN_S)
        if end - time.monotonic() <= self._pause_s:
            return False
        await asyncio.sleep(self._pause_s)
        return True


class MemberGone(Exception):
    """Raised by a try whose member went away after answering (its answer is void): retried on
    another member as a failed call that may go elsewhere; the cause is raised when none may."""


class TryAgain(Exception):
    """Raised by a try that is to be made again, its member included (its job changed: e.g. a
    CACHED_ONLY encode whose entry was gone is computed next)."""


Check = Callable[[str], Awaitable[None]]


class Failover:
    """The tries of one call to one stage (use once per call, from one event loop)."""

    def __init__(
        self,
        pool: MemberPool,
        stage: Stage,
        retries: Retries,
        deadline: float | None,
        check: Check | None,
        pick: Callable[[set[str]], str] | None = None,
    ) -> None:
        self.pool = pool
        self._stage = stage
        self._retries = retries
        self._check = check
        self._pick = pick or (lambda tried: pool.pick(exclude=tried))
        self._drain = DrainWait(deadline)
        self._tried: set[str] = set()

    @property
    def wait_for_ready(self) -> bool:
        """Whether the call should wait for a member that is not up (the stage's only one)."""
        return self.pool.size <= 1

    async def unary(self, call: Callable[[str], Awaitable[T]]) -> T:
        """`call(address)` on members in turn until one answers."""
        while True:
            address = await self._next()
            self.pool.begin(address)
            try:
                return await call(address)
            except grpc.aio.AioRpcError as exc:
                if not await self._again(address, exc):
                    raise
            except MemberGone as gone:
                if not self._elsewhere():
                    raise gone.__cause__ or gone from None
                self._retrying(address, gone=True)
            except TryAgain:
                self._tried.discard(address)
            except (FailedPrecondition, Unavailable) as exc:
                if not self._another(address, exc):  # the try's own first-contact check
                    raise
            finally:
                self.pool.end(address)

    async def stream(self, call: Callable[[str], AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
        """`call(address)`'s items, from members in turn until one streams; a failure after the
        first item is the caller's."""
        while True:
            address = await self._next()
            self.pool.begin(address)
            started = False
            try:
                # Closed here, not by the garbage collector: a consumer gone mid-stream must end
                # the member's call (e.g. cancel a decode) at once.
                async with contextlib.aclosing(call(address)) as items:
                    async for item in items:
                        started = True
                        yield item
                return
            except grpc.aio.AioRpcError as exc:
                if started or not await self._again(address, exc):
                    raise
            finally:
                self.pool.end(address)

    def _elsewhere(self) -> bool:
        # Counted among the members *now*: the one that failed may have left them meanwhile
        # (drained, exited, dropped from the list).
        budget = self._retries.elsewhere
        return self.pool.untried(self._tried) and (budget is None or len(self._tried) <= budget)

    async def _next(self) -> str:
        """The member for the next try (checked); raises when no compatible member is left. A stage
        with no member now (a discovered pool between its last pod leaving and the next ready one)
        is waited for, within the drain wait, where the stage's retries say so."""
        while self._retries.wait_for_members and not self.pool.size and await self._drain.pause():
            pass
        while True:
            address = self._pick(self._tried)
            self._tried.add(address)
            if self._check is None:
                return address
            try:
                await self._check(address)
                return address
            except (FailedPrecondition, Unavailable) as exc:
                if not self._another(address, exc):
                    raise

    def _another(self, address: str, exc: FailedPrecondition | Unavailable) -> bool:
        """Whether another member may be tried after `address` failed its first-contact check."""
        # An incompatible member: any other one; an unreachable one: within the retries.
        another = self.pool.untried(self._tried) if isinstance(exc, FailedPrecondition) else self._elsewhere()
        if another:
            _log.warning(f"{self.pool.stage} not usable; trying another", member=address, error=str(exc)[:200])
        return another

    async def _again(self, address: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether to try again after `address` failed the call with `exc` before its first reply."""
        what = meaning(self._stage, exc)
        if what.leaving:
            self.pool.draining(address)  # leaving: other members take its work
        if what.elsewhere and self._elsewhere():
            if self._retries.avoid_s is not None:
                self.pool.draining(address, for_s=self._retries.avoid_s)
            self._retrying(address, code=exc.code().name)
            return True
        if what.wait and await self._drain.pause():
            self._tried.clear()  # every member we may try is draining or stopping: wait for one
            return True
        return False

    def _retrying(self, address: str, gone: bool = False, **fields: str) -> None:
        # The events operators (and tests/services) read in the router's log.
        if self._stage != "encode":
            _log.warning(f"{self.pool.stage} refused; trying another", member=address, **fields)
        elif gone:
            _log.warning("encoder gone after answering; encoding elsewhere", encoder=address)
        else:
            _log.warning("encoder failed; retrying elsewhere", encoder=address, **fields)
