"""Build the `GenerateRequest` that asks a speech stack (Whisper, contract 1.4) for a transcript:
one user turn holding one audio item and nothing else (the router then transcribes it window by
window; a text part would make it an ordinary chat request); and read the timed segments of a
transcript streamed with timestamps."""

from __future__ import annotations

from dataclasses import dataclass

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


SECONDS_PER_TIMESTAMP = 0.02  # Whisper's timestamp tokens mark multiples of 20 ms


@dataclass(frozen=True)
class TimedText:
    start_s: float
    end_s: float
    text: str


class Segments:
    """Whisper's segments of a transcript streamed with timestamp tokens (`sampling.timestamps`),
    as they close: a timestamp opens a segment and the next one closes it (a pair of consecutive
    timestamps closes one and opens the next); a window's timestamps count from where the previous
    window's last segment ended, so a stamp before the open segment's start begins the next
    window. The rule of the door's `verbose_json` (libs/door/openai/transcription.py, which has the
    tokenizer), and a window boundary after a pair; a client has only each chunk's text, and a
    router streams a window's tokens segment by segment (services/router/transcribe.py), so a
    chunk's text belongs to the segment its words are in."""

    def __init__(self, timestamp_begin: int) -> None:
        self._begin = timestamp_begin
        self._offset = 0.0  # seconds the current window starts at
        self._start: float | None = None  # the open segment's start (None: none open)
        self._words = 0
        self._text = ""
        self.found: list[TimedText] = []

    def push(self, token_ids: list[int], text: str) -> list[TimedText]:
        """One streamed chunk; returns the segments it closed."""
        before = len(self.found)
        placed = False
        for token in token_ids:
            if token < self._begin:
                if self._start is None:
                    self._start = self.found[-1].end_s if self.found else 0.0
                self._words += 1
                if not placed:
                    self._text, placed = self._text + text, True
                continue
            at = (token - self._begin) * SECONDS_PER_TIMESTAMP
            if self._start is None:
                if self.found and self._offset + at < self.found[-1].end_s - 1e-6:
                    self._offset = self.found[-1].end_s
                self._start, self._words, self._text = self._offset + at, 0, ""
            elif not self._words and self._offset + at < self._start - 1e-6:
                # A stamp before the open (empty) segment's: the next window's first. A window
                # ends on a pair whose second stamp opened a segment the window then dropped
                # unfinished (libs/speech/longform.py); the next window starts at that pair's first
                # stamp, the end of the last segment, and its stamps count from there.
                self._offset = self.found[-1].end_s if self.found else self._start
                self._start, self._text = self._offset + at, ""
            else:
                self._close(self._offset + at)
        if not placed:
            self._text += text
        return self.found[before:]

    def finish(self) -> list[TimedText]:
        """The end of the stream: a segment still open ends where it started (no closing stamp)."""
        before = len(self.found)
        if self._start is not None:
            self._close(self._start)
        return self.found[before:]

    def _close(self, end_s: float) -> None:
        assert self._start is not None
        if self._words:
            start = round(self._start, 2)
            self.found.append(TimedText(start, round(max(end_s, start), 2), self._text.strip()))
        self._start, self._words, self._text = None, 0, ""


def clock(seconds: float) -> str:
    """`[MM:SS.mmm]` as whisper's command line prints segment times (HH: from an hour on)."""
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{minutes:02d}:{rest // 1000:02d}.{rest % 1000:03d}"
    return f"{hours:02d}:{text}" if hours else text


def segment_line(segment: TimedText) -> str:
    """One line as whisper's command line prints it: `[00:00.000 --> 00:02.400]  text`."""
    return f"[{clock(segment.start_s)} --> {clock(segment.end_s)}]  {segment.text}"
