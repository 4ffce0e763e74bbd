"""Whisper tiny.en (trained weights) through the engine's E, P and D runners against the model's
own generate(): the token-equality table over the test utterances (one over 30 s, long-form) and
the word error rate of both over the Harvard sentences read by espeak-ng.

    .venv/bin/python -m tests.runtime.whisper_report [--sentences N] [--skip-table] [--services]

With `--services` the split side is a real E/P/D stack instead (router, encoder, prefill, decode,
each its own process, started with the project's launcher): every clip goes through the router
as a transcription request, all sent concurrently, and the stack is stopped before generate() runs.

Takes a few CPU minutes; `make test` runs a part of it (tests/runtime/test_whisper_staged.py,
tests/services/test_whisper_stack.py).
"""

from __future__ import annotations

import argparse
import io
import resource
import tempfile
import time
import wave
from collections.abc import Callable
from pathlib import Path

import torch

from libs.model.checkpoints.generate import ensure_converted
from tests.support.speech_corpus import HARVARD, UTTERANCES, utterance
from tests.support.speech_wer import corpus_wer
from tests.support.whisper_staged import WhisperStages, load_reference, reference_tokens


def _times(t0: float, c0: float, t1: float, c1: float, t2: float, c2: float, side: str) -> str:
    """Wall and CPU seconds of both sides (the CPU of this process: the services' own is not in it)."""
    return f"{side}: {t1 - t0:.1f} s wall, {c1 - c0:.1f} s CPU; generate(): {t2 - t1:.1f} s wall, {c2 - c1:.1f} s CPU"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Split = Callable[[dict[str, bytes]], dict[str, tuple[list[int], int | None]]]


def _staged(path: Path, begin: int) -> Split:
    """The engine's E, P and D runners in this process: each clip's tokens and window count."""
    stages = WhisperStages(path)

    def run(clips: dict[str, bytes]) -> dict[str, tuple[list[int], int | None]]:
        return {name: (t.tokens, len(t.windows)) for name, t in stages.transcribe(clips, begin).items()}

    return run


def _services(path: Path, run_dir: Path) -> Split:
    """A real Whisper E/P/D stack per call: every clip through the router, concurrently; the
    window count from the router's `epd.transcribe.window` spans."""
    from libs.client.transcribe import audio_item, transcription_request
    from libs.launch.stack import Stack, StackSpec
    from libs.telemetry.spans import load_jsonl
    from tests.support.stacks import run_requests

    def run(clips: dict[str, bytes]) -> dict[str, tuple[list[int], int | None]]:
        spans = run_dir / f"spans-{len(list(run_dir.glob('spans-*')))}.jsonl"
        env = {"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(spans.resolve())}
        spec = StackSpec(layout="e/p/d", encoders=1, model=path, run_dir=run_dir, env=env)
        names = list(clips)
        with Stack(spec).running() as stack:
            requests = [transcription_request(audio_item(clips[n], item_id=n), request_id=n) for n in names]
            results = run_requests(stack.address, requests, timeout_s=1800.0)
        assert all(r.finish_reason == "FINISH_REASON_STOP" for r in results), [r.finish_reason for r in results]
        recorded = load_jsonl(spans)
        roots = {s.trace_id: s.attributes["epd.request_id"] for s in recorded if "epd.request_id" in s.attributes}
        windows = [roots.get(s.trace_id) for s in recorded if s.name == "epd.transcribe.window"]
        return {n: (r.token_ids, windows.count(n) or None) for n, r in zip(names, results, strict=True)}

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=len(HARVARD))
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--services", action="store_true", help="the split side through a real E/P/D stack")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = ensure_converted()
    model, processor = load_reference(path)
    begin = processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    transcribe = (
        _services(path, Path(tempfile.mkdtemp(prefix="whisper-report-"))) if args.services else _staged(path, begin)
    )
    side = "E/P/D services" if args.services else "E/P/D runners"
    decode = processor.tokenizer.decode

    if not args.skip_table:
        clips = {name: utterance(text, wpm) for name, (text, wpm) in UTTERANCES.items()}
        t0, c0 = time.monotonic(), _cpu_s()
        split = transcribe(clips)
        t1, c1 = time.monotonic(), _cpu_s()
        reference = {name: reference_tokens(model, processor, data) for name, data in clips.items()}
        t2, c2 = time.monotonic(), _cpu_s()
        print(f"{side} against generate():")
        print("| utterance | seconds | windows | tokens | generate() tokens | equal to generate() |")
        print("|---|---|---|---|---|---|")
        for name, data in clips.items():
            with wave.open(io.BytesIO(data)) as wav:
                seconds = wav.getnframes() / wav.getframerate()
            tokens, windows = split[name]
            print(
                f"| {name} | {seconds:.1f} | {windows if windows is not None else '?'} | {len(tokens)} | "
                f"{len(reference[name])} | {'yes' if tokens == reference[name] else 'NO'} |"
            )
        print(_times(t0, c0, t1, c1, t2, c2, side))
        for name in clips:
            print(f"  {name}: {decode(split[name][0], skip_special_tokens=True).strip()!r}")

    sentences = HARVARD[: args.sentences]
    clips = {f"h{i:02d}": utterance(text) for i, text in enumerate(sentences)}
    t0, c0 = time.monotonic(), _cpu_s()
    split = transcribe(clips)
    t1, c1 = time.monotonic(), _cpu_s()
    reference = {name: reference_tokens(model, processor, data) for name, data in clips.items()}
    t2, c2 = time.monotonic(), _cpu_s()
    ours = [decode(split[name][0], skip_special_tokens=True) for name in clips]
    theirs = [decode(reference[name], skip_special_tokens=True) for name in clips]
    equal = sum(split[name][0] == reference[name] for name in clips)
    print(f"\nWER over {len(sentences)} Harvard sentences (espeak-ng, 160 wpm; Whisper's English normalizer):")
    print(f"  {side + ':':<16}{corpus_wer(list(zip(sentences, ours, strict=True))):.4f}")
    print(f"  {'generate():':<16}{corpus_wer(list(zip(sentences, theirs, strict=True))):.4f}")
    print(f"  token-identical transcripts: {equal}/{len(sentences)}")
    print(_times(t0, c0, t1, c1, t2, c2, side))
    for text, hyp in zip(sentences, ours, strict=True):
        print(f"  {text!r} -> {hyp.strip()!r}")


if __name__ == "__main__":
    main()
