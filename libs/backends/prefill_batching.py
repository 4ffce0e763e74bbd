"""Prefill batching: while requests run in the engine, a new one waits to go in with others.

A continuous-batching engine runs a new request's prefill in a step that every decoding sequence
waits for. Requests that reach a full engine one by one each stall its decoding batch; let in
together at most once every `max_steps` engine steps, they stall it once per window, and the
sequences decoding in between step at their own pace. The price is first-token time: a request
waits at most `max_steps` of the running batch's steps. It is held only while the engine's batch is
full: with a free slot the engine starts it in its next step, and holding it would cost its first
token and the engine a sequence to step for nothing, and throughput falls. TGI's router holds
requests the same way (`--max-waiting-tokens`).

Used from one event loop (the backend's request coroutines): `enter()` before a request goes into
the engine, then its ticket's `stepped()` for each output read from the engine and `leave()` once
the request is out of it.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Iterator

from opentelemetry import metrics

from libs.contract.errors import DeadlineExceeded

# Every live batching, for the gauges below: one per PD service.
_LIVE: weakref.WeakSet[PrefillBatching] = weakref.WeakSet()


def _observe(count: str) -> Callable[[metrics.CallbackOptions], Iterator[metrics.Observation]]:
    def callback(_options: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
        yield metrics.Observation(sum(getattr(batching, count) for batching in list(_LIVE)))

    return callback


_meter = metrics.get_meter("epd")
_meter.create_observable_gauge(
    "epd.prefill_batch.held",
    [_observe("held")],
    description="Requests held by the service until the next round goes into the engine",
)
_meter.create_observable_gauge(
    "epd.prefill_batch.running",
    [_observe("running")],
    description="Requests let into the engine and not out of it",
)


class Ticket:
    """One request let into the engine."""

    def __init__(self, batching: PrefillBatching, held: bool) -> None:
        self._batching = batching
        self.held = held  # it waited to go in with others
        self._round = batching.round
        self._outputs = 0  # read since requests last went in

    def stepped(self) -> None:
        """One output of the request was read: one engine step, for it."""
        batching = self._batching
        if self._round != batching.round:
            self._round, self._outputs = batching.round, 0
        self._outputs += 1
        if self._outputs > batching.steps:
            batching.steps = self._outputs
            batching.release_if_due()

    def leave(self) -> None:
        """The request is out of the engine (finished, failed or aborted)."""
        self._batching.running -= 1
        self._batching.release_if_due()


class PrefillBatching:
    """Holds new requests while others run, and lets them into the engine together."""

    def __init__(self, max_steps: int, batch: int = 1) -> None:
        """`max_steps`: engine steps between two rounds of requests going in (0: none is held);
        `batch`: sequences the engine steps together (a request is held only while that many run)."""
        self.max_steps = max_steps
        self.batch = max(1, batch)
        self.running = 0  # requests let into the engine and not out of it
        self.round = 0  # how many times requests went in
        self.steps = 0  # the most outputs one request read since then: the engine's steps
        self._held: list[asyncio.Future[None]] = []
        _LIVE.add(self)

    @property
    def held(self) -> int:
        return len(self._held)

    async def enter(self, deadline: float | None = None) -> Ticket:
        """Return once the request may go into the engine; DEADLINE_EXCEEDED if `deadline` (a
        `time.monotonic()` instant) passes first. The ticket must `leave()`."""
        # A free slot, the window is over, or there is none: in at once (nobody is held then,
        # `release_if_due`).
        if self.max_steps <= 0 or self._due:
            self._let_in(1)
            return Ticket(self, held=False)
        turn = asyncio.get_running_loop().create_future()
        self._held.append(turn)
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(asyncio.shield(turn), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if turn.done():
                self.running -= 1  # let in just as it gave up: counted in `_let_in`
                self.release_if_due()
            else:
                turn.cancel()
                self._held.remove(turn)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("deadline passed while waiting to be prefilled with others") from None
            raise
        return Ticket(self, held=True)

    @property
    def _due(self) -> bool:
        return self.running < self.batch or self.steps >= self.max_steps

    def release_if_due(self) -> None:
        if self._held and self._due:
            turns, self._held = self._held, []
            self._let_in(len(turns))
            for turn in turns:
                turn.set_result(None)

    def _let_in(self, count: int) -> None:
        self.running += count
        self.round += 1
        self.steps = 0
