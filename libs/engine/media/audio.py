"""Decode an audio clip with PyAV into 16 kHz-style mono float32 samples."""

from __future__ import annotations

import io

import av
import numpy as np

from libs.engine.errors import InvalidMediaError, MediaLimitError
from libs.engine.media.limits import MediaLimits


def decode_audio(data: bytes, sampling_rate: int, limits: MediaLimits) -> np.ndarray:
    """Return mono float32 samples at `sampling_rate`; refuse clips over the duration limit."""
    if len(data) > limits.max_media_bytes:
        raise MediaLimitError(f"audio is {len(data)} bytes, limit {limits.max_media_bytes}", field="media.data")
    max_samples = int(limits.max_audio_seconds * sampling_rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InvalidMediaError("no audio stream", field="media.data")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    chunks.append(samples)
                    total += samples.size
                if total > max_samples:
                    raise MediaLimitError(f"audio longer than {limits.max_audio_seconds} s", field="media.data")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except (InvalidMediaError, MediaLimitError):
        raise
    except Exception as exc:
        raise InvalidMediaError(f"cannot decode audio: {exc}", field="media.data") from exc
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InvalidMediaError("audio has no samples", field="media.data")
    if samples.size > max_samples:
        raise MediaLimitError(f"audio longer than {limits.max_audio_seconds} s", field="media.data")
    return samples
