"""CPU cost of each engine stage (a benchmark script, not a test; pytest does not collect it).

    .venv/bin/python tests/benchmarks/bench_engine.py --family qwen2_5_omni qwen2_5_vl qwen3_vl --sizes tiny small

Reports CPU time (process_time: all threads) and wall time per stage: encode per item, prefill per
500 prompt tokens, decode per token, and batched decode throughput at 1/4/8 sequences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from libs.model.checkpoints import FAMILIES, ensure_checkpoint
from libs.model.media import synthetic
from libs.model.types import ChatMessage, ChatRole, MediaInput, Modality, SamplingParams, TextPart
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner


def measure(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median (cpu_s, wall_s) of `repeat` runs after one warm-up."""
    fn()
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def prompt_of(runtime: LanguageModelRuntime, tokens: int) -> list[ChatMessage]:
    words = "the quick brown fox jumps over the lazy dog and the red car " * tokens
    ids = runtime.tokenizer.encode(words, add_special_tokens=False)[:tokens]
    return [ChatMessage(ChatRole.USER, (TextPart(runtime.tokenizer.decode(ids)),))]


def bench(family: str, size: str, repeat: int) -> list[str]:
    path = ensure_checkpoint(family, size)
    encoder = EncoderRunner(path)
    runtime = LanguageModelRuntime(path)
    prefill, decode = PrefillRunner(runtime), DecodeRunner(runtime)
    params = sum(p.numel() for p in encoder.module.parameters()) + sum(p.numel() for p in runtime.module.parameters())
    rows = [f"| {family}-{size} | parameters | {params / 1e6:.1f} M | |"]
    media = {
        Modality.IMAGE: MediaInput(Modality.IMAGE, synthetic.png_bytes(448, 336, seed=0)),
        Modality.VIDEO: MediaInput(Modality.VIDEO, synthetic.video_bytes(224, 168, frames=16, fps=4, seed=0)),
        Modality.AUDIO: MediaInput(Modality.AUDIO, synthetic.wav_bytes(10.0, seed=0)),
    }
    for modality in sorted(encoder.modalities, key=lambda m: m.value):
        item = media[modality]
        (encoded,) = encoder.encode([item])
        cpu, wall = measure(lambda item=item: encoder.encode([item]), repeat)
        rows.append(
            f"| {family}-{size} | encode 1 {modality.value} ({encoded.layout.placeholder_token_count} tokens) "
            f"| {cpu * 1e3:.1f} ms | {wall * 1e3:.1f} ms |"
        )
    messages = prompt_of(runtime, 500)
    n_prompt = len(prefill.build(messages).input_ids)
    cpu, wall = measure(lambda: prefill.prefill(messages, SamplingParams(max_tokens=2)), repeat)
    scale = 500 / n_prompt
    rows.append(
        f"| {family}-{size} | prefill per 500 tokens | {cpu * scale * 1e3:.1f} ms | {wall * scale * 1e3:.1f} ms |"
    )
    steps = 32
    for batch in (1, 4, 8):
        short = prompt_of(runtime, 64)

        def run_batch(batch: int = batch, short: list[ChatMessage] = short) -> int:
            sampling = SamplingParams(max_tokens=steps + 1)
            for i in range(batch):
                result = prefill.prefill(short, sampling)
                assert result.kv_cache is not None
                decode.add(str(i), result.kv_cache, result.decode_state, sampling)
            c0, w0 = time.process_time(), time.perf_counter()
            produced = sum(len(chunks) for chunks in decode.run().values())
            run_batch.cpu, run_batch.wall = time.process_time() - c0, time.perf_counter() - w0  # type: ignore[attr-defined]
            return produced

        run_batch()
        produced = run_batch()
        cpu, wall = run_batch.cpu, run_batch.wall  # type: ignore[attr-defined]
        if batch == 1:
            rows.append(
                f"| {family}-{size} | decode per token (1 sequence) "
                f"| {cpu / produced * 1e3:.2f} ms | {wall / produced * 1e3:.2f} ms |"
            )
        rows.append(
            f"| {family}-{size} | batched decode, {batch} sequences "
            f"| {produced / cpu:.0f} tok/s CPU | {produced / wall:.0f} tok/s wall |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # 1 keeps CPU figures honest on a shared, busy machine
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| checkpoint | stage | CPU time | wall time |\n|---|---|---|---|")
    for family in args.family:
        for size in args.sizes:
            for row in bench(family, size, args.repeat):
                print(row, flush=True)


if __name__ == "__main__":
    main()
