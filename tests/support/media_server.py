"""A local HTTP media server for fetch tests (aiohttp, in the test's own loop, on 127.0.0.x), a
server that accepts and never answers, and a fake DNS (a table, as a rebinding DNS would answer).

`MediaServer` serves:
- `/media/{name}`: a fixed PNG-ish body (`BODY`), `Content-Type: image/png`, with a Content-Length;
- `/redirect?to=URL`: 302 to URL;  `/hop/{n}`: 302 to `/hop/{n-1}`, and `/hop/0` is `/media/hop`;
- `/sized/{n}`: n bytes with their Content-Length;
- `/endless`: a chunked body that never ends (no Content-Length) until the client goes away;
- `/gzip`: a body sent with `Content-Encoding: gzip`;  `/missing`: 404.
`hits` counts requests per path; `endless_bytes` counts what `/endless` managed to send."""

from __future__ import annotations

import asyncio
import collections
import gzip
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
CHUNK = b"z" * 16384


class MediaServer:
    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.hits: collections.Counter[str] = collections.Counter()
        self.endless_bytes = 0
        self.endless_ended = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/media/{name}", self._media)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/hop/{n}", self._hop)
        app.router.add_get("/sized/{n}", self._sized)
        app.router.add_get("/endless", self._endless)
        app.router.add_get("/gzip", self._gzip)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _media(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(body=BODY, content_type="image/png")

    async def _redirect(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        raise web.HTTPFound(request.query["to"])

    async def _hop(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        n = int(request.match_info["n"])
        raise web.HTTPFound(f"/hop/{n - 1}" if n > 0 else "/media/hop")

    async def _sized(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(body=b"s" * int(request.match_info["n"]), content_type="application/octet-stream")

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        response = web.StreamResponse()
        response.content_type = "video/mp4"
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while True:  # ends when the client hangs up: the write fails
                await response.write(CHUNK)
                self.endless_bytes += len(CHUNK)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.endless_ended.set()
        return response

    async def _gzip(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        return web.Response(body=gzip.compress(BODY), content_type="image/png", headers={"Content-Encoding": "gzip"})


@asynccontextmanager
async def media_server(host: str = "127.0.0.1") -> AsyncIterator[MediaServer]:
    server = MediaServer(host)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def silent_server(host: str = "127.0.0.1") -> AsyncIterator[tuple[int, asyncio.Event]]:
    """(port, accepted): a server that accepts connections, reads nothing and never answers."""
    accepted = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        accepted.set()

    server = await asyncio.start_server(hold, host, 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


class FakeDns(AbstractResolver):
    """Answers from a table, whatever a (hostile) DNS server chose; unknown names fail as DNS does."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: collections.Counter[str] = collections.Counter()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked[host] += 1
        if host not in self.table:
            raise OSError(f"no such host {host}")
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=0,
            )
            for address in self.table[host]
        ]

    async def close(self) -> None:
        pass
