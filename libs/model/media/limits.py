"""Configurable input limits; the defaults keep one request from exhausting a worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    max_media_bytes: int = 64 * 1024 * 1024
    # Source images larger than this are refused before their pixels are decoded
    # (decompression-bomb guard: a tiny PNG can declare a gigapixel canvas).
    max_source_pixels: int = 40_000_000
    # Upper bound a request may ask for as the resized area (ProcessorOptions.max_pixels).
    max_resized_pixels: int = 16_777_216
    max_video_frames: int = 768  # sampled frames
    max_video_seconds: float = 600.0
    max_video_source_pixels: int = 8_294_400  # per frame (4K UHD)
    # Frames decoded to reach the sampled ones are work too: 600 s at 120 fps.
    max_video_source_frames: int = 72_000
    max_audio_seconds: float = 30.0  # the Whisper-style feature extractor covers 30 s
    # Encoder-decoder speech models (Whisper) transcribe longer clips, one 30 s window at a time.
    max_speech_seconds: float = 600.0
    # Decoded audio is channels x rate x seconds floats: bound the first two from the header too
    # (a small FLAC of silence can declare hundreds of channels).
    max_audio_channels: int = 16
    max_audio_source_rate: int = 384_000
