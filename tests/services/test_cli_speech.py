"""The speech commands as a user runs them against a Whisper stack started with `epd up` (the
installed script, stopped with Ctrl-C), driven by the lines it prints:

- `epd generate "Hello"` is refused by the stack (INVALID_ARGUMENT) and told the command to use;
- `epd transcribe --timestamps` prints one `[start --> end]  text` line per segment: the segments
  of the tokens the router streams, as the door's verbose_json makes them (a Python client's call,
  the tokenizer's text);
- `epd transcribe` without the flag prints the text alone, as before.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from pathlib import Path

import pytest

from libs.client.generate import generate, open_channel
from libs.client.transcribe import audio_item, transcription_request
from libs.door.app import whisper_vocab
from libs.door.openai.transcription import segments
from libs.model.checkpoints.generate import ensure_converted
from tests.support.epd_cli import EPD, Lines, cli_env, run_epd
from tests.support.speech_corpus import UTTERANCES, utterance

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def _expected_segments(address: str, clip: bytes, checkpoint: Path) -> list[tuple[float, float, str]]:
    async def tokens() -> list[int]:
        async with open_channel(address) as channel:
            request = transcription_request(audio_item(clip), timestamps=True)
            return (await generate(channel, request, timeout_s=240)).token_ids

    vocab = whisper_vocab(checkpoint)
    assert vocab is not None
    found = segments(asyncio.run(tokens()), vocab.timestamp_begin, vocab.decode)
    return [(s.start_s, s.end_s, s.text.strip()) for s in found]


@pytest.mark.timeout(600)
def test_speech_commands_on_a_whisper_stack(tmp_path: Path) -> None:
    whisper = ensure_converted()
    run_dir = tmp_path / "run"
    args = ["up", "--model", str(whisper), "--encoders", "1", "--run-dir", str(run_dir)]
    args += ["--no-openai-door", "--no-supervise", "--trace-exporter", "none"]
    up = subprocess.Popen(
        [EPD, *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = Lines(up)
    try:
        address = lines.until(r"^router listening on (\S+)", 300).group(1)
        lines.until(r"^Ctrl-C stops the stack\.$", 10)
        at = ["--run-dir", str(run_dir)]

        chat = run_epd(["generate", "Hello", *at], tmp_path, 120)
        assert chat.returncode == 1
        assert "epd generate: INVALID_ARGUMENT" in chat.stderr
        assert f"the stack serves {whisper.name}, a speech model: use `epd transcribe FILE`" in chat.stderr

        clip = tmp_path / "speech.wav"
        clip.write_bytes(utterance(*UTTERANCES["twenty_seconds"]))
        timed = run_epd(["transcribe", str(clip), "--timestamps", *at], tmp_path, 300)
        assert timed.returncode == 0, timed.stderr
        printed = re.findall(r"^\[(\d\d):(\d\d\.\d{3}) --> (\d\d):(\d\d\.\d{3})\]  (.*)$", timed.stdout, re.MULTILINE)
        assert len(printed) == len(timed.stdout.strip().splitlines()) >= 2, timed.stdout
        got = [(int(m1) * 60 + float(s1), int(m2) * 60 + float(s2), text) for m1, s1, m2, s2, text in printed]
        expected = _expected_segments(address, clip.read_bytes(), whisper)
        assert [(round(a, 2), round(b, 2)) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
        assert [text for *_, text in got] == [text for *_, text in expected]

        plain = run_epd(["transcribe", str(clip), *at], tmp_path, 300)
        assert plain.returncode == 0, plain.stderr
        assert "-->" not in plain.stdout and plain.stdout.strip()
    finally:
        up.send_signal(signal.SIGINT)
    out = lines.rest(120)
    up.wait(60)
    assert up.returncode == 0, out
