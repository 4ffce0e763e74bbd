"""Build the `GenerateRequest` that asks a speech stack (Whisper, contract 1.4) for a transcript:
one user turn holding one audio item and nothing else (the router then transcribes it window by
window; a text part would make it an ordinary chat request)."""

from __future__ import annotations

from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2, sampling_pb2


def transcription_request(
    audio: media_pb2.MediaItem, *, timestamps: bool = False, max_tokens: int = 0, request_id: str = ""
) -> generate_pb2.GenerateRequest:
    """Greedy; `max_tokens` bounds each 30 s window (0: the server's default); clips over one
    window always get timestamps (long-form needs them to find where the next window starts)."""
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(media=audio)])],
        sampling=sampling_pb2.SamplingParams(timestamps=timestamps, max_tokens=max_tokens),
    )


def audio_item(data: bytes, *, mime_type: str = "audio/wav", item_id: str = "") -> media_pb2.MediaItem:
    return media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=data, mime_type=mime_type, id=item_id)
