"""`epd demo` (what `make run` runs): a stack, one request per modality mix, outputs and timings."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import media_pb2, sampling_pb2
from libs.launch.process import LaunchError
from libs.launch.runs import shown
from libs.launch.stack import Stack, StackSpec
from libs.model.media import synthetic


def sample_requests() -> list[tuple[str, list[media_pb2.MediaItem], str]]:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(96, 64, seed=1))
    video = media_pb2.MediaItem(
        modality=media_pb2.MODALITY_VIDEO, data=synthetic.video_bytes(64, 48, frames=8, fps=4, seed=3)
    )
    audio = media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=synthetic.wav_bytes(1.5, seed=2))
    return [
        ("text", [], "Describe the quick brown fox in one sentence."),
        ("image", [image], "What is in this image?"),
        ("video", [video], "Describe the video."),
        ("audio", [audio], "What is this sound?"),
        ("audio+image", [audio, image], "Does the sound fit the picture?"),
    ]


async def _send_all(address: str) -> list[tuple[str, GenerationResult | str]]:
    out: list[tuple[str, GenerationResult | str]] = []
    async with open_channel(address) as channel:
        for name, media, prompt in sample_requests():
            request = build_request(
                prompt,
                media,
                sampling=sampling_pb2.SamplingParams(max_tokens=16),
                request_id=f"demo-{name.replace('+', '-')}",
            )
            try:
                out.append((name, await generate(channel, request, timeout_s=60)))
            except grpc.aio.AioRpcError as exc:
                out.append((name, f"{exc.code().name}: {exc.details()}"))
    return out


def run_demo(spec: StackSpec, trace_file: Path | None = None) -> int:
    """Run the demo; with `trace_file` (a fresh JSONL span file), print the latency attribution of
    its requests and draw the slowest one's waterfall next to it."""
    if trace_file is not None:
        trace_file.unlink(missing_ok=True)
    started = time.perf_counter()
    stack = Stack(spec)
    encoders = "" if spec.layout == "colocated" else f" with {spec.encoders} encoders"
    print(f"starting the {spec.layout} stack{encoders} from {spec.model} ...", flush=True)
    try:
        address = stack.up()
    except LaunchError as exc:
        print(f"epd demo: {exc}", file=sys.stderr)
        return 1
    failures = 0
    try:
        pids = ", ".join(f"{name}={p.pid}" for name, p in stack.processes.items())
        print(f"up in {time.perf_counter() - started:.1f} s: router {address} ({pids})\n", flush=True)
        print(f"{'request':<12} {'tokens':>6} {'ttft ms':>8} {'total ms':>9} {'ms/token':>8}  output")
        for name, result in asyncio.run(_send_all(address)):
            if isinstance(result, str):
                failures += 1
                print(f"{name:<12} FAILED {result}")
                continue
            print(
                f"{name:<12} {len(result.token_ids):>6} {result.ttft_s * 1e3:>8.1f} {result.total_s * 1e3:>9.1f} "
                f"{result.inter_token_s * 1e3:>8.2f}  {result.text!r}"
            )
        if stack.door_url:
            failures += _curl_the_door(stack.door_url, spec.model.name)
    finally:
        statuses = stack.down()  # services flush their spans on the way out
        print(f"\nstopped: {statuses}; logs in {spec.log_dir or spec.run_dir}", flush=True)
    if trace_file is not None and trace_file.exists():
        report_traces(trace_file)
    return 1 if failures else 0


def _curl_the_door(url: str, model: str) -> int:
    """One chat completion through the OpenAI door, sent as a user would, with curl; 1 on failure."""
    curl = shutil.which("curl")
    if curl is None:
        print("\nOpenAI door: curl is not installed; skipped", flush=True)
        return 0
    body = {"model": model, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}
    command = [
        curl,
        "-sS",
        "--fail-with-body",
        "-m",
        "60",
        f"{url}/chat/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(body),
    ]
    print(f"\nthrough the OpenAI door:\n$ {shlex.join(['curl', *command[1:]])}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    print(done.stdout.strip() or done.stderr.strip(), flush=True)
    return 0 if done.returncode == 0 else 1


def report_traces(trace_file: Path) -> None:
    from libs.telemetry.report import breakdowns, render_text
    from libs.telemetry.spans import by_trace, load_jsonl
    from libs.telemetry.waterfall import render

    spans = load_jsonl(trace_file)
    items = breakdowns(spans)
    print(f"\ntraces: {shown(trace_file)} ({len(spans)} spans); `epd trace report` prints this again\n")
    print(render_text(items), end="")
    if items:
        slowest = max(items, key=lambda b: b.ttft_s)
        for suffix in (".html", ".png"):
            out = trace_file.with_name("waterfall" + suffix)
            render(by_trace(spans)[slowest.trace_id], out)
        print(
            f"waterfall of the slowest request ({slowest.request_id}): {shown(trace_file.with_name('waterfall.html'))} "
            "(.png)"
        )
