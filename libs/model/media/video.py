"""Decode a video with PyAV the way transformers' reference reader does, frames picked by index.

Reference: transformers `video_utils.read_video_pyav`: the frame count is the stream's header count
(`stream.frames`), the rate its `average_rate`, frames are numbered in decode order and converted
with `to_ndarray(format="rgb24")`; the family's video processor picks the indices from that
metadata (`sample_frames`). Only the picked frames are kept, each resized as soon as it is decoded
(the resize is per frame, so this equals resizing the stacked clip).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import av
import torch

from libs.model.errors import InvalidMediaError, MediaLimitError
from libs.model.media.limits import MediaLimits
from libs.model.media.pixels import resize_bicubic


@dataclass(frozen=True)
class VideoSource:
    """What the reference's `VideoMetadata` holds before sampling."""

    total_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.fps


@dataclass(frozen=True)
class FramePlan:
    """Which source frames to keep, and the size (h, w) to resize them to."""

    indices: tuple[int, ...]
    height: int
    width: int


@dataclass
class DecodedVideo:
    source: VideoSource
    indices: tuple[int, ...]
    frames: torch.Tensor  # [T, 3, height, width] uint8, resized

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of source (`VideoMetadata.sampled_fps`)."""
        return len(self.indices) / self.source.total_frames * self.source.fps

    def timestamps_s(self) -> list[float]:
        """Source time of each kept frame: index / fps (`VideoMetadata.timestamps`)."""
        return [i / self.source.fps for i in self.indices]


def _count_frames(data: bytes) -> int:
    """Frame count of a stream whose header does not give one (WebM, some MKV): its video packets."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        return sum(1 for packet in container.demux(stream) if packet.size)


def _source(container: Any, data: bytes, limits: MediaLimits) -> VideoSource:
    if not container.streams.video:
        raise InvalidMediaError("no video stream", field="media.data")
    stream = container.streams.video[0]
    width, height = int(stream.width or 0), int(stream.height or 0)
    if width <= 0 or height <= 0:
        raise InvalidMediaError("video has no frame size", field="media.data")
    if width * height > limits.max_video_source_pixels:
        raise MediaLimitError(f"video frames are {width}x{height}", field="media.data")
    if not stream.average_rate or float(stream.average_rate) <= 0:
        raise InvalidMediaError("video has no frame rate", field="media.data")
    fps = float(stream.average_rate)
    total = int(stream.frames or 0) or _count_frames(data)
    if total <= 0:
        raise InvalidMediaError("video has no frames", field="media.data")
    source = VideoSource(total_frames=total, fps=fps, width=width, height=height)
    if total > limits.max_video_source_frames:
        raise MediaLimitError(f"video has {total} frames, limit {limits.max_video_source_frames}", field="media.data")
    if source.duration_s > limits.max_video_seconds:
        raise MediaLimitError(
            f"video is {source.duration_s:.1f} s, limit {limits.max_video_seconds} s", field="media.data"
        )
    return source


def read_video(data: bytes, limits: MediaLimits, plan: Callable[[VideoSource], FramePlan]) -> DecodedVideo:
    """Decode the frames `plan` picks from the source metadata, resized to the plan's size."""
    if len(data) > limits.max_media_bytes:
        raise MediaLimitError(f"video is {len(data)} bytes, limit {limits.max_media_bytes}", field="media.data")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            source = _source(container, data, limits)
            chosen = plan(source)
            if not chosen.indices or len(chosen.indices) > limits.max_video_frames:
                raise MediaLimitError(
                    f"{len(chosen.indices)} sampled frames, limit {limits.max_video_frames}", field="media.data"
                )
            if min(chosen.indices) < 0 or max(chosen.indices) >= source.total_frames:
                raise InvalidMediaError("frame index outside the video", field="media.data")
            wanted, last = set(chosen.indices), max(chosen.indices)
            decoded: dict[int, torch.Tensor] = {}
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index > last:
                    break
                if index in wanted:
                    rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).unsqueeze(0)
                    if tuple(rgb.shape[-2:]) != (source.height, source.width):
                        raise InvalidMediaError("video frame size changes mid-stream", field="media.data")
                    decoded[index] = resize_bicubic(rgb, chosen.height, chosen.width)
    except (InvalidMediaError, MediaLimitError):
        raise
    except Exception as exc:
        raise InvalidMediaError(f"cannot decode video: {exc}", field="media.data") from exc
    if len(decoded) != len(wanted):
        raise InvalidMediaError(
            f"video ended after {len(decoded)} of the {len(wanted)} sampled frames (header: {source.total_frames})",
            field="media.data",
        )
    # In index order, as the reference's `video[indices]` on the decoded clip.
    frames = torch.cat([decoded[i] for i in chosen.indices], dim=0)
    return DecodedVideo(source=source, indices=chosen.indices, frames=frames)
