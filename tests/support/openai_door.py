"""The OpenAI door in tests: one door process in front of a running router (or a router serving the
door itself), a gRPC request as the same OpenAI messages (media as data URLs, audio as
input_audio), a client leaving mid-stream."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack

MIME = {media_pb2.MODALITY_IMAGE: "image/png", media_pb2.MODALITY_VIDEO: "video/mp4"}
_PART = {media_pb2.MODALITY_IMAGE: "image_url", media_pb2.MODALITY_VIDEO: "video_url"}
_ROLE = {
    chat_pb2.CHAT_ROLE_SYSTEM: "system",
    chat_pb2.CHAT_ROLE_USER: "user",
    chat_pb2.CHAT_ROLE_ASSISTANT: "assistant",
}


@contextmanager
def running_door(
    router: str,
    model: Path | str,
    log_dir: Path,
    *extra: str,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A door process in front of `router`; yields its HOST:PORT and stops it (exit 0) by PID."""
    process = ServiceProcess(
        name="openai_door",
        module="services.openai_door",
        args=["--router", router, "--model", str(model), *extra],
        log_path=log_dir / "openai_door.log",
        env=dict(env or {}),
    )
    process.start()
    try:
        yield process.wait_ready(60)
    finally:
        status = process.stop()
        assert status == 0, f"door exited with {status}:\n{process.log_tail()}"


@contextmanager
def router_with_door(
    stack: Stack, model: Path | str, log_dir: Path, *extra: str, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """A second router over `stack`'s backends (its router's arguments) serving the door too
    (`--openai-port 0`); yields the door's HOST:PORT and stops the router (exit 0) by PID."""
    args = list(stack.processes["router"].args)
    if "--port" in args:  # a fixed-ports stack: this router takes a port of its own
        at = args.index("--port")
        del args[at : at + 2]
    process = ServiceProcess(
        name="router-door",
        module="services.router",
        args=[*args, "--openai-port", "0", "--model", str(model), *extra],
        log_path=log_dir / "router-door.log",
        env=dict(env or {}),
    )
    process.start()
    try:
        process.wait_ready(60)
        yield process.wait_ready(60, listener="openai_door")
    finally:
        status = process.stop()
        assert status == 0, f"router exited with {status}:\n{process.log_tail()}"


def openai_messages(
    request: generate_pb2.GenerateRequest, url_of: Callable[[int], str] | None = None
) -> list[dict[str, Any]]:
    """The same conversation as OpenAI messages: images and videos as data URLs (or `url_of(i)` for
    the i-th media item), audio as `input_audio`; parts in order."""
    messages, index = [], 0
    for message in request.messages:
        parts: list[dict[str, Any]] = []
        for part in message.parts:
            if part.WhichOneof("kind") == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            media = part.media
            data = base64.b64encode(media.data).decode()
            if media.modality == media_pb2.MODALITY_AUDIO:
                parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
            else:
                kind = _PART[media.modality]
                url = url_of(index) if url_of else f"data:{MIME[media.modality]};base64,{data}"
                parts.append({"type": kind, kind: {"url": url}})
            index += 1
        messages.append({"role": _ROLE[message.role], "content": parts})
    return messages


def traceparent() -> tuple[str, dict[str, str]]:
    """A fresh trace id and the HTTP header that makes the door's spans join it."""
    trace_id = os.urandom(16).hex()
    return trace_id, {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}


def streamed_until_first_token(lines: Sequence[str] | Iterator[str]) -> bool:
    """Read SSE lines until one carries generated text; True if one did."""
    return any(line.startswith("data: ") and '"content":"' in line and '"content":""' not in line for line in lines)


def disconnects(door_url: str) -> float:
    import httpx

    from tests.support.metrics import counter_total

    return counter_total(httpx.get(door_url.removesuffix("/v1") + "/metrics").text, "epd_door_client_disconnects_total")


def disconnect_mid_stream(
    door_url: str, model: str, messages: list[dict[str, Any]], headers: Mapping[str, str]
) -> None:
    """Stream a long answer, leave after its first token, and wait until the door counted the
    disconnect. ignore_eos and a budget of 4000 tokens keep the generation going past any host's
    speed: the stream cannot end before the client leaves."""
    import httpx

    from tests.support.stacks import wait_for

    before = disconnects(door_url)
    payload = {
        "model": model,
        "temperature": 0,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
        "messages": messages,
    }
    with httpx.stream(
        "POST", f"{door_url}/chat/completions", json=payload, headers=dict(headers), timeout=120
    ) as reply:
        assert reply.status_code == 200, reply.read()
        assert streamed_until_first_token(reply.iter_lines())
    wait_for(lambda: disconnects(door_url) > before, 60, "the door counting the disconnect")
