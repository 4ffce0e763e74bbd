"""The door's real application in front of a fake router call, without a socket: the call checks
each request as the router does (`validate_generate_request`, so a request the door should have
refused still gets the router's 400) and answers a few tokens; tests drive the app with starlette's
TestClient or with ASGI messages of their own."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncGenerator, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastapi
from aiohttp.abc import AbstractResolver
from PIL import Image
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from libs.contract.epd.v1 import generate_pb2, generation_pb2
from libs.contract.errors import EpdError
from libs.contract.validation import validate_generate_request
from libs.door.app import DoorConfig, SpeechVocab, create_app
from libs.door.gate import Gate
from libs.door.openai.errors import from_error
from libs.fetch import FetchClient, FetchLimits

MODEL = "tiny"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi"}


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "PNG")
    return out.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass
class FakeRouter:
    """A `GenerateCall`: the router's validation, then `tokens` tokens; `fail` raises after
    `fail_after` tokens (an ApiError as the router's refusal, anything else as a bug of the door's
    own would). `gate`, when given, holds token `gate_at` until it is set."""

    tokens: int = 2
    fail: BaseException | None = None
    fail_after: int = 0
    gate: asyncio.Event | None = None
    gate_at: int = 0
    seen: list[generate_pb2.GenerateRequest] = field(default_factory=list)

    async def __call__(
        self, request: generate_pb2.GenerateRequest, token: str | None
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        try:
            validate_generate_request(request)
        except EpdError as exc:
            raise from_error(exc) from None
        self.seen.append(request)
        for i in range(self.tokens):
            if self.fail is not None and i == self.fail_after:
                raise self.fail
            if self.gate is not None and i == self.gate_at:
                await self.gate.wait()
            last = i == self.tokens - 1
            finish = generation_pb2.FINISH_REASON_LENGTH if last else generation_pb2.FINISH_REASON_UNSPECIFIED
            chunk = generation_pb2.TokenChunk(token_ids=[7 + i], text=f"t{i}", finish_reason=finish)
            response = generate_pb2.GenerateResponse(chunk=chunk)
            if finish:
                response.usage.prompt_tokens, response.usage.completion_tokens = 3, self.tokens
            yield response


async def _healthy() -> bool:
    return True


@dataclass
class Door:
    app: fastapi.FastAPI
    router: FakeRouter
    registry: CollectorRegistry
    fetch: FetchClient

    def client(self, raise_server_exceptions: bool = True) -> TestClient:
        return TestClient(self.app, raise_server_exceptions=raise_server_exceptions)

    def count(self, route: str, status: int) -> float:
        value = self.registry.get_sample_value("epd_door_requests_total", {"route": route, "status": str(status)})
        return value or 0.0

    def counts(self) -> dict[tuple[str, str], float]:
        return {
            (s.labels["route"], s.labels["status"]): s.value
            for metric in self.registry.collect()
            for s in metric.samples
            if s.name == "epd_door_requests_total"
        }

    def disconnects(self) -> float:
        return self.registry.get_sample_value("epd_door_client_disconnects_total") or 0.0


def door(
    router: FakeRouter | None = None,
    *,
    max_body_bytes: int = 1 << 20,
    fetch: FetchLimits | None = None,
    dns: AbstractResolver | None = None,
    speech: SpeechVocab | None = None,
    tokens: frozenset[str] = frozenset(),
    gate: Gate | None = None,
) -> Door:
    """The app over `router`; media URLs fetched under `fetch`, names resolved by `dns`; a speech
    model's vocabulary when `speech` is given (transcriptions); `gate` refuses at arrival (its own
    calls counted, as a door of its own: libs/door/gate.py)."""
    router = router or FakeRouter()
    registry = CollectorRegistry()
    config = DoorConfig(MODEL, Path("/models/tiny"), 1.0, max_body_bytes, tokens, speech=speech)
    fetcher = FetchClient(fetch or FetchLimits(max_bytes=1 << 20), dns=dns)
    app = create_app(config, router if gate is None else gate.counted(router), fetcher, _healthy, registry, gate)
    return Door(app, router, registry, fetcher)


def http_scope(path: str, headers: dict[str, str], method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }


class Exchange:
    """One HTTP exchange driven by hand, ASGI message by message: what a real server would pass
    between a client and the app, so a test can end the client's side where it chooses."""

    def __init__(self, app: fastapi.FastAPI, path: str, headers: dict[str, str]) -> None:
        self.app = app
        self.scope = http_scope(path, headers)
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.gone = False

    def body(self, data: bytes, more: bool = False) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": data, "more_body": more})

    def disconnect(self) -> None:
        self.gone = True
        self.inbox.put_nowait({"type": "http.disconnect"})

    async def receive(self) -> dict[str, Any]:
        if self.gone and self.inbox.empty():
            return {"type": "http.disconnect"}  # a server answers every later receive so
        return await self.inbox.get()

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(dict(message))
        self.changed.set()

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    async def until(self, seen: Callable[[list[dict[str, Any]]], bool]) -> None:
        while not seen(self.sent):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), timeout=10)

    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)
