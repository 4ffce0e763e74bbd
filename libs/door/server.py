"""Serving the door's application: its settings, its socket, uvicorn in the caller's event loop.

Two processes host it: the door's own (services/openai_door, in front of a router over gRPC) and
the router's (`--openai-port`, libs/door/in_process.py: no gRPC hop per token). Either owns its
signals: uvicorn here never installs handlers of its own, the host stops it (`DoorServer.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from libs.config import setting
from libs.door.app import DoorConfig, create_app, whisper_vocab
from libs.door.calls import GenerateCall
from libs.door.connections import ConnectionBounds, bounded_http
from libs.door.gate import DEFAULT_MAX_PENDING, Gate
from libs.fetch import FetchClient, FetchLimits


@dataclasses.dataclass(frozen=True)
class DoorHttpSettings:
    """What the OpenAI-compatible API serves and accepts (HTTPS with the process's certificate)."""

    model: Path = setting(Path("var/models/qwen2_5_omni-tiny"), "the checkpoint the stack serves (/v1/models root)")
    served_model_name: str = setting(
        "", "the model id clients send and /v1/models lists; empty: the model directory's name"
    )
    default_temperature: float = setting(1.0, "temperature of requests that send none (OpenAI's default is 1)")
    max_body_mib: int = setting(64, "largest request body accepted, in MiB (413 beyond)")
    fetch_max_mib: int = setting(
        20, "largest media item fetched from a URL or decoded from a data URL, in MiB (413 beyond)"
    )
    fetch_timeout_s: float = setting(10.0, "longest a media URL fetch may take, in seconds")
    fetch_max_redirects: int = setting(3, "redirects followed per media URL")
    fetch_allow_private: bool = setting(
        False, "allow media URLs on loopback, link-local and private addresses (off: SSRF protection)"
    )
    # Connection bounds (libs/door/connections.py): what a reverse proxy in front would enforce.
    header_timeout_s: float = setting(
        10.0, "longest a request's headers may take, from the connection's start or its last answer (408 beyond)"
    )
    body_timeout_s: float = setting(
        60.0, "longest a request's body may take after its headers, in seconds (408 beyond)"
    )
    max_header_kib: int = setting(32, "largest request line and headers together, in KiB (431 beyond)")
    max_headers: int = setting(100, "most headers one request may carry (431 beyond)")
    keep_alive_s: int = setting(5, "seconds an idle keep-alive connection stays open")
    max_connections: int = setting(
        2048, "connections open at once; one more is answered 503 and closed (keep under the file limit)"
    )
    max_pending: int = setting(
        0,
        "a door of its own: requests it holds at once (arriving or in the router); one more is answered 429 at its "
        f"arrival, before its body is read. 0: {DEFAULT_MAX_PENDING} (the router's --max-running + --max-waiting "
        "defaults). In the router's process the router's admission is the bound (every caller counted)",
    )


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a keep-alive connection's small SSE writes wait
    # for the client's delayed ACK and a whole stream arrives at once (TTFT ~ end-to-end time).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the hosting process owns SIGTERM and SIGINT (its drain stops this server)


class DoorServer:
    """The door's HTTP server on (host, port), serving until `stop`."""

    def __init__(
        self,
        settings: DoorHttpSettings,
        generate: GenerateCall,
        health: Callable[[], Awaitable[bool]],
        *,
        tokens: frozenset[str],
        tls_cert: Path | None,
        tls_key: Path | None,
        grace_s: float,
        gate: Gate | None = None,
    ) -> None:
        """`gate`: the door's refusals at arrival (libs/door/gate.py); None: a gate of its own over
        its calls, `max_pending` places."""
        if gate is None:
            gate = Gate.own(settings.max_pending or DEFAULT_MAX_PENDING)
            generate = gate.counted(generate)
        self.gate = gate
        self.fetch = FetchClient(
            FetchLimits(
                max_bytes=settings.fetch_max_mib << 20,
                timeout_s=settings.fetch_timeout_s,
                max_redirects=settings.fetch_max_redirects,
                allow_private=settings.fetch_allow_private,
            )
        )
        config = DoorConfig(
            served_model=settings.served_model_name or settings.model.name,
            model_root=settings.model.resolve(),
            default_temperature=settings.default_temperature,
            max_body_bytes=settings.max_body_mib << 20,
            tokens=tokens,
            speech=whisper_vocab(settings.model),
            body_timeout_s=settings.body_timeout_s,
        )
        self.tls = tls_cert is not None
        self.metrics = CollectorRegistry()  # the door's instruments, served on its /metrics
        app = create_app(config, generate, self.fetch, health, self.metrics, gate)
        bounds = ConnectionBounds(
            header_timeout_s=settings.header_timeout_s,
            max_header_bytes=settings.max_header_kib << 10,
            max_headers=settings.max_headers,
            max_connections=settings.max_connections,
        )
        self._server = _Uvicorn(
            uvicorn.Config(
                app,
                http=bounded_http(bounds, app.state.metrics.requests, gate),
                timeout_keep_alive=settings.keep_alive_s,
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=int(grace_s),
                ssl_certfile=tls_cert,
                ssl_keyfile=tls_key,
            )
        )
        self._serving: asyncio.Task[None] | None = None
        self.address = ""

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}/v1"

    async def start(self, host: str, port: int) -> str:
        """Listen on (host, port) (0: a free port); the bound HOST:PORT once serving."""
        sock = bind(host, port)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._serving.done():
            await asyncio.sleep(0.01)
        if not self._server.started:
            await self._serving  # its failure, raised here
            raise RuntimeError("the OpenAI door stopped before it served")
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        return self.address

    async def wait(self) -> None:
        """Until the server has stopped."""
        if self._serving is not None:
            await self._serving

    def shutdown(self) -> None:
        """Begin stopping: no new connections, open requests get the grace period."""
        self._server.should_exit = True

    async def stop(self) -> None:
        """`shutdown`, until the server has stopped; then the fetcher closes."""
        self.shutdown()
        try:
            await self.wait()
        finally:
            await self.fetch.close()
