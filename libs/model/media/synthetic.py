"""Small deterministic media, for start-up spec measurement, tests and benchmarks."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
from PIL import Image


def png_bytes(width: int, height: int, *, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def video_bytes(width: int, height: int, *, frames: int, fps: int, seed: int) -> bytes:
    """An MPEG-4 part 2 clip in MP4 (the codec every PyAV build carries)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def wav_bytes(seconds: float, *, seed: int, rate: int = 16000, freq: float = 440.0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.4 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def audio_bytes(
    seconds: float, *, seed: int, rate: int = 16000, channels: int = 1, fmt: str = "WAV", subtype: str | None = None
) -> bytes:
    """A clip in any container libsndfile writes (WAV, FLAC, OGG...), one distinct tone per channel."""
    import soundfile as sf  # type: ignore[import-untyped]

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = [0.3 * np.sin(2 * np.pi * (220.0 * (c + 1)) * t) for c in range(channels)]
    signal = np.stack(tones, axis=1) + 0.05 * rng.standard_normal((t.size, channels))
    buf = io.BytesIO()
    sf.write(buf, np.clip(signal, -1, 1).astype(np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def m4a_bytes(seconds: float, *, seed: int, rate: int = 44100, channels: int = 2) -> bytes:
    """AAC in MP4: a container libsndfile cannot read (decoded with PyAV)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    signal = (0.3 * np.sin(2 * np.pi * 330.0 * np.arange(n) / rate))[None, :] + 0.05 * rng.standard_normal(
        (channels, n)
    )
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="stereo" if channels == 2 else "mono")
        frame = av.AudioFrame.from_ndarray(signal.astype(np.float32), format="fltp", layout=stream.layout.name)
        frame.rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()
