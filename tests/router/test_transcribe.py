"""The router's window loop for speech (services/router/transcribe.py) without sockets: scripted
encoder, prefill and decode doubles stand for a Whisper stack. Per window the router encodes the
clip at the window's start, prefills and decodes; the next window starts at the last complete
segment's end (as generate()'s long-form loop), the unfinished segment and every end-of-text token
are dropped, and one final chunk carries STOP and the usage. Real tokens against generate():
tests/services/test_whisper_stack.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from libs.client.transcribe import audio_item, transcription_request
from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    prefill_pb2,
    service_info_pb2,
)
from services.router.core import Router
from services.router.encoders import EncoderPool
from services.router.stubs import StageStubs
from tests.support import samples
from tests.support.router_checks import PassingChecks
from tests.support.router_harness import Leases, StreamCall

pytestmark = pytest.mark.unit

TS = 100  # <|0.00|> in this toy vocabulary
EOT = 99
CLIP_FRAMES = 4150  # 41.5 s: two windows
SPEC = service_info_pb2.TranscriptionSpec(window_frames=3000, timestamp_begin_token_id=TS, end_of_text_token_id=EOT)
# What the model says in each window: window 1 closes two segments and starts a third it does not
# finish (dropped; the next window starts at its first timestamp, 12 s = frame 2400); window 2 has
# one segment with no closing pair (kept whole).
SCRIPT = {
    0: [TS + 0, 5, 6, TS + 500, TS + 500, 7, TS + 1200, TS + 1200, 8],
    2400: [TS + 0, 9, TS + 300],
}


class SpeechEncoder:
    def __init__(self) -> None:
        self.starts: list[int] = []

    async def Encode(self, request: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        start = request.items[0].media.processor_options.audio_window_start_frame
        self.starts.append(start)
        encoded = samples.encoded_speech_window()
        audio = encoded.layout.audio
        audio.window_start_frame, audio.clip_frames = start, CLIP_FRAMES
        audio.window_frames = min(SPEC.window_frames, CLIP_FRAMES - start)
        encoded.embeddings.lease_id = f"window-{start}"
        encoded.embeddings.agent.producer_address = "enc0"
        return encoder_pb2.EncodeResponse(items=[encoded])


class SpeechPrefill:
    def __init__(self) -> None:
        self.requests: list[prefill_pb2.PrefillRequest] = []

    async def Prefill(self, request: prefill_pb2.PrefillRequest, timeout: float | None = None, **_: Any) -> Any:
        self.requests.append(request)
        start = request.messages[0].parts[0].encoded.layout.audio.window_start_frame
        kv = samples.cross_attention_kv_cache()
        kv.handle.lease_id = f"kv-{start}"
        return prefill_pb2.PrefillResponse(
            first_chunk=generation_pb2.TokenChunk(token_ids=[SCRIPT[start][0]]),
            kv_cache=kv,
            decode_state=prefill_pb2.DecodeState(
                next_input_token_id=SCRIPT[start][0], generated_tokens=1, prompt_tokens=3
            ),
        )


class SpeechDecode:
    def Decode(self, request: decode_pb2.DecodeRequest, timeout: float | None = None, **_: Any) -> StreamCall:
        start = int(request.kv_cache.handle.lease_id.removeprefix("kv-"))

        async def stream() -> AsyncIterator[Any]:
            for token in SCRIPT[start][1:]:
                yield decode_pb2.DecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[token], text=f"<{token}>"))
            yield decode_pb2.DecodeResponse(
                chunk=generation_pb2.TokenChunk(token_ids=[EOT], finish_reason=generation_pb2.FINISH_REASON_STOP),
                usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=len(SCRIPT[start]) + 1),
            )

        return StreamCall(stream())


def _stack() -> tuple[Router, SpeechEncoder, SpeechPrefill, Leases]:
    encoder, prefill, leases = SpeechEncoder(), SpeechPrefill(), Leases()
    backends = StageStubs(
        encoder=lambda address: encoder,
        lease=leases.stub,
        checks=PassingChecks(service_info_pb2.ServiceInfo(transcription=SPEC)),
        prefill=lambda address: prefill,
        decode=lambda address: SpeechDecode(),
    )
    return Router(backends, EncoderPool(["enc0"])), encoder, prefill, leases


def _collect(router: Router, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    async def run() -> list[generate_pb2.GenerateResponse]:
        return [response async for response in router.generate(request)]

    return asyncio.run(run())


def test_a_long_clip_is_transcribed_window_by_window_from_its_timestamps() -> None:
    router, encoder, prefill, leases = _stack()
    replies = _collect(router, transcription_request(audio_item(b"RIFF-clip"), request_id="t1"))
    tokens = [t for r in replies for t in r.chunk.token_ids]
    assert encoder.starts == [0, 2400]  # window 2 starts where window 1's unfinished segment began
    assert tokens == SCRIPT[0][:8] + SCRIPT[2400]  # no end-of-text, no unfinished segment
    assert all(r.sampling.timestamps for r in prefill.requests)  # long-form needs timestamps
    final = replies[-1]
    assert final.chunk.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (6, len(tokens))
    assert sum(1 for r in replies if r.chunk.finish_reason) == 1  # the windows' own finishes stay inside
    # Text goes with its tokens: the dropped token's text is not streamed.
    assert "".join(r.chunk.text for r in replies) == "".join(f"<{t}>" for t in SCRIPT[0][1:8] + SCRIPT[2400][1:])
    assert not leases.released  # every embedding and KV was read and acked


def test_a_request_with_text_is_an_ordinary_generate() -> None:
    router, encoder, prefill, _ = _stack()
    request = transcription_request(audio_item(b"RIFF-clip"), request_id="t2")
    request.messages[0].parts.append(chat_pb2.ContentPart(text="Summarize."))
    _collect(router, request)
    assert encoder.starts == [0] and len(prefill.requests) == 1
    assert not prefill.requests[0].sampling.timestamps
