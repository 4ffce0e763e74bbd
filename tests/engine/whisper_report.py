"""Whisper tiny.en (trained weights) through the engine's E, P and D runners against the model's
own generate(): the token-equality table over the test utterances (one over 30 s, long-form) and
the word error rate of both over the Harvard sentences read by espeak-ng.

    .venv/bin/python -m tests.engine.whisper_report [--sentences N] [--skip-table]

Takes a few CPU minutes; `make test` runs a part of it (tests/engine/test_whisper_staged.py).
"""

from __future__ import annotations

import argparse
import io
import resource
import time
import wave

import torch

from libs.engine.checkpoints.generate import ensure_converted
from tests.engine.whisper_staged import WhisperStages, load_reference, reference_tokens
from tests.speech_corpus import HARVARD, UTTERANCES, utterance
from tests.speech_wer import corpus_wer


def _times(t0: float, c0: float, t1: float, c1: float, t2: float, c2: float) -> str:
    return f"E/P/D: {t1 - t0:.1f} s wall, {c1 - c0:.1f} s CPU; generate(): {t2 - t1:.1f} s wall, {c2 - c1:.1f} s CPU"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=len(HARVARD))
    parser.add_argument("--skip-table", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = ensure_converted()
    model, processor = load_reference(path)
    stages = WhisperStages(path)
    begin = processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    decode = processor.tokenizer.decode

    if not args.skip_table:
        clips = {name: utterance(text, wpm) for name, (text, wpm) in UTTERANCES.items()}
        t0, c0 = time.monotonic(), _cpu_s()
        split = stages.transcribe(clips, begin)
        t1, c1 = time.monotonic(), _cpu_s()
        reference = {name: reference_tokens(model, processor, data) for name, data in clips.items()}
        t2, c2 = time.monotonic(), _cpu_s()
        print("| utterance | seconds | windows | tokens | equal to generate() |")
        print("|---|---|---|---|---|")
        for name, data in clips.items():
            with wave.open(io.BytesIO(data)) as wav:
                seconds = wav.getnframes() / wav.getframerate()
            ours = split[name].tokens
            print(
                f"| {name} | {seconds:.1f} | {len(split[name].windows)} | {len(ours)} | "
                f"{'yes' if ours == reference[name] else 'NO'} |"
            )
        print(_times(t0, c0, t1, c1, t2, c2))
        for name in clips:
            print(f"  {name}: {decode(split[name].tokens, skip_special_tokens=True).strip()!r}")

    sentences = HARVARD[: args.sentences]
    clips = {f"h{i:02d}": utterance(text) for i, text in enumerate(sentences)}
    t0, c0 = time.monotonic(), _cpu_s()
    split = stages.transcribe(clips, begin)
    t1, c1 = time.monotonic(), _cpu_s()
    reference = {name: reference_tokens(model, processor, data) for name, data in clips.items()}
    t2, c2 = time.monotonic(), _cpu_s()
    ours = [decode(split[name].tokens, skip_special_tokens=True) for name in clips]
    theirs = [decode(reference[name], skip_special_tokens=True) for name in clips]
    equal = sum(split[name].tokens == reference[name] for name in clips)
    print(f"\nWER over {len(sentences)} Harvard sentences (espeak-ng, 160 wpm; Whisper's English normalizer):")
    print(f"  E/P/D runners: {corpus_wer(list(zip(sentences, ours, strict=True))):.4f}")
    print(f"  generate():    {corpus_wer(list(zip(sentences, theirs, strict=True))):.4f}")
    print(f"  token-identical transcripts: {equal}/{len(sentences)}")
    print(_times(t0, c0, t1, c1, t2, c2))
    for text, hyp in zip(sentences, ours, strict=True):
        print(f"  {text!r} -> {hyp.strip()!r}")


if __name__ == "__main__":
    main()
