"""The Qwen image / video processors' settings, resolved from a checkpoint as transformers does.

Files are found by transformers' own resolution (`processor_config.json` nested entries, then
`video_preprocessor_config.json`, then `preprocessor_config.json`); defaults and the
`min_pixels` / `max_pixels` overrides of `size` follow each processor class's `__init__`
(transformers 5.19-5.23 `image_processing_qwen2_vl.py`, `video_processing_qwen2_vl.py`,
`video_processing_qwen3_vl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils.constants import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
)
from transformers.video_processing_utils import VideoProcessorMixin

from libs.model.errors import CheckpointError


@dataclass(frozen=True)
class VisionSettings:
    min_pixels: int  # size["shortest_edge"]
    max_pixels: int  # size["longest_edge"]: per image / frame (Qwen2-VL), per clip (Qwen3-VL video)
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoSettings(VisionSettings):
    style: str  # "qwen2_vl" or "qwen3_vl": which sampling and resize rule
    fps: float
    min_frames: int
    max_frames: int


# Class defaults of the two video processors (attributes in their source files).
_VIDEO_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(
        min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, patch_size=14, merge_size=2, temporal_patch_size=2,
        mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, fps=None, min_frames=4, max_frames=768,
    ),
    "qwen3_vl": dict(
        min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, merge_size=2, temporal_patch_size=2,
        mean=IMAGENET_STANDARD_MEAN, std=IMAGENET_STANDARD_STD, fps=2, min_frames=4, max_frames=768,
    ),
}  # fmt: skip
_VIDEO_STYLE_BY_CLASS = {"Qwen2VLVideoProcessor": "qwen2_vl", "Qwen3VLVideoProcessor": "qwen3_vl"}
# The Qwen2.5-Omni processor hard-codes this when the call passes no fps (processing_qwen2_5_omni.py).
DEFAULT_FPS = 2.0


def processor_video_defaults(processor_class: Any) -> dict[str, Any]:
    """A family processor's own `videos_kwargs` defaults, which win over the video processor's file:
    a class attribute in 5.23, `valid_processor_kwargs._defaults` in 5.19 (merged in the order of
    `ProcessorMixin._merge_kwargs`: attribute first, `_defaults` over it)."""
    out = dict(getattr(processor_class, "videos_kwargs", None) or {})
    kwargs_class = getattr(processor_class, "valid_processor_kwargs", None)
    out.update(getattr(kwargs_class, "_defaults", {}).get("videos_kwargs", {}))
    return out


def image_settings(path: Path) -> VisionSettings:
    processor: Any = Qwen2VLImageProcessorPil.from_pretrained(str(path))  # same __init__ as the fast class
    return VisionSettings(
        min_pixels=int(processor.size.shortest_edge),
        max_pixels=int(processor.size.longest_edge),
        patch_size=int(processor.patch_size),
        merge_size=int(processor.merge_size),
        temporal_patch_size=int(processor.temporal_patch_size),
        mean=tuple(float(x) for x in processor.image_mean),
        std=tuple(float(x) for x in processor.image_std),
    )


def video_settings(path: Path, default_style: str, size_override: dict[str, int] | None = None) -> VideoSettings:
    """`size_override`: a family processor's own video size default, which wins over the file's
    (`Qwen2_5OmniProcessor.videos_kwargs["size"]`)."""
    raw, _ = VideoProcessorMixin.get_video_processor_dict(str(path))
    style = _VIDEO_STYLE_BY_CLASS.get(str(raw.get("video_processor_type")), default_style)
    d = _VIDEO_DEFAULTS[style]
    size = dict(raw.get("size") or {"shortest_edge": d["min_pixels"], "longest_edge": d["max_pixels"]})
    if style == "qwen2_vl":  # Qwen2VLVideoProcessor.__init__: min/max_pixels keys override size
        size["shortest_edge"] = raw.get("min_pixels", size.get("shortest_edge"))
        size["longest_edge"] = raw.get("max_pixels", size.get("longest_edge"))
    if size_override:
        size = dict(size_override)
    return VideoSettings(
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        patch_size=int(raw.get("patch_size", d["patch_size"])),
        merge_size=int(raw.get("merge_size", d["merge_size"])),
        temporal_patch_size=int(raw.get("temporal_patch_size", d["temporal_patch_size"])),
        mean=tuple(float(x) for x in raw.get("image_mean", d["mean"])),
        std=tuple(float(x) for x in raw.get("image_std", d["std"])),
        style=style,
        fps=float(raw.get("fps") or d["fps"] or DEFAULT_FPS),
        min_frames=int(raw.get("min_frames", d["min_frames"])),
        max_frames=int(raw.get("max_frames", d["max_frames"])),
    )


def check_against_model(settings: VisionSettings, vision_config: Any, what: str) -> None:
    """A processor config that cuts other patches than the tower expects is an unusable checkpoint."""
    expected = (
        int(vision_config.patch_size),
        int(vision_config.spatial_merge_size),
        int(vision_config.temporal_patch_size),
    )
    got = (settings.patch_size, settings.merge_size, settings.temporal_patch_size)
    if got != expected:
        raise CheckpointError(
            f"{what} processor cuts (patch, merge, temporal) = {got}, the vision tower expects {expected}",
            field="model_path",
        )


def with_bounds(settings: VideoSettings, min_pixels: int, max_pixels: int) -> VideoSettings:
    return replace(settings, min_pixels=min_pixels, max_pixels=max_pixels)
