"""The door's connections under the bounds a reverse proxy would enforce, before any request reaches
the application: how long a request's headers may take, how large and how many they may be, how
many connections may be open at once.

`bounded_http` makes uvicorn's httptools protocol (its default HTTP/1.1 implementation, the one the
door serves with) enforce them; uvicorn bounds none of them itself. With a `Gate` (libs/door/gate.py)
it also refuses a generation request the router would refuse (429, `Retry-After`) as its headers
complete: no task, no body read, no route run, a few tens of microseconds; the request let in
carries its place (`Ticket`) to the application in its scope (`TICKET`). The body's own timeout is the
application's (`DoorConfig.body_timeout_s`): by then there is a route to answer in. Each refusal is
an OpenAI error object with `Connection: close`, counted in /metrics under the route `connection`
(it reached no route); a connection that sent nothing is closed without an answer, as an idle
keep-alive connection is.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from libs.door.gate import TICKET, Gate, Ticket
from libs.door.openai.errors import RETRY_AFTER_S, ApiError

ROUTE = "connection"  # the /metrics route of an answer given before any route was reached
# The routes that start generations: a POST to one takes a place at the gate with its headers.
GATED = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/audio/transcriptions"})


@dataclass(frozen=True)
class ConnectionBounds:
    header_timeout_s: float  # from a connection's start, or its last answer's end, to a request's full headers
    max_header_bytes: int  # request line and headers together
    max_headers: int
    max_connections: int  # open at once; one more is answered 503 and closed


def bounded_http(bounds: ConnectionBounds, requests: Counter, gate: Gate | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP/1.1 protocol under `bounds`, counting each refusal in `requests` (the door's
    responses by route and status); with `gate`, a POST to a generation route takes its place there
    as its headers complete, or is refused."""
    return type("BoundedHttp", (_BoundedHttp,), {"bounds": bounds, "requests": requests, "gate": gate})


class _BoundedHttp(HttpToolsProtocol):
    bounds: ClassVar[ConnectionBounds]
    requests: ClassVar[Counter]
    gate: ClassVar[Gate | None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._begun = False  # bytes of a request arrived since the deadline was set
        self._header_bytes = 0
        self._headers = 0
        self._refused = False
        self._tickets: list[Ticket] = []  # places this connection's requests took at the gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.bounds.max_connections:
            error = ApiError(
                503,
                f"more than {self.bounds.max_connections} connections open: retry later",
                code="too_many_connections",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            self._refuse(error)
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for ticket in self._tickets:  # a request whose handler never handed its place on
            ticket.called()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # what follows a refusal is not read
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)

    # The parser's callbacks: none of them acts once the connection is refused.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a request pipelined behind one in progress
            self._arm()
        self._begun = True
        self._header_bytes = self._headers = 0

    def on_url(self, url: bytes) -> None:
        if self._grown(len(url), 0):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._grown(len(name) + len(value) + 4, 1):  # ": " and CRLF
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._refused:
            self._disarm()
            if self.gate is not None and not self._admitted():
                return
            super().on_headers_complete()

    def _admitted(self) -> bool:
        """A POST to a generation route takes a place at the gate (in its scope, for the application
        to hand on), or is refused 429 here; other requests pass."""
        assert self.gate is not None
        path = self.url.partition(b"?")[0]
        if path not in GATED or self.parser.get_method() != b"POST":
            return True
        try:
            ticket = self.gate.enter()
        except ApiError as refusal:
            self._refuse(refusal, route=path.decode())
            return False
        self._tickets = [t for t in self._tickets if t.held]
        self._tickets.append(ticket)
        self.scope[TICKET] = ticket  # type: ignore[literal-required]
        return True

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a request already in: it starts now, its headers are in
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm()  # the next request's headers are due from now (keep-alive closes it idle sooner)

    def _grown(self, size: int, count: int) -> bool:
        """Whether the request's head is still within bounds, having grown by `size` bytes and
        `count` headers; refused (431) when not."""
        if self._refused:
            return False
        self._header_bytes += size
        self._headers += count
        if self._header_bytes > self.bounds.max_header_bytes or self._headers > self.bounds.max_headers:
            limits = f"{self.bounds.max_headers} headers, {self.bounds.max_header_bytes} bytes"
            self._refuse(ApiError(431, f"the request's headers exceed the limits ({limits})", code="headers_too_large"))
            return False
        return True

    def _arm(self) -> None:
        self._disarm()
        self._begun = False
        self._deadline = self.loop.call_later(self.bounds.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._begun:  # nothing of a request arrived: an idle connection, closed as keep-alive closes one
            self._refused = True
            self.transport.close()
            return
        timeout = self.bounds.header_timeout_s
        self._refuse(
            ApiError(408, f"the request's headers did not arrive within {timeout:g} s", code="request_timeout")
        )

    def _refuse(self, error: ApiError, route: str = ROUTE) -> None:
        """Answer `error` and close: what the client sent after it is not read."""
        self._refused = True
        self._disarm()
        body = json.dumps(error.body()).encode()
        head = [STATUS_LINE[error.status]]
        headers = {
            **error.headers,
            "content-type": "application/json",
            "content-length": str(len(body)),
            "connection": "close",
        }
        head += [f"{name}: {value}\r\n".encode() for name, value in headers.items()]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()
        self.requests.labels(route, str(error.status)).inc()
