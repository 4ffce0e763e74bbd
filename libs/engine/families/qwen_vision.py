"""Qwen-style vision preprocessing shared by the Qwen families: images through the Pillow image
processor, videos sampled with PyAV and patchified by our own code (no torchvision)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from libs.engine.checkpoint import Checkpoint
from libs.engine.errors import InvalidMediaError, InvalidRequestError, MediaLimitError
from libs.engine.media.image import decode_image
from libs.engine.media.limits import MediaLimits
from libs.engine.media.video import sample_video
from libs.engine.types import ImageLayout, ProcessorOptions, VideoLayout

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoDefaults:
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    fps: float = 2.0
    max_frames: int = 768


class QwenVisionPreprocessor:
    def __init__(self, checkpoint: Checkpoint, *, patch_size: int, merge_size: int, temporal_patch_size: int) -> None:
        cfg = checkpoint.json_file("preprocessor_config.json")
        size = cfg.get("size") or {}
        self.min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.mean = tuple(cfg.get("image_mean") or _CLIP_MEAN)
        self.std = tuple(cfg.get("image_std") or _CLIP_STD)
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.image_processor = Qwen2VLImageProcessorPil(
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            patch_size=patch_size,
            merge_size=merge_size,
            temporal_patch_size=temporal_patch_size,
            image_mean=list(self.mean),
            image_std=list(self.std),
        )
        vcfg = checkpoint.json_file("video_preprocessor_config.json")
        vsize = vcfg.get("size") or {}
        base = VideoDefaults()
        self.video_defaults = VideoDefaults(
            min_pixels=int(vcfg.get("min_pixels") or vsize.get("shortest_edge") or base.min_pixels),
            max_pixels=int(vcfg.get("max_pixels") or vsize.get("longest_edge") or base.max_pixels),
            fps=float(vcfg.get("fps") or base.fps),
            max_frames=int(vcfg.get("max_frames") or base.max_frames),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def _pixel_bounds(
        self, options: ProcessorOptions, default_min: int, default_max: int, limits: MediaLimits
    ) -> tuple[int, int]:
        lo = options.min_pixels if options.min_pixels is not None else default_min
        hi = options.max_pixels if options.max_pixels is not None else default_max
        if hi > limits.max_resized_pixels:
            raise MediaLimitError(
                f"max_pixels {hi} exceeds the limit {limits.max_resized_pixels}", field="processor_options.max_pixels"
            )
        if lo <= 0 or hi < lo:
            raise InvalidRequestError(f"bad pixel bounds [{lo}, {hi}]", field="processor_options.min_pixels")
        return lo, hi

    def image(self, data: bytes, options: ProcessorOptions, limits: MediaLimits) -> tuple[torch.Tensor, ImageLayout]:
        lo, hi = self._pixel_bounds(options, self.min_pixels, self.max_pixels, limits)
        image = decode_image(data, limits)
        try:
            out: Any = self.image_processor(
                images=[image], size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="pt"
            )
        except ValueError as exc:  # e.g. an extreme aspect ratio
            raise InvalidMediaError(f"cannot preprocess image: {exc}", field="media.data") from exc
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"], ImageLayout(grid_t=t, grid_h=h, grid_w=w)

    def video(
        self, data: bytes, options: ProcessorOptions, limits: MediaLimits, *, mean_patch_times: bool = False
    ) -> tuple[torch.Tensor, VideoLayout]:
        """Pixels and layout of a video. `grid_timestamps_s` holds each temporal patch's first frame
        time, or with `mean_patch_times` the mean of its first and last frame (the Qwen3-VL prompt
        timestamps)."""
        lo, hi = self._pixel_bounds(options, self.video_defaults.min_pixels, self.video_defaults.max_pixels, limits)
        fps = options.video_fps if options.video_fps is not None else self.video_defaults.fps
        max_frames = (
            options.video_max_frames if options.video_max_frames is not None else self.video_defaults.max_frames
        )
        if fps <= 0:
            raise InvalidRequestError("video_fps must be > 0", field="processor_options.video_fps")
        if max_frames > limits.max_video_frames:
            raise MediaLimitError(
                f"video_max_frames {max_frames} exceeds {limits.max_video_frames}",
                field="processor_options.video_max_frames",
            )
        tp = self.temporal_patch_size
        sampled = sample_video(data, fps=fps, max_frames=max_frames, frame_multiple=tp, limits=limits)
        pixels, (grid_t, grid_h, grid_w) = self.patchify_frames(sampled.frames, lo, hi)
        layout = VideoLayout(
            grid_t=grid_t,
            grid_h=grid_h,
            grid_w=grid_w,
            seconds_per_grid=tp * sampled.frame_interval_s,
            grid_timestamps_s=_patch_times(sampled.timestamps_s, tp, mean_patch_times),
            sampled_frames=len(sampled.frames),
        )
        return pixels, layout

    def patchify_frames(
        self, frames: list[Image.Image], min_pixels: int, max_pixels: int
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Resize every frame like an image, normalise, and cut [grid_t*grid_h*grid_w, C*tp*p*p] patches
        in the order the Qwen vision towers expect."""
        width, height = frames[0].size
        try:
            rh, rw = smart_resize(height, width, factor=self.factor, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as exc:
            raise InvalidMediaError(f"cannot preprocess video: {exc}", field="media.data") from exc
        mean = np.asarray(self.mean, dtype=np.float32).reshape(3, 1, 1)
        std = np.asarray(self.std, dtype=np.float32).reshape(3, 1, 1)
        arrays = []
        for frame in frames:
            resized = frame.resize((rw, rh), resample=Image.Resampling.BICUBIC)
            chw = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
            arrays.append((chw - mean) / std)
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        while len(arrays) % tp:
            arrays.append(arrays[-1])
        video = np.stack(arrays)  # [T, C, H, W]
        channels = video.shape[1]
        grid_t, grid_h, grid_w = video.shape[0] // tp, rh // p, rw // p
        patches = video.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
        return torch.from_numpy(np.ascontiguousarray(flat)), (grid_t, grid_h, grid_w)


def _patch_times(times: list[float], tp: int, mean: bool) -> tuple[float, ...]:
    times = times + [times[-1]] * (-len(times) % tp)
    return tuple((times[i] + times[i + tp - 1]) / 2 if mean else times[i] for i in range(0, len(times), tp))


def vision_position_offsets(
    grid_t: int, grid_h: int, grid_w: int, merge_size: int, t_index: torch.Tensor
) -> torch.Tensor:
    """[3, n] (t, h, w) offsets of a merged vision grid; `t_index` gives the t value per temporal patch."""
    llm_h, llm_w = grid_h // merge_size, grid_w // merge_size
    t = t_index.view(-1, 1).expand(-1, llm_h * llm_w).flatten()
    h = torch.arange(llm_h).view(1, -1, 1).expand(grid_t, -1, llm_w).flatten()
    w = torch.arange(llm_w).view(1, 1, -1).expand(grid_t, llm_h, -1).flatten()
    return torch.stack([t, h, w])


def build_mrope(
    input_len: int, spans: list[tuple[int, torch.Tensor]], *, spatial_advance: bool = False
) -> tuple[torch.Tensor, int]:
    """Positions [3, input_len]: text advances by one; an item at `start` with offsets [3, n] sits at
    next_position + offsets. Text after it resumes at the item's max + 1, or, with `spatial_advance`
    (transformers-5 Qwen2.5-VL / Qwen3-VL), at next_position + max(merged h, merged w), whatever the
    temporal extent. Returns (positions, rope_delta = max position + 1 - input_len)."""
    pieces: list[torch.Tensor] = []
    cursor = 0
    next_pos = 0
    for start, offsets in sorted(spans, key=lambda s: s[0]):
        if start > cursor:
            pieces.append(torch.arange(next_pos, next_pos + start - cursor).view(1, -1).expand(3, -1))
            next_pos += start - cursor
        placed = offsets + next_pos
        pieces.append(placed)
        next_pos = next_pos + int(offsets[1:].max()) + 1 if spatial_advance else int(placed.max()) + 1
        cursor = start + offsets.shape[1]
    if cursor < input_len:
        pieces.append(torch.arange(next_pos, next_pos + input_len - cursor).view(1, -1).expand(3, -1))
    positions = torch.cat(pieces, dim=1).long() if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - input_len if input_len else 0
    return positions, delta
