"""What a service serving an encoder-decoder speech model (Whisper) advertises (contract 1.4)."""

from __future__ import annotations

from libs.contract.epd.v1 import service_info_pb2
from libs.contract.validation import SPEECH_TRANSCRIPTION
from libs.model.families.base import FamilyAdapter
from libs.model.families.whisper import WhisperAdapter


def speech_capabilities(adapter: FamilyAdapter) -> tuple[str, ...]:
    return (SPEECH_TRANSCRIPTION,) if adapter.is_encoder_decoder else ()


def transcription_spec(adapter: FamilyAdapter) -> service_info_pb2.TranscriptionSpec | None:
    """The numbers a router needs to transcribe window by window; None for other models (and for
    a speech checkpoint without timestamp tokens: nothing would tell where a window's speech ends)."""
    if not isinstance(adapter, WhisperAdapter) or adapter.rules is None:
        return None
    return service_info_pb2.TranscriptionSpec(
        window_frames=adapter.window_frames,
        timestamp_begin_token_id=adapter.rules.timestamp_begin,
        end_of_text_token_id=adapter.rules.eos,
    )
