"""Decode an audio clip the way transformers' reference loader does, with hard limits.

Reference: `transformers.audio_utils.load_audio(..., backend="soundfile")` (5.23: `_load_audio_soundfile`;
5.19: `backend="librosa"`, i.e. `librosa.load`, which it documents as identical): decode with soundfile
as float32, average the channels, resample with soxr at quality "soxr_hq", then pad or trim to
ceil(n * rate / source_rate) samples. Containers libsndfile cannot read (MP4/M4A/AAC, WebM...) are
decoded with PyAV instead and then go through the same channel average and soxr resampling (the
reference would need torchcodec for those and refuses them without it).
"""

from __future__ import annotations

import io
import math

import av
import numpy as np
import soundfile as sf  # type: ignore[import-untyped]
import soxr  # type: ignore[import-untyped]

from libs.model.errors import InvalidMediaError, MediaLimitError
from libs.model.media.limits import MediaLimits

RESAMPLE_QUALITY = "soxr_hq"  # what the reference passes to soxr.resample


def decode_audio(data: bytes, sampling_rate: int, limits: MediaLimits) -> np.ndarray:
    """Mono float32 samples at `sampling_rate`; refuses clips over the byte, duration, channel or
    source-rate limits before their samples are decoded."""
    if len(data) > limits.max_media_bytes:
        raise MediaLimitError(f"audio is {len(data)} bytes, limit {limits.max_media_bytes}", field="media.data")
    try:
        opened = sf.SoundFile(io.BytesIO(data))
    except Exception:  # not a container libsndfile reads (or a header it rejects): PyAV decodes it
        channels_first, source_rate = _read_pyav(data, limits)
    else:
        with opened:
            channels_first, source_rate = _read_soundfile(opened, limits)
    if channels_first.shape[1] == 0:
        raise InvalidMediaError("audio has no samples", field="media.data")
    try:
        return to_mono_at_rate(channels_first, source_rate, sampling_rate)
    except Exception as exc:  # soxr refuses a pathological rate
        raise InvalidMediaError(f"cannot resample audio: {exc}", field="media.data") from exc


def to_mono_at_rate(channels_first: np.ndarray, source_rate: int, sampling_rate: int) -> np.ndarray:
    """The reference's steps after decoding, on a float32 [channels, samples] array."""
    # Same expression as the reference: float32 mean over a channels-first view (not a sum, not a
    # weighted downmix), so the result is bit-identical.
    waveform = channels_first.mean(axis=0) if channels_first.shape[0] > 1 else channels_first[0]
    if source_rate != sampling_rate:
        num_samples = math.ceil(waveform.shape[-1] * sampling_rate / source_rate)
        waveform = soxr.resample(waveform, source_rate, sampling_rate, quality=RESAMPLE_QUALITY)
        waveform = np.pad(waveform, (0, max(0, num_samples - len(waveform))))[:num_samples]
    return np.ascontiguousarray(waveform, dtype=np.float32)


def _check_header(channels: int, rate: int, seconds: float, limits: MediaLimits) -> None:
    if channels <= 0 or rate <= 0:
        raise InvalidMediaError(f"audio declares {channels} channels at {rate} Hz", field="media.data")
    if channels > limits.max_audio_channels:
        raise MediaLimitError(f"audio has {channels} channels, limit {limits.max_audio_channels}", field="media.data")
    if rate > limits.max_audio_source_rate:
        raise MediaLimitError(
            f"audio is sampled at {rate} Hz, limit {limits.max_audio_source_rate}", field="media.data"
        )
    if seconds > limits.max_audio_seconds:
        raise MediaLimitError(f"audio is {seconds:.1f} s, limit {limits.max_audio_seconds} s", field="media.data")


def _read_soundfile(f: sf.SoundFile, limits: MediaLimits) -> tuple[np.ndarray, int]:
    rate, channels = int(f.samplerate), int(f.channels)
    _check_header(channels, rate, f.frames / rate if rate > 0 else 0.0, limits)
    max_frames = int(limits.max_audio_seconds * rate)
    try:
        # Bounded read: a header that understates its length cannot make us decode more.
        samples = f.read(frames=max_frames + 1, dtype="float32", always_2d=True)
    except Exception as exc:
        raise InvalidMediaError(f"cannot decode audio: {exc}", field="media.data") from exc
    if samples.shape[0] > max_frames:
        raise MediaLimitError(f"audio longer than {limits.max_audio_seconds} s", field="media.data")
    return samples.T, rate


def _read_pyav(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, int]:
    chunks: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InvalidMediaError("no audio stream", field="media.data")
            stream = container.streams.audio[0]
            rate, channels = int(stream.rate or 0), int(stream.channels or 0)
            _check_header(channels, rate, 0.0, limits)
            max_frames = int(limits.max_audio_seconds * rate)
            # Only the sample format changes (to planar float32): no remix, no rate change, so the
            # reference's channel average and soxr resampling apply to the decoded signal as is.
            to_float = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            total = 0
            for frame in container.decode(stream):
                for out in to_float.resample(frame):
                    chunks.append(out.to_ndarray().reshape(channels, -1))
                    total += chunks[-1].shape[1]
                if total > max_frames:
                    raise MediaLimitError(f"audio longer than {limits.max_audio_seconds} s", field="media.data")
            for out in to_float.resample(None):
                chunks.append(out.to_ndarray().reshape(channels, -1))
    except (InvalidMediaError, MediaLimitError):
        raise
    except Exception as exc:
        raise InvalidMediaError(f"cannot decode audio: {exc}", field="media.data") from exc
    if not chunks:
        raise InvalidMediaError("audio has no samples", field="media.data")
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), rate
