"""The door's connection bounds over a real socket (`libs/door/connections.py`, the door's uvicorn
server in this process, a fake router behind it): headers that do not arrive in time (408),
headers too large or too many (431), a body that does not arrive in time (408), an idle keep-alive
connection, connections beyond the bound (503). Each test waits for the server's answer or its
close, never for a fixed time; the timeouts are short so the waits are."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from libs.door.server import DoorHttpSettings, DoorServer
from tests.support.door_router import CHAT, FakeRouter

pytestmark = pytest.mark.unit

TIMEOUT_S = 0.5


async def _healthy() -> bool:
    return True


@asynccontextmanager
async def _door(tmp_path: Path, **bounds: Any) -> AsyncIterator[DoorServer]:
    settings = DoorHttpSettings(
        model=tmp_path / "tiny",
        **{"header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S, "keep_alive_s": 1, **bounds},
    )
    door = DoorServer(settings, FakeRouter(), _healthy, tokens=frozenset(), tls_cert=None, tls_key=None, grace_s=1)
    await door.start("127.0.0.1", 0)
    try:
        yield door
    finally:
        await door.stop()


async def _connect(door: DoorServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = door.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next response: status, headers, body (by its Content-Length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout=10)
    return int(lines[0].split()[1]), headers, body


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout=10)


def _count(door: DoorServer, route: str, status: int) -> float:
    return door.metrics.get_sample_value("epd_door_requests_total", {"route": route, "status": str(status)}) or 0.0


def _run(tmp_path: Path, test: Callable[[DoorServer], Awaitable[None]], **bounds: Any) -> None:
    async def main() -> None:
        async with _door(tmp_path, **bounds) as door:
            await test(door)

    asyncio.run(main())


def _request(body: bytes = b"", extra: str = "") -> bytes:
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}"
    return head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body


def test_headers_that_do_not_arrive_in_time_are_408_and_closed(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        started = time.monotonic()  # the deadline runs from the server's accept, within the connect
        reader, writer = await _connect(door)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        sent = await _closed(reader)
        assert time.monotonic() - started >= TIMEOUT_S * 0.9  # not before its time
        assert sent.startswith(b"HTTP/1.1 408 ")
        error = json.loads(sent.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
        assert _count(door, "connection", 408) == 1
        writer.close()

    _run(tmp_path, test)


def test_headers_dribbled_a_byte_at_a_time_do_not_hold_the_connection(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        started = time.monotonic()
        reader, writer = await _connect(door)
        closing = asyncio.ensure_future(_closed(reader))
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nx-pad: " + b"a" * 1000:  # a byte per tick
            if closing.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(TIMEOUT_S / 10)
        assert (await closing).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < TIMEOUT_S * 4  # each byte did not restart the clock
        writer.close()

    _run(tmp_path, test)


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        reader, writer = await _connect(door)
        assert await _closed(reader) == b""
        assert _count(door, "connection", 408) == 0
        writer.close()

    _run(tmp_path, test)


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        ("x-big: " + "a" * (40 << 10) + "\r\n", "a 40 KiB header"),
        ("".join(f"x-h{i}: v\r\n" for i in range(150)), "150 headers"),
    ],
)
def test_headers_too_large_or_too_many_are_431(tmp_path: Path, extra: str, what: str) -> None:
    async def test(door: DoorServer) -> None:
        reader, writer = await _connect(door)
        writer.write(_request(json.dumps(CHAT).encode(), extra))
        status, headers, body = await _answer(reader)
        assert status == 431, what
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "headers_too_large"
        assert await _closed(reader) == b""
        assert _count(door, "connection", 431) == 1
        writer.close()

    _run(tmp_path, test, max_header_kib=32, max_headers=100)


def test_headers_within_the_bounds_are_served(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        reader, writer = await _connect(door)
        extra = "x-big: " + "a" * (20 << 10) + "\r\n" + "".join(f"x-h{i}: v\r\n" for i in range(90))
        writer.write(_request(json.dumps(CHAT).encode(), extra))
        status, _, body = await _answer(reader)
        assert status == 200, body
        writer.close()

    _run(tmp_path, test, max_header_kib=32, max_headers=100)


def test_a_body_that_does_not_arrive_in_time_is_408_and_closed(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        reader, writer = await _connect(door)
        body = json.dumps(CHAT).encode()
        writer.write(_request(body)[: -len(body) + 5])  # the headers, five bytes of the body
        status, headers, sent = await _answer(reader)
        assert status == 408
        error = json.loads(sent)["error"]
        assert (error["param"], error["code"]) == ("body", "request_timeout")
        assert headers["connection"] == "close"
        assert await _closed(reader) == b""
        assert _count(door, "/v1/chat/completions", 408) == 1
        writer.close()

    _run(tmp_path, test)


def test_an_idle_keep_alive_connection_is_closed(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        reader, writer = await _connect(door)
        writer.write(_request(json.dumps(CHAT).encode()))
        status, headers, _ = await _answer(reader)
        assert status == 200 and headers.get("connection") != "close"
        writer.write(_request(json.dumps(CHAT).encode()))  # the connection is reused
        assert (await _answer(reader))[0] == 200
        started = time.monotonic()
        assert await _closed(reader) == b""  # then left idle: closed, no answer
        assert time.monotonic() - started >= 0.8  # keep-alive_s, less the read of the answer
        writer.close()

    _run(tmp_path, test, keep_alive_s=1, header_timeout_s=30)


def test_connections_beyond_the_bound_are_503_at_once(tmp_path: Path) -> None:
    async def test(door: DoorServer) -> None:
        held = []
        for _ in range(2):  # served once: the server holds both connections
            reader, writer = await _connect(door)
            writer.write(_request(json.dumps(CHAT).encode()))
            assert (await _answer(reader))[0] == 200
            held.append((reader, writer))
        reader, writer = await _connect(door)
        status, headers, body = await _answer(reader)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert await _closed(reader) == b""
        assert _count(door, "connection", 503) == 1
        writer.close()
        held[0][1].close()  # one leaves: a new one is served
        assert await _closed(held[0][0]) == b""
        for _ in range(100):
            if len(door._server.server_state.connections) < 2:
                break
            await asyncio.sleep(0.01)
        reader, writer = await _connect(door)
        writer.write(_request(json.dumps(CHAT).encode()))
        assert (await _answer(reader))[0] == 200
        writer.close()
        held[1][1].close()

    _run(tmp_path, test, max_connections=2, header_timeout_s=30, keep_alive_s=30)
