"""Transcription through `Generate`: one audio clip through an encoder-decoder speech model
(Whisper) split into E, P and D, window by window, as the model's own `generate()` transcribes it.

A `Generate` whose only content is one audio item, to a stack whose prefill advertises a
`TranscriptionSpec` (contract 1.4), runs per 30 s window: `Encode` of the clip with
`audio_window_start_frame` = the window's start (the encoder cuts the window out of the whole
clip's features; the window is part of the item's content hash), then `Prefill` + `Decode` as for
any request. A clip of one window is transcribed as asked (timestamps only with
`sampling.timestamps`); a longer one always with timestamps, which generate()'s long-form loop
needs to find where the next window starts (`libs.speech.longform`): tokens after the last
complete segment are dropped and the next window starts at that segment's end. Tokens are streamed
as soon as their segment closes (or when the window ends); the end-of-text token of each window
is dropped, as generate() drops it, and one final chunk carries the finish reason and the usage.

Built on the router's encode dispatch and stage clients, as any request: a window whose embedding
is gone before prefill read it is encoded again, once.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from libs.contract.epd.v1 import chat_pb2, generate_pb2, generation_pb2, layout_pb2, media_pb2, service_info_pb2
from libs.speech.longform import WindowSegmenter
from libs.telemetry.stages import phase
from services.router.dispatch import EncodeDispatch
from services.router.leases import Leases, RequestState
from services.router.policy import RpcFailed
from services.router.stages import Reply, StageClients

_log = structlog.get_logger(__name__)


def speech_item(request: generate_pb2.GenerateRequest) -> media_pb2.MediaItem | None:
    """The audio item of a request that is nothing but one audio item (a transcription), else None."""
    parts = [part for message in request.messages for part in message.parts]
    if (
        len(parts) == 1
        and parts[0].WhichOneof("kind") == "media"
        and parts[0].media.modality == media_pb2.MODALITY_AUDIO
    ):
        return parts[0].media
    return None


@dataclass
class _Window:
    """One window's tokens as they stream, each with the text that came with it."""

    segmenter: WindowSegmenter
    texts: list[str] = field(default_factory=list)  # per pushed token
    sent: int = 0  # tokens already released (the segmenter's `released`)

    def push(self, chunk: generation_pb2.TokenChunk, end_of_text: int) -> generation_pb2.TokenChunk | None:
        tokens = [t for t in chunk.token_ids if t != end_of_text]
        # A chunk's text belongs to its tokens together: it goes with the last of them.
        self.texts += [""] * (len(tokens) - 1) + [chunk.text] if tokens else []
        final: list[int] = []
        for token in tokens:
            final += self.segmenter.push(token)
        return self._release(final)

    def finish(self) -> tuple[generation_pb2.TokenChunk | None, int]:
        rest, advance = self.segmenter.finish()
        return self._release(rest), advance

    def _release(self, tokens: list[int]) -> generation_pb2.TokenChunk | None:
        if not tokens:
            return None
        text = "".join(self.texts[self.sent : self.sent + len(tokens)])
        self.sent += len(tokens)
        return generation_pb2.TokenChunk(token_ids=tokens, text=text)


@dataclass(frozen=True)
class WindowEnd:
    """How a window ended: prefill's prompt tokens, frames to the next window, the clip's frames."""

    prompt_tokens: int
    advance: int
    clip_frames: int


class Transcriber:
    """Transcriptions over the router's encode dispatch and stage clients."""

    def __init__(self, dispatch: EncodeDispatch, clients: StageClients, leases: Leases) -> None:
        self._dispatch = dispatch
        self._clients = clients
        self._leases = leases

    async def transcribe(
        self,
        request: generate_pb2.GenerateRequest,
        audio: media_pb2.MediaItem,
        spec: service_info_pb2.TranscriptionSpec,
        state: RequestState,
        deadline: float | None,
    ) -> AsyncIterator[Reply]:
        """Every window of the clip, its final tokens streamed; then the finish chunk with the usage."""
        seek = window = prompt_tokens = completion_tokens = 0
        while True:
            end: WindowEnd | None = None
            with phase("epd.transcribe.window", **{"epd.window": window, "epd.window.start_frame": seek}):
                async for out in self._window(request, audio, spec, seek, state, deadline):
                    if isinstance(out, WindowEnd):
                        end = out
                    else:
                        completion_tokens += len(out.token_ids)
                        yield out, None
            assert end is not None  # every window ends with one
            prompt_tokens += end.prompt_tokens
            # Timestamp rules guarantee progress; a window that "ends" at its own start would loop
            # forever (generate() too): move a whole window on instead.
            seek += end.advance if end.advance > 0 else spec.window_frames
            window += 1
            if seek >= end.clip_frames:
                break
        _log.info("transcribed", request_id=state.request_id, windows=window, tokens=completion_tokens)
        usage = generation_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        yield generation_pb2.TokenChunk(finish_reason=generation_pb2.FINISH_REASON_STOP), usage

    async def _window(
        self,
        request: generate_pb2.GenerateRequest,
        audio: media_pb2.MediaItem,
        spec: service_info_pb2.TranscriptionSpec,
        seek: int,
        state: RequestState,
        deadline: float | None,
    ) -> AsyncIterator[generation_pb2.TokenChunk | WindowEnd]:
        """One window: encode, prefill, decode; its final tokens as they close, then its `WindowEnd`."""
        media = copy.deepcopy(audio)
        if seek:
            media.processor_options.audio_window_start_frame = seek
        for attempt in range(2):
            encoded = await self._dispatch.encode_item(state, chat_pb2.ContentPart(media=media), deadline)
            try:
                async for out in self._decode_window(request, encoded, spec, seek, state, deadline):
                    yield out
                return
            except RpcFailed as exc:
                # The window's embedding went before prefill read it (nothing streamed): encode again once.
                if attempt or not exc.embedding_gone:
                    raise
                _log.warning("window embedding gone before prefill; re-encoding", request_id=state.request_id)
                await self._leases.release_all(state)

    async def _decode_window(
        self,
        request: generate_pb2.GenerateRequest,
        encoded: layout_pb2.EncodedMedia,
        spec: service_info_pb2.TranscriptionSpec,
        seek: int,
        state: RequestState,
        deadline: float | None,
    ) -> AsyncIterator[generation_pb2.TokenChunk | WindowEnd]:
        layout = encoded.layout.audio
        sampling = copy.deepcopy(request.sampling)
        if layout.clip_frames > spec.window_frames:
            sampling.timestamps = True  # long-form transcription needs them (as generate())
        call = generate_pb2.GenerateRequest(
            request_id=state.request_id,
            messages=[
                chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(encoded=encoded)])
            ],
            sampling=sampling,
            priority=request.priority,
        )
        tokens = _Window(WindowSegmenter(spec.timestamp_begin_token_id, seek, layout.window_frames))
        prompt = 0
        async for chunk, usage in self._clients.prefill_and_decode(list(call.messages), call, state, deadline):
            if usage is not None:
                prompt = usage.prompt_tokens
            released = tokens.push(chunk, spec.end_of_text_token_id)
            if released is not None:
                yield released
        rest, advance = tokens.finish()
        if rest is not None:
            yield rest
        yield WindowEnd(prompt, advance, layout.clip_frames)
