"""`POST /v1/audio/transcriptions` (OpenAI's multipart form) as the contract's transcription request
(one audio item alone, contract 1.4), and the stream back as OpenAI's `json`, `text` or
`verbose_json` (segments from the timestamp tokens)."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libs.client.transcribe import audio_item, transcription_request
from libs.contract.epd.v1 import generate_pb2
from libs.door.openai.errors import invalid

FORMATS = ("json", "text", "verbose_json")
FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]")
SECONDS_PER_TIMESTAMP = 0.02  # Whisper's timestamp tokens mark multiples of 20 ms


@dataclass(frozen=True)
class TranscriptionForm:
    model: str
    audio: bytes
    mime_type: str
    response_format: str
    language: str | None


def parse_form(form: Mapping[str, Any], audio: bytes, mime_type: str) -> TranscriptionForm:
    """Validate the form's fields (the file's bytes already read, within the size limit)."""
    unknown = sorted(set(form) - set(FIELDS))
    if unknown:
        raise invalid(unknown[0], "unknown or unsupported field")
    model = str(form.get("model") or "")
    if not model:
        raise invalid("model", "required")
    response_format = str(form.get("response_format") or "json")
    if response_format not in FORMATS:
        raise invalid("response_format", f"{response_format!r} is not one of {', '.join(FORMATS)}")
    if form.get("prompt"):
        raise invalid("prompt", "prompting the transcription is not supported")
    temperature = str(form.get("temperature") or "0")
    try:
        if float(temperature) != 0:
            raise invalid("temperature", "transcription is greedy: only 0 is supported")
    except ValueError:
        raise invalid("temperature", f"{temperature!r} is not a number") from None
    granularity = form.get("timestamp_granularities[]")
    if granularity not in (None, "", "segment"):
        raise invalid("timestamp_granularities[]", "only segment timestamps are produced")
    language = str(form.get("language") or "") or None
    if language not in (None, "en"):
        # The checkpoints EPD serves for speech are English-only (tiny.en): no other language.
        raise invalid("language", f"{language!r}: this model transcribes English only")
    if not audio:
        raise invalid("file", "required: the audio file")
    return TranscriptionForm(model, audio, mime_type, response_format, language)


def request_for(form: TranscriptionForm, request_id: str) -> generate_pb2.GenerateRequest:
    item = audio_item(form.audio, mime_type=form.mime_type or "audio/wav", item_id="file")
    return transcription_request(item, timestamps=form.response_format == "verbose_json", request_id=request_id)


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...]


def segments(token_ids: Sequence[int], timestamp_begin: int, decode: Callable[[list[int]], str]) -> list[Segment]:
    """Segments of a transcript streamed with timestamp tokens, as Whisper marks them: a timestamp
    opens a segment, the next one closes it (a pair of consecutive timestamps closes one and opens
    the next). A window's timestamps count from the window's start, which is where the previous
    window's last complete segment ended: a segment opening before the last end begins the next
    window. Text without an opening timestamp starts where the last segment ended."""
    found: list[Segment] = []
    offset = 0.0  # seconds the current window starts at
    start: float | None = None  # the open segment's start, in seconds (None: none open)
    words: list[int] = []

    def close(end_s: float) -> None:
        if words:
            assert start is not None
            found.append(Segment(round(start, 2), round(max(end_s, start), 2), decode(words), tuple(words)))

    for token in token_ids:
        if token < timestamp_begin:
            if start is None:
                start = found[-1].end_s if found else 0.0
            words.append(token)
            continue
        at = (token - timestamp_begin) * SECONDS_PER_TIMESTAMP
        if start is None:
            if found and offset + at < found[-1].end_s - 1e-6:
                offset = found[-1].end_s
            start, words = offset + at, []
        else:
            close(offset + at)
            start, words = None, []
    if start is not None:
        close(start)
    return found


def duration_s(audio: bytes) -> float | None:
    """The clip's length, when soundfile can read its header."""
    import soundfile  # type: ignore[import-untyped]

    try:
        return float(soundfile.info(io.BytesIO(audio)).duration)
    except Exception:
        return None


def verbose(text: str, found: list[Segment], duration: float | None) -> dict[str, Any]:
    return {
        "task": "transcribe",
        "language": "english",
        "duration": duration if duration is not None else (found[-1].end_s if found else 0.0),
        "text": text,
        "segments": [
            {
                "id": i,
                "seek": 0,
                "start": s.start_s,
                "end": s.end_s,
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": 0.0,
                "avg_logprob": None,
                "compression_ratio": None,
                "no_speech_prob": None,
            }
            for i, s in enumerate(found)
        ],
    }
