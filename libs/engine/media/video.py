"""Decode a video with PyAV and sample frames at real timestamps."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import av
from PIL import Image

from libs.engine.errors import InvalidMediaError, MediaLimitError
from libs.engine.media.limits import MediaLimits


@dataclass
class SampledVideo:
    frames: list[Image.Image]
    timestamps_s: list[float]  # presentation time of each sampled frame in the source
    duration_s: float
    frame_interval_s: float  # spacing of the sampling grid


def _duration_s(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000.0
    return None


def _frame_time(frame: Any, index: int, rate: float) -> float:
    return float(frame.time) if frame.time is not None else index / rate


def sample_video(data: bytes, *, fps: float, max_frames: int, frame_multiple: int, limits: MediaLimits) -> SampledVideo:
    """Sample about `fps` frames per second, evenly over the clip, as a multiple of `frame_multiple`."""
    if len(data) > limits.max_media_bytes:
        raise MediaLimitError(f"video is {len(data)} bytes, limit {limits.max_media_bytes}", field="media.data")
    max_frames = min(max_frames, limits.max_video_frames)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidMediaError("no video stream", field="media.data")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > limits.max_video_source_pixels:
                raise MediaLimitError(f"video frames are {width}x{height}", field="media.data")
            rate = float(stream.average_rate or 25)
            duration = _duration_s(container, stream)
            if duration is None or duration <= 0:
                raise InvalidMediaError("video has no duration", field="media.data")
            if duration > limits.max_video_seconds:
                raise MediaLimitError(
                    f"video is {duration:.1f} s, limit {limits.max_video_seconds} s", field="media.data"
                )
            count = max(frame_multiple, min(max_frames, round(duration * fps)))
            count -= count % frame_multiple
            if count <= 0:
                raise MediaLimitError("video_max_frames is below the temporal patch size", field="media.data")
            interval = duration / count
            targets = [k * interval for k in range(count)]
            frames: list[Image.Image] = []
            times: list[float] = []
            for index, frame in enumerate(container.decode(stream)):
                t = _frame_time(frame, index, rate)
                if t > limits.max_video_seconds:
                    raise MediaLimitError("video longer than the limit", field="media.data")
                # One decoded frame may serve several targets when the source fps is low.
                while len(frames) < count and t + 0.5 / rate >= targets[len(frames)]:
                    frames.append(frame.to_image().convert("RGB"))  # type: ignore[no-untyped-call]
                    times.append(t)
                if len(frames) == count:
                    break
    except (InvalidMediaError, MediaLimitError):
        raise
    except Exception as exc:
        raise InvalidMediaError(f"cannot decode video: {exc}", field="media.data") from exc
    if not frames:
        raise InvalidMediaError("video has no decodable frames", field="media.data")
    while len(frames) < count:  # stream ended early: repeat the last frame
        frames.append(frames[-1])
        times.append(times[-1])
    return SampledVideo(frames=frames, timestamps_s=times, duration_s=duration, frame_interval_s=interval)
