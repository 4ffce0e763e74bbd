"""`epd transcribe`: speech to text through a running Whisper stack, streamed like `epd generate`.

epd up --model var/models/whisper-tiny.en --encoders 1   # a Whisper E/P/D stack
epd transcribe speech.wav                                 # its transcript
epd transcribe speech.wav --timestamps                    # one `[00:00.000 --> 00:02.400]  text` line per segment

A stack whose model is not a speech model would take the clip as an ordinary chat turn and answer
something else entirely; it is refused, with the command that asks such a model about audio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from libs.cli.router_client import (
    ADDRESS_FILE,
    DEFAULT_RUN_DIR,
    Check,
    Reply,
    Served,
    UsageError,
    plain_text,
    router_target,
    stream_to_stdout,
)
from libs.client.generate import media_from_file
from libs.client.transcribe import Segments, segment_line, transcription_request
from libs.contract.epd.v1 import media_pb2


def _check(file: Path) -> Check:
    def check(stack: Served | None) -> str | None:
        if stack is None or not stack.model or stack.speech:
            return None  # a speech stack, or one that does not say: the router decides
        return (
            f"the stack serves {stack.model}, which is not a speech model (it does not advertise "
            f"speech.transcription): it would take the clip as a chat turn, not transcribe it. To ask it about the "
            f'audio: epd generate --audio {file} "What is said?"; to transcribe: a Whisper stack, '
            "epd up --model var/models/whisper-tiny.en"
        )

    return check


def _timed(stack: Served | None) -> Reply:
    """One whisper-style line per segment as it closes; the plain text where the stack does not
    say where its timestamp tokens begin (a router older than the check)."""
    if stack is None or stack.timestamp_begin is None:
        print(
            "epd transcribe: the router does not advertise its transcription spec: printing the text without times",
            file=sys.stderr,
        )
        return plain_text()
    segments = Segments(stack.timestamp_begin)

    def on_chunk(token_ids: list[int], text: str) -> None:
        for segment in segments.push(token_ids, text):
            print(segment_line(segment), flush=True)

    def end() -> None:
        for segment in segments.finish():
            print(segment_line(segment), flush=True)

    return Reply(on_chunk, end)


def cmd_transcribe(ns: argparse.Namespace) -> int:
    try:
        target = router_target(ns)  # the same resolution as `epd generate`
    except UsageError as exc:
        print(f"epd transcribe: {exc}", file=sys.stderr)
        return 2
    if not ns.file.is_file():
        print(f"epd transcribe: no such file: {ns.file}", file=sys.stderr)
        return 2
    audio = media_from_file(ns.file, media_pb2.MODALITY_AUDIO)
    request = transcription_request(audio, timestamps=ns.timestamps, max_tokens=ns.max_tokens)
    return stream_to_stdout(
        "epd transcribe",
        target,
        request,
        ns.timeout,
        first="first text",
        check=_check(ns.file),
        reply=_timed if ns.timestamps else None,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("transcribe", help="transcribe an audio file through a running Whisper stack")
    p.add_argument("file", type=Path, help="audio file (WAV, FLAC, MP3, ...)")
    p.add_argument("--address", default="", help=f"router address (default: RUN_DIR/{ADDRESS_FILE})")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where `epd up` runs (address, tls/)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA of the router's certificate (PEM): use TLS")
    p.add_argument("--token-file", type=Path, default=None, help="bearer token file (or env EPD_TOKEN)")
    p.add_argument(
        "--timestamps",
        action="store_true",
        help="print one `[start --> end]  text` line per segment, as whisper's command line does",
    )
    p.add_argument("--max-tokens", type=int, default=0, help="bound per 30 s window (0: the server's default)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    p.set_defaults(func=cmd_transcribe)
