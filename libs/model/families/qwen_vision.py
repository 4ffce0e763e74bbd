"""Qwen vision preprocessing shared by the Qwen families, equal to the families' default transformers
processors (the torchvision "fast" `Qwen2VLImageProcessor`, `Qwen2VLVideoProcessor`,
`Qwen3VLVideoProcessor`) without torchvision: decoding in `libs.model.media`, settings in
`qwen_settings`, frame choice in `qwen_frames`, pixel operations in `libs.model.media.pixels`.
Also the M-RoPE helpers the Qwen adapters share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from libs.model.checkpoint import Checkpoint
from libs.model.errors import InvalidMediaError, InvalidRequestError, MediaLimitError
from libs.model.families.qwen_frames import frame_plan, patch_timestamps
from libs.model.families.qwen_settings import (
    VideoSettings,
    check_against_model,
    image_settings,
    video_settings,
    with_bounds,
)
from libs.model.media.image import decode_image
from libs.model.media.limits import MediaLimits
from libs.model.media.pixels import image_to_chw, normalize, patchify, resize_bicubic
from libs.model.media.video import DecodedVideo, read_video
from libs.model.types import ImageLayout, ProcessorOptions, VideoLayout


@dataclass
class VideoPixels:
    """A preprocessed video: tower input, grid, and what its layout needs from the sampling."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    decoded: DecodedVideo
    fps: float  # the sampling rate asked for (request or processor default)


class QwenVisionPreprocessor:
    def __init__(
        self,
        checkpoint: Checkpoint,
        vision_config: object,
        *,
        video_style: str,
        video_size_override: dict[str, int] | None = None,
    ) -> None:
        self.image_settings = image_settings(checkpoint.path)
        self.video_settings = video_settings(checkpoint.path, video_style, video_size_override)
        check_against_model(self.image_settings, vision_config, "image")
        check_against_model(self.video_settings, vision_config, "video")

    @property
    def temporal_patch_size(self) -> int:
        return self.video_settings.temporal_patch_size

    @staticmethod
    def _pixel_bounds(
        options: ProcessorOptions, default_min: int, default_max: int, limits: MediaLimits
    ) -> tuple[int, int]:
        """The request's bounds; an unset one keeps the processor's (as the processors' deprecated
        `min_pixels` / `max_pixels` call arguments do)."""
        lo = options.min_pixels if options.min_pixels is not None else default_min
        hi = options.max_pixels if options.max_pixels is not None else default_max
        if hi > limits.max_resized_pixels:
            raise MediaLimitError(
                f"max_pixels {hi} exceeds the limit {limits.max_resized_pixels}", field="processor_options.max_pixels"
            )
        if lo <= 0 or hi < lo:
            raise InvalidRequestError(f"bad pixel bounds [{lo}, {hi}]", field="processor_options.min_pixels")
        return lo, hi

    def resized_image(self, data: bytes, options: ProcessorOptions, limits: MediaLimits) -> torch.Tensor:
        """The decoded image resized to its patch grid: [1, 3, H, W] uint8, any strides (what another engine's
        processor is given so that its grid is this one: libs/backends/vllm/encoder.py)."""
        s = self.image_settings
        lo, hi = self._pixel_bounds(options, s.min_pixels, s.max_pixels, limits)
        image = image_to_chw(decode_image(data, limits)).unsqueeze(0)
        try:
            height, width = smart_resize(image.shape[2], image.shape[3], factor=s.factor, min_pixels=lo, max_pixels=hi)
        except ValueError as exc:  # an extreme aspect ratio
            raise InvalidMediaError(f"cannot preprocess image: {exc}", field="media.data") from exc
        return resize_bicubic(image, height, width)

    def image_grid(self, resized: torch.Tensor) -> ImageLayout:
        """The patch grid of a `resized_image` (one temporal patch: `patchify` pads a lone frame)."""
        patch = self.image_settings.patch_size
        return ImageLayout(grid_t=1, grid_h=resized.shape[2] // patch, grid_w=resized.shape[3] // patch)

    def image_patches(self, resized: torch.Tensor, *, normalized: bool = True) -> torch.Tensor:
        """A `resized_image`'s tower input rows: normalized float32, or with `normalized=False` the
        uint8 pixels in the same order (for a tower that normalizes them itself, as vLLM's does with
        `mm_device_do_normalize`)."""
        s = self.image_settings
        pixels = normalize(resized, s.mean, s.std) if normalized else resized
        return patchify(pixels, s.patch_size, s.merge_size, s.temporal_patch_size)[0]

    def image(self, data: bytes, options: ProcessorOptions, limits: MediaLimits) -> tuple[torch.Tensor, ImageLayout]:
        resized = self.resized_image(data, options, limits)
        return self.image_patches(resized), self.image_grid(resized)

    def video_settings_for(self, options: ProcessorOptions, limits: MediaLimits) -> tuple[VideoSettings, float, int]:
        """Settings with the request's pixel bounds, the sampling fps and max_frames."""
        s = self.video_settings
        lo, hi = self._pixel_bounds(options, s.min_pixels, s.max_pixels, limits)
        fps = options.video_fps if options.video_fps is not None else s.fps
        max_frames = options.video_max_frames if options.video_max_frames is not None else s.max_frames
        if fps <= 0:
            raise InvalidRequestError("video_fps must be > 0", field="processor_options.video_fps")
        if max_frames <= 0:
            raise InvalidRequestError("video_max_frames must be > 0", field="processor_options.video_max_frames")
        if max_frames > limits.max_video_frames:
            raise MediaLimitError(
                f"video_max_frames {max_frames} exceeds {limits.max_video_frames}",
                field="processor_options.video_max_frames",
            )
        return with_bounds(s, lo, hi), fps, max_frames

    def video(self, data: bytes, options: ProcessorOptions, limits: MediaLimits) -> VideoPixels:
        settings, fps, max_frames = self.video_settings_for(options, limits)
        decoded = read_video(data, limits, lambda source: frame_plan(source, fps, settings, max_frames))
        pixels = normalize(decoded.frames, settings.mean, settings.std)
        flat, grid_t, grid_h, grid_w = patchify(
            pixels, settings.patch_size, settings.merge_size, settings.temporal_patch_size
        )
        return VideoPixels(pixel_values=flat, grid=(grid_t, grid_h, grid_w), decoded=decoded, fps=fps)


def video_layout(video: VideoPixels, temporal_patch: int, *, seconds_per_grid: float, mean_times: bool) -> VideoLayout:
    """`grid_timestamps_s`: each temporal patch's first frame time, or with `mean_times` the mean of
    its first and last (the Qwen3-VL prompt's stamps)."""
    grid_t, grid_h, grid_w = video.grid
    return VideoLayout(
        grid_t=grid_t,
        grid_h=grid_h,
        grid_w=grid_w,
        seconds_per_grid=seconds_per_grid,
        grid_timestamps_s=patch_timestamps(video.decoded.timestamps_s(), temporal_patch, mean=mean_times),
        sampled_frames=len(video.decoded.indices),
    )


def vision_position_offsets(
    grid_t: int, grid_h: int, grid_w: int, merge_size: int, t_index: torch.Tensor
) -> torch.Tensor:
    """[3, n] (t, h, w) offsets of a merged vision grid; `t_index` gives the t value per temporal patch."""
    llm_h, llm_w = grid_h // merge_size, grid_w // merge_size
    t = t_index.view(-1, 1).expand(-1, llm_h * llm_w).flatten()
    h = torch.arange(llm_h).view(1, -1, 1).expand(grid_t, -1, llm_w).flatten()
    w = torch.arange(llm_w).view(1, 1, -1).expand(grid_t, llm_h, -1).flatten()
    return torch.stack([t, h, w])


def build_mrope(input_len: int, spans: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    """Positions [3, input_len]: text advances by one; an item at `start` with offsets [3, n] sits at
    next_position + offsets, and text after it resumes at the item's largest position + 1 (the
    original Qwen implementations and vLLM; transformers 5.x resumes Qwen2.5-VL / Qwen3-VL text at
    next_position + max(merged h, merged w), which differs only for a video whose temporal positions
    outrun its spatial size: docs/runtime.md, "Preprocessing decisions").
    Returns (positions, rope_delta = max position + 1 - input_len)."""
    pieces: list[torch.Tensor] = []
    cursor = 0
    next_pos = 0
    for start, offsets in sorted(spans, key=lambda s: s[0]):
        if start > cursor:
            pieces.append(torch.arange(next_pos, next_pos + start - cursor).view(1, -1).expand(3, -1))
            next_pos += start - cursor
        placed = offsets + next_pos
        pieces.append(placed)
        next_pos = int(placed.max()) + 1
        cursor = start + offsets.shape[1]
    if cursor < input_len:
        pieces.append(torch.arange(next_pos, next_pos + input_len - cursor).view(1, -1).expand(3, -1))
    positions = torch.cat(pieces, dim=1).long() if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - input_len if input_len else 0
    return positions, delta
