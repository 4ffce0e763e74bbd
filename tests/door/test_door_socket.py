"""The door's listening socket: the connections it accepts send small writes at once (TCP_NODELAY).
Without it a keep-alive connection (how `vllm bench serve` and the openai client connect) held a
stream's SSE events until the client's delayed ACK and delivered them together at the end
(docs/openai-door.md, "Streams on keep-alive connections")."""

from __future__ import annotations

import socket

import pytest

from libs.door.server import bind

pytestmark = pytest.mark.unit


def test_accepted_connections_send_without_nagle() -> None:
    listener = bind("127.0.0.1", 0)
    try:
        listener.setblocking(True)
        with socket.create_connection(listener.getsockname()[:2], timeout=5) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                client.sendall(b"x")
                assert accepted.recv(1) == b"x"
    finally:
        listener.close()
