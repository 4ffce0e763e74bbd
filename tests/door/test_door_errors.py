"""The door's error table, one real door process per case in front of what makes the status: no
router (503), a router that never answers (504), a gRPC server refusing with RESOURCE_EXHAUSTED
(429 with Retry-After), bodies and media over the limits (413), HTTPS with bearer tokens (401)."""

from __future__ import annotations

import base64
import socket
import ssl
from collections.abc import Iterator
from concurrent import futures
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc
from libs.contract.reasons import STATUS_DETAILS_KEY, Reason, status_details
from libs.launch.process import ServiceProcess
from libs.rpc.certs import LocalCa, write_material
from tests.support.openai_door import running_door

pytestmark = pytest.mark.integration

MODEL = "var/models/qwen2_5_omni-tiny"
CHAT = {"model": "qwen2_5_omni-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def door(tmp_path: Path, router: str, *extra: str) -> AbstractContextManager[str]:
    return running_door(router, MODEL, tmp_path, *extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Overloaded(generate_pb2_grpc.GenerateServiceServicer):
    def Generate(self, request: generate_pb2.GenerateRequest, context: Any) -> Iterator[generate_pb2.GenerateResponse]:
        message = "router: 256 requests waiting, limit 256"
        context.set_trailing_metadata(
            ((STATUS_DETAILS_KEY, status_details(grpc.StatusCode.RESOURCE_EXHAUSTED, message, Reason.OVERLOADED)),)
        )
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        yield generate_pb2.GenerateResponse()  # unreachable: abort raises


def test_no_router_is_503(tmp_path: Path) -> None:
    with door(tmp_path, f"127.0.0.1:{_free_port()}") as address:
        reply = httpx.post(f"http://{address}/v1/chat/completions", json=CHAT, timeout=60)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "service_unavailable"
        health = httpx.get(f"http://{address}/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "not_serving"}


def test_a_router_that_never_answers_is_504(tmp_path: Path) -> None:
    with socket.socket() as silent:  # the kernel accepts connections; nobody speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        router = f"127.0.0.1:{silent.getsockname()[1]}"
        with door(tmp_path, router, "--request-timeout-s", "1") as address:
            reply = httpx.post(f"http://{address}/v1/chat/completions", json=CHAT, timeout=60)
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["type"] == "timeout_error"


def test_an_overloaded_router_is_429_with_retry_after(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(_Overloaded(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with door(tmp_path, f"127.0.0.1:{port}") as address:
            reply = httpx.post(f"http://{address}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
    finally:
        server.stop(0)
    assert reply.status_code == 429, reply.text
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"] == {
        "message": "router: 256 requests waiting, limit 256",
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
    }


def test_bodies_and_media_over_the_limits_are_413(tmp_path: Path) -> None:
    big = base64.b64encode(b"\0" * (1536 << 10)).decode()  # 1.5 MiB of media, under the 4 MiB body bound
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{big}"}}
    media_body = {**CHAT, "messages": [{"role": "user", "content": [image, {"type": "text", "text": "x"}]}]}
    with door(tmp_path, f"127.0.0.1:{_free_port()}", "--max-body-mib", "4", "--fetch-max-mib", "1") as address:
        media = httpx.post(f"http://{address}/v1/chat/completions", json=media_body, timeout=60)
        body = httpx.post(
            f"http://{address}/v1/chat/completions",
            content=b'{"pad": "' + b"x" * (5 << 20) + b'"}',
            headers={"content-type": "application/json"},
            timeout=60,
        )
    assert media.status_code == 413, media.text
    assert media.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert body.status_code == 413, body.text
    assert body.json()["error"]["param"] == "body"


def test_https_with_tokens_refuses_a_missing_or_wrong_token_with_401(tmp_path: Path) -> None:
    ca = LocalCa.create()
    ca_path, cert, key = write_material(ca.issue("openai_door"), tmp_path / "tls", "openai_door")
    token = "t" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(token + "\n")
    args = ["--tls-ca", str(ca_path), "--tls-cert", str(cert), "--tls-key", str(key), "--auth-tokens-file", str(tokens)]
    trusted = ssl.create_default_context(cafile=str(ca_path))
    with door(tmp_path, f"127.0.0.1:{_free_port()}", *args) as address, httpx.Client(verify=trusted) as client:
        url = f"https://{address}/v1/chat/completions"
        missing = client.post(url, json=CHAT, timeout=60)
        wrong = client.post(url, json=CHAT, headers={"authorization": f"Bearer {'w' * 32}"}, timeout=60)
        # The right token passes the door; with no router behind it the call is then unavailable.
        right = client.post(url, json=CHAT, headers={"authorization": f"Bearer {token}"}, timeout=60)
        models = client.get(f"https://{address}/v1/models", timeout=60)
    assert (missing.status_code, wrong.status_code, models.status_code) == (401, 401, 401)
    assert missing.json()["error"]["type"] == "authentication_error"
    assert right.status_code == 503, right.text


def test_tokens_without_tls_do_not_start(tmp_path: Path) -> None:
    process = ServiceProcess(
        name="openai_door",
        module="services.openai_door",
        args=["--router", "127.0.0.1:1", "--model", MODEL, "--auth-tokens", "t" * 32],
        log_path=tmp_path / "openai_door.log",
    )
    process.start()
    assert process.process is not None
    assert process.process.wait(60) != 0
    assert "bearer tokens need TLS" in process.log_tail()
