"""The door's admission at a request's arrival: refuse fast what would be refused anyway.

A request the router would refuse (its admission's running and waiting places all taken) is
refused here, at the arrival of its headers, before anything costly: its body is not read nor
parsed, no media fetched or decoded. So a burst's refusals take milliseconds, not the seconds the
admitted requests' work (parsing, fetching, the router's own) holds the event loop, and a client
told 429 goes elsewhere at once.

The gate counts what the router counts, plus the requests it let in whose calls have not reached
the router yet (`arriving`: their bodies being read, their media fetched):

- in the router's process (`Gate.of_admission`): the router's admission (gRPC callers included),
  `--max-running` + `--max-waiting` places;
- in a door of its own (`Gate.own`): the calls this door has open, `--max-pending` places (the
  router's admission still refuses what other clients fill; the door passes that 429 on).

The router's own admission stays the exact bound; the gate only answers early what it would answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator

from libs.contract.epd.v1 import generate_pb2
from libs.door.calls import GenerateCall
from libs.door.openai.errors import RETRY_AFTER_S, ApiError
from libs.rpc.admission import Admission

# A door of its own: its calls' bound by default, the router's defaults (--max-running 64 +
# --max-waiting 256).
DEFAULT_MAX_PENDING = 320
# The ASGI scope's key for the place a request took at the gate as its headers arrived
# (libs/door/connections.py); the application hands it on as the request's calls start.
TICKET = "epd.gate_ticket"


class Ticket:
    """A request let in: counted as arriving until its calls start (`called`) or it ends."""

    def __init__(self, gate: Gate) -> None:
        self._gate: Gate | None = gate
        gate.arriving += 1

    @property
    def held(self) -> bool:
        return self._gate is not None

    def called(self) -> None:
        """Its calls start now (or it ended): the router's admission (or the door's call count)
        counts it from here. Once only; later calls do nothing."""
        if self._gate is not None:
            self._gate.arriving -= 1
            self._gate = None


class Gate:
    """At most `limit` requests busy behind the door or arriving at it; one more is refused (429)."""

    def __init__(self, limit: int, busy: Callable[[], int] | None = None, what: str = "the door") -> None:
        if limit < 1:
            raise ValueError("the gate's limit must be >= 1")
        self.limit = limit
        self.what = what
        self.arriving = 0  # let in, calls not started yet
        self.calling = 0  # the door's own calls open (`counted`)
        self._busy = busy

    @classmethod
    def of_admission(cls, admission: Admission) -> Gate:
        """The router's admission in the router's process: every caller counted, its bound."""
        return cls(
            admission.max_running + admission.max_waiting,
            lambda: admission.running + admission.waiting,
            what=admission.name,
        )

    @classmethod
    def own(cls, limit: int) -> Gate:
        """A door of its own: its own calls counted (wrap its `GenerateCall` with `counted`)."""
        return cls(limit)

    @property
    def busy(self) -> int:
        return self.calling if self._busy is None else self._busy()

    def enter(self) -> Ticket:
        """A place for a request arriving now, or the 429 (`ApiError`) to answer it with."""
        busy = self.busy
        if busy + self.arriving >= self.limit:
            raise ApiError(
                429,
                f"{self.what} is full: {busy} requests in progress or queued, {self.arriving} arriving (limit "
                f"{self.limit}); retry later or elsewhere",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return Ticket(self)

    @contextlib.contextmanager
    def arrival(self, taken: Ticket | None = None) -> Iterator[Ticket]:
        """A request's place from its arrival to the end of its handler (`taken`: the one its
        connection took as its headers completed), or a 429 at once."""
        ticket = taken if taken is not None else self.enter()
        try:
            yield ticket
        finally:
            ticket.called()

    def counted(self, generate: GenerateCall) -> GenerateCall:
        """`generate` with its open calls counted (`calling`), from their first step to their end."""

        async def call(
            request: generate_pb2.GenerateRequest, token: str | None
        ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
            self.calling += 1
            try:
                async with contextlib.aclosing(generate(request, token)) as responses:
                    async for response in responses:
                        yield response
            finally:
                self.calling -= 1

        return call
