"""Load on a running stack: `workers` clients sending requests back to back, each with a new image."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
from PIL import Image

from libs.client.generate import build_request, generate, open_channel
from libs.contract.epd.v1 import media_pb2, sampling_pb2


def png_image(seed: int) -> media_pb2.MediaItem:
    """A 64x64 PNG of random pixels: a new seed, new content (no cache hit, no affinity)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=buffer.getvalue())


class Load:
    """`workers` clients sending requests (a new image each) back to back until stopped."""

    def __init__(self, address: str, workers: int = 3) -> None:
        self.address = address
        self.workers = workers
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._seed = 10_000
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive()

    async def _run(self) -> None:
        async with open_channel(self.address) as channel:

            async def worker() -> None:
                while not self._stop.is_set():
                    self._seed += 1
                    request = build_request(
                        "Describe it.", [png_image(self._seed)], sampling=sampling_pb2.SamplingParams(max_tokens=4)
                    )
                    try:
                        result = await generate(channel, request, timeout_s=60)
                        assert len(result.token_ids) == 4, result
                        self.done += 1
                    except Exception as exc:  # any failure counts, whatever its kind
                        self.failures.append(repr(exc))

            await asyncio.gather(*(worker() for _ in range(self.workers)))
