"""Which frames a Qwen video processor samples, the size it resizes them to, and their timestamps.

Transcribed from transformers 5.19-5.23 (identical in both):
- `Qwen2VLVideoProcessor.sample_frames` / `.resize` (video_processing_qwen2_vl.py; Qwen2.5-VL and
  Qwen2.5-Omni): frame count from fps, clamped to [min_frames, max_frames] and floored to a multiple
  of the temporal patch, indices `arange(0, total, total / n).int()`; each frame resized on its own
  pixel budget (`smart_resize`, `cap_pixels_per_frame` unset = off).
- `Qwen3VLVideoProcessor.sample_frames` / `.resize` (video_processing_qwen3_vl.py): `int(n)` frames
  clamped the same way but not to a multiple, indices `linspace(0, total - 1, n).round()`; the
  pixel budget counts all frames (its own `smart_resize(num_frames, h, w)`).
- `Qwen3VLProcessor._calculate_timestamps` (processing_qwen3_vl.py): frame times index / fps, the
  last repeated to fill the final temporal patch, each patch stamped with the mean of its first
  and last frame time.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as per_frame_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as per_clip_resize

from libs.model.errors import InvalidMediaError
from libs.model.families.qwen_settings import VideoSettings
from libs.model.media.video import FramePlan, VideoSource


def qwen2_vl_indices(source: VideoSource, fps: float, settings: VideoSettings, max_frames: int) -> tuple[int, ...]:
    total, tp = source.total_frames, settings.temporal_patch_size
    cap = math.floor(min(max_frames, total) / tp) * tp
    count = min(max(total / source.fps * fps, settings.min_frames), cap, total)
    count = math.floor(count / tp) * tp
    if count <= 0:
        raise InvalidMediaError(
            f"video has {total} frames; at least {tp} are needed (temporal patch) within video_max_frames",
            field="media.data",
        )
    # Same float32 arange as the reference, so truncation lands on the same indices.
    return tuple(int(i) for i in torch.arange(0, total, total / count).int().tolist())


def qwen3_vl_indices(source: VideoSource, fps: float, settings: VideoSettings, max_frames: int) -> tuple[int, ...]:
    total = source.total_frames
    count = min(max(int(total / source.fps * fps), settings.min_frames), max_frames, total)
    if count <= 0:
        raise InvalidMediaError("video_max_frames leaves no frame to sample", field="processor_options")
    return tuple(int(i) for i in np.linspace(0, total - 1, count).round().astype(int).tolist())


def frame_plan(source: VideoSource, fps: float, settings: VideoSettings, max_frames: int) -> FramePlan:
    """The frames to keep and their resized (height, width), by the settings' processor style."""
    try:
        if settings.style == "qwen3_vl":
            indices = qwen3_vl_indices(source, fps, settings, max_frames)
            height, width = per_clip_resize(
                len(indices),
                source.height,
                source.width,
                temporal_factor=settings.temporal_patch_size,
                factor=settings.factor,
                min_pixels=settings.min_pixels,
                max_pixels=settings.max_pixels,
            )
        else:
            indices = qwen2_vl_indices(source, fps, settings, max_frames)
            height, width = per_frame_resize(
                source.height,
                source.width,
                factor=settings.factor,
                min_pixels=settings.min_pixels,
                max_pixels=settings.max_pixels,
            )
    except ValueError as exc:  # too few frames for a temporal patch, extreme aspect ratio
        raise InvalidMediaError(f"cannot preprocess video: {exc}", field="media.data") from exc
    return FramePlan(indices=indices, height=int(height), width=int(width))


def patch_timestamps(times: list[float], temporal_patch: int, *, mean: bool) -> tuple[float, ...]:
    """One time per temporal patch: its first frame's, or (Qwen3-VL) the mean of its first and last."""
    times = times + [times[-1]] * (-len(times) % temporal_patch)
    return tuple(
        (times[i] + times[i + temporal_patch - 1]) / 2 if mean else times[i]
        for i in range(0, len(times), temporal_patch)
    )
