"""Every response the door gives is counted in /metrics by route and status (a 500 from an
exception nothing caught, a client gone before its answer: 499), and every failure is one log line
at its level: a client that left is "client disconnected" at info, never "unexpected error"."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from libs.door.openai.errors import ApiError
from tests.support.door_router import CHAT, COMPLETION, Exchange, FakeRouter, door

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}
CHAT_ROUTE = "/v1/chat/completions"


def _failures(logs: list[Any]) -> list[tuple[str, str]]:
    return [(entry["log_level"], entry["event"]) for entry in logs]


def test_an_uncaught_exception_is_a_counted_500_and_one_error_line() -> None:
    d = door(FakeRouter(fail=RuntimeError("a bug")))
    with capture_logs() as logs:
        reply = d.client(raise_server_exceptions=True).post(CHAT_ROUTE, json=CHAT)
    assert reply.status_code == 500  # answered, not raised out of the app
    assert reply.json()["error"] == {
        "message": "internal error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert "a bug" not in reply.text  # details to the log only
    assert d.count(CHAT_ROUTE, 500) == 1
    assert _failures(logs) == [("error", "unexpected error")]
    assert logs[0]["route"] == CHAT_ROUTE and "exc_info" in logs[0]


def test_an_uncaught_exception_mid_stream_ends_the_stream_with_an_error_event() -> None:
    d = door(FakeRouter(tokens=3, fail=RuntimeError("a bug"), fail_after=1))
    with capture_logs() as logs:
        reply = d.client().post(CHAT_ROUTE, json={**CHAT, "stream": True})
    assert reply.status_code == 200  # the status went out with the first token
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "t0"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    assert events[-1] == "[DONE]"
    assert d.count(CHAT_ROUTE, 200) == 1
    assert _failures(logs) == [("error", "unexpected error")]


@pytest.mark.parametrize(
    ("refusal", "status", "level", "event"),
    [
        (ApiError(429, "router full", code="overloaded", headers={"Retry-After": "1"}), 429, "info", "request refused"),
        (ApiError(503, "router draining", code="draining"), 503, "warning", "request failed"),
        (ApiError(504, "deadline", code="deadline_exceeded"), 504, "warning", "request failed"),
        (ApiError(500, "internal error in Generate", code="internal"), 500, "warning", "request failed"),
    ],
)
def test_a_failure_behind_the_door_is_counted_and_logged_at_its_level(
    refusal: ApiError, status: int, level: str, event: str
) -> None:
    d = door(FakeRouter(fail=refusal))
    with capture_logs() as logs:
        whole = d.client().post(CHAT_ROUTE, json=CHAT)
        streamed = d.client().post(CHAT_ROUTE, json={**CHAT, "stream": True})
    assert (whole.status_code, streamed.status_code) == (status, status)
    assert d.count(CHAT_ROUTE, status) == 2
    assert _failures(logs) == [(level, event)] * 2
    assert logs[0]["status"] == status and logs[0]["code"] == refusal.code


def test_every_status_a_client_sees_is_counted() -> None:
    d = door(max_body_bytes=4096)
    client = d.client()
    seen: dict[tuple[str, str], int] = {}
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", CHAT_ROUTE, {"json": CHAT}),
        ("POST", CHAT_ROUTE, {"json": {**CHAT, "stream": True}}),
        ("POST", "/v1/completions", {"json": COMPLETION}),
        ("POST", CHAT_ROUTE, {"json": {**CHAT, "temperature": "hot"}}),
        ("POST", CHAT_ROUTE, {"json": {**CHAT, "model": "other"}}),
        ("POST", CHAT_ROUTE, {"content": b"{}", "headers": {"content-type": "text/plain"}}),
        ("POST", CHAT_ROUTE, {"json": {**CHAT, "user": "u" * 5000}}),
        ("GET", CHAT_ROUTE, {}),
        ("POST", "/v1/nothing", {"json": CHAT}),
        ("GET", "/v1/models", {}),
        ("GET", "/health", {}),
    ]
    for method, path, kwargs in sends:
        reply = client.request(method, path, **kwargs)
        route = path if path != "/v1/nothing" else "unmatched"
        seen[(route, str(reply.status_code))] = seen.get((route, str(reply.status_code)), 0) + 1
    assert {status for _, status in seen} == {"200", "400", "404", "405", "413", "415"}
    metrics = client.get("/metrics").text
    # /metrics counts its own answer as it starts, after the text was made.
    assert d.counts() == {**{k: float(v) for k, v in seen.items()}, ("/metrics", "200"): 1.0}
    assert 'epd_door_requests_total{route="/v1/chat/completions",status="415"} 1.0' in metrics


def test_a_client_gone_mid_body_is_a_counted_499_logged_as_a_disconnect() -> None:
    d = door()

    async def exchange() -> Exchange:
        ex = Exchange(d.app, CHAT_ROUTE, {**JSON, "content-length": "500"})
        ex.body(b'{"model": "tiny", "mess', more=True)
        ex.disconnect()
        await ex.run()
        return ex

    with capture_logs() as logs:
        ex = asyncio.run(exchange())
    assert ex.status() == 499
    assert d.count(CHAT_ROUTE, 499) == 1 and d.disconnects() == 1
    assert _failures(logs) == [("info", "client disconnected")]
    assert d.router.seen == []


def test_a_client_gone_while_its_answer_is_made_is_a_counted_499() -> None:
    gate = asyncio.Event()  # never set: the router's first token never comes
    d = door(FakeRouter(gate=gate))

    async def exchange() -> Exchange:
        ex = Exchange(d.app, CHAT_ROUTE, JSON)
        ex.body(json.dumps(CHAT).encode())
        running = asyncio.create_task(ex.run())
        while not d.router.seen:  # the call is out: the door waits on the router
            await asyncio.sleep(0)
        ex.disconnect()
        await asyncio.wait_for(running, timeout=10)
        return ex

    with capture_logs() as logs:
        ex = asyncio.run(exchange())
    assert ex.status() == 499
    assert d.count(CHAT_ROUTE, 499) == 1 and d.disconnects() == 1
    assert _failures(logs) == [("info", "client disconnected")]


def test_a_client_gone_mid_stream_is_counted_with_its_200_and_as_a_disconnect() -> None:
    gate = asyncio.Event()
    d = door(FakeRouter(tokens=3, gate=gate, gate_at=1))

    async def exchange() -> Exchange:
        ex = Exchange(d.app, CHAT_ROUTE, JSON)
        ex.body(json.dumps({**CHAT, "stream": True}).encode())
        running = asyncio.create_task(ex.run())
        await ex.until(lambda sent: any(m.get("body", b"").startswith(b"data: ") for m in sent))
        ex.disconnect()  # after the first token, while the router holds the second
        await asyncio.wait_for(running, timeout=10)
        return ex

    with capture_logs() as logs:
        ex = asyncio.run(exchange())
    assert ex.status() == 200
    assert d.counts() == {(CHAT_ROUTE, "200"): 1.0}
    assert d.disconnects() == 1
    assert _failures(logs) == [("info", "client disconnected")]
