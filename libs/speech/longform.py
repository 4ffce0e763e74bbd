"""Long-form transcription: how the tokens of one 30 s window become segments and where the next
window starts, as transformers' Whisper `generate()` does it (`_retrieve_segment`).

A window's tokens (timestamp tokens included, the end-of-text token excluded) split at every pair
of consecutive timestamps. Each pair ends a segment (the first timestamp) and starts the next (the
second). What follows the last pair is an unfinished segment: it is dropped and the next window
starts at the pair's first timestamp - unless the window ends with a single timestamp (no speech
after it) or has no pair at all; then everything is kept and the next window starts where this
one's audio ends. Tokens become final as soon as a pair closes, so they can be streamed then.

Numbers (transformers' defaults for Whisper): a timestamp token is 0.02 s (`time_precision`), a
mel frame 0.01 s, the encoder halves the frames (`input_stride` 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIME_PRECISION_S = 0.02  # seconds per timestamp token
FRAME_S = 0.01  # seconds per mel frame
INPUT_STRIDE = 2  # mel frames per timestamp step


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    tokens: tuple[int, ...]


@dataclass
class WindowSegmenter:
    """Feed one window's generated tokens with `push`; `finish` says what else is kept and how far
    the next window moves (in mel frames)."""

    timestamp_begin: int  # id of the <|0.00|> token
    seek: int  # first mel frame of this window in the clip
    window_frames: int  # mel frames of the clip inside this window
    tokens: list[int] = field(default_factory=list)
    released: int = 0  # tokens[:released] are final
    _pairs: list[int] = field(default_factory=list)  # index of each pair's second timestamp

    def _is_ts(self, token: int) -> bool:
        return token >= self.timestamp_begin

    def push(self, token: int) -> list[int]:
        """Add a generated token (not the end-of-text one); returns tokens that became final."""
        self.tokens.append(token)
        n = len(self.tokens)
        if n >= 2 and self._is_ts(self.tokens[-1]) and self._is_ts(self.tokens[-2]):
            self._pairs.append(n - 1)
            out, self.released = self.tokens[self.released : n], n
            return out
        return []

    @property
    def _single_ending(self) -> bool:
        ts = [self._is_ts(t) for t in self.tokens[-2:]]
        return ts == [False, True]

    def finish(self) -> tuple[list[int], int]:
        """(tokens that become final now, mel frames to advance to the next window)."""
        if not self._pairs or self._single_ending:
            out, self.released = self.tokens[self.released :], len(self.tokens)
            return out, self.window_frames
        # The unfinished segment after the last pair is dropped; restart at the pair's first stamp.
        first_of_pair = self.tokens[self._pairs[-1] - 1]
        return [], (first_of_pair - self.timestamp_begin) * INPUT_STRIDE

    def segments(self) -> list[Segment]:
        """The window's segments with clip times, as generate()'s `_retrieve_segment` makes them
        (call after `finish`)."""
        seq, begin = self.tokens, self.timestamp_begin
        offset = self.seek * FRAME_S
        if not self._pairs:
            stamps = [t for t in seq if self._is_ts(t)]
            last = int(self.window_frames * FRAME_S / TIME_PRECISION_S)
            if stamps and stamps[-1] != begin:
                last = stamps[-1] - begin
            return [Segment(offset, offset + last * TIME_PRECISION_S, tuple(seq))]
        single = self._single_ending
        slices = list(self._pairs)
        if single:
            slices.append(len(seq))
        else:
            slices[-1] += 1  # the last segment keeps both stamps of its closing pair
        out, previous = [], 0
        for i, current in enumerate(slices):
            piece = seq[previous:current]
            end = piece[-1] if i < len(slices) - 1 or single else piece[-2]
            out.append(
                Segment(
                    offset + (piece[0] - begin) * TIME_PRECISION_S,
                    offset + (end - begin) * TIME_PRECISION_S,
                    tuple(piece),
                )
            )
            previous = current
        return out
