"""What `epd transcribe --timestamps` prints, without a stack: the timed segments a client reads
from a transcript streamed with timestamp tokens (it has each chunk's text, not the tokenizer) are
the door's `verbose_json` segments (which decodes the tokens itself), across windows too; lines
as whisper's command line prints them; finish reasons as OpenAI clients name them."""

from __future__ import annotations

import pytest

from libs.cli.router_client import finish_reason
from libs.client.transcribe import Segments, TimedText, segment_line
from libs.door.openai.transcription import segments as door_segments

pytestmark = pytest.mark.unit

BEGIN = 50364  # <|0.00|>
WORDS = {101: " The", 102: " birch", 103: " canoe", 104: " slid.", 105: " Glue", 106: " the", 107: " sheet."}


def ts(seconds: float) -> int:
    return BEGIN + round(seconds / 0.02)


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


# As a router streams a long-form transcript: each window's tokens released segment by segment
# (at each pair of timestamps, services/router/transcribe.py), a chunk's text that of its words.
# Window 2 starts where window 1's last complete segment ended (2.4 s): its stamps count from there.
RELEASES = [
    [ts(0.0), 101, 102, ts(1.2), ts(1.2)],
    [103, 104, ts(2.4), ts(2.4)],
    [ts(0.0), 105, 106, 107, ts(1.6)],
]


def _read(releases: list[list[int]]) -> list[tuple[float, float, str]]:
    reader = Segments(BEGIN)
    found: list[TimedText] = []
    for chunk in releases:
        found += reader.push(chunk, decode([t for t in chunk if t < BEGIN]))
    found += reader.finish()
    return [(s.start_s, s.end_s, s.text) for s in found]


def test_streamed_segments_are_the_doors_segments_within_a_window() -> None:
    window = RELEASES[:2]
    tokens = [t for chunk in window for t in chunk]
    expected = [(s.start_s, s.end_s, s.text.strip()) for s in door_segments(tokens, BEGIN, decode)]
    assert _read(window) == expected == [(0.0, 1.2, "The birch"), (1.2, 2.4, "canoe slid.")]


def test_the_next_window_counts_from_where_the_last_segment_ended() -> None:
    assert _read(RELEASES)[-1] == (2.4, 4.0, "Glue the sheet.")


def test_each_segment_is_printed_as_soon_as_it_closes() -> None:
    reader = Segments(BEGIN)
    assert reader.push([ts(0.0), 101], " The") == []  # open: nothing to print yet
    assert [s.text for s in reader.push([102, ts(1.2)], " birch")] == ["The birch"]
    assert reader.push([103], " canoe") == []  # words with no opening stamp: from the last end
    assert reader.finish() == [TimedText(1.2, 1.2, "canoe")]


def test_lines_read_as_whispers() -> None:
    assert segment_line(TimedText(0.0, 2.4, "The birch canoe.")) == "[00:00.000 --> 00:02.400]  The birch canoe."
    assert segment_line(TimedText(3725.5, 3727.0, "Late.")) == "[01:02:05.500 --> 01:02:07.000]  Late."


def test_finish_reasons_read_as_openai_names_them() -> None:
    assert finish_reason("FINISH_REASON_LENGTH") == "length"
    assert finish_reason("FINISH_REASON_STOP") == "stop"
    assert finish_reason("FINISH_REASON_STOP_SEQUENCE").startswith("stop")
