"""Build `GenerateRequest`s from a prompt and media files, stream the reply, time it."""

from __future__ import annotations

import asyncio
import mimetypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from libs.contract.epd.v1 import chat_pb2, generate_pb2, generate_pb2_grpc, generation_pb2, media_pb2, sampling_pb2
from libs.rpc import security
from libs.rpc import server as rpc_server
from libs.rpc.retry import went_away
from libs.telemetry.propagation import client_interceptors

_MODALITY_BY_TYPE = {
    "image": media_pb2.MODALITY_IMAGE,
    "video": media_pb2.MODALITY_VIDEO,
    "audio": media_pb2.MODALITY_AUDIO,
}


def media_from_file(path: Path, modality: media_pb2.Modality.ValueType | None = None) -> media_pb2.MediaItem:
    """A media item with the file's bytes inline; modality from the flag or the file's MIME type."""
    mime, _ = mimetypes.guess_type(path.name)
    if modality is None:
        kind = (mime or "").split("/")[0]
        if kind not in _MODALITY_BY_TYPE:
            raise ValueError(f"{path}: cannot tell the modality from its name; pass it explicitly")
        modality = _MODALITY_BY_TYPE[kind]
    return media_pb2.MediaItem(modality=modality, data=path.read_bytes(), mime_type=mime or "", id=path.name)


def build_request(
    prompt: str,
    media: Sequence[media_pb2.MediaItem] = (),
    *,
    sampling: sampling_pb2.SamplingParams | None = None,
    system: str | None = None,
    request_id: str = "",
) -> generate_pb2.GenerateRequest:
    """One user turn: the media items first, then the prompt (the usual multimodal chat layout)."""
    messages = []
    if system:
        messages.append(chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_SYSTEM, parts=[chat_pb2.ContentPart(text=system)]))
    parts = [chat_pb2.ContentPart(media=item) for item in media]
    parts.append(chat_pb2.ContentPart(text=prompt))
    messages.append(chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts))
    return generate_pb2.GenerateRequest(
        request_id=request_id, messages=messages, sampling=sampling or sampling_pb2.SamplingParams(max_tokens=32)
    )


@dataclass
class GenerationResult:
    """A finished stream, with client-side timings (seconds)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the engine reused from a cached prefix
    ttft_s: float = 0.0
    total_s: float = 0.0
    retries: int = 0  # calls that failed retryably before any token, then retried
    retried_codes: list[str] = field(default_factory=list)  # the status code of each retried call
    logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)  # when the sampling asked

    @property
    def inter_token_s(self) -> float:
        """Mean time between tokens after the first."""
        n = len(self.token_ids)
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


async def generate(
    channel: grpc.aio.Channel,
    request: generate_pb2.GenerateRequest,
    *,
    timeout_s: float | None = 120.0,
    on_text: Callable[[str], None] | None = None,
    on_chunk: Callable[[list[int], str], None] | None = None,
    retry_unavailable: bool = False,
    max_retries: int = 100,
) -> GenerationResult:
    """Call `Generate` and collect the stream; `on_text` sees each text delta as it arrives,
    `on_chunk` each chunk's token ids with its text (a transcript's timestamp tokens have none).

    With `retry_unavailable`, a call that failed before any token arrived because the server was
    going away (`libs.rpc.retry.went_away`, by the failure's reason: draining, stopped, its engine
    restarting; from a server that sends none, UNAVAILABLE while it drains or restarts, or the
    CANCELLED grpc core gives calls still queued when a server stops) is retried after a pause
    growing to 0.5 s, at most `max_retries` times and within the deadline, the channel waiting for
    the server to be ready: what a client of a service under a rolling upgrade does.
    """
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    started = time.perf_counter()
    deadline = None if timeout_s is None else started + timeout_s
    retried: list[str] = []
    while True:
        result = GenerationResult(retries=len(retried), retried_codes=list(retried))
        left = None if deadline is None else deadline - time.perf_counter()
        try:
            async for response in stub.Generate(request, timeout=left, wait_for_ready=retry_unavailable or None):
                if response.chunk.token_ids and not result.token_ids:
                    result.ttft_s = time.perf_counter() - started
                result.request_id = response.request_id
                result.token_ids.extend(response.chunk.token_ids)
                result.logprobs.extend(response.chunk.logprobs)
                result.text += response.chunk.text
                if on_text and response.chunk.text:
                    on_text(response.chunk.text)
                if on_chunk and (response.chunk.token_ids or response.chunk.text):
                    on_chunk(list(response.chunk.token_ids), response.chunk.text)
                if response.chunk.finish_reason:
                    result.finish_reason = generation_pb2.FinishReason.Name(response.chunk.finish_reason)
                if response.HasField("usage"):
                    result.prompt_tokens = response.usage.prompt_tokens
                    result.completion_tokens = response.usage.completion_tokens
                    result.cached_prompt_tokens = response.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            again = retry_unavailable and went_away(exc) and not result.token_ids
            pause = min(0.5, 0.05 * 1.5 ** len(retried))
            out_of_time = deadline is not None and deadline - time.perf_counter() < 2 * pause
            if not again or len(retried) >= max_retries or out_of_time:
                raise
            retried.append(exc.code().name)
            await asyncio.sleep(pause)
            continue
        result.total_s = time.perf_counter() - started
        return result


def open_channel(address: str, *, tls_ca: bytes | None = None, token: str | None = None) -> grpc.aio.Channel:
    """A channel to the router with EPD's message-size bounds (and trace context propagation).

    `tls_ca`: the CA that signed the router's certificate (TLS; otherwise plaintext, or the
    process's own TLS identity when it is a configured service). `token`: sent as
    `authorization: Bearer <token>` on every call; only over TLS."""
    if tls_ca is None:
        if token is not None:
            raise ValueError("a bearer token is only sent over TLS: give the router's CA too")
        return rpc_server.open_channel(address)
    credentials = security.client_credentials(tls_ca)
    if token is not None:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
    return grpc.aio.secure_channel(
        address, credentials, options=rpc_server.channel_options(), interceptors=client_interceptors()
    )
