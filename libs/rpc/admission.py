"""Admission control: a bound on work running and waiting in one service, by priority.

A request first waits for one of `max_running` slots; at most `max_waiting` may wait. Waiting
requests are admitted highest `priority` first (epd.v1 1.1 `priority`; 0 by default), equal
priorities in arrival order. A request arriving when the waiting room is full is refused at once
(RESOURCE_EXHAUSTED), one whose deadline passes while waiting gets DEADLINE_EXCEEDED, and once the
service drains for shutdown new requests get UNAVAILABLE: a slow stage sheds load instead of
queueing without bound.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import heapq
import itertools
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from opentelemetry import metrics

from libs.contract.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from libs.contract.reasons import Reason
from libs.telemetry.logging import bind_request
from libs.telemetry.stages import stage

CAPABILITY = "admission.priority"

# Every live admission, for the load gauges below (the encoder pool's autoscaler reads occupancy).
_LIVE: weakref.WeakSet[Admission] = weakref.WeakSet()


def _observe(value: str) -> Any:
    def callback(_options: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
        for admission in list(_LIVE):
            yield metrics.Observation(getattr(admission, value), {"epd.lane": admission.name})

    return callback


_meter = metrics.get_meter("epd")
_meter.create_observable_gauge("epd.admission.running", [_observe("running")], description="Requests running")
_meter.create_observable_gauge("epd.admission.waiting", [_observe("waiting")], description="Requests waiting")
_meter.create_observable_gauge(
    "epd.admission.occupancy",
    [_observe("occupancy")],
    description="(running + waiting) / max_running: 1 is every slot busy, above 1 a queue (autoscaling signal)",
)


class Admission:
    """Bounded running + waiting counts for one service (use from one event loop)."""

    def __init__(self, name: str, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.name = name
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.closed = False
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        _LIVE.add(self)

    @property
    def occupancy(self) -> float:
        return (self.running + self.waiting) / self.max_running

    @property
    def waiting(self) -> int:
        return sum(1 for *_, future in self._heap if not future.done())

    @asynccontextmanager
    async def slot(self, deadline: float | None = None, priority: int = 0) -> AsyncIterator[None]:
        """Hold a running slot for the body. `deadline` is a `time.monotonic()` instant."""
        if self.closed:
            raise Unavailable(f"{self.name} is draining for shutdown; retry elsewhere or later", reason=Reason.DRAINING)
        with stage(f"{self.name}.queue", "queue", **{"epd.priority": priority}):
            await self._acquire(deadline, priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, deadline: float | None, priority: int) -> None:
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"{self.name} is full: {self.running} running, {self.waiting} waiting (limit {self.max_waiting})",
                reason=Reason.OVERLOADED,
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-priority, next(self._arrivals), future))
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                self._release()  # admitted just as we gave up: pass the slot on
            else:
                future.cancel()
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"deadline passed while waiting for {self.name}") from None
            raise

    def _release(self) -> None:
        self.running -= 1
        while self._heap and self.running < self.max_running:
            *_, future = heapq.heappop(self._heap)
            if not future.done():  # skip those that gave up
                self.running += 1
                future.set_result(None)

    def close(self) -> None:
        """Refuse new work (UNAVAILABLE); admitted and waiting requests carry on."""
        self.closed = True

    async def idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs or waits; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.running or self.waiting:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def deadline_of(time_remaining: float | None) -> float | None:
    """A monotonic deadline from gRPC's `context.time_remaining()` (None: no deadline)."""
    return None if time_remaining is None else time.monotonic() + time_remaining


# A request this large gives its memory back when its call ends (see `_give_back`), in bytes.
LARGE_REQUEST_BYTES = 8 << 20


@asynccontextmanager
async def admitted(admission: Admission, request: Any, context: Any) -> AsyncIterator[float | None]:
    """What every servicer method does first: log lines carry the request id, and the body runs in
    an admission slot at the request's priority. Yields the request's monotonic deadline.

    A large request (inline media) gives its memory back when the call is done (`_give_back`)."""
    if request.ByteSize() >= LARGE_REQUEST_BYTES:
        context.add_done_callback(_give_back)
    deadline = deadline_of(context.time_remaining())
    with bind_request(request.request_id or "-"):
        async with admission.slot(deadline, request.priority):
            yield deadline


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    except OSError:
        return None


_malloc_trim = _libc_malloc_trim()


# References the call's end does not yet drop (the outer grpc task that still holds the call
# state, an executor thread between its result and its next job, the C core freeing the receive
# buffers on its own threads) are gone by a second pass this much later, in seconds.
SECOND_PASS_S = 1.0
_second_pass: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.TimerHandle] = weakref.WeakKeyDictionary()


def _give_back(_: object) -> None:
    """After a large request: a failed call's frames, its exception and grpc's call objects form
    reference cycles that hold the request's bytes until the cyclic collector runs (with few
    Python objects allocated per request, that is many requests later, so resident memory climbs
    with each one); and glibc keeps the freed receive buffers, spread over its per-thread arenas,
    as resident memory, which the collection alone gives back only in part and the trim returns to
    the baseline. Costs a few milliseconds, only after such requests.

    The call's done callback runs before everything that holds the request has let go (on a busy
    host a request's bytes can stay held long after its call has ended), so one more pass follows
    `SECOND_PASS_S` later: one per loop however many calls end meanwhile."""
    _reclaim()
    loop = asyncio.get_running_loop()
    if loop not in _second_pass:
        _second_pass[loop] = loop.call_later(SECOND_PASS_S, _second, loop)


def _second(loop: asyncio.AbstractEventLoop) -> None:
    del _second_pass[loop]
    _reclaim()


def _reclaim() -> None:
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
