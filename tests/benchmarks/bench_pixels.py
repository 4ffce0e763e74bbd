"""CPU per image from JPEG bytes to what each encoder hands on, decoded pixels kept channels last (as
`libs/model/media/pixels.py` does) against a channels-first copy first (the processors' own
layout, the project's earlier layout), interleaved in one run: the reference encoder's tower
rows (normalized patches) and the vLLM encoder's [H, W, 3] uint8 resized pixels.

    .venv/bin/python tests/benchmarks/bench_pixels.py [--images 50] [--rounds 7]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from libs.model.media import pixels
from libs.model.media.image import decode_image
from libs.model.media.limits import MediaLimits

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def channels_first(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def cpu_ms_per_image(jpegs: list[bytes], to_chw: Callable[[Image.Image], torch.Tensor], side: int, vllm: bool) -> float:
    limits = MediaLimits()
    start = time.process_time()
    for data in jpegs:
        resized = pixels.resize_bicubic(to_chw(decode_image(data, limits)).unsqueeze(0), side, side)
        if vllm:
            resized[0].permute(1, 2, 0).contiguous().numpy()
        else:
            pixels.patchify(pixels.normalize(resized, MEAN, STD), 14, 2, 2)
    return (time.process_time() - start) / len(jpegs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=50, help="distinct 224x224 JPEGs")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per layout")
    ns = parser.parse_args()
    torch.set_num_threads(1)  # as the encoders' preparing threads run
    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(ns.images):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(out, "JPEG")
        jpegs.append(out.getvalue())
    print("| target | encoder | channels first (ms/image) | channels last | ratio |\n|---|---|---|---|---|")
    for side in (112, 224):  # the tiny checkpoints' grid, and a 224x224 image unresized
        for vllm in (False, True):
            runs: dict[str, list[float]] = {"first": [], "last": []}
            for _ in range(ns.rounds):
                runs["first"].append(cpu_ms_per_image(jpegs, channels_first, side, vllm))
                runs["last"].append(cpu_ms_per_image(jpegs, pixels.image_to_chw, side, vllm))
            first, last = statistics.median(runs["first"]), statistics.median(runs["last"])
            name = "vLLM" if vllm else "reference"
            print(f"| {side}x{side} | {name} | {first:.3f} | {last:.3f} | {last / first:.2f} |")


if __name__ == "__main__":
    main()
