"""The door refuses fast (issue 65, item 6): a request the router would refuse is answered 429 with
`Retry-After` at its arrival, before its body is read (so before any parsing, fetching or media
decoding), while the requests let in proceed; the places come back when requests end. Driven
ASGI message by message (tests/support/door_router.py `Exchange`), waiting on state, never on time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from libs.contract.epd.v1 import generate_pb2, generation_pb2
from libs.door.app import DoorConfig, create_app
from libs.door.gate import Gate
from libs.door.in_process import in_process
from libs.door.server import DoorHttpSettings, DoorServer
from libs.fetch import FetchClient, FetchLimits
from libs.rpc.admission import Admission
from tests.support.door_router import CHAT, MODEL, Exchange, FakeRouter, door

pytestmark = pytest.mark.unit

ROUTE = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}
BODY = json.dumps(CHAT).encode()


async def _until(condition: Callable[[], object]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0)


def _headers(exchange: Exchange) -> dict[str, str]:
    start = next(m for m in exchange.sent if m["type"] == "http.response.start")
    return {k.decode(): v.decode() for k, v in start["headers"]}


def _error(exchange: Exchange) -> dict[str, str]:
    body = b"".join(m.get("body", b"") for m in exchange.sent if m["type"] == "http.response.body")
    return dict(json.loads(body)["error"])


def test_a_request_beyond_the_bound_is_refused_at_arrival_before_its_body_is_read() -> None:
    """One place, held by a request in its call: the next is answered 429 (`Retry-After`, code
    `overloaded`) though its body never arrives: the door did not wait to read it. The held request
    then completes, and its place serves the next request."""
    router = FakeRouter(gate=asyncio.Event())
    d = door(router, gate=Gate.own(1))

    async def run() -> None:
        held = Exchange(d.app, ROUTE, HEADERS)
        held.body(BODY)
        held_run = asyncio.create_task(held.run())
        await _until(lambda: router.seen)  # in its call, holding the one place
        refused = Exchange(d.app, ROUTE, HEADERS)  # its body is never sent
        async with asyncio.timeout(10):
            await refused.run()  # answered without reading a byte of body
        assert refused.status() == 429
        assert _headers(refused)["retry-after"] == "1"
        error = _error(refused)
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
        assert "1 requests in progress or queued" in error["message"] and "limit 1" in error["message"]
        assert refused.inbox.empty() and not held_run.done()
        assert router.gate is not None
        router.gate.set()
        await held_run
        assert held.status() == 200
        after = Exchange(d.app, ROUTE, HEADERS)
        after.body(BODY)
        await after.run()
        assert after.status() == 200

    asyncio.run(run())
    assert d.count(ROUTE, 429) == 1 and d.count(ROUTE, 200) == 2


def test_a_request_whose_body_is_still_arriving_holds_its_place() -> None:
    """Arriving counts: while one request's body is still coming in, the next is refused (with one
    place); once its body is in and its answer given, nothing is counted."""
    gate = Gate.own(1)
    d = door(gate=gate)

    async def run() -> None:
        slow = Exchange(d.app, ROUTE, HEADERS)
        slow.body(BODY[:5], more=True)
        slow_run = asyncio.create_task(slow.run())
        await _until(lambda: gate.arriving == 1)
        refused = Exchange(d.app, ROUTE, HEADERS)
        await refused.run()
        assert refused.status() == 429
        slow.body(BODY[5:])
        await slow_run
        assert slow.status() == 200

    asyncio.run(run())
    assert gate.arriving == 0 and gate.calling == 0


def test_a_refused_request_never_fetches_its_media() -> None:
    """A refusal at arrival reads nothing: a chat request naming an image URL the door would have
    fetched is answered 429 without a fetch (its body, with the URL, is offered but never taken)."""
    router = FakeRouter(gate=asyncio.Event())
    d = door(router, gate=Gate.own(1))
    with_url = dict(CHAT)
    with_url["messages"] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://198.51.100.7/cat.png"}}]}
    ]

    async def run() -> None:
        held = Exchange(d.app, ROUTE, HEADERS)
        held.body(BODY)
        held_run = asyncio.create_task(held.run())
        await _until(lambda: router.seen)
        refused = Exchange(d.app, ROUTE, HEADERS)
        refused.body(json.dumps(with_url).encode())
        await refused.run()
        assert refused.status() == 429
        assert not refused.inbox.empty()  # its body offered, never read: nothing parsed, nothing fetched
        assert router.gate is not None
        router.gate.set()
        await held_run

    asyncio.run(run())
    assert len(router.seen) == 1


class _HeldRouter:
    """The router core in the door's process (`RouterCore`): one token once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None = None, coalesce: bool = True
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        self.calls += 1
        await self.release.wait()
        chunk = generation_pb2.TokenChunk(token_ids=[7], text="t", finish_reason=generation_pb2.FINISH_REASON_STOP)
        response = generate_pb2.GenerateResponse(chunk=chunk)
        response.usage.prompt_tokens, response.usage.completion_tokens = 3, 1
        yield response


def test_in_the_routers_process_the_gate_counts_the_routers_admission_once() -> None:
    """In the router's process the gate's bound is the router's admission (1 running + 1 waiting
    here): a request in its call is counted by the admission only (not again as arriving), so a
    second is let in and waits there, a third is refused at arrival; both let in complete."""
    admission = Admission("router", 1, 1)
    core = _HeldRouter()
    config = DoorConfig(MODEL, Path("/models/tiny"), 1.0, 1 << 20, frozenset())
    fetch = FetchClient(FetchLimits(max_bytes=1 << 20))
    app = create_app(
        config, in_process(core, admission, 60.0), fetch, _healthy, CollectorRegistry(), Gate.of_admission(admission)
    )

    async def run() -> None:
        first = Exchange(app, ROUTE, HEADERS)
        first.body(BODY)
        first_run = asyncio.create_task(first.run())
        await _until(lambda: admission.running == 1)
        second = Exchange(app, ROUTE, HEADERS)
        second.body(BODY)
        second_run = asyncio.create_task(second.run())
        await _until(lambda: admission.waiting == 1)
        third = Exchange(app, ROUTE, HEADERS)
        await third.run()
        assert third.status() == 429
        assert "router is full: 2 requests in progress or queued, 0 arriving" in _error(third)["message"]
        core.release.set()
        await asyncio.gather(first_run, second_run)
        assert first.status() == second.status() == 200
        await fetch.close()

    asyncio.run(run())
    assert admission.running == 0 and admission.waiting == 0 and core.calls == 2


async def _healthy() -> bool:
    return True


def test_over_a_socket_the_refusal_is_given_as_the_headers_complete(tmp_path: Path) -> None:
    """The door's server (a door of its own, `--max-pending 1`): with its one place held by a
    request in its call, a request whose headers are in but whose body never comes is answered 429
    (`Retry-After`) and its connection closed, counted under its route; the held request then
    completes and the gate counts nothing."""
    router = FakeRouter(gate=asyncio.Event())

    async def healthy() -> bool:
        return True

    async def run() -> DoorServer:
        settings = DoorHttpSettings(model=tmp_path / "tiny", max_pending=1)
        server = DoorServer(settings, router, healthy, tokens=frozenset(), tls_cert=None, tls_key=None, grace_s=1)
        await server.start("127.0.0.1", 0)
        host, port = server.address.rsplit(":", 1)
        try:
            head = f"POST {ROUTE} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            r1, w1 = await asyncio.open_connection(host, int(port))
            w1.write(f"{head}content-length: {len(BODY)}\r\n\r\n".encode() + BODY)
            await _until(lambda: router.seen)
            r2, w2 = await asyncio.open_connection(host, int(port))
            w2.write(f"{head}content-length: 1000\r\n\r\n".encode())  # the body never follows
            async with asyncio.timeout(10):
                refused = await r2.read()  # to the close
            assert refused.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1\r\n" in refused.lower()
            assert b'"code": "overloaded"' in refused or b'"code":"overloaded"' in refused
            assert router.gate is not None
            router.gate.set()
            async with asyncio.timeout(10):
                answered = await r1.readuntil(b"\r\n\r\n")
            assert answered.startswith(b"HTTP/1.1 200 ")
            w1.close()
            w2.close()
            await _until(lambda: server.gate.calling == 0 and server.gate.arriving == 0)
            return server
        finally:
            await server.stop()

    server = asyncio.run(run())
    count = server.metrics.get_sample_value("epd_door_requests_total", {"route": ROUTE, "status": "429"})
    assert count == 1
