"""`epd transcribe`: speech to text through a running Whisper stack, streamed like `epd generate`.

epd up --model var/models/whisper-tiny.en --encoders 1   # a Whisper E/P/D stack
epd transcribe speech.wav [--timestamps]                  # its transcript
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from libs.cli.router_client import ADDRESS_FILE, DEFAULT_RUN_DIR, UsageError, router_target, stream_to_stdout
from libs.client.generate import media_from_file
from libs.client.transcribe import transcription_request
from libs.contract.epd.v1 import media_pb2


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
    return stream_to_stdout("epd transcribe", target, request, ns.timeout, first="first text")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("transcribe", help="transcribe an audio file through a running Whisper stack")
    p.add_argument("file", type=Path, help="audio file (WAV, FLAC, MP3, ...)")
    p.add_argument("--address", default="", help=f"router address (default: RUN_DIR/{ADDRESS_FILE})")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where `epd up` runs (address, tls/)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA of the router's certificate (PEM): use TLS")
    p.add_argument("--token-file", type=Path, default=None, help="bearer token file (or env EPD_TOKEN)")
    p.add_argument("--timestamps", action="store_true", help="predict segment timestamps (always on past 30 s)")
    p.add_argument("--max-tokens", type=int, default=0, help="bound per 30 s window (0: the server's default)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    p.set_defaults(func=cmd_transcribe)
